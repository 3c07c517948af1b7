"""The one training loop: a single device, nn.DataParallel and DDP differ only in distributed.wrap.

    python ddp/train.py --config configs/quick.yaml optim.lr=0.05
    torchrun --standalone --nproc_per_node=2 ddp/train.py --config configs/quick.yaml

Owns the order of things: what is checked before joining the process group (all of it once, for
a launch script, with --preflight N); the data; build (model, optimizer), resume, compile, wrap;
then each epoch's steps with the step boundary (divergence, checkpoint, stop request) inline, its
evaluation, its record. main(argv) returns the last epoch's metrics; cli(argv)
is the command (exit codes: ddp.errors). Devices and the process group are distributed.py's, data
data.py's, a checkpoint's contents and files checkpoint.py's, measuring metrics.py's, printing and
writing logs.py's.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (python/torchrun ddp/train.py): import ddp from the repo
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddp import (
    checkpoint,
    config,
    distributed,
    faults,
    launchers,
    loaders,
    logs,
    metrics,
    models,
    optim,
    preemption,
    rng,
    rundir,
    sync_bn,
)
from ddp import data as datasets
from ddp.checkpoint import Position
from ddp.cli import command, parse_args
from ddp.config import Config
from ddp.distributed import World
from ddp.errors import Diverged, Stopped, UsageError

USAGE = """usage: python ddp/train.py [--config FILE.yaml] [section.key=value ...] [--print-config]
       torchrun --standalone --nproc_per_node=N ddp/train.py [the same arguments]
       python ddp/train.py --preflight N [the same arguments]   (check, then exit: before starting N processes)

