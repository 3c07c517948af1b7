"""The checks made before any rank joins the process group (train.checked makes them, in order) and what they decide,
the Plan: each rank's share of the global batch, the steps, the autocast dtype, the stop signals, the steps to
profile. Settings that each parse but do not go together are refused here; those a run never reads, noted (unused)."""

from __future__ import annotations

import math
import os
import shutil
import signal
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddp import cpus, fsdp, mixing, models
from ddp.config import Config, DdpConfig, to_dict
from ddp.devices import World
from ddp.errors import UsageError


@dataclass(frozen=True)
class Plan:
    per_rank_batch: int  # images per rank per optimizer step: the global batch / world_size
    steps_per_epoch: int  # global batches per epoch (the last, partial one is dropped)
    amp: torch.dtype | None = None  # autocast dtype, None for float32
    weights: torch.dtype = torch.float32  # the model's and its inputs' (run.amp=fp16-weights: fp16, BatchNorm's not)
    loss_scale: float = 1.0  # the loss's factor before the backward (run.amp=fp16-weights: see precision)
    stop_signals: tuple[signal.Signals, ...] = ()  # each asks for a stop at the next step boundary
    profile_steps: range | None = None  # global steps to trace (run.profile), None for none
    recorded: bool = False  # the step recorded in a CUDA graph and replayed (run.cuda_graph, resolved: cuda_graph())


