"""What a run shows and leaves behind, on rank 0 only: the epoch line, metrics.jsonl, config.yaml,
the progress bar, TensorBoard scalars. Callers guard with `if world.is_main`; nothing here talks to
other ranks."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ddp import files
from ddp.errors import UsageError


def start(out_dir: str, config_yaml: str, resumed_epoch: int) -> None:
    """Write config.yaml; keep only metrics.jsonl's epochs up to the checkpoint being resumed (a
    crashed run may have logged an epoch it never saved)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files.replace(out / "config.yaml", config_yaml.encode())
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        kept = [line for line in metrics.read_text().splitlines() if _epoch(line) <= resumed_epoch]
        files.replace(metrics, "".join(line + "\n" for line in kept).encode())


def _epoch(line: str) -> float:
    """A metrics line's epoch; infinity for a line a crash left half-written (so it is dropped)."""
    try:
        return json.loads(line)["epoch"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def append(out_dir: str, metrics: dict[str, Any]) -> None:
    """One line of metrics.jsonl, whole or not at all."""
    files.append(Path(out_dir) / "metrics.jsonl", json.dumps(metrics) + "\n")


def epoch_line(m: dict[str, Any], epochs: int) -> str:
    line = (
        f"epoch {m['epoch']}/{epochs}  loss {m['train_loss']:.4f}  test_acc {100 * m['test_acc']:.2f}%  "
        f"{m['images_per_s']:.0f} img/s  {m['seconds']:.1f} s"
    )
    if "gpu_allocated_mb" in m:
        line += (
            f"  gpu {m['gpu_allocated_mb']:.0f} MB allocated / {m['gpu_reserved_mb']:.0f} MB reserved, "
            f"peak {m['gpu_peak_mb']:.0f} MB"
        )
    return line


def say(text: str) -> None:
    print(text, flush=True)


def record_epoch(m: dict[str, Any], epochs: int, out_dir: str, board: Board | None) -> None:
    """An epoch's record everywhere it goes: the epoch line, metrics.jsonl, TensorBoard."""
    say(epoch_line(m, epochs))
    append(out_dir, m)
    if board:
        board.epoch(m)


class Progress:
    """An epoch's batches, shown as a tqdm bar when `enabled` (rank 0) and stdout is a terminal,
    else passed through as they are (logs and pipes get only the epoch lines). The bar shows the
    last step's loss, the lr and images/s over all ranks, a few times a second: reading the loss
    waits for the device."""

    def __init__(self, batches: Iterable, enabled: bool, desc: str, world_size: int) -> None:
        self.bar = None
        if enabled and sys.stdout.isatty():
            self.bar = tqdm(batches, desc=desc, leave=False, dynamic_ncols=True, mininterval=0.25, file=sys.stdout)
        self.batches = self.bar if self.bar is not None else batches
        self.world_size = world_size
        self.started = self.last_shown = time.perf_counter()
        self.images = 0  # over all ranks

    def __iter__(self) -> Iterator:
        return iter(self.batches)

    def update(self, loss: torch.Tensor, lr: float, images: int) -> None:
        """After a step that took `images` on this rank."""
        self.images += images * self.world_size
        now = time.perf_counter()
        if self.bar is not None and now - self.last_shown > 0.25:
            self.last_shown = now
            rate = self.images / (now - self.started)
            self.bar.set_postfix_str(f"loss={loss.item():.4f} lr={lr:.3g} img/s={rate:.0f}", refresh=False)


def check_tensorboard() -> None:
    """run.tensorboard needs the tensorboard package: say so before any rank starts waiting."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise UsageError(
            "run.tensorboard=true needs the tensorboard package: pip install 'ddp-cifar[tensorboard]' "
            "(or run.tensorboard=false)"
        ) from None


class Board:
    """run.tensorboard=true: one point per epoch for each scalar, in out_dir/tensorboard
    (`tensorboard --logdir runs`)."""

    def __init__(self, out_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(out_dir) / "tensorboard"))

    def epoch(self, m: dict[str, Any]) -> None:
        step, add = m["epoch"], self.writer.add_scalar
        add("train/loss", m["train_loss"], step)
        add("train/lr", m["lr"], step)
        add("train/images_per_s", m["images_per_s"], step)
        add("test/accuracy", m["test_acc"], step)
        for name, acc in zip(m["classes"], m["per_class_acc"]):
            if acc is not None:
                add(f"test_per_class/{name}", acc, step)
        for key in ("gpu_allocated_mb", "gpu_reserved_mb", "gpu_peak_mb"):
            if key in m:
                add(f"gpu/{key}", m[key], step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
