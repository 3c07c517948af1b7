"""The training loop, told in the order a run meets each step: this rank's device, the process group,
the model on its device, the resume, the wrap, then per epoch set_epoch, train_step, the evaluation
summed over ranks and rank 0's checkpoint. README.md's "Read the code" maps each step to its line.

    python ddp/train.py --config configs/quick.yaml optim.lr=0.05
    torchrun --standalone --nproc_per_node=2 ddp/train.py --config configs/quick.yaml
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (python/torchrun ddp/train.py): import ddp from the repo
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
PARENT = os.getppid()  # the launcher that started this process, read before the seconds of imports (lifeline)
from ddp.startup import as_a_rank, quiet_startup

quiet_startup(__name__)  # a Ctrl-C or a missing package in the imports below: one line, not their traceback
as_a_rank(__name__)  # a launcher's rank: first for the kernel's out-of-memory killer, before torch's import

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils.data import DataLoader

from ddp import (
    alike,
    checkpoint,
    checks,
    config,
    datasets,
    devices,
    distributed,
    ema,
    faults,
    graphed,
    launchers,
    lifeline,
    loaders,
    logs,
    lost_rank,
    metrics,
    mixing,
    models,
    network,
    optim,
    preemption,
    profiling,
    rng,
    rundir,
    sync_bn,
    warmup,
)
from ddp.checkpoint import Position
from ddp.checks import Plan
from ddp.cli import command, leave, parse_args, show
from ddp.config import Config
from ddp.devices import World
from ddp.errors import Diverged

USAGE = """usage: python ddp/train.py [--config FILE.yaml] [section.key=value ...] [--print-config]
       torchrun --standalone --nproc_per_node=N ddp/train.py [the same arguments]
       python ddp/train.py --preflight N [the same arguments]   (check, then exit: before starting N processes)

Values: defaults < the YAML file < section.key=value on the command line. Keys:
"""


@lost_rank.telling_the_waiting()  # stopped before the ranks met (one machine's data missing, say): they hear why
def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """The run this process is part of; the last epoch's metrics."""
    args = parse_args(sys.argv[1:] if argv is None else argv, USAGE)
    cfg = config.load(args.config, args.overrides)
    if args.print_config:
        show(config.dump(cfg), end="")
        return None
    cfg.run = launchers.accelerate_flags(cfg.run)
    if args.preflight:
        return preflight(cfg, args.preflight)
    world = devices.resolve(cfg.run)  # rank, local_rank, world_size from the launcher; device cuda:<local_rank>
    devices.share_cpus(cfg.run)  # its threads: its share of the CPUs it may use (a container's quota too)
    with checked(cfg, world, logs.say if world.is_main else None) as (data, plan):  # every mistake before the group
        with lifeline.watched(world, plan.stop_signals, PARENT):  # the launcher's end, signals, deadlines
            with distributed.setup(world, cfg.run.timeout_s) as world, graphed.stream(plan.recorded, world.device):
                alike.check(cfg, data, world)  # each machine's own code, settings and data: one that differs, said
                return fit(cfg, world, data, plan)


def preflight(cfg: Config, processes: int) -> None:
    """`--preflight N`, run by the launch scripts before they start N processes: the checks every rank would make, made
    once, so that a mistake is one line (exit 2) instead of one per rank and the launcher's traceback. Downloads the
    data here, once, if it must. A job on several machines (NODE_RANK): whether MASTER_ADDR answers; node 0 locks."""
    node = launchers.node_rank()
    with checked(cfg, devices.planned(cfg.run, processes, node), say=None):  # notes: rank 0's, after it
        if node is not None:
            network.check_master(launchers.master_address() or "", launchers.master_port(), node, cfg.run.timeout_s)
    faults.preflight(cfg.run.out_dir)  # the tests' only; none unless DDP_CIFAR_FAULT=wait:preflight