def split_batch(global_batch: int, world_size: int, key: str, accum_steps: int = 1) -> int:
    """This rank's share of a global batch; every rank gets the same share, which splits again
    into `accum_steps` equal micro-batches. Refused with the nearest values that would work."""
    unit = world_size * accum_steps
    if global_batch >= 1 and global_batch % unit == 0:
        return global_batch // world_size
    lo = max(unit, global_batch // unit * unit)
    if accum_steps == 1:
        raise UsageError(
            f"{key}={global_batch} must be a positive multiple of world_size={world_size} "
            f"(it is the global batch, split evenly across ranks); try {lo} or {lo + world_size}"
        )
    per_rank = global_batch // world_size if global_batch % world_size == 0 else 0
    ks = [k for k in range(1, per_rank + 1) if per_rank % k == 0]  # the K that divide this rank's share
    below = max((k for k in ks if k < accum_steps), default=0)
    above = min((k for k in ks if k > accum_steps), default=0)
    near = [str(k) for k in (below, above) if k]
    other = f", or train.grad_accum_steps={' or '.join(near)}" if near else ""
    raise UsageError(
        f"{key}={global_batch} must be a positive multiple of world_size x train.grad_accum_steps = "
        f"{world_size} x {accum_steps} = {unit} (equal micro-batches on every rank); try {lo} or {lo + unit}{other}"
    )


def accumulation(global_batch: int, world_size: int, micro_batch: int) -> int:
    """train.micro_batch_size: the micro-batches per optimizer step that keep the global batch on
    `world_size` ranks (DeepSpeed's convention); refused with the sizes that would work."""
    unit = world_size * micro_batch
    if global_batch % unit == 0:
        return global_batch // unit
    per_rank = global_batch // world_size if global_batch % world_size == 0 else 0
    fits = [str(m) for m in range(1, per_rank + 1) if per_rank % m == 0][-4:]
    hint = f"train.micro_batch_size={' or '.join(fits)}" if fits else f"a train.batch_size that {world_size} divides"
    raise UsageError(
        f"train.batch_size={global_batch} is not a multiple of world_size x train.micro_batch_size = {world_size} x "
        f"{micro_batch} = {unit}: with {world_size} rank(s), try {hint}"
    )


def steps_per_epoch(cfg: Config, train_images: int) -> int:
    """Global batches in an epoch (the last, partial one is dropped)."""
    if train_images < cfg.train.batch_size:
        raise UsageError(f"train.batch_size={cfg.train.batch_size} exceeds the {train_images} training images")
    return train_images // cfg.train.batch_size


def autocast_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    if amp == "off":
        return None
    if amp == "fp16" and device.type != "cuda":
        if os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower() == "fp16":  # (launchers.accelerate_flags' amp)
            raise UsageError(f"ACCELERATE_MIXED_PRECISION=fp16 (accelerate launch --mixed_precision fp16, or left in "
                             f"the shell) is run.amp=fp16, which needs a CUDA device, not {device}: bf16 or no there, "
                             "or unset it")  # fmt: skip
        raise UsageError(f"run.amp=fp16 needs a CUDA device, not {device}; use run.amp=bf16 or off")
    return torch.bfloat16 if amp == "bf16" else torch.float16


MAX_LOSS_SCALE_LOG2 = 10  # fp16-weights' loss scale: at most 2**10 = airbench94's batch (see precision)


def precision(amp: str, device: torch.device, global_batch: int) -> tuple[torch.dtype | None, torch.dtype, float]:
    """run.amp's Plan.amp (autocast), Plan.weights and Plan.loss_scale. fp16-weights: fp16 weights and inputs, and
    the loss x the power of 2 nearest the global batch, as if the batch's losses were summed (airbench's way: fp16
    gradients that large neither underflow nor lose their digits), at most 1024 (airbench94's batch): the gradients'
    size is the scale's (a mean loss's x it), kept where airbench's trains, and from a batch of 46341 the scale itself,
    the fp16 loss's gradient, would be 65536, over fp16's largest number: a NaN step. optim.make_optimizer divides
    the LR and multiplies the weight decay by it, which undoes it exactly (a power of 2)."""
    if amp != "fp16-weights":
        return autocast_dtype(amp, device), torch.float32, 1.0
    return None, torch.float16, float(2 ** min(round(math.log2(global_batch)), MAX_LOSS_SCALE_LOG2))


def settings(cfg: Config, world: World) -> tuple[int, tuple[torch.dtype | None, torch.dtype, float]]:
    """The settings alone, checked as a run on `world` takes them (train.checked's first checks, the doctor's): this
    rank's share of the global batch, and precision's (autocast, weights, loss scale). train.micro_batch_size sets
    cfg.train.grad_accum_steps for this world size."""
    t = cfg.train
    if t.micro_batch_size:  # the accumulation follows from the world size this run (or restart) got
        t.grad_accum_steps = accumulation(t.batch_size, world.world_size, t.micro_batch_size)
    per_rank_batch = split_batch(t.batch_size, world.world_size, "train.batch_size", t.grad_accum_steps)
    chosen = precision(cfg.run.amp, world.device, t.batch_size)  # autocast, weights, loss scale
    check_combinations(cfg, world)
    check_compile_cache()
    return per_rank_batch, chosen


def check_compile_cache() -> None:
    """TORCHINDUCTOR_CACHE_DIR, made as torch._dynamo loads, which every run does (distributed.setup): one that cannot
    be made (a file there, a disk this machine lacks) was a FileNotFoundError's traceback in every rank."""
    if cache := os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        try:
            os.makedirs(os.path.abspath(cache), exist_ok=True)  # as torch makes it
        except OSError as e:
            raise UsageError(
                f"TORCHINDUCTOR_CACHE_DIR={cache}: torch makes its compile cache there as it loads, and "
                f"cannot ({e.strerror}); set it to a directory this user may write, or unset it"
            ) from None


def check_combinations(cfg: Config, world: World) -> None:
    """Settings that each parse but do not work together."""
    models.check(cfg.model.name, cfg.model.dropout, cfg.model.width, cfg.model.whiten)
    if world.parallel == "fsdp":
        check_fsdp(cfg)
    if cfg.run.amp == "fp16-weights":
        check_fp16_weights(cfg)
    if cfg.run.cuda_graph == "true":
        check_cuda_graph(cfg, world)
    if cfg.optim.muon_lr > 0 and cfg.optim.name != "sgd":
        raise UsageError(f"optim.muon_lr={cfg.optim.muon_lr:g}: Muon steps the filters beside SGD, which steps the "
                         f"rest: use optim.name=sgd (not {cfg.optim.name}), or optim.muon_lr=0")  # fmt: skip
    check_workers(cfg)
    if cfg.train.sync_bn and world.parallel == "dp":
        raise UsageError(
            "train.sync_bn=true needs DDP (nn.DataParallel computes BatchNorm per GPU): "
            "torchrun --standalone --nproc_per_node=N ddp/train.py ..."
        )
    if cfg.run.compile and (no_compiler := compiler_missing(world.device)):
        raise UsageError(f"run.compile=true: {no_compiler}, or leave run.compile off")
    if cfg.run.compile_mode != "default" and not cfg.run.compile:
        raise UsageError(f"run.compile_mode={cfg.run.compile_mode} is torch.compile's mode: add run.compile=true")
    if not cfg.ddp.split_graph and not cfg.run.compile:
        raise UsageError("ddp.split_graph=false is how compiled DDP's graph is cut: add run.compile=true")
    first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 2**20) / 2**20  # DDP's first bucket: 1 MiB
    if world.parallel == "ddp" and cfg.run.compile and cfg.ddp.split_graph and cfg.ddp.bucket_cap_mb < first:
        raise UsageError(
            f"ddp.bucket_cap_mb={cfg.ddp.bucket_cap_mb} with run.compile=true: compiled DDP needs buckets no smaller "
            f"than DDP's first one ({first:g} MiB); use ddp.bucket_cap_mb >= {first:g} (or ddp.split_graph=false)"
        )
    if cfg.run.deterministic and cfg.run.cudnn_benchmark:
        raise UsageError("run.deterministic=true and run.cudnn_benchmark=true: cuDNN's autotuning is not deterministic")
    if cfg.ddp.static_graph and cfg.train.grad_accum_steps > 1:
        raise UsageError(
            "ddp.static_graph=true with train.grad_accum_steps>1: DDP's static graph breaks under no_sync "
            "(an internal assert, then gradients that are no longer all-reduced: pytorch/pytorch#143580); "
            "use one of the two"
        )


