"""What a run measures: each rank's step figures (StepStats), exact distributed evaluation (the
confusion matrix, each test image once) and per-class accuracy, an epoch's record for metrics.jsonl,
and time and memory on a device.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp import distributed, lifeline
from ddp.devices import World


class StepStats:
    """What this rank's steps add up, read only at boundaries that sync anyway (a checkpoint, an epoch's end):
    - the epoch's loss sums, for its mean: loss x images, and images;
    - the gradients' total norm before clipping, per optimizer step: its sum, count and maximum (the
      same on every rank: it is taken after the all-reduce);
    - whether the loss is still finite: the last finite loss and the global step of the first one
      that was not (train.stop_if_diverged reads them).
    A step only copies its loss and norm into a journal on the training device (one kernel each: the host's
    cost of a step, bench/host_cost.py, and no sync); a read folds the journal into the sums on the host, in
    float64, step by step in order, as adding each step on the device did. A journal that fills (JOURNAL_STEPS
    steps without a read) is folded then: one sync in that many steps."""

    NONE = 2**62  # first_non_finite_step before any: larger than any step, so a minimum keeps the first
    JOURNAL_STEPS = 4096

    def __init__(self, device: torch.device) -> None:
        self._journal = torch.zeros(self.JOURNAL_STEPS, 2, dtype=torch.float64, device=device)  # (loss, norm) a row
        self._steps: list[tuple[int, int]] = []  # each journalled loss's (images, global step)
        self._norms = 0  # journalled norms
        self.loss_sum, self.image_count = 0.0, 0
        self.norm_sum, self.norm_steps, self.norm_max = 0.0, 0, 0.0
        self._last_finite, self._first_non_finite = math.nan, self.NONE

    def add(self, loss: torch.Tensor, images: int, global_step: int) -> None:
        if len(self._steps) == self.JOURNAL_STEPS:
            self._fold()
        self._journal[len(self._steps), 0].copy_(loss.detach())
        self._steps.append((images, global_step))

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        """A step's norm; not one that is inf or NaN: fp16's GradScaler skips those steps (a
        divergence shows in the loss and the weights, stop_if_diverged's business)."""
        if self._norms == self.JOURNAL_STEPS:
            self._fold()
        self._journal[self._norms, 1].copy_(norm.detach())
        self._norms += 1

    def _fold(self) -> None:
        """The journal into the sums (a sync on a GPU), then empty."""
        if not (self._steps or self._norms):
            return  # nothing to read: no sync
        rows = self._journal[: max(len(self._steps), self._norms)].tolist()
        for (images, step), (loss, _) in zip(self._steps, rows):
            self.loss_sum += loss * images  # exact in float64: a float32 loss times a batch's images
            self.image_count += images
            if math.isfinite(loss):
                self._last_finite = loss
            else:
                self._first_non_finite = min(self._first_non_finite, step)
        for _, norm in rows[: self._norms]:
            if math.isfinite(norm):
                self.norm_sum += norm
                self.norm_steps += 1
                self.norm_max = max(self.norm_max, norm)
        self._empty()

    def _empty(self) -> None:
        """The journal emptied: its rows are written over from the first."""
        self._steps.clear()
        self._norms = 0

    def snapshot(self) -> tuple:
        """Everything it holds (ddp.warmup puts it back with restore)."""
        self._fold()
        return (self.loss_sum, self.image_count, self.norm_sum, self.norm_steps, self.norm_max, self._last_finite,
                self._first_non_finite)  # fmt: skip

    def restore(self, snapshot: tuple) -> None:
        self._empty()  # the journalled steps since the snapshot are not counted
        (self.loss_sum, self.image_count, self.norm_sum, self.norm_steps, self.norm_max, self._last_finite,
         self._first_non_finite) = snapshot  # fmt: skip

    def partial(self) -> torch.Tensor:
        """The loss sums as a checkpoint keeps them: float64 (loss x images, images), on the CPU."""
        self._fold()
        return torch.tensor([self.loss_sum, self.image_count], dtype=torch.float64)

    def norms_partial(self) -> torch.Tensor:
        """The norms' figures as a checkpoint keeps them: float64 (sum, steps, max), on the CPU."""
        self._fold()
        return torch.tensor([self.norm_sum, self.norm_steps, self.norm_max], dtype=torch.float64)

    def load(self, partial: torch.Tensor | None, grad_norms: torch.Tensor | None) -> None:
        """A checkpoint's partial() and norms_partial(), each where it has one (a resume, before any step)."""
        self._empty()
        if partial is not None:
            loss_sum, images = partial.tolist()
            self.loss_sum, self.image_count = loss_sum, int(images)
        if grad_norms is not None:
            self.norm_sum, steps, self.norm_max = grad_norms.tolist()
            self.norm_steps = int(steps)

    def first_non_finite(self) -> int:
        """The global step of the first loss that was not finite, -1 if none (a sync on a GPU)."""
        self._fold()
        return -1 if self._first_non_finite == self.NONE else self._first_non_finite

    def last_finite(self) -> float:
        """The last finite loss (NaN before any; a sync on a GPU)."""
        self._fold()
        return self._last_finite

    def grad_norm(self) -> dict[str, float]:
        """The epoch's grad_norm_mean and grad_norm_max (before clipping), for metrics.jsonl."""
        self._fold()
        steps = self.norm_steps
        return {"grad_norm_mean": self.norm_sum / steps, "grad_norm_max": self.norm_max} if steps else {}

    def images(self) -> int:
        """Images this rank has added (a sync on a GPU: call it once an epoch)."""
        self._fold()
        return self.image_count

    def mean_over_ranks(self, world: World) -> float:
        """The mean loss per image over every rank's images; every rank calls it."""
        sums = self.partial().to(world.device)
        loss_sum, images = distributed.all_reduce_sum(sums, world).tolist()
        return loss_sum / images

    def reset(self) -> None:
        """For the next epoch (the finiteness record carries on)."""
        self._fold()
        self.loss_sum, self.image_count = 0.0, 0
        self.norm_sum, self.norm_steps, self.norm_max = 0.0, 0, 0.0


@torch.no_grad()
def confusion_matrix(
    module: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    to_input: Callable[[torch.Tensor], torch.Tensor],
    num_classes: int,
    world: World,
    amp: torch.dtype | None,
    tta_flip: bool = False,
    tta_translate: bool = False,
) -> torch.Tensor:
    """The confusion matrix (true class x predicted class, counts) over the whole test set, summed over ranks: each
    image once; its diagonal the correct count per class, its row sums the images per class. Test-time augmentation
    (the prediction from averaged logits): tta_flip, each image and its mirror; tta_translate, also the image shifted
    by 1 px up-left and down-right (reflect padding, each with its mirror if tta_flip), the two weighing as one."""
    module.eval()
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=world.device)
    for images, labels in loader:
        x = to_input(images)
        y = labels.to(world.device, non_blocking=True)
        with torch.autocast(world.device.type, dtype=amp, enabled=amp is not None):
            logits = _logits(module, x, tta_flip)
            if tta_translate:
                padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
                size = x.shape[-1]
                shifted = [padded[..., :size, :size], padded[..., 2:, 2:]]  # the image moved down-right, up-left
                logits = logits + 0.5 * sum(_logits(module, view, tta_flip) for view in shifted)
            predicted = logits.argmax(dim=1)
        confusion.index_add_(0, y * num_classes + predicted, torch.ones_like(y))  # no sync per batch
    if world.grouped:  # each rank counted its own images: the sum counts every test image once
        dist.all_reduce(confusion, op=dist.ReduceOp.SUM)
    return confusion.view(num_classes, num_classes).cpu()