@contextlib.contextmanager
def checked(cfg: Config, world: World, say: Callable[[str], None] | None) -> Iterator[tuple[datasets.Data, Plan]]:
    """Everything checked before joining the process group, so that a mistake stops every rank alike instead of
    leaving some waiting, cheapest first: the settings; run.out_dir, locked for this run while inside (rank 0
    holds it), against run.resume; the data (read here) and what depends on it. Yields the data and the Plan.
    `say`: where its notes go (rank 0's; None for a preflight, which rank 0 follows and would repeat)."""
    per_rank_batch, precision = checks.settings(cfg, world)  # autocast, weights, loss scale
    checks.unused(cfg, say)  # settings that do nothing in this run: notes
    stop_signals = tuple(preemption.parse_signals(cfg.run.stop_signal))
    if cfg.run.tensorboard:
        logs.check_tensorboard()
    with rundir.lock(cfg.run.out_dir, world):  # one run at a time in out_dir
        checkpoint.check_resume(cfg)  # run.resume; the settings of its checkpoint, before the data
        data = datasets.read(cfg.data, world)  # a file that lies stops every rank alike, before the group
        steps = checks.steps_per_epoch(cfg, len(data.train.labels))
        profile_steps = profiling.parse(cfg.run.profile, steps * cfg.train.epochs)
        recorded = checks.cuda_graph(cfg, world, say)  # auto: where it can be
        yield data, Plan(per_rank_batch, steps, *precision, stop_signals, profile_steps, recorded)


@dataclass
class Job:
    """Everything the loop uses, built once by build()."""

    cfg: Config
    world: World
    data: datasets.Data
    plan: Plan
    trained: checkpoint.Trained  # the raw model, optimizer, LR schedule, GradScaler, moving average
    wrapped: nn.Module  # what forward is called on: the model, DataParallel or DDP (compiled first if asked)
    checkpoints: checkpoint.Checkpoints
    stats: metrics.StepStats  # this rank's loss sums, gradient norms and finiteness (a journal on the device)
    train_loader: loaders.DeviceLoader | DataLoader  # uint8 batches of this rank's shard
    sampler: loaders.ResumableSampler  # the train loader's DistributedSampler
    eval_loader: loaders.EvalBatches  # as many batches on every rank
    to_input: Callable[[torch.Tensor], torch.Tensor]  # uint8 batch -> normalised float on the device
    criterion: nn.Module
    startup_s: float | None = None  # process start to the end of its first step (metrics.jsonl, first epoch)
    recorded: graphed.Recorder | None = None  # run.cuda_graph: gradient_step recorded in a CUDA graph, replayed
    warmup_s: float | None = None  # run.warmup_steps' seconds (metrics.jsonl, first epoch)