def compiler_missing(device: torch.device) -> str | None:
    """Why torch.compile cannot build code for `device` here, or None: on the CPU its C++ needs a C++ compiler (CXX,
    else g++; clang++ on macOS: inductor's own search, run here), on a GPU Triton's launchers a C compiler (CC, else
    gcc or clang on PATH). Without one, the first step was inductor's InvalidCxxCompiler traceback (a slim container,
    a Mac without Xcode's tools). A torch whose search is not where it was looked for: no check."""
    if device.type == "cuda":
        cc = os.environ.get("CC")
        if (shutil.which(cc) if cc else shutil.which("gcc") or shutil.which("clang")) is not None:
            return None
        tried = f"CC={cc}" if cc else "gcc and clang on PATH"
        return f"Triton builds torch.compile's GPU kernels with a C compiler, and found none ({tried}): install one " \
               "(apt-get install gcc), set CC to one"  # fmt: skip
    if device.type != "cpu":
        return None
    try:
        from torch._inductor import config as inductor
        from torch._inductor import cpp_builder, exc

        found = getattr(cpp_builder, "get_cpp_compiler", None)
        if found is None:  # (torch 2.4: codecache's)
            from torch._inductor.codecache import cpp_compiler as found
        found()
    except (ImportError, AttributeError):
        return None
    except exc.InvalidCxxCompiler:
        tried = " and ".join(str(c) for c in inductor.cpp.cxx if c)
        return f"torch.compile builds C++ for the CPU, and found no C++ compiler (it tried {tried}): install one " \
               "(apt-get install g++; macOS: xcode-select --install), set CXX to one"  # fmt: skip
    return None


WORKERS_PER_CPU = 4  # data.workers beyond this many per usable CPU (and beyond 8) are refused


def check_workers(cfg: Config) -> None:
    """data.workers that no machine here could run: the data is in memory and a worker augments on one CPU, so more
    than the CPUs never helps, and each worker holds memory of its own. data.workers=1000 (a typo) was a machine
    frozen by a thousand forks a rank, or an out-of-memory kill with no line (seen: exit 137 in a 3 GiB cgroup)."""
    usable, workers = cpus.usable(), cfg.data.workers
    if cfg.data.loader == "torch" and workers > (most := max(8, WORKERS_PER_CPU * usable)):
        raise UsageError(
            f"data.workers={workers}: {workers:,} DataLoader worker processes a rank, {2 * workers:,} with "
            f"evaluation's, on a machine where this process may use {usable} CPU{'s' * (usable > 1)}: at most {most} "
            f"are taken (a worker augments in-memory images on one CPU); use data.workers={min(usable, 8)}, or "
            "data.loader=device"
        )


