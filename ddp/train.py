"""The one training loop: a single device, nn.DataParallel and DDP differ only in distributed.wrap.

    python ddp/train.py --config configs/quick.yaml optim.lr=0.05
    torchrun --standalone --nproc_per_node=2 ddp/train.py --config configs/quick.yaml

main(argv) returns the last epoch's metrics; cli(argv) is the command line: a UsageError is one line
on stderr and exit 2, a stop on a signal (after its checkpoint) exit 75. Owns the order of things
(build, resume, compile, wrap), the step and the step boundary (checkpoints, stop requests); devices
and process groups belong to distributed.py, data to data.py, files to checkpoint.py and logs.py.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (python/torchrun ddp/train.py): import ddp from the repo
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np
import torch
from torch import nn

from ddp import __version__ as ddp_version
from ddp import checkpoint, config, distributed, faults, logs, models, preemption
from ddp import data as datasets
from ddp.config import Config, OptimConfig
from ddp.distributed import World
from ddp.errors import EXIT_USAGE, UsageError

EXIT_PEER_LOST = 1  # another rank died or hung; the launcher (torchrun --max-restarts, SLURM) may restart

USAGE = """usage: python ddp/train.py [--config FILE.yaml] [section.key=value ...] [--print-config]
       torchrun --standalone --nproc_per_node=N ddp/train.py [the same arguments]