def build(cfg: Config, world: World, data: datasets.Data, plan: Plan) -> tuple[Job, checkpoint.Resumed | None]:
    """The model on this rank's device and its optimizer; the checkpoint to continue from, loaded into
    the raw model; then compile and the wrap; the loaders. Returns the job and what was resumed."""
    rng.seed_everything(cfg.run.seed)
    if cfg.run.deterministic:
        rng.deterministic()  # before any CUDA kernel runs
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.run.tf32  # both: one key decides
    torch.backends.cudnn.benchmark = cfg.run.cudnn_benchmark
    m, steps = cfg.model, plan.steps_per_epoch
    model = models.build(m.name, data.num_classes, m.dropout, m.width, plan.weights).to(world.device)  # the raw one
    to_input = loaders.input_fn(data.mean, data.std, world.device, cfg.run.channels_last, plan.weights)
    whitened = model[0] if m.whiten else None  # fast's stem (models.check: the one model with it)
    if whitened is not None:  # the same images on every rank, the same filters (DDP's wrap broadcasts rank 0's)
        models.whiten(whitened, to_input(data.train.images[: models.WHITEN_IMAGES]))
    if cfg.train.sync_bn and world.grouped:
        model = sync_bn.convert(model, world.device, world.process_group_backend)  # same parameters, same keys
    if cfg.run.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = distributed.shard(model, world, plan.amp)  # fsdp: fully_shard per block, in place; the rest: as it is
    t, total_steps = cfg.train, cfg.train.epochs * steps
    optimizer, scheduler = optim.make_optimizer(model, cfg.optim, total_steps, steps, whitened, plan.loss_scale)
    scaler = torch.amp.GradScaler(world.device.type, enabled=cfg.run.amp == "fp16")
    average = ema.EMA(model, t.ema_decay, t.ema_warmup) if t.ema_decay > 0 else None
    lookahead = ema.Lookahead(model, t.lookahead_every, t.lookahead_decay, total_steps) if t.lookahead_every else None
    trained = checkpoint.Trained(model, optimizer, scheduler, scaler, average, lookahead, plan.loss_scale)
    info = checkpoint.RunInfo.of(config.to_dict(cfg), world.world_size, data)
    checkpoints = checkpoint.Checkpoints(cfg.run, world, trained, info)
    stats = metrics.StepStats(world.device)
    resumed = checkpoints.resume(stats)  # torch.load(..., map_location="cpu") into the raw model, before the wrap
    knobs = replace(cfg.ddp, broadcast_buffers=cfg.ddp.broadcast_buffers and bn_agreement(cfg) == "reduce")
    compiled = torch.compile(model, mode=cfg.run.compile_mode) if cfg.run.compile else model  # before the wrap
    wrapped = distributed.wrap(compiled, world, knobs)  # DDP / DP
    d = cfg.data
    how = loaders.Augment(d.translate, d.pad == "reflect", d.flip) if d.augment else None
    train_loader = loaders.train_loader(data.train, plan.per_rank_batch, world, how, d.workers, cfg.run.seed, d.loader)
    eval_batch = max(1, cfg.train.eval_batch_size // world.world_size)
    job = Job(
        cfg=cfg, world=world, data=data, plan=plan, trained=trained, wrapped=wrapped, checkpoints=checkpoints,
        stats=stats, train_loader=train_loader, sampler=train_loader.sampler,
        eval_loader=loaders.eval_loader(data.test, eval_batch, world, d.workers, d.loader),
        to_input=to_input, criterion=nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing),
    )  # fmt: skip
    if plan.recorded:  # (on a CPU it replays by calling the step again: the tests' way; checks refuse it)
        say = logs.say if world.is_main else None
        job.recorded = graphed.Recorder(lambda x, y: gradient_step(job, x, y), optimizer, world, say)
    return job, resumed