def check_fsdp(cfg: Config) -> None:
    """What run.parallel=fsdp does not do (yet), each with its alternative; then a torch that has FSDP2 (a setting
    is wrong on any torch: said first)."""
    t, run = cfg.train, cfg.run
    refused = {
        "train.ema_decay": (t.ema_decay > 0, "the moving average copies the whole model, and FSDP2's cannot be copied"),
        "train.lookahead_every": (t.lookahead_every > 0, "lookahead keeps whole copies of the weights"),
        "run.channels_last": (run.channels_last, "FSDP2 shards contiguous weights only"),
        "run.warmup_steps": (run.warmup_steps > 0, "the warm-up puts back whole state dicts, not sharded ones"),
        "run.amp": (run.amp.startswith("fp16"), "no GradScaler for sharded gradients, no fp16 weights: use bf16"),
        "optim.muon_lr": (cfg.optim.muon_lr > 0, "Muon orthogonalizes each filter whole, and FSDP2 shards them"),
    }
    for key, (on, why) in refused.items():
        if on:
            raise UsageError(f"{key} does not work with run.parallel=fsdp ({why}); use run.parallel=ddp for it")
    default = DdpConfig()
    tuned = [name for name, value in vars(cfg.ddp).items() if value != getattr(default, name)]
    if tuned:
        raise UsageError(
            f"ddp.{tuned[0]} tunes DistributedDataParallel, which run.parallel=fsdp does not use: leave ddp.* at "
            "their defaults"
        )
    fsdp.check_available()


def check_cuda_graph(cfg: Config, world: World) -> None:
    """run.cuda_graph=true: refused, with why, where cuda_graph_refusal finds something."""
    refused = cuda_graph_refusal(cfg, world)
    if refused:
        raise UsageError(f"{refused[0]} does not work with run.cuda_graph=true ({refused[1]})")


def cuda_graph(cfg: Config, world: World, say: Callable[[str], None] | None) -> bool:
    """run.cuda_graph resolved for this run: whether its step is recorded. true was checked in check_combinations;
    auto records where cuda_graph_refusal finds nothing, and where it finds something `say`s why not."""
    if cfg.run.cuda_graph != "auto":
        return cfg.run.cuda_graph == "true"
    refused = cuda_graph_refusal(cfg, world)
    if refused and say:
        say(f"run.cuda_graph=auto: the step runs eager, not recorded ({refused[0]}: {refused[1]})")
    return not refused


def cuda_graph_refusal(cfg: Config, world: World) -> tuple[str, str] | None:
    """What a recorded step (run.cuda_graph: replayed as recorded, ddp/graphed.py) would get wrong or cannot record:
    (the setting, why and what to use instead), or None."""
    t, run = cfg.train, cfg.run
    refused = {
        f"run.device={world.device}": (world.device.type != "cuda", "CUDA graphs need a GPU"),
        f"run.parallel={world.parallel}": (world.parallel in ("dp", "fsdp"), "a recording is one GPU's: use DDP"),
        "run.backend=gloo": (world.grouped and world.backend == "gloo", "gloo's all-reduce runs on the host: use nccl"),
        "run.compile": (run.compile, "use one: run.compile_mode=reduce-overhead records graphs of its own"),
        "run.amp=fp16": (run.amp == "fp16", "its GradScaler decides on the host which steps to skip: use bf16"),
        "train.grad_accum_steps": (t.grad_accum_steps > 1, "one batch a step is recorded: raise the batch instead"),
        "data.mixup_alpha / cutmix_alpha under DDP": (
            world.parallel == "ddp" and (cfg.data.mixup_alpha > 0 or cfg.data.cutmix_alpha > 0),
            "each rank draws its own mixed batches, which take the eager step: one rank's all-reduce recorded and "
            "another's not, which NCCL does not allow"),
        "data.mix_prob=1": (
            mixing_always(cfg), "every batch is mixed and a mixed one takes the eager step: nothing would be "
            "recorded; set data.mix_off_epoch to record the epochs after it, or data.mix_prob below 1"),
        "train.sync_bn": (t.sync_bn, "its forward's collectives are not recorded (yet)"),
        "ddp.find_unused_parameters": (cfg.ddp.find_unused_parameters, "DDP searches the graph on the host each step"),
        f"optim.name={cfg.optim.name}": (cfg.optim.name != "sgd", "only SGD's fused step is recorded (yet)"),
    }  # fmt: skip
    return next(((key, why) for key, (on, why) in refused.items() if on), None)


