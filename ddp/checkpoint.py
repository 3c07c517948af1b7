"""Checkpoints: the only module that calls torch.save / torch.load.

A checkpoint is a dict of tensors and plain types, so it loads with weights_only=True on any machine:

    {"format": 1, "epoch": last completed epoch (1-based), "model": raw state_dict (no "module." or
     "_orig_mod." prefix), "optimizer", "scheduler", "scaler" (or None), "config": the resolved
     config as a dict, "metrics": the last epoch's metrics, "world_size", "versions"}

Written by rank 0 only, atomically: a temporary file in the same directory, fsync, then rename, so
`last.pt` is always a complete file. Keys may be added (the next issue adds step and RNG state);
readers ignore keys they do not know.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ddp.errors import UsageError

FORMAT = 1


def last_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints" / "last.pt"


def save(state: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path: str | Path) -> dict[str, Any]:
    """A checkpoint's dict with every tensor on the CPU; never unpickles code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UsageError(f"checkpoint not found: {path}") from None
    except Exception as e:  # truncated file, not a checkpoint, or a pickle that wants code
        raise UsageError(f"{path} is not a loadable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise UsageError(f"{path} is not a ddp-cifar checkpoint (no model/epoch entries)")
    return state


def to_resume(resume: str, out_dir: str) -> Path | None:
    """Which checkpoint run.resume means: auto = out_dir's last.pt if there is one."""
    last = last_path(out_dir)
    if resume == "auto":
        return last if last.is_file() else None
    if resume == "never":
        if last.is_file():
            raise UsageError(
                f"run.resume=never but {last} exists and would be overwritten; "
                "use another run.out_dir, run.resume=auto to continue, or delete it yourself"
            )
        return None
    if not Path(resume).is_file():
        raise UsageError(f"run.resume={resume}: no such checkpoint file (use auto, never or a path)")
    if last.is_file() and not last.samefile(resume):
        raise UsageError(f"run.resume={resume} but {last} exists and would be overwritten; use another run.out_dir")
    return Path(resume)


def make_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    epoch: int,
    config: dict[str, Any],
    metrics: dict[str, Any],
    world_size: int,
) -> dict[str, Any]:
    """The checkpoint of `model`, the raw module: never the DDP/DataParallel/compiled wrapper."""
    from ddp import __version__

    return {
        "format": FORMAT,
        "epoch": epoch,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "config": config,
        "metrics": metrics,
        "world_size": world_size,
        "versions": {"torch": str(torch.__version__), "ddp_cifar": __version__},
    }


def check_compatible(state: dict[str, Any], config: dict[str, Any], path: str | Path) -> None:
    """Refuse to continue a run of another model or dataset in this one."""
    saved = state.get("config", {})
    for section, key in (("model", "name"), ("data", "dataset")):
        old, new = saved.get(section, {}).get(key), config[section][key]
        if old is not None and old != new:
            raise UsageError(
                f"{path} was trained with {section}.{key}={old} but this run has {section}.{key}={new}; "
                "use another run.out_dir, or run.resume=never in a new one"
            )


def restore(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
) -> None:
    """Load a checkpoint into objects built for this run's device (optimizer state follows the
    parameters' device)."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler.is_enabled() and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
