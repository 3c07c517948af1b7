"""Checkpoints: the only module that calls torch.save / torch.load.

A checkpoint is everything an exact continuation needs, as tensors and plain types only, so it loads
with weights_only=True and never runs code:

    format, epoch (completed epochs), step (global batches done in epoch + 1; 0 at an epoch end),
    global_step, model (the raw module's state_dict: no "module." / "_orig_mod." prefix), optimizer,
    scheduler, scaler, ranks (one entry per rank: its RNG states - python, numpy, torch, cuda - and
    the running loss sum and image count of an unfinished epoch), global_batch, world_size,
    train_images, normalize, config, metrics (of the last finished epoch), versions, checksum
    (sha256 of all the rest)

Files: checkpoints/step-<global_step>.pt, the newest `run.keep_last` of them kept, and last.pt, a
hard link to the newest. Each is written by rank 0 to a temporary file in the same directory,
fsynced, then renamed, so a final name never holds a partial file. On resume the newest file whose
checksum holds wins; a bad newer one is reported and skipped.

    python -m ddp.checkpoint inspect PATH       epoch, step, world size, metrics, size, checksum
    python -m ddp.checkpoint export PATH OUT    the model weights alone, for inference
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from ddp import faults
from ddp.errors import EXIT_USAGE, UsageError

FORMAT = 2
_STEP_FILE = re.compile(r"^step-(\d+)\.pt$")


class CorruptCheckpoint(UsageError):
    """A file that is not a whole, unaltered checkpoint (truncated, bit-flipped, or not ours)."""


def directory(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def last_path(out_dir: str | Path) -> Path:
    return directory(out_dir) / "last.pt"


def digest(obj: Any) -> str:
    """sha256 over a checkpoint's content (tensors by dtype, shape and bytes), independent of how
    torch.save lays it out, so it can be stored inside the file it checks."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            h.update(f"D{len(x)}".encode())
            for k in sorted(x, key=repr):
                walk(k)
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"S{type(x).__name__}:{x!r}".encode())

    walk(obj)
    return h.hexdigest()


