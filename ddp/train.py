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
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (python/torchrun ddp/train.py): import ddp from the repo
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils.data import DataLoader

from ddp import (
    checkpoint,
    config,
    distributed,
    ema,
    faults,
    launchers,
    loaders,
    logs,
    metrics,
    mixing,
    models,
    optim,
    preemption,
    profiling,
    rng,
    rundir,
    sync_bn,
)
from ddp import data as datasets
from ddp.checkpoint import Position
from ddp.cli import command, parse_args
from ddp.config import Config
from ddp.distributed import World
from ddp.errors import Diverged, UsageError

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
    startup_s: float | None = None  # process start to the end of its first step (metrics.jsonl, first epoch)


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
        profiling.parse(cfg.run.profile, steps_per_epoch(cfg, len(data.train.labels)) * cfg.train.epochs)
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
    steps = steps_per_epoch(cfg, len(datasets.load(cfg.data, alone).train.labels))
    profiling.parse(cfg.run.profile, steps * cfg.train.epochs)
    with rundir.lock(cfg.run.out_dir, alone):
        rundir.check_resume_setting(cfg.run.resume, cfg.run.out_dir)


def check_combinations(cfg: Config, world: World) -> None:
    """Settings that each parse but do not work together."""
    models.check(cfg.model.name, cfg.model.dropout, cfg.model.width)
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
    m = cfg.model
    model = models.build(m.name, data.num_classes, m.dropout, m.width).to(world.device)  # the raw one we save
    if cfg.train.sync_bn and world.parallel == "ddp":
        model = sync_bn.convert(model, world.device, world.process_group_backend)  # same parameters, same keys
    if cfg.run.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer, scheduler = optim.make_optimizer(model, cfg.optim, cfg.train.epochs * steps, steps)
    scaler = torch.amp.GradScaler(world.device.type, enabled=cfg.run.amp == "fp16")
    average = ema.EMA(model, cfg.train.ema_decay, cfg.train.ema_warmup) if cfg.train.ema_decay > 0 else None
    trained = checkpoint.Trained(model, optimizer, scheduler, scaler, average)
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


def train_step(job: Job, images: torch.Tensor, labels: torch.Tensor, mix: mixing.Mix | None = None) -> torch.Tensor:
    """One optimizer step on this rank's batch (mixed by `mix`, if any), in train.grad_accum_steps
    micro-batches: forward and backward of each (DDP averages the gradients over the ranks in the
    last one's backward), then the gradients' norm (clipped to optim.clip_grad_norm), step, schedule,
    the moving average. Returns the batch's mean loss, still on the device (reading it syncs)."""
    accum, device = job.cfg.train.grad_accum_steps, job.world.device
    optimizer, scaler = job.trained.optimizer, job.trained.scaler
    optimizer.zero_grad(set_to_none=True)
    with record_function("data"):
        y = labels.to(device, non_blocking=True)
        x, y = mixing.apply(mix, job.to_input(images), y, job.data.num_classes)  # y: class probabilities if mixed
    total = torch.zeros((), device=device)
    for micro, xs, ys in zip(distributed.micro_batches(job.wrapped, accum), x.chunk(accum), y.chunk(accum)):
        with micro:  # forward and backward both inside no_sync
            with record_function("forward"), torch.autocast(device.type, dtype=job.amp, enabled=job.amp is not None):
                loss = job.criterion(forward(job.wrapped, xs), ys) / accum  # the big batch's mean
            with record_function("backward"):
                scaler.scale(loss).backward()
        total += loss.detach()
    with record_function("clip"):
        scaler.unscale_(optimizer)  # the true gradients' norm, not fp16's scaled ones
        job.epoch_loss.add_grad_norm(optim.clip_gradients(job.trained.model, job.cfg.optim.clip_grad_norm))
    with record_function("optimizer"):
        scaler.step(optimizer)
        scaler.update()
        job.trained.scheduler.step()
    if job.trained.ema:
        with record_function("ema"):
            job.trained.ema.update(job.trained.model)
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
        params = sum(p.numel() for p in job.trained.model.parameters())
        logs.say(logs.start_line(cfg, world, data, params, resumed))
    board = logs.Board(cfg.run.out_dir) if cfg.run.tensorboard and world.is_main else None
    profile_steps = profiling.parse(cfg.run.profile, job.steps_per_epoch * cfg.train.epochs, position.global_step)
    if cfg.run.profile and profile_steps is None and world.is_main:
        logs.say(f"run.profile={cfg.run.profile}: resumed after global step {position.global_step}, nothing to profile")
    first_epoch = position.epochs_done + 1
    with (
        contextlib.closing(board) if board else contextlib.nullcontext(),
        preemption.StopRequest(stop_signals) as stop,
        profiling.Profile(profile_steps, cfg.run.out_dir, world) as profile,
    ):
        for epoch in range(first_epoch, cfg.train.epochs + 1):
            started, images_before = metrics.epoch_start(world.device), job.epoch_loss.images()
            position = train_epoch(job, epoch, position, stop, profile, last_metrics)
            stop_if_diverged(job, position)
            images_trained = (job.epoch_loss.images() - images_before) * world.world_size  # all ranks'
            images_per_s = images_trained / metrics.elapsed(started, world.device)
            startup_s = job.startup_s if epoch == first_epoch else None  # reported with this process's first epoch
            last_metrics = epoch_metrics(job, epoch, started, images_per_s, startup_s)
            distributed.on_rank0(world, logs.record_epoch, last_metrics, cfg.train.epochs, cfg.run.out_dir, board)
            position = Position(epoch, 0, position.global_step)
            saved = job.checkpoints.save(position, job.epoch_loss, last_metrics)
            job.epoch_loss.reset()
            if epoch < cfg.train.epochs and distributed.any_rank(stop.requested, world):  # done is done
                preemption.finish_stop(stop.received, saved, world)
    return last_metrics