def fit(cfg: Config, world: World, data: datasets.Data, plan: Plan) -> dict[str, Any] | None:
    """Build, resume, then train to cfg.train.epochs; the last epoch's metrics. Runs inside the
    process group, and the DDP model dies with this call, before the group does (distributed.setup)."""
    job, resumed = build(cfg, world, data, plan)
    position = resumed.position if resumed else Position()
    last_metrics = resumed.metrics if resumed else None
    rundir.prepare(cfg.run.out_dir, config.dump(cfg), position.epochs_done, world, cfg.run.tensorboard)
    profile_steps = profiling.left(plan.profile_steps, position.global_step)
    if world.is_main:
        params = sum(p.numel() for p in job.trained.model.parameters())
        logs.say(logs.start_line(cfg, world, data, params, resumed))
        if cfg.run.profile and profile_steps is None:
            logs.say(f"run.profile={cfg.run.profile}: resumed after step {position.global_step}, nothing to profile")
    faults.arm(cfg.run.out_dir, world.rank, position.global_step)  # the kill-and-resume tests' only; none unless set
    board = logs.Board(cfg.run.out_dir) if cfg.run.tensorboard and world.is_main else None
    first_epoch = position.epochs_done + 1
    if cfg.run.warmup_steps and first_epoch <= cfg.train.epochs:
        job.warmup_s = warm_up(job, first_epoch, position)
    with (
        contextlib.closing(board) if board else contextlib.nullcontext(),
        preemption.StopRequest(plan.stop_signals, world.is_main) as stop,
        profiling.Profile(profile_steps, cfg.run.out_dir, world) as profile,
    ):
        for epoch in range(first_epoch, cfg.train.epochs + 1):
            # the sampler: this epoch's shuffle, alike on every rank, each its slice (resumed: from the step it left)
            job.sampler.set_epoch(epoch, start_step=position.step_in_epoch)
            started, before = metrics.epoch_start(world.device), job.stats.images()  # this rank's images so far
            position = train_epoch(job, epoch, position, stop, profile, last_metrics)
            stop_if_diverged(job, position)
            train_s = metrics.elapsed(started, world.device)  # training alone: the evaluation comes after
            speed = dict(images_per_s=(job.stats.images() - before) * world.world_size / train_s, train_s=train_s)
            startup_s = job.startup_s if epoch == first_epoch else None  # reported with this process's first epoch
            evaluate = epoch % cfg.train.eval_every == 0 or epoch == cfg.train.epochs
            last_metrics = epoch_metrics(job, epoch, started, speed, startup_s, evaluate)  # all_reduce
            with distributed.fail_together(world):  # metrics.jsonl on a full disk stops every rank alike
                if world.is_main:
                    logs.record_epoch(last_metrics, cfg.train.epochs, cfg.run.out_dir, board)
            position = Position(epoch, 0, position.global_step)
            saved = job.checkpoints.save(position, job.stats, last_metrics)  # rank 0: torch.save, the raw model
            job.stats.reset()
            if epoch < cfg.train.epochs and distributed.any_rank(stop.requested, world):  # done is done
                preemption.finish_stop(stop.received, saved, world, cfg.run.out_dir)
    return last_metrics


def warm_up(job: Job, epoch: int, position: Position) -> float:
    """run.warmup_steps throwaway steps on the next batch, then an evaluation (the average's too); their seconds."""
    job.sampler.set_epoch(epoch, start_step=position.step_in_epoch)
    images, labels = next(iter(job.train_loader))
    evaluated = [distributed.for_eval(job.wrapped)] + ([job.trained.ema.module] if job.trained.ema else [])
    steps, evaluations = lambda: train_step(job, images, labels), lambda: [test_confusion(job, m) for m in evaluated]
    return warmup.throwaway_steps(job.checkpoints, position, job.stats, job.cfg.run.warmup_steps, steps, evaluations)


def train_epoch(
    job: Job,
    epoch: int,
    position: Position,
    stop: preemption.StopRequest,
    profile: profiling.Profile,
    last_metrics: dict[str, Any] | None,
) -> Position:
    """The steps of `epoch` from `position` on, each followed by the step boundary: a checkpoint when one is due
    (never of diverged weights), and leaving when a stop was agreed. Returns the position after its last step."""
    cfg, world = job.cfg, job.world
    job.wrapped.train()
    progress = logs.Progress(job.train_loader, world.is_main and cfg.run.progress, f"epoch {epoch}", world.world_size)
    agreement = distributed.StopAgreement(world)
    stop.epoch_started()  # a stop's grace counts steps: the evaluation and checkpoint before are none
    for images, labels in progress:
        mix = mixing.draw(cfg.data, cfg.run.seed, epoch, position.step_in_epoch, world.rank)
        profile.before_step(position.global_step + 1)
        loss = train_step(job, images, labels, mix)
        position.step_in_epoch += 1
        position.global_step += 1
        profile.after_step(position.global_step)
        job.stats.add(loss, len(labels), position.global_step)
        job.startup_s = job.startup_s or metrics.seconds_since_process_start()
        with record_function("stop agreement"):  # CPU flags on the control group, a step late: no wait
            stopping = stop.agreed(agreement)  # the step before's flags: all stop (or pause) together
        if job.checkpoints.due(position, job.plan.steps_per_epoch, stopping):
            stop_if_diverged(job, position)  # a checkpoint is never written with NaN weights
            if job.trained.ema:  # the average's BatchNorm statistics, as at an epoch's end (exact resume)
                distributed.sync_buffers(job.trained.ema.module, world, bn_agreement(cfg))
            saved = job.checkpoints.save(position, job.stats, last_metrics)
            if stopping:
                preemption.finish_stop(stop.received, saved, world, cfg.run.out_dir)
        progress.update(loss, job.trained.scheduler.get_last_lr()[0], len(labels))
    stop.take(agreement.wait(), agreement)  # the last step's (a hold or pause taken here): the epoch's end asks again
    return position