Values: defaults < the YAML file < section.key=value on the command line. Keys:
"""


def parse_args(argv: list[str]) -> tuple[str | None, list[str], bool]:
    """(config path, overrides, print-config) from the command line; --help prints and exits."""
    path, overrides, print_config = None, [], False
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            print(USAGE + config.reference())
            raise SystemExit(0)
        if arg == "--config":
            path = next(args, None)
            if path is None:
                raise UsageError("--config needs a file: --config configs/quick.yaml")
        elif arg.startswith("--config="):
            path = arg.partition("=")[2]
        elif arg == "--print-config":
            print_config = True
        elif arg.startswith("-"):
            raise UsageError(f"unknown option {arg}; options are --config FILE, --print-config, --help")
        else:
            overrides.append(arg)
    return path, overrides, print_config


def autocast_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    if amp == "off":
        return None
    if amp == "fp16" and device.type != "cuda":
        raise UsageError(f"run.amp=fp16 needs a CUDA device, not {device}; use run.amp=bf16 or off")
    return torch.bfloat16 if amp == "bf16" else torch.float16


def make_optimizer(
    model: nn.Module, o: OptimConfig, total_steps: int, steps_per_epoch: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer and its per-step schedule: linear warm-up, then constant or cosine to 0."""
    if o.name == "sgd":
        optimizer = torch.optim.SGD(
            model.parameters(),
            lr=o.lr,
            momentum=o.momentum,
            nesterov=o.nesterov and o.momentum > 0,
            weight_decay=o.weight_decay,
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    warmup = round(o.warmup_epochs * steps_per_epoch)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if o.schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_steps(
    wrapped: nn.Module,
    loader: torch.utils.data.DataLoader,
    to_input: Callable[[torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    criterion: nn.Module,
    world: World,
    amp: torch.dtype | None,
    totals: torch.Tensor,
    progress: bool,
    desc: str,
) -> Iterator[None]:
    """This rank's steps over its shard; yields after each optimizer step so the caller can act at
    the step boundary. Adds (loss x images, images) of this rank into `totals` without a sync."""
    wrapped.train()
    shown = logs.bar(loader, world.is_main and progress, desc)
    started, seen, last_update = time.perf_counter(), 0, 0.0
    for images, labels in shown:
        x = to_input(images)
        y = labels.to(world.device, non_blocking=True)
        with torch.autocast(world.device.type, dtype=amp, enabled=amp is not None):
            loss = criterion(wrapped(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces (averages) gradients during backward
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        totals[0] += loss.detach().double() * len(y)
        totals[1] += len(y)
        seen += len(y) * world.world_size
        now = time.perf_counter()
        if shown is not loader and now - last_update > 0.25:  # a few times a second: loss.item() syncs
            last_update = now
            logs.show(shown, loss=loss.item(), lr=scheduler.get_last_lr()[0], images_per_s=seen / (now - started))
        yield


@torch.no_grad()
def evaluate(
    module: nn.Module,
    loader: torch.utils.data.DataLoader,
    to_input: Callable[[torch.Tensor], torch.Tensor],
    num_classes: int,
    world: World,
    amp: torch.dtype | None,
    tta_flip: bool = False,
) -> torch.Tensor:
    """The confusion matrix (true class x predicted class, counts) over the whole test set, summed
    over ranks: each image once. Its diagonal is the correct count per class, its row sums the
    images per class. tta_flip: predict from the sum of the logits of each image and its mirror."""
    module.eval()
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=world.device)
    for images, labels in loader:
        x = to_input(images)
        y = labels.to(world.device, non_blocking=True)
        with torch.autocast(world.device.type, dtype=amp, enabled=amp is not None):
            logits = module(x)
            if tta_flip:
                logits = logits + module(x.flip(-1))
            predicted = logits.argmax(dim=1)
        confusion.index_add_(0, y * num_classes + predicted, torch.ones_like(y))  # no sync per batch
    distributed.all_reduce_sum(confusion, world)
    return confusion.view(num_classes, num_classes).cpu()


def accuracy_per_class(confusion: torch.Tensor) -> list[float | None]:
    """Each class's accuracy from a confusion matrix (None for a class with no test images)."""
    correct, total = confusion.diag().tolist(), confusion.sum(dim=1).tolist()
    return [c / t if t else None for c, t in zip(correct, total)]


def seconds_since_process_start() -> float | None:
    """How long this process has existed (Linux /proc), Python's and torch's imports included: the
    startup_s metric, time from process start to the end of the first training step."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def elapsed(since: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # time the work, not its queueing
    return time.perf_counter() - since


def start_run_dir(cfg: Config, world: World, resumed_epoch: int) -> None:
    """Rank 0 writes config.yaml; every rank learns whether out_dir is writable (none waits forever)."""
    error = None
    if world.is_main:
        try:
            logs.start(cfg.run.out_dir, config.dump(cfg), resumed_epoch)
            checkpoint.remove_partial_writes(cfg.run.out_dir)
        except OSError as e:
            error = e
    if not distributed.all_agree(error is None, world):
        raise UsageError(f"cannot write to run.out_dir={cfg.run.out_dir} ({error or 'failed on rank 0'})")


def check_resume_setting(resume: str, out_dir: str) -> None:
    """run.resume must not overwrite checkpoints the user has not asked to continue."""
    if resume == "auto":
        return
    if resume != "never" and not Path(resume).is_file():
        raise UsageError(f"run.resume={resume}: no such checkpoint file (use auto, never or a path)")
    existing = checkpoint.existing(out_dir)
    if not existing:
        return
    if resume == "never":
        raise UsageError(
            f"run.resume=never but {existing[0]} exists and would be overwritten; "
            "use another run.out_dir, run.resume=auto to continue, or delete it yourself"
        )
    if not Path(resume).samefile(existing[0]):  # last.pt is a hard link to the newest
        raise UsageError(
            f"run.resume={resume} but {checkpoint.directory(out_dir)} holds newer checkpoints that a later "
            "auto-resume would pick; use another run.out_dir"
        )


def find_checkpoint(cfg: Config, world: World) -> tuple[Path | None, dict[str, Any] | None]:
    if cfg.run.resume == "never":
        return None, None
    if cfg.run.resume == "auto":
        path, state, warnings = checkpoint.newest_valid(cfg.run.out_dir)
    else:
        path, state, warnings = Path(cfg.run.resume), checkpoint.load(cfg.run.resume), []
    if world.is_main:
        for warning in warnings:
            print(warning, file=sys.stderr, flush=True)
    found = state["global_step"] if state and "global_step" in state else -1
    if not distributed.same_on_all_ranks(found, world):
        raise UsageError(
            f"ranks found different checkpoints in {cfg.run.out_dir}: is it on a filesystem all nodes share?"
        )
    return path, state


def run(
    cfg: Config, world: World, per_rank_batch: int, amp: torch.dtype | None, stop_signals: list[signal.Signals]
) -> dict[str, Any] | None:
    """Train up to cfg.train.epochs inside an initialised World; the last epoch's metrics."""
    seed_everything(cfg.run.seed)
    # TF32: CUDA matmuls and cuDNN convolutions in TensorFloat-32 (both switches, so one key decides).
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.run.tf32
    torch.backends.cudnn.benchmark = cfg.run.cudnn_benchmark
    data = datasets.load(cfg.data, world)
    n_train = len(data.train.labels)
    steps_per_epoch = n_train // cfg.train.batch_size
    if steps_per_epoch == 0:
        raise UsageError(f"train.batch_size={cfg.train.batch_size} exceeds the {n_train} training images")

    model = models.build(cfg.model.name, data.num_classes).to(world.device)  # raw module: the one we save
    if cfg.run.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer, scheduler = make_optimizer(model, cfg.optim, cfg.train.epochs * steps_per_epoch, steps_per_epoch)
    scaler = torch.amp.GradScaler(world.device.type, enabled=cfg.run.amp == "fp16")
    # Position: `done` epochs finished, `step` global batches into the next; `totals` its running sums.
    done, step, global_step, last = 0, 0, 0, None
    totals = torch.zeros(2, dtype=torch.float64, device=world.device)
    path, state = find_checkpoint(cfg, world)
    if state:
        checkpoint.check_compatible(state, config.to_dict(cfg), n_train, path)
        checkpoint.restore(state, model, optimizer, scheduler, scaler)
        done, step, last = state["epoch"], state.get("step", 0), state.get("metrics")
        global_step = state.get("global_step", done * steps_per_epoch)
        same_world = checkpoint.restore_rank(state, world.rank, world.world_size, world.device, totals)
        if world.is_main:
            logs.say(
                f"resumed from {path}: {done} epoch(s) + {step} step(s) done (global step {global_step}); "
                f"saved at world_size {state.get('world_size')}, now {world.world_size}; same global batch "
                f"{cfg.train.batch_size} and data order"
                + ("" if same_world else "; RNG states not restored (world size changed)")
            )
    wrapped = distributed.wrap(torch.compile(model) if cfg.run.compile else model, world)
    start_run_dir(cfg, world, done)

    train_dl = datasets.train_loader(
        data.train, per_rank_batch, world, cfg.data.augment, cfg.data.workers, cfg.run.seed, cfg.data.loader
    )
    eval_dl = datasets.eval_loader(
        data.test, max(1, cfg.train.eval_batch_size // world.world_size), world, cfg.data.workers, cfg.data.loader
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
    to_input = datasets.input_fn(data, world.device, cfg.run.channels_last)
    if world.is_main:
        params = sum(p.numel() for p in model.parameters())
        logs.say(
            f"{cfg.model.name} ({params / 1e6:.2f}M params) on {cfg.data.dataset} "
            f"({n_train} train / {len(data.test.labels)} test, {data.num_classes} classes); "
            f"launcher={world.launcher} parallel={world.parallel} world_size={world.world_size} device={world.device} "
            f"global batch {cfg.train.batch_size} ({per_rank_batch} per rank), amp={cfg.run.amp}; "
            f"loader={cfg.data.loader} tf32={cfg.run.tf32} cudnn_benchmark={cfg.run.cudnn_benchmark}"
        )

    def save(metrics: dict[str, Any] | None) -> Path | None:
        """Every rank calls this at the same boundary (it gathers RNG states); rank 0 writes."""
        epoch_done, step_done = (done, step) if step < steps_per_epoch else (done + 1, 0)
        mine = {"rng": checkpoint.rng_state(world.device), "partial": totals.cpu() if step_done else None}
        ranks = distributed.gather_objects(mine, world)
        if not world.is_main:
            return None
        return checkpoint.save(
            {
                "format": checkpoint.FORMAT,
                "epoch": epoch_done,
                "step": step_done,
                "global_step": global_step,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                "ranks": ranks,
                "global_batch": cfg.train.batch_size,
                "world_size": world.world_size,
                "train_images": n_train,
                "normalize": {"mean": list(data.mean), "std": list(data.std)},
                "config": config.to_dict(cfg),
                "metrics": metrics,
                "versions": {"torch": str(torch.__version__), "ddp_cifar": ddp_version},
            },
            cfg.run.out_dir,
            cfg.run.keep_last,
        )

    # Process start to the end of its first step: reported once, with this process's first epoch.
    startup_s, first_step_done = None, False
    board = logs.Board(cfg.run.out_dir) if cfg.run.tensorboard and world.is_main else None
    with contextlib.closing(board) if board else contextlib.nullcontext(), preemption.StopRequest(stop_signals) as stop:
        for epoch in range(done + 1, cfg.train.epochs + 1):
            started, images_before = time.perf_counter(), totals[1].item()
            if world.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(world.device)  # the epoch's own peak
            train_dl.sampler.set_position(epoch, step)  # this epoch's permutation, from `step` on
            for _ in train_steps(
                wrapped, train_dl, to_input, optimizer, scheduler, scaler, criterion, world, amp, totals,
                cfg.run.progress, f"epoch {epoch}",
            ):  # fmt: skip
                step, global_step = step + 1, global_step + 1
                if not first_step_done:
                    startup_s, first_step_done = seconds_since_process_start(), True
                faults.maybe_kill("step", global_step, world.rank, cfg.run.out_dir)
                stopping = distributed.any_rank(stop.requested, world)
                periodic = cfg.run.save_every_steps and global_step % cfg.run.save_every_steps == 0
                if step < steps_per_epoch and (stopping or periodic):  # at the last step: the epoch's end
                    saved = save(last)
                    if stopping:
                        finish_stop(stop.received, saved, world)
            train_seconds = elapsed(started, world.device)
            distributed.sync_buffers(model, world)
            confusion = evaluate(
                distributed.for_eval(wrapped), eval_dl, to_input, data.num_classes, world, amp, cfg.train.tta_flip
            )
            summed = distributed.all_reduce_sum(totals.clone(), world).tolist()
            last = {
                "epoch": epoch,
                "train_loss": summed[0] / summed[1],
                "test_acc": confusion.diag().sum().item() / confusion.sum().item(),
                "test_images": int(confusion.sum()),
                "per_class_acc": accuracy_per_class(confusion),
                "classes": data.classes,
                "confusion": confusion.tolist(),  # rows: true class, columns: predicted
                "lr": scheduler.get_last_lr()[0],
                "images_per_s": (totals[1].item() - images_before) * world.world_size / train_seconds,
                "seconds": elapsed(started, world.device),
                "world_size": world.world_size,
                "parallel": world.parallel,
                "device": str(world.device),
            }
            if world.device.type == "cuda":  # this rank's (rank 0's in the log): MB
                last["gpu_allocated_mb"] = torch.cuda.memory_allocated(world.device) / 2**20
                last["gpu_reserved_mb"] = torch.cuda.memory_reserved(world.device) / 2**20
                last["gpu_peak_mb"] = torch.cuda.max_memory_allocated(world.device) / 2**20
            if startup_s is not None:
                last["startup_s"], startup_s = startup_s, None
            if world.is_main:
                logs.say(logs.epoch_line(last, cfg.train.epochs))
                logs.append(cfg.run.out_dir, last)
                if board:
                    board.epoch(last)
            saved = save(last)
            done, step = epoch, 0
            totals.zero_()
            if epoch < cfg.train.epochs and distributed.any_rank(stop.requested, world):  # done is done
                finish_stop(stop.received, saved, world)
    if state and state["epoch"] >= cfg.train.epochs and world.is_main:
        logs.say(f"nothing to do: {state['epoch']} of train.epochs={cfg.train.epochs} already done")
    return last


def finish_stop(signal_name: str | None, saved: Path | None, world: World) -> None:
    """After the stop checkpoint: rank 0 asks SLURM to requeue the job (if in one); all ranks leave."""
    cause = signal_name or "a signal to another rank"
    if world.is_main:
        logs.say(f"stopping on {cause}: checkpoint {saved}")
        command = distributed.requeue_command()
        if command:
            result = subprocess.run(command, capture_output=True, text=True)
            logs.say(f"{' '.join(command)}: " + ("requeued" if result.returncode == 0 else result.stderr.strip()))
    distributed.all_agree(True, world)  # leave together, after rank 0's checkpoint is on disk
    why = f"stopped on {cause}; run the same command to resume"
    raise preemption.Stopped(why if world.is_main else "")  # other ranks print nothing but errors


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    path, overrides, print_config = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = config.load(path, overrides)
    if print_config:
        print(config.dump(cfg), end="")
        return None
    cfg.run = distributed.accelerate_flags(cfg.run)
    world = distributed.resolve(cfg.run)
    # Checks that need no process group, made before joining one: a bad value must not leave the
    # other ranks waiting in the rendezvous.
    per_rank_batch = world.split(cfg.train.batch_size, "train.batch_size")
    amp = autocast_dtype(cfg.run.amp, world.device)
    check_resume_setting(cfg.run.resume, cfg.run.out_dir)
    stop_signals = preemption.parse_signals(cfg.run.stop_signal)
    if cfg.run.tensorboard:
        logs.check_tensorboard()
    with distributed.setup(world, cfg.run.timeout_s):
        return run(cfg, world, per_rank_batch, amp, stop_signals)


def debug_requested(argv: list[str]) -> bool:
    """run.debug from the config (file and overrides), or from the command line alone when the
    config itself is what failed to load."""
    try:
        path, overrides, _ = parse_args(argv)
        return config.load(path, overrides).run.debug
    except UsageError:
        values = [a.partition("=")[2] for a in argv if a.replace(" ", "").startswith("run.debug=")]
        return bool(values) and config.parse_bool(values[-1]) is True


def cli(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        main(argv)
    except (UsageError, distributed.PeerLost) as e:
        if debug_requested(argv):
            raise  # the traceback, for a bug report
        print(f"error: {e}", file=sys.stderr)
        return EXIT_PEER_LOST if isinstance(e, distributed.PeerLost) else EXIT_USAGE
    except preemption.Stopped as e:
        if str(e):
            print(str(e), file=sys.stderr)
        return preemption.EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    sys.exit(cli())