Values: defaults < the YAML file < section.key=value on the command line. Keys:
"""


@dataclass
class Job:
    """Everything the loop uses, built once by build()."""

    cfg: Config
    world: World
    data: datasets.Data
    trained: checkpoint.Trained  # the raw model, optimizer, LR schedule, GradScaler
    wrapped: nn.Module  # what forward is called on: the model, DataParallel or DDP (compiled first if asked)
    checkpoints: checkpoint.Checkpointer
    epoch_loss: metrics.EpochLoss  # this rank's running loss sums in the current epoch
    train_loader: loaders.DeviceLoader | DataLoader  # uint8 batches of this rank's shard
    eval_loader: loaders.DeviceEvalLoader | DataLoader
    to_input: Callable[[torch.Tensor], torch.Tensor]  # uint8 batch -> normalised float on the device
    criterion: nn.Module
    amp: torch.dtype | None  # autocast dtype, None for float32
    steps_per_epoch: int  # global batches per epoch (the last partial batch is dropped)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(sys.argv[1:] if argv is None else argv, USAGE)
    cfg = config.load(args.config, args.overrides)
    if args.print_config:
        print(config.dump(cfg), end="")
        return None
    cfg.run = launchers.accelerate_flags(cfg.run)
    if args.preflight:
        return preflight(cfg, args.preflight)
    world = distributed.resolve(cfg.run)
    # Checks that need no process group, made before joining one: a bad value must not leave the
    # other ranks waiting in the rendezvous.
    per_rank_batch = world.split(cfg.train.batch_size, "train.batch_size", cfg.train.grad_accum_steps)
    amp = autocast_dtype(cfg.run.amp, world.device)
    check_combinations(cfg, world)
    if cfg.run.deterministic:
        rng.deterministic()  # before any CUDA work
    stop_signals = preemption.parse_signals(cfg.run.stop_signal)
    if cfg.run.tensorboard:
        logs.check_tensorboard()
    with rundir.lock(cfg.run.out_dir, world):  # one run at a time in out_dir (rank 0 holds it)
        rundir.check_resume_setting(cfg.run.resume, cfg.run.out_dir)
        data = datasets.load(cfg.data, world)  # a file that lies stops every rank alike, before the group
        with distributed.setup(world, cfg.run.timeout_s) as world:
            return train(cfg, world, data, per_rank_batch, amp, stop_signals)


def preflight(cfg: Config, processes: int) -> None:
    """`--preflight N`, run by the launch scripts before they start N processes: what every rank
    would check, checked once here, so that a mistake is one line (exit 2) instead of one error per
    rank followed by the launcher's traceback. The split of the global batch, the stop signals, the
    data (downloaded here, once, if it must be), run.resume and the lock of run.out_dir."""
    alone = World(0, 0, 1, torch.device("cpu"), "none")
    ranks = World(0, 0, processes, torch.device("cpu"), "ddp")
    ranks.split(cfg.train.batch_size, "train.batch_size", cfg.train.grad_accum_steps)
    check_combinations(cfg, ranks)
    preemption.parse_signals(cfg.run.stop_signal)
    if cfg.run.tensorboard:
        logs.check_tensorboard()
    steps_per_epoch(cfg, len(datasets.load(cfg.data, alone).train.labels))
    with rundir.lock(cfg.run.out_dir, alone):
        rundir.check_resume_setting(cfg.run.resume, cfg.run.out_dir)


def check_combinations(cfg: Config, world: World) -> None:
    """Settings that each parse but do not work together."""
    if cfg.train.sync_bn and world.parallel == "dp":
        raise UsageError(
            "train.sync_bn=true needs DDP (nn.DataParallel computes BatchNorm per GPU): "
            "torchrun --standalone --nproc_per_node=N ddp/train.py ..."
        )
    if cfg.run.deterministic and cfg.run.cudnn_benchmark:
        raise UsageError("run.deterministic=true and run.cudnn_benchmark=true: cuDNN's autotuning is not deterministic")
    if cfg.ddp.static_graph and cfg.train.grad_accum_steps > 1:
        raise UsageError(
            "ddp.static_graph=true with train.grad_accum_steps>1: DDP's static graph breaks under no_sync "
            "(an internal assert, then gradients that are no longer all-reduced: pytorch/pytorch#143580); "
            "use one of the two"
        )


def autocast_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    if amp == "off":
        return None
    if amp == "fp16" and device.type != "cuda":
        raise UsageError(f"run.amp=fp16 needs a CUDA device, not {device}; use run.amp=bf16 or off")
    return torch.bfloat16 if amp == "bf16" else torch.float16


def build(
    cfg: Config, world: World, data: datasets.Data, per_rank_batch: int, amp: torch.dtype | None
) -> tuple[Job, checkpoint.Resumed | None]:
    """Model and optimizer for `data`; the checkpoint to continue from, loaded into the raw model
    before compile and wrap; the loaders. Returns the job and what was resumed."""
    rng.seed_everything(cfg.run.seed)
    # TF32: CUDA matmuls and cuDNN convolutions in TensorFloat-32 (both switches, so one key decides).
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.run.tf32
    torch.backends.cudnn.benchmark = cfg.run.cudnn_benchmark
    n_train = len(data.train.labels)
    steps = steps_per_epoch(cfg, n_train)
    model = models.build(cfg.model.name, data.num_classes).to(world.device)  # raw module: the one we save
    if cfg.train.sync_bn and world.parallel == "ddp":
        model = sync_bn.convert(model, world.device)  # same parameters and state-dict keys
    if cfg.run.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer, scheduler = optim.make_optimizer(model, cfg.optim, cfg.train.epochs * steps, steps)
    scaler = torch.amp.GradScaler(world.device.type, enabled=cfg.run.amp == "fp16")
    trained = checkpoint.Trained(model, optimizer, scheduler, scaler)
    normalize = {"mean": list(data.mean), "std": list(data.std)}
    info = checkpoint.RunInfo(config.to_dict(cfg), world.world_size, n_train, normalize, data.classes)
    checkpoints = checkpoint.Checkpointer(cfg.run, world, trained, info)
    epoch_loss = metrics.EpochLoss(world.device)
    resumed = checkpoints.resume(epoch_loss)
    wrapped = distributed.wrap(torch.compile(model) if cfg.run.compile else model, world, cfg.ddp)
    d = cfg.data
    train_loader = loaders.train_loader(data.train, per_rank_batch, world, d.augment, d.workers, cfg.run.seed, d.loader)
    eval_batch = max(1, cfg.train.eval_batch_size // world.world_size)
    eval_loader = loaders.eval_loader(data.test, eval_batch, world, d.workers, d.loader)
    to_input = loaders.input_fn(data.mean, data.std, world.device, cfg.run.channels_last)
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
    parts = (trained, wrapped, checkpoints, epoch_loss, train_loader, eval_loader, to_input, criterion, amp, steps)
    job = Job(cfg, world, data, *parts)
    return job, resumed


def steps_per_epoch(cfg: Config, n_train: int) -> int:
    """Global batches in an epoch (the last, partial one is dropped)."""
    if n_train < cfg.train.batch_size:
        raise UsageError(f"train.batch_size={cfg.train.batch_size} exceeds the {n_train} training images")
    return n_train // cfg.train.batch_size


def train_step(job: Job, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One optimizer step on this rank's batch, in train.grad_accum_steps micro-batches: forward and
    backward of each (DDP averages the gradients over the ranks in the last one's backward), then
    clip, step, schedule. Returns the batch's mean loss, still on the device (reading it syncs)."""
    accum = job.cfg.train.grad_accum_steps
    optimizer, scaler = job.trained.optimizer, job.trained.scaler
    optimizer.zero_grad(set_to_none=True)
    x, y = job.to_input(images), labels.to(job.world.device, non_blocking=True)
    total = torch.zeros((), device=job.world.device)
    for micro, xs, ys in zip(distributed.micro_batches(job.wrapped, accum), x.chunk(accum), y.chunk(accum)):
        with micro:  # forward and backward both inside no_sync
            with torch.autocast(job.world.device.type, dtype=job.amp, enabled=job.amp is not None):
                loss = job.criterion(forward(job.wrapped, xs), ys) / accum  # the big batch's mean
            scaler.scale(loss).backward()
        total += loss.detach()
    if job.cfg.optim.clip_grad_norm > 0:
        scaler.unscale_(optimizer)  # clip the true gradients, not fp16's scaled ones
        nn.utils.clip_grad_norm_(job.trained.model.parameters(), job.cfg.optim.clip_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    job.trained.scheduler.step()
    return total


def forward(wrapped: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """wrapped(x), with DDP's error for a model that left parameters unused as a usage error."""
    try:
        return wrapped(x)
    except RuntimeError as e:
        if "Expected to have finished reduction in the prior iteration" not in str(e):
            raise
        raise UsageError(
            "the model left some parameters without a gradient in the last step, and DDP waits for every "
            "one: set ddp.find_unused_parameters=true (or ddp.static_graph=true if the same ones are unused "
            "in every step)"
        ) from None


def train(
    cfg: Config,
    world: World,
    data: datasets.Data,
    per_rank_batch: int,
    amp: torch.dtype | None,
    stop_signals: list[signal.Signals],
) -> dict[str, Any] | None:
    """Build, resume, then train to cfg.train.epochs; the last epoch's metrics. Runs inside the
    process group, and the DDP model dies with it before the group does (distributed.setup)."""
    job, resumed = build(cfg, world, data, per_rank_batch, amp)
    position = resumed.position if resumed else Position()
    last_metrics = resumed.metrics if resumed else None
    rundir.start(cfg.run.out_dir, config.dump(cfg), position.epochs_done, world)
    if world.is_main:
        logs.say(start_line(job, resumed))
    board = logs.Board(cfg.run.out_dir) if cfg.run.tensorboard and world.is_main else None
    first_epoch, startup_s = position.epochs_done + 1, None  # startup_s: reported with this process's first epoch
    with contextlib.closing(board) if board else contextlib.nullcontext(), preemption.StopRequest(stop_signals) as stop:
        for epoch in range(first_epoch, cfg.train.epochs + 1):
            started, images_before = metrics.epoch_start(world.device), job.epoch_loss.images()
            job.train_loader.sampler.set_position(epoch, position.step_in_epoch)  # this epoch's order, from there on
            job.wrapped.train()
            progress = logs.Progress(
                job.train_loader, world.is_main and cfg.run.progress, f"epoch {epoch}", world.world_size
            )
            for images, labels in progress:
                loss = train_step(job, images, labels)
                position.step_in_epoch += 1
                position.global_step += 1
                job.epoch_loss.add(loss, len(labels), position.global_step)
                startup_s = startup_s or metrics.seconds_since_process_start()
                faults.maybe_kill("step", position.global_step, world.rank, cfg.run.out_dir)
                stopping = distributed.any_rank(stop.requested, world)
                if job.checkpoints.due(position, job.steps_per_epoch, stopping):
                    stop_if_diverged(job, position)  # a checkpoint is never written with NaN weights
                    saved = job.checkpoints.save(position, job.epoch_loss, last_metrics)
                    if stopping:
                        finish_stop(stop.received, saved, world)
                progress.update(loss, job.trained.scheduler.get_last_lr()[0], len(labels))
            stop_if_diverged(job, position)
            images_trained = (job.epoch_loss.images() - images_before) * world.world_size  # all ranks'
            images_per_s = images_trained / metrics.elapsed(started, world.device)
            last_metrics = epoch_metrics(job, epoch, started, images_per_s, startup_s if epoch == first_epoch else None)
            distributed.on_rank0(world, logs.record_epoch, last_metrics, cfg.train.epochs, cfg.run.out_dir, board)
            position = Position(epoch, 0, position.global_step)
            saved = job.checkpoints.save(position, job.epoch_loss, last_metrics)
            job.epoch_loss.reset()
            if epoch < cfg.train.epochs and distributed.any_rank(stop.requested, world):  # done is done
                finish_stop(stop.received, saved, world)
    return last_metrics


def epoch_metrics(job: Job, epoch: int, started: float, images_per_s: float, startup_s: float | None) -> dict[str, Any]:
    """The epoch's record: the whole test set evaluated once over the ranks (after rank 0's BatchNorm
    statistics are made everyone's), the mean training loss over the ranks, lr, speed, and seconds
    since `started` (training and evaluation)."""
    how = "broadcast" if job.cfg.train.sync_bn else job.cfg.train.dist_bn  # with sync_bn they agree already
    distributed.sync_buffers(job.trained.model, job.world, how)
    module = distributed.for_eval(job.wrapped)
    confusion = metrics.evaluate(
        module, job.eval_loader, job.to_input, job.data.num_classes, job.world, job.amp, job.cfg.train.tta_flip
    )
    train_loss = job.epoch_loss.mean_over_ranks(job.world)
    extra = {} if startup_s is None else {"startup_s": startup_s}
    return metrics.epoch_record(
        epoch, train_loss, confusion, job.data.classes, job.world, lr=job.trained.scheduler.get_last_lr()[0],
        images_per_s=images_per_s, seconds=metrics.elapsed(started, job.world.device), **extra,
    )  # fmt: skip


def stop_if_diverged(job: Job, position: Position) -> None:
    """All ranks stop together, before anything is saved, if any rank's loss or weights stopped
    being finite. Called where the step boundary syncs anyway (a checkpoint, an epoch's end), so a
    GPU step never waits for it. A step that fp16's GradScaler skips (inf gradients) has a finite
    loss and unchanged weights: not a divergence."""
    state = [t for t in job.trained.model.state_dict().values() if t.is_floating_point()]  # BatchNorm's stats too
    weights_finite = bool(torch.stack([t.isfinite().all() for t in state]).all())
    loss = job.epoch_loss
    mine = (int(loss.first_non_finite_step), float(loss.last_finite), weights_finite)
    if not distributed.any_rank(mine[0] >= 0 or not weights_finite, job.world):
        return
    ranks = distributed.gather_objects(mine, job.world)
    steps = [step for step, _, _ in ranks if step >= 0]
    what = f"the loss was not finite at global step {min(steps)}" if steps else "the weights were not finite"
    newest = checkpoint.step_files(job.cfg.run.out_dir)
    kept = f"the newest checkpoint, {newest[0]}, is finite" if newest else "no checkpoint was written"
    fp16 = ", or run.amp=bf16 instead of fp16" if job.cfg.run.amp == "fp16" else ""
    raise Diverged(
        f"training diverged: {what} (step {position.global_step} now; last finite loss {ranks[0][1]:.4g}, "
        f"lr {job.trained.scheduler.get_last_lr()[0]:.3g}); nothing was saved after it and {kept}. "
        f"Try a lower optim.lr (now {job.cfg.optim.lr:g}), optim.clip_grad_norm=1.0{fp16}"
    )


def start_line(job: Job, resumed: checkpoint.Resumed | None) -> str:
    """What rank 0 says before the first step: where it resumed from, then what runs where."""
    cfg, world, data = job.cfg, job.world, job.data
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
    params = sum(p.numel() for p in job.trained.model.parameters())
    lines.append(
        f"{cfg.model.name} ({params / 1e6:.2f}M params) on {cfg.data.dataset} "
        f"({len(data.train.labels)} train / {len(data.test.labels)} test, {data.num_classes} classes); "
        f"launcher={world.launcher} parallel={world.parallel} world_size={world.world_size} device={world.device} "
        f"global batch {cfg.train.batch_size} ({batch_split(cfg, world)}), sync_bn={cfg.train.sync_bn}, "
        f"amp={cfg.run.amp}; loader={cfg.data.loader} tf32={cfg.run.tf32} cudnn_benchmark={cfg.run.cudnn_benchmark} "
        f"threads={torch.get_num_threads()} deterministic={cfg.run.deterministic}"
    )
    return "\n".join(lines)


def accum_change(saved: int, now: int) -> str:
    """For the resume line: " (grad_accum_steps 1, now 4)" when micro-batching is or was on."""
    return "" if saved == now == 1 else f" (grad_accum_steps {saved}, now {now})"


def batch_split(cfg: Config, world: World) -> str:
    """How the global batch is split: "128 per rank" or "64 per rank = 4 micro-batches of 16"."""
    per_rank, accum = cfg.train.batch_size // world.world_size, cfg.train.grad_accum_steps
    return f"{per_rank} per rank" + (f" = {accum} micro-batches of {per_rank // accum}" if accum > 1 else "")


def finish_stop(signal_name: str | None, saved: Path | None, world: World) -> None:
    """After the stop checkpoint: rank 0 asks SLURM to requeue the job (if in one); all ranks leave."""
    cause = signal_name or "a signal to another rank"
    if world.is_main:
        logs.say(f"stopping on {cause}: checkpoint {saved}")
        requeue = launchers.requeue_command()
        if requeue:
            result = subprocess.run(requeue, capture_output=True, text=True)
            logs.say(f"{' '.join(requeue)}: " + ("requeued" if result.returncode == 0 else result.stderr.strip()))
    distributed.all_agree(True, world)  # leave together, after rank 0's checkpoint is on disk
    why = f"stopped on {cause}; run the same command to resume"
    raise Stopped(why if world.is_main else "")  # other ranks print nothing but errors


def cli(argv: list[str] | None = None) -> int:
    """The command line: ddp/train.py's exit code (ddp.errors)."""
    return command(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