def _logits(module: nn.Module, x: torch.Tensor, tta_flip: bool) -> torch.Tensor:
    """The logits of x, with those of its mirror added if tta_flip. A copy, not the module's output:
    compiled with CUDA graphs (run.compile_mode=reduce-overhead), a module's next call
    writes its output into the same memory, and torch raises when the first output is read after."""
    logits = module(x).clone()
    return logits + module(x.flip(-1)) if tta_flip else logits


def accuracy(confusion: torch.Tensor) -> float:
    return confusion.diag().sum().item() / max(1, confusion.sum().item())


def accuracy_per_class(confusion: torch.Tensor) -> list[float | None]:
    """Each class's accuracy from a confusion matrix (None for a class with no test images)."""
    correct, total = confusion.diag().tolist(), confusion.sum(dim=1).tolist()
    return [c / t if t else None for c, t in zip(correct, total)]


def shown_classes(accuracies: list[float | None], most: int = 20) -> list[int]:
    """The classes a table or chart shows: all up to `most`, else the best and the worst half of
    `most` each (a class without test images counts as the worst)."""
    if len(accuracies) <= most:
        return list(range(len(accuracies)))
    order = sorted(range(len(accuracies)), key=lambda c: -1 if accuracies[c] is None else accuracies[c], reverse=True)
    return order[: most // 2] + order[-(most // 2) :]


def epoch_record(
    epoch: int, train_loss: float, confusion: torch.Tensor | None, classes: list[str], world: World, **timing: float
) -> dict[str, Any]:
    """One line of metrics.jsonl: the epoch's loss and evaluation (none for an epoch that did not
    evaluate: confusion None, train.eval_every), `timing` (lr, images_per_s, train_s, seconds, startup_s), the
    layout of the run, and on a GPU its memory in MB (this rank's)."""
    record: dict[str, Any] = {"epoch": epoch, "train_loss": train_loss}
    if confusion is not None:
        record.update({
            "test_acc": accuracy(confusion),
            "test_images": int(confusion.sum()),
            "per_class_acc": accuracy_per_class(confusion),
            "classes": classes,
            "confusion": confusion.tolist(),  # rows: true class, columns: predicted
        })  # fmt: skip
    record.update({**timing, "world_size": world.world_size, "parallel": world.parallel, "device": str(world.device)})
    if world.device.type == "cuda":
        record.update({f"gpu_{k}_mb": v for k, v in gpu_memory_mb(world.device).items()})
    return record


def clock() -> float:
    """Seconds on time.perf_counter() less those this process was stopped (a pause, Ctrl-Z; SLURM's suspend): a
    paused epoch's images a second count the time it ran."""
    return time.perf_counter() - lifeline.stopped_s()


def epoch_start(device: torch.device) -> float:
    """The clock() at an epoch's start; on a GPU the peak-memory count starts again too, so that each epoch reports
    its own peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return clock()


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`, so that a clock read after it times the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed(since: float, device: torch.device) -> float:
    """Seconds from `since` (clock()) to the end of the work queued on `device`."""
    synchronize(device)
    return clock() - since


def gpu_memory_mb(device: torch.device | int) -> dict[str, float]:
    """torch's CUDA memory on a device, in MB: allocated now, reserved by its cache, and the peak
    allocation since the last torch.cuda.reset_peak_memory_stats."""
    return {
        "allocated": torch.cuda.memory_allocated(device) / 2**20,
        "reserved": torch.cuda.memory_reserved(device) / 2**20,
        "peak": torch.cuda.max_memory_allocated(device) / 2**20,
    }


def seconds_since_process_start() -> float | None:
    """How long this process has existed (Linux /proc), Python's and torch's imports included: the
    startup_s metric, time from process start to the end of the first training step."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