def mixing_always(cfg: Config) -> bool:
    """Whether MixUp/CutMix mixes every training batch of the run."""
    return cfg.data.mix_prob >= 1 and all(mixing.enabled(cfg.data, e) for e in range(1, cfg.train.epochs + 1))


def check_fp16_weights(cfg: Config) -> None:
    """What run.amp=fp16-weights (SGD on fp16 weights, no float32 copy: airbench's) does not do, with why."""
    refused = {
        "optim.name=adamw": (cfg.optim.name == "adamw", "its squared gradients overflow fp16"),
        "train.ema_decay": (cfg.train.ema_decay > 0, "a moving average's small steps vanish in fp16 weights"),
        "train.sync_bn": (cfg.train.sync_bn, "the synchronised BatchNorm hands float32 to fp16 convolutions"),
        "optim.clip_grad_norm": (cfg.optim.clip_grad_norm > 0, "the norm of gradients x the loss scale overflows fp16"),
        "optim.muon_lr": (cfg.optim.muon_lr > 0, "its loss scale is undone in SGD's LR, and Muon's step has none"),
    }
    for key, (on, why) in refused.items():
        if on:
            raise UsageError(f"{key} does not work with run.amp=fp16-weights ({why}); use run.amp=bf16 for it")


def unused(cfg: Config, say: Callable[[str], None] | None = None, typed: Collection[str] | None = None) -> list[str]:
    """Settings given a value other than their default that the run never reads, with why, a line for each reason,
    each `say`d as a note (rank 0's, before the data: data.path without data.dataset=npz fetched CIFAR-10 instead,
    silently); `typed`: only these keys (evaluate's overrides). Notes, not errors: an ablation turns a method off and
    keeps the settings its recipe gives it. Not data.workers, which recipes set for data.loader=torch ahead."""
    d, t, o = cfg.data, cfg.train, cfg.optim
    never_read = [  # (whether the run reads none of them, the keys, why)
        (d.dataset != "npz", ("data.path",), f"data.dataset={d.dataset} (data.dataset=npz's file)"),
        (d.dataset not in ("cifar10", "cifar100"), ("data.root", "data.download"), f"data.dataset={d.dataset} (CIFAR's "
         "settings)"),
        (d.dataset != "synthetic", ("data.synthetic_train", "data.synthetic_test", "data.synthetic_classes"),
         f"data.dataset={d.dataset}"),
        (not d.augment, ("data.translate", "data.pad", "data.flip"), "data.augment=false"),
        (d.mixup_alpha == d.cutmix_alpha == 0, ("data.mix_prob", "data.mix_off_epoch"), "MixUp and CutMix are off "
         "(data.mixup_alpha=0, data.cutmix_alpha=0)"),
        (t.ema_decay == 0, ("train.ema_warmup",), "the moving average is off (train.ema_decay=0)"),
        (t.lookahead_every == 0, ("train.lookahead_decay",), "lookahead is off (train.lookahead_every=0)"),
        (o.name != "sgd", ("optim.momentum", "optim.nesterov"), f"optim.name={o.name} (SGD's settings)"),
        (o.muon_lr == 0, ("optim.muon_momentum",), "Muon is off (optim.muon_lr=0)"),
        (o.schedule == "constant", ("optim.final_lr",), "optim.schedule=constant"),
        (o.warmup_epochs == 0, ("optim.warmup_from",), "no warm-up (optim.warmup_epochs=0)"),
        (not cfg.model.whiten, ("optim.whiten_bias_epochs",), "model.whiten=false"),
    ]  # fmt: skip
    now, defaults = _dotted(cfg), _dotted(Config())
    notes = []
    for unread, keys, why in never_read:
        given = [k for k in keys if unread and now[k] != defaults[k] and (typed is None or k in typed)]
        if given:
            settings = ", ".join(f"{k}={_typed(now[k])}" for k in given)
            notes.append(f"{settings} {'does' if len(given) == 1 else 'do'} nothing here: {why}")
            if say:
                say(f"note: {notes[-1]}")
    return notes


def _dotted(cfg: Config) -> dict[str, Any]:
    """Every setting by its section.key."""
    return {f"{section}.{key}": v for section, keys in to_dict(cfg).items() for key, v in keys.items()}


def _typed(value: Any) -> str:
    """A setting's value as it is typed on the command line: true, 0.95, reflect."""
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)