def _atomic_write(obj: dict[str, Any], path: Path, fault_step: int | None = None) -> None:
    """torch.save `obj` to a temporary file beside `path`, fsync, rename over `path`."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data[: len(data) // 2])
            if fault_step is not None:
                faults.maybe_kill("write", fault_step, 0, path.parent.parent)
            f.write(data[len(data) // 2 :])
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


def _point_last_at(path: Path) -> None:
    """last.pt -> `path`, replaced atomically (a hard link: no second copy of the bytes)."""
    tmp = path.parent / f".last.pt.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(path, tmp)
    os.replace(tmp, path.parent / "last.pt")


def step_files(out_dir: str | Path) -> list[Path]:
    """This run's numbered checkpoints, newest first."""
    d = directory(out_dir)
    found = [(int(m.group(1)), p) for p in d.glob("step-*.pt") if (m := _STEP_FILE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def existing(out_dir: str | Path) -> list[Path]:
    """The checkpoints a run in out_dir would resume from, newest first (a format-1 dir: last.pt)."""
    return step_files(out_dir) or [p for p in [last_path(out_dir)] if p.is_file()]


def save(state: dict[str, Any], out_dir: str | Path, keep_last: int) -> Path:
    """Write `state` as step-<global_step>.pt with its checksum, point last.pt at it, keep the
    newest `keep_last` numbered files. Rank 0 only."""
    state = {**state, "checksum": digest(state)}
    path = directory(out_dir) / f"step-{state['global_step']:09d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(state, path, fault_step=state["global_step"])
    _point_last_at(path)
    for old in step_files(out_dir)[max(1, keep_last) :]:
        old.unlink(missing_ok=True)
    return path


def remove_partial_writes(out_dir: str | Path) -> None:
    """Temporary files left by a writer that was killed; never a complete checkpoint."""
    for tmp in directory(out_dir).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def load(path: str | Path) -> dict[str, Any]:
    """A checkpoint's dict with every tensor on the CPU; its checksum verified; never unpickles code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UsageError(f"checkpoint not found: {path}") from None
    except Exception as e:  # truncated, not a checkpoint, or a pickle that wants to run code
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CorruptCheckpoint(f"{path} is not a loadable checkpoint ({type(e).__name__}: {first})") from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise CorruptCheckpoint(f"{path} is not a ddp-cifar checkpoint (no model/epoch entries)")
    if "checksum" in state:
        stored = state.pop("checksum")
        if digest(state) != stored:
            raise CorruptCheckpoint(f"{path} fails its checksum (the file was altered or damaged)")
        state["checksum"] = stored
    return state


def newest_valid(out_dir: str | Path) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """(path, state, warnings) of the newest checkpoint in out_dir that loads and checks out."""
    candidates = existing(out_dir)
    warnings = []
    for path in candidates:
        try:
            return path, load(path), warnings
        except CorruptCheckpoint as e:
            warnings.append(f"warning: skipping {path}: {e}; falling back to the previous checkpoint")
    if candidates:
        raise UsageError(f"no valid checkpoint in {directory(out_dir)}: {'; '.join(warnings)}")
    return None, None, warnings


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random number generators, as weights_only-loadable values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def check_compatible(state: dict[str, Any], config: dict[str, Any], train_images: int, path: str | Path) -> None:
    """Refuse to continue a run of another model, dataset or batch in this one."""
    saved = state.get("config", {})
    for section, key in (("model", "name"), ("data", "dataset"), ("train", "batch_size")):
        old, new = saved.get(section, {}).get(key), config[section][key]
        if old is not None and old != new:
            raise UsageError(
                f"{path} was trained with {section}.{key}={old} but this run has {section}.{key}={new}; "
                "set it back to continue, or start a new run.out_dir"
            )
    if state.get("train_images", train_images) != train_images:
        raise UsageError(
            f"{path} was trained on {state['train_images']} training images, this data has {train_images}; "
            "the data order cannot continue: use the same data, or start a new run.out_dir"
        )


def restore(state: dict[str, Any], model: torch.nn.Module, *stateful: Any) -> None:
    """Load a checkpoint into objects built for this run's device: the model (accepting state
    dicts saved from a DataParallel/DDP/compiled wrapper too), then optimizer, scheduler, scaler
    (optimizer state follows the parameters' device)."""
    weights = dict(state["model"])
    for prefix in ("module.", "_orig_mod.", "module."):
        consume_prefix_in_state_dict_if_present(weights, prefix)
    model.load_state_dict(weights)
    for obj, key in zip(stateful, ("optimizer", "scheduler", "scaler")):
        if state.get(key) is not None and not (key == "scaler" and not obj.is_enabled()):
            obj.load_state_dict(state[key])


def restore_rank(state: dict[str, Any], rank: int, world_size: int, device: torch.device, totals: torch.Tensor) -> bool:
    """This rank's share of `ranks`: its RNG states (same world size only: data order and
    augmentation need none) and the unfinished epoch's loss sums into `totals` (all on rank 0 if
    the world size changed, so the epoch's mean loss stays right). Returns whether it was the same."""
    ranks = state.get("ranks") or []
    same_world = len(ranks) == world_size
    if same_world:
        set_rng_state(ranks[rank]["rng"], device)
    partials = [r["partial"] for r in ranks if r["partial"] is not None]
    if partials:
        totals.copy_(partials[rank] if same_world else sum(partials) * (rank == 0))
    return same_world


def export(path: str | Path, out: str | Path) -> None:
    """The model alone, with what inference needs to rebuild it: name, classes, normalisation."""
    state = load(path)
    config = state.get("config", {})
    metrics = state.get("metrics") or {}
    weights = {
        "format": "ddp-cifar-weights/1",
        "model_name": config.get("model", {}).get("name"),
        "classes": metrics.get("classes"),
        "normalize": state.get("normalize"),
        "model": state["model"],
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(weights, out)


def describe(path: str | Path) -> str:
    size = Path(path).stat().st_size
    try:
        state = load(path)
    except CorruptCheckpoint as e:
        return f"{path}: {size / 1e6:.1f} MB, checksum FAILED: {e}"
    metrics = state.get("metrics") or {}
    lines = [
        f"{path}: {size / 1e6:.1f} MB, checksum "
        + ("ok" if "checksum" in state else "absent (format 1: only loadability checked)"),
        f"  epoch {state['epoch']} done, step {state.get('step', 0)} of the next, global step "
        f"{state.get('global_step', '?')}",
        f"  world_size {state.get('world_size')}, global batch {state.get('global_batch', '?')}, "
        f"model {state.get('config', {}).get('model', {}).get('name')}, "
        f"dataset {state.get('config', {}).get('data', {}).get('dataset')}",
        f"  versions {state.get('versions')}",
    ]
    if metrics:
        lines.append(
            f"  last epoch: test_acc {metrics.get('test_acc', 0):.4f}, train_loss {metrics.get('train_loss', 0):.4f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m ddp.checkpoint inspect PATH | export PATH OUT"
    try:
        if len(args) == 2 and args[0] == "inspect":
            if not Path(args[1]).is_file():
                raise UsageError(f"checkpoint not found: {args[1]}")
            text = describe(args[1])
            print(text)
            return 1 if "checksum FAILED" in text else 0
        if len(args) == 3 and args[0] == "export":
            export(args[1], args[2])
            print(f"wrote {args[2]} (model weights only)")
            return 0
        raise UsageError(usage)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