def train_epoch(
    job: Job,
    epoch: int,
    position: Position,
    stop: preemption.StopRequest,
    profile: profiling.Profile,
    last_metrics: dict[str, Any] | None,
) -> Position:
    """The steps of `epoch` from `position` on, each followed by the step boundary: a checkpoint
    when one is due (never of diverged weights), and leaving when a stop was requested. Returns
    the position after the epoch's last step."""
    cfg, world = job.cfg, job.world
    job.train_loader.sampler.set_position(epoch, position.step_in_epoch)  # this epoch's order, from there on
    job.wrapped.train()
    progress = logs.Progress(job.train_loader, world.is_main and cfg.run.progress, f"epoch {epoch}", world.world_size)
    for images, labels in progress:
        mix = mixing.draw(cfg.data, cfg.run.seed, epoch, position.step_in_epoch, world.rank)
        profile.before_step(position.global_step + 1)
        loss = train_step(job, images, labels, mix)
        position.step_in_epoch += 1
        position.global_step += 1
        profile.after_step(position.global_step)
        job.epoch_loss.add(loss, len(labels), position.global_step)
        job.startup_s = job.startup_s or metrics.seconds_since_process_start()
        faults.maybe_kill("step", position.global_step, world.rank, cfg.run.out_dir)
        stopping = distributed.any_rank(stop.requested, world)
        if job.checkpoints.due(position, job.steps_per_epoch, stopping):
            stop_if_diverged(job, position)  # a checkpoint is never written with NaN weights
            if job.trained.ema:  # the average's BatchNorm statistics, as at an epoch's end (exact resume)
                distributed.sync_buffers(job.trained.ema.module, world, bn_agreement(cfg))
            saved = job.checkpoints.save(position, job.epoch_loss, last_metrics)
            if stopping:
                preemption.finish_stop(stop.received, saved, world)
        progress.update(loss, job.trained.scheduler.get_last_lr()[0], len(labels))
    return position


def bn_agreement(cfg: Config) -> str:
    """How the ranks' BatchNorm statistics become one (distributed.sync_buffers): with sync_bn they
    agree already, so rank 0's are everyone's; else train.dist_bn."""
    return "broadcast" if cfg.train.sync_bn else cfg.train.dist_bn


def epoch_metrics(job: Job, epoch: int, started: float, images_per_s: float, startup_s: float | None) -> dict[str, Any]:
    """The epoch's record: the whole test set evaluated once over the ranks (after the ranks' BatchNorm
    statistics are made one), by the moving average if there is one (the trained weights' accuracy
    beside it as raw_test_acc), the mean training loss over the ranks, the gradients' norm, lr,
    speed, and seconds since `started` (training and evaluation)."""
    how, world = bn_agreement(job.cfg), job.world
    distributed.sync_buffers(job.trained.model, world, how)
    confusion = evaluate(job, distributed.for_eval(job.wrapped))
    extra = {} if startup_s is None else {"startup_s": startup_s}
    if job.trained.ema:
        distributed.sync_buffers(job.trained.ema.module, world, how)
        extra["raw_test_acc"] = metrics.accuracy(confusion)
        confusion = evaluate(job, job.trained.ema.module)
    train_loss = job.epoch_loss.mean_over_ranks(world)
    return metrics.epoch_record(
        epoch, train_loss, confusion, job.data.classes, world, lr=job.trained.scheduler.get_last_lr()[0],
        images_per_s=images_per_s, seconds=metrics.elapsed(started, world.device),
        **job.epoch_loss.grad_norm(), **extra,
    )  # fmt: skip


def evaluate(job: Job, module: nn.Module) -> torch.Tensor:
    """The confusion matrix of `module` over the whole test set (every rank calls it)."""
    cfg = job.cfg
    return metrics.evaluate(
        module, job.eval_loader, job.to_input, job.data.num_classes, job.world, job.amp, cfg.train.tta_flip
    )


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


def cli(argv: list[str] | None = None) -> int:
    """The command line: ddp/train.py's exit code (ddp.errors)."""
    return command(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