def train_step(job: Job, images: torch.Tensor, labels: torch.Tensor, mix: mixing.Mix | None = None) -> torch.Tensor:
    """One optimizer step on this rank's batch (mixed by `mix`, if any): gradient_step (run.cuda_graph: replayed),
    then the schedule, lookahead and the moving average. Returns the batch's mean loss, on the device (syncs read)."""
    recorded = job.recorded if mix is None else None  # a mixed batch: the eager step
    total, norm = recorded(images, labels) if recorded else gradient_step(job, images, labels, mix)
    job.stats.add_grad_norm(norm)
    with record_function("optimizer"):
        job.trained.scheduler.step()
    if job.trained.lookahead:
        with record_function("lookahead"):
            job.trained.lookahead.update(job.trained.model)
    if job.trained.ema:
        with record_function("ema"):
            job.trained.ema.update(job.trained.model)
    return total


def gradient_step(job: Job, images: torch.Tensor, labels: torch.Tensor, mix: mixing.Mix | None = None) -> graphed.Pair:
    """The batch in train.grad_accum_steps micro-batches: forward and backward of each (DDP averages the
    gradients over the ranks in the last one's backward), then the gradients' norm (clipped to
    optim.clip_grad_norm) and the optimizer's step. Returns the batch's mean loss and the norm, on the device."""
    accum, device, amp, scale = job.cfg.train.grad_accum_steps, job.world.device, job.plan.amp, job.plan.loss_scale
    optimizer, scaler = job.trained.optimizer, job.trained.scaler
    optimizer.zero_grad(set_to_none=True)
    with record_function("data"):
        y = labels.to(device, non_blocking=True)
        x, y = mixing.apply(mix, job.to_input(images), y, job.data.num_classes)  # y: class probabilities if mixed
    total: torch.Tensor | None = None
    for micro, xs, ys in zip(distributed.micro_batches(job.wrapped, accum), x.chunk(accum), y.chunk(accum)):
        with micro:  # forward and backward both inside no_sync
            with record_function("forward"), torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                loss = job.criterion(distributed.forward(job.wrapped, xs), ys)
                loss = loss / accum if accum > 1 else loss  # the big batch's mean (/ 1: 2 kernels for nothing)
            with record_function("backward"):
                scaler.scale(loss * scale if scale != 1.0 else loss).backward()  # fp16-weights: x the loss scale
        total = loss.detach() if total is None else total + loss.detach()
    with record_function("clip"):
        scaler.unscale_(optimizer)  # the true gradients' norm, not fp16's scaled ones
        norm = optim.clip_gradients(job.trained.model, job.cfg.optim.clip_grad_norm, scale)
    with record_function("optimizer"):
        scaler.step(optimizer)
        scaler.update()
    return total, norm


def bn_agreement(cfg: Config) -> str:
    """How the ranks' BatchNorm statistics become one at the boundaries (distributed.sync_buffers): with sync_bn
    they agree, so rank 0's; else train.dist_bn. build() keeps DDP's per-forward buffer broadcast for "reduce" alone."""
    return "broadcast" if cfg.train.sync_bn else cfg.train.dist_bn


