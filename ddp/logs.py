"""What rank 0 shows and records of a run: the start line, the epoch line and its record in
metrics.jsonl and TensorBoard, the progress bar. Callers guard with `if world.is_main`: nothing here
talks to other ranks."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from ddp import cli, devices, files, metrics, rundir
from ddp.errors import UsageError

if TYPE_CHECKING:
    from ddp.checkpoint import Resumed
    from ddp.config import Config
    from ddp.datasets import Data
    from ddp.devices import World


def append(out_dir: str, metrics: dict[str, Any]) -> None:
    """One line of metrics.jsonl, whole or not at all."""
    files.append(rundir.metrics_path(out_dir), json.dumps(metrics) + "\n")


def epoch_line(m: dict[str, Any], epochs: int) -> str:
    tested = f"test_acc {100 * m['test_acc']:.2f}%  " if "test_acc" in m else ""  # none: train.eval_every
    line = f"epoch {m['epoch']}/{epochs}  loss {m['train_loss']:.4f}  {tested}"
    line += f"{m['images_per_s']:.0f} img/s  {m['seconds']:.1f} s"
    if "raw_test_acc" in m:  # test_acc is the moving average's
        line += f"  (test_acc of the EMA; raw weights {100 * m['raw_test_acc']:.2f}%)"
    if "grad_norm_mean" in m:
        line += f"  grad_norm {m['grad_norm_mean']:.3g} (max {m['grad_norm_max']:.3g})"
    if "gpu_allocated_mb" in m:
        line += (
            f"  gpu {m['gpu_allocated_mb']:.0f} MB allocated / {m['gpu_reserved_mb']:.0f} MB reserved, "
            f"peak {m['gpu_peak_mb']:.0f} MB"
        )
    return line


def start_line(cfg: Config, world: World, data: Data, params: int, resumed: Resumed | None) -> str:
    """What rank 0 says before the first step: where it resumed from, then what runs where (a model
    of `params` parameters)."""
    lines = []
    if resumed:
        done = resumed.position
        lines.append(
            f"resumed from {resumed.path}: {done.epochs_done} epoch(s) + {done.step_in_epoch} step(s) done "
            f"(global step {done.global_step}); saved at world_size {resumed.saved_world_size}, now {world.world_size}"
            + accum_change(resumed.saved_accum_steps, cfg.train.grad_accum_steps)
            + f"; same global batch {cfg.train.batch_size} and data order"
            + ("" if resumed.same_world else "; RNG states not restored (world size changed)")
            + ("; changed since: " + ", ".join(resumed.changes) if resumed.changes else "")
        )
        if done.epochs_done >= cfg.train.epochs:
            lines.append(f"nothing to do: {done.epochs_done} of train.epochs={cfg.train.epochs} already done")
    lines.append(
        f"{cfg.model.name} ({params / 1e6:.2f}M params) on {cfg.data.dataset} "
        f"({len(data.train.labels)} train / {len(data.test.labels)} test, {data.num_classes} classes); "
        f"launcher={world.launcher} parallel={world.parallel} world_size={world.world_size} device={world.device}"
        f"{backend(world)} "
        f"global batch {cfg.train.batch_size} ({batch_split(cfg, world)}), sync_bn={cfg.train.sync_bn}, "
        f"amp={cfg.run.amp}{compiled(cfg)}{toolbox(cfg)}; loader={cfg.data.loader} tf32={cfg.run.tf32} "
        f"cudnn_benchmark={cfg.run.cudnn_benchmark} "
        f"threads={torch.get_num_threads()} deterministic={cfg.run.deterministic}"
    )
    if cfg.run.amp == "fp16-weights" and world.device.type == "cpu":
        lines.append("note: run.amp=fp16-weights on a CPU: its fp16 convolutions are 100x slower than float32 there")
    if crowded := devices.oversubscribed(cfg.run, world.device):
        lines.append(f"note: {crowded}")
    return "\n".join(lines)


def compiled(cfg: Config) -> str:
    """For the start line: " compile=MODE" when run.compile is on."""
    return f" compile={cfg.run.compile_mode}" if cfg.run.compile else ""


def accum_change(saved: int, now: int) -> str:
    """For the resume line: " (grad_accum_steps 1, now 4)" when micro-batching is or was on."""
    return "" if saved == now == 1 else f" (grad_accum_steps {saved}, now {now})"


def batch_split(cfg: Config, world: World) -> str:
    """How the global batch is split: "128 per rank" or "64 per rank = 4 micro-batches of 16"."""
    per_rank, accum = cfg.train.batch_size // world.world_size, cfg.train.grad_accum_steps
    micro = " (train.micro_batch_size)" if cfg.train.micro_batch_size else ""
    return f"{per_rank} per rank" + (f" = {accum} micro-batches of {per_rank // accum}{micro}" if accum > 1 else "")


def backend(world: World) -> str:
    """For the start line: the process group's backend under DDP, and a warning for gloo on GPUs."""
    if not world.grouped:
        return ""
    name = world.process_group_backend
    testing = " (gloo on GPUs: ranks may share a GPU; for testing the multi-rank CUDA paths, not for speed)"
    return f" backend={name}" + (testing if name == "gloo" and world.device.type == "cuda" else "")


