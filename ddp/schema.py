"""A checkpoint's schema as its readers check it: each entry's kind and range, checked on every load (resume,
evaluate, inspect, export), so that a file whose checksum holds but whose entries lie (another program, or a
version that wrote them otherwise) is one line naming them. What a checkpoint holds, and why, is checkpoint.py's."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddp import files
from ddp.errors import CorruptCheckpoint, UsageError, first_line

FORMAT = 2
# Each entry its readers take as it is: its kind and, for a number, its least value.
ENTRIES = {"epoch": (int, 0), "step": (int, 0), "global_step": (int, 0), "model": (dict, None),
           "optimizer": (dict, None), "scheduler": (dict, None), "ranks": (list, None), "world_size": (int, 1),
           "global_batch": (int, 1), "train_images": (int, 1), "classes": (list, None), "normalize": (dict, None),
           "config": (dict, None), "versions": (dict, None)}  # fmt: skip
SETTINGS = {"model": {"name": str}, "data": {"dataset": str}, "train": {"batch_size": int}, "optim": {"name": str}}


def verified(state: Any, path: Path) -> dict[str, Any]:
    """A loaded checkpoint whose checksum holds, of the format this version reads, every entry of its kind and range."""
    if not isinstance(state, dict) or not {"model", "epoch", "checksum"} <= state.keys():
        export = isinstance(state, dict) and "model_name" in state  # python -m ddp.checkpoint export's
        what = "an export: the weights alone" if export else "no model/epoch/checksum entries"
        raise CorruptCheckpoint(f"{path} is not a ddp-cifar checkpoint ({what}); a run's are RUN/checkpoints/*.pt")
    stored = state.pop("checksum")
    if files.digest(state) != stored:
        raise CorruptCheckpoint(f"{path} fails its checksum (the file was altered or damaged)")
    if state.get("format") != FORMAT:
        raise UsageError(f"{path} has checkpoint format {state.get('format')}; this ddp-cifar reads format {FORMAT}")
    bad = [k for k, (kind, least) in ENTRIES.items() if not _of(state.get(k), kind, least)]
    bad = bad or settings_problems(state["config"]) or _entries(state)
    if bad:  # its checksum holds: another program wrote it so, not a damaged disk
        raise UsageError(f"{path} is no ddp-cifar checkpoint of format {FORMAT}: {', '.join(bad)} missing or malformed")
    state["checksum"] = stored
    return state


def _of(value: Any, kind: type, least: float | None = None) -> bool:
    """Whether `value` is of `kind`; a number (not a bool) also finite (an int within int64, as torch holds one) and
    at least `least`."""
    if kind not in (int, float):
        return isinstance(value, kind)
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        return False
    return (value < 2**63 if kind is int else math.isfinite(value)) and (least is None or value >= least)


def settings_problems(config: dict[str, Any]) -> list[str]:
    """The sections and keys of a checkpoint's config that every reader takes, missing or not of their kind."""
    bad = [f"config.{s}" for s, v in config.items() if not isinstance(v, dict)]
    bad += [f"config.{s}" for s in SETTINGS if s not in config]
    return bad or [f"config.{s}.{k}" for s, keys in SETTINGS.items() for k, kind in keys.items()
                   if not isinstance(config[s].get(k), kind)]  # fmt: skip


def _entries(state: dict[str, Any]) -> list[str]:
    """The entries whose values do not agree with each other, or are no names, statistics or metrics."""
    ranks, normalize, metrics = state["ranks"], state["normalize"], state.get("metrics")
    stats = [normalize.get(k) for k in ("mean", "std")]
    checks = {
        "step": state["step"] * state["global_batch"] < state["train_images"],  # batches done of an epoch unfinished
        "ranks": len(ranks) == state["world_size"]
        and all(isinstance(r, dict) and isinstance(r.get("rng"), dict) and "partial" in r for r in ranks),
        "classes": bool(state["classes"]) and all(isinstance(c, str) for c in state["classes"]),
        "normalize": all(isinstance(s, (list, tuple)) and len(s) == 3 and all(_of(x, float) for x in s) for s in stats)
        and all(x > 0 for x in stats[1]),
        "metrics": metrics is None or isinstance(metrics, dict) and _of(metrics.get("train_loss"), float)
        and _of(metrics.get("test_acc", 0.0), float),
        "data_digest": isinstance(state.get("data_digest") or "", str),  # (none before 2026-11-28)
    }  # fmt: skip
    return [name for name, holds in checks.items() if not holds]


@contextlib.contextmanager
def restoring(path: str | Path) -> Iterator[None]:
    """What loading a checked checkpoint into a run raised where its entries are not what this version wrote
    (an optimizer's or RNG's state of another shape) as one line, a UsageError, naming the file and torch's reason."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise UsageError(f"{path} holds entries this ddp-cifar cannot restore ({first_line(e, typed=True)}); "
                         "was it written by another program or version?") from None  # fmt: skip