def epoch_metrics(
    job: Job, epoch: int, started: float, speed: dict[str, float], startup_s: float | None, evaluate: bool
) -> dict[str, Any]:
    """The epoch's record: the ranks' BatchNorm statistics made one (every epoch: the checkpoint is the same whether
    the epoch evaluates or not); if `evaluate`, the whole test set evaluated once over the ranks, by the moving average
    if there is one (the trained weights' accuracy as raw_test_acc); the mean training loss over the ranks, the
    gradients' norm, lr, `speed` (images_per_s over all ranks, train_s) and the seconds since `started`."""
    how, world = bn_agreement(job.cfg), job.world
    distributed.sync_buffers(job.trained.model, world, how)
    confusion = test_confusion(job, distributed.for_eval(job.wrapped)) if evaluate else None
    first = {"startup_s": startup_s, "warmup_s": job.warmup_s}  # with this process's first epoch only
    extra = {} if startup_s is None else {key: value for key, value in first.items() if value is not None}
    if job.trained.ema:
        distributed.sync_buffers(job.trained.ema.module, world, how)
        if evaluate:
            extra["raw_test_acc"] = metrics.accuracy(confusion)
            confusion = test_confusion(job, job.trained.ema.module)
    train_loss = job.stats.mean_over_ranks(world)
    return metrics.epoch_record(
        epoch, train_loss, confusion, job.data.classes, world, **speed, seconds=metrics.elapsed(started, world.device),
        lr=job.trained.scheduler.get_last_lr()[0], **job.stats.grad_norm(), **extra,
    )  # fmt: skip


def test_confusion(job: Job, module: nn.Module) -> torch.Tensor:
    """The confusion matrix of `module` over the test set, summed over the ranks (each calls it), paused as agreed."""
    t, batches = job.cfg.train, preemption.agreed_pauses(job.eval_loader, job.world)
    return metrics.confusion_matrix(module, batches, job.to_input, job.data.num_classes, job.world, job.plan.amp,
                                    t.tta_flip, t.tta_translate)  # fmt: skip


def stop_if_diverged(job: Job, position: Position) -> None:
    """All ranks stop together, before anything is saved, if any rank's loss or weights stopped
    being finite. Called where the step boundary syncs anyway (a checkpoint, an epoch's end), so a
    GPU step never waits for it. A step that fp16's GradScaler skips (inf gradients) has a finite
    loss and unchanged weights: not a divergence."""
    state = [distributed.local(t) for t in job.trained.model.state_dict().values() if t.is_floating_point()]
    weights_finite = bool(torch.stack([t.isfinite().all() for t in state]).all())
    mine = (job.stats.first_non_finite(), job.stats.last_finite(), weights_finite)
    if not distributed.any_rank(mine[0] >= 0 or not weights_finite, job.world):
        return
    ranks = distributed.gather_objects(mine, job.world)
    steps = [step for step, _, _ in ranks if step >= 0]
    what = f"the loss was not finite at global step {min(steps)}" if steps else "the weights were not finite"
    newest = rundir.step_files(job.cfg.run.out_dir)
    kept = f"the newest checkpoint, {newest[0]}, is finite" if newest else "no checkpoint was written"
    fix = {"fp16": "optim.clip_grad_norm=1.0, or run.amp=bf16 instead of fp16", "fp16-weights": "run.amp=bf16"}
    muon = f" or optim.muon_lr (now {job.cfg.optim.muon_lr:g})" if job.cfg.optim.muon_lr else ""  # its own rate
    raise Diverged(
        f"training diverged: {what} (step {position.global_step} now; last finite loss {ranks[0][1]:.4g}, lr "
        f"{job.trained.scheduler.get_last_lr()[0]:.3g}); nothing was saved after it and {kept}. "
        f"Try a lower optim.lr (now {job.cfg.optim.lr:g}){muon}, {fix.get(job.cfg.run.amp, 'optim.clip_grad_norm=1.0')}"
    )


def cli(argv: list[str] | None = None) -> int:
    """The command line: ddp/train.py's exit code (ddp.errors); with no argv (ddp-train, ddp/train.py), its exit."""
    return command(main, argv) if argv is not None else leave(command(main, argv))


if __name__ == "__main__":
    cli()