def toolbox(cfg: Config) -> str:
    """For the start line: the recipe options that are on (EMA, MixUp/CutMix, clipping, dropout, Muon)."""
    on = {
        "train.ema_decay": cfg.train.ema_decay,
        "model.dropout": cfg.model.dropout,
        "model.width": cfg.model.width * (cfg.model.width != 1),
        "data.mixup_alpha": cfg.data.mixup_alpha,
        "data.cutmix_alpha": cfg.data.cutmix_alpha,
        "optim.clip_grad_norm": cfg.optim.clip_grad_norm,
        "optim.muon_lr": cfg.optim.muon_lr,
    }
    return "".join(f", {key.split('.')[1]}={value:g}" for key, value in on.items() if value > 0)


def say(text: str) -> None:
    """A line of the run's log on stdout, on a line of its own where a progress bar is shown (a note mid-epoch was
    glued to the bar's end). A log the OS refuses (its disk full) does not stop the run, which keeps each epoch in
    metrics.jsonl: stdout goes to /dev/null from then on, with one warning on stderr."""
    try:
        with tqdm.external_write_mode(file=sys.stdout):  # (the bar cleared, then drawn again below the line)
            print(text, flush=True)
    except BrokenPipeError:  # its reader has gone (`| head`): the run ends as any command does
        raise
    except OSError as e:
        cli.silence_stdout()
        with contextlib.suppress(OSError):  # stderr on the same full disk
            print(f"warning: cannot write the run's log to stdout ({e.strerror}); the run goes on, its epochs in "
                  "metrics.jsonl", file=sys.stderr, flush=True)  # fmt: skip


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
        self.started = self.last_shown = metrics.clock()  # (a pause does not count)
        self.stopped = time.perf_counter() - self.started  # this process's stopped seconds so far (clock's)
        self.images = 0  # over all ranks

    def __iter__(self) -> Iterator:
        return iter(self.batches)

    def update(self, loss: torch.Tensor, lr: float, images: int) -> None:
        """After a step that took `images` on this rank."""
        self.images += images * self.world_size
        if self.bar is None:
            return
        now = metrics.clock()
        if (stopped := time.perf_counter() - now) > self.stopped + 0.1:
            self.stopped = stopped  # stopped since the step before (a pause, a hold): tqdm's own rate leaves it out
            self.bar.unpause()
        if now - self.last_shown > 0.25:
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

        self.writer = SummaryWriter(str(rundir.tensorboard_dir(out_dir)))

    def epoch(self, m: dict[str, Any]) -> None:
        step, add = m["epoch"], self.writer.add_scalar
        add("train/loss", m["train_loss"], step)
        add("train/lr", m["lr"], step)
        add("train/images_per_s", m["images_per_s"], step)
        for key in ("grad_norm_mean", "grad_norm_max"):
            if key in m:
                add(f"train/{key}", m[key], step)
        if "test_acc" in m:  # an epoch that evaluated (train.eval_every)
            add("test/accuracy", m["test_acc"], step)
            if "raw_test_acc" in m:
                add("test/raw_test_acc", m["raw_test_acc"], step)
            for name, acc in zip(m["classes"], m["per_class_acc"]):
                if acc is not None:
                    add(f"test_per_class/{name}", acc, step)
        for key in ("gpu_allocated_mb", "gpu_reserved_mb", "gpu_peak_mb"):
            if key in m:
                add(f"gpu/{key}", m[key], step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
