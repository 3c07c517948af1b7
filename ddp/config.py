"""Typed configuration: the only place defaults live (config_file.py reads and writes its YAML files).

`load(path, overrides)` resolves defaults < YAML file < `section.key=value` overrides, coercing every value to
its field's type. Unknown sections or keys, bad values and bad choices raise UsageError with the valid
alternatives; what a value *means* (a device, a data file, a model) is checked where it is used.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp import config_file, models
from ddp.errors import UsageError


@dataclass(frozen=True)
class Range:
    """The valid values of a number: low <= value <= high, with either end open (< instead of <=)."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        low, high = (int(x) if x is not None and x == int(x) else x for x in (self.low, self.high))
        if high is None:
            return f"{'>' if self.low_open else '>='} {low}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


POSITIVE, NATURAL = Range(1), Range(0)  # integers from 1, from 0
IMAGES = Range(1, 10**9)  # 3 TB of them; past 2**63 torch's own traceback (its sizes overflowed)
FRACTION = Range(0, 1, high_open=True)  # [0, 1)
PATHS = {"data.root", "data.path", "run.out_dir", "run.resume"}  # ~ expanded: bash leaves run.out_dir=~/x as typed


def opt(default: Any, help: str, choices: tuple[str, ...] = (), valid: Range | None = None) -> Any:
    """A config field with its one-line help (shown by --help) and its valid values: choices or a Range."""
    return field(default=default, metadata={"help": help, "choices": choices, "valid": valid})


@dataclass
class DataConfig:
    dataset: str = opt("cifar10", "which data", ("cifar10", "cifar100", "npz", "synthetic"))
    root: str = opt("data", "torchvision download/cache directory for cifar10/cifar100")
    path: str = opt("", "the .npz file for dataset=npz (x_train, y_train, x_test, y_test)")
    download: bool = opt(True, "download cifar10/cifar100 into data.root when missing")
    augment: bool = opt(True, "random translation (data.translate, data.pad) and flip (data.flip) while training")
    translate: int = opt(4, "augment: crop 32x32 of the image padded by this many px (shifts up to it)",
                         valid=Range(0, 16))  # fmt: skip
    pad: str = opt("zeros", "augment: the crop's padding: zeros | reflect = the image mirrored", ("zeros", "reflect"))
    flip: str = opt("random", "augment: flip a random half each epoch | alternate = a random half in odd epochs, the "
                    "other in even ones (airbench) | none", ("random", "alternate", "none"))  # fmt: skip
    loader: str = opt("device", "device = the split on the training device, batched augmentation there | torch = "
                      "DataLoader workers", ("device", "torch"))  # fmt: skip
    workers: int = opt(2, "DataLoader worker processes per rank for loader=torch (0 = load in the main process; up "
                       "to 4 per CPU this process may use, and up to 8 on any machine)", valid=NATURAL)  # fmt: skip
    mixup_alpha: float = opt(
        0.0, "MixUp: blend each training image with another, weight ~ Beta(alpha, alpha) (0 = off)", valid=Range(0)
    )
    cutmix_alpha: float = opt(0.0, "CutMix: paste a box of another training image, area ~ Beta(alpha, alpha) (0 = off)",
                              valid=Range(0))  # fmt: skip
    mix_prob: float = opt(1.0, "the share of training batches mixed when MixUp/CutMix is on (both on: each is half)",
                          valid=Range(0, 1))  # fmt: skip
    mix_off_epoch: int = opt(0, "no MixUp/CutMix from this epoch on (0 = mix to the end)", valid=NATURAL)
    synthetic_train: int = opt(2048, "train images for dataset=synthetic", valid=IMAGES)
    synthetic_test: int = opt(512, "test images for dataset=synthetic", valid=IMAGES)
    synthetic_classes: int = opt(10, "classes for dataset=synthetic", valid=Range(2, 10**5))


@dataclass
class ModelConfig:
    name: str = opt("resnet18", models.described(), tuple(models.MODELS))
    dropout: float = opt(0.0, "dropout probability inside each residual block (Wide ResNet's; wrn*, preact_resnet18)",
                         valid=FRACTION)  # fmt: skip
    width: float = opt(1.0, "channel counts x this, for small and fast (parameters grow as its square)",
                       valid=Range(0, 8, low_open=True))  # fmt: skip
    whiten: bool = opt(False, "fast's 2x2 stem whitens the first 5,000 training images' patches, frozen (airbench)")


@dataclass
class TrainConfig:
    epochs: int = opt(30, "epochs to train; the LR schedule spans them (a resumed run trains up to it)", valid=POSITIVE)
    batch_size: int = opt(256, "GLOBAL batch in images per step, split evenly across ranks", valid=POSITIVE)
    eval_batch_size: int = opt(1024, "GLOBAL evaluation batch, split across ranks", valid=POSITIVE)
    label_smoothing: float = opt(0.0, "label smoothing of the cross-entropy loss (0 = off)", valid=FRACTION)
    tta_flip: bool = opt(False, "evaluate on each test image and its mirror image, averaging the logits")
    tta_translate: bool = opt(False, "also evaluate each test image shifted 1 px up-left and down-right (airbench)")
    eval_every: int = opt(1, "evaluate the test set after every N-th epoch and after the last (the epochs between: "
                          "loss and speed only)", valid=POSITIVE)  # fmt: skip
    ema_decay: float = opt(0.0, "keep a moving average of the weights, decayed by this per step, and evaluate it "
                           "(0 = off)", valid=FRACTION)  # fmt: skip
    ema_warmup: int = opt(10, "update n of the average decays by min(ema_decay, (1+n)/(ema_warmup+n)) (0 = ema_decay "
                          "from the start)", valid=NATURAL)  # fmt: skip
    lookahead_every: int = opt(0, "every N steps: slow weights -> towards the weights, weights = them (0 = off)",
                               valid=NATURAL)  # fmt: skip
    lookahead_decay: float = opt(0.95, "lookahead: slow weights keep decay**N x (step/steps)**3 of themselves",
                                 valid=FRACTION)  # fmt: skip
    grad_accum_steps: int = opt(1, "K micro-batches per optimizer step: each rank runs K x batch_size/(world_size x "
                                "K) images, gradients all-reduced once; same update as one big batch",
                                valid=POSITIVE)  # fmt: skip
    micro_batch_size: int = opt(0, "images per rank in each forward/backward (DeepSpeed's micro-batch per GPU): with "
                                "the global batch it fixes train.grad_accum_steps for whatever world size a run (or "
                                "its restart) gets; 0 = off", valid=NATURAL)  # fmt: skip
    sync_bn: bool = opt(False, "BatchNorm statistics over the global batch (all ranks), as 1 process computes them")
    dist_bn: str = opt("broadcast", "without sync_bn, how the ranks' BatchNorm running statistics become one before "
                       "evaluating and saving: broadcast = rank 0's | reduce = their mean",
                       ("broadcast", "reduce"))  # fmt: skip


@dataclass
class OptimConfig:
    name: str = opt("sgd", "optimizer", ("sgd", "adamw"))
    lr: float = opt(0.1, "peak learning rate (for the global batch)", valid=Range(0, low_open=True))
    momentum: float = opt(0.9, "SGD momentum", valid=FRACTION)
    nesterov: bool = opt(True, "Nesterov momentum for SGD")
    weight_decay: float = opt(5e-4, "L2 weight decay", valid=Range(0))
    schedule: str = opt("cosine", "LR after warm-up, stepped per step", ("cosine", "linear", "constant"))
    final_lr: float = opt(0.0, "cosine and linear: the LR at the last step, as a fraction of optim.lr", valid=FRACTION)
    norm_bias_lr_scale: float = opt(1.0, "BatchNorm biases: LR x this, weight decay / this",
                                    valid=Range(0, low_open=True))  # fmt: skip
    norm_weight_decay: bool = opt(True, "weight decay on BatchNorm's weights and biases too (false: none on them)")
    freeze_norm_weights: bool = opt(False, "BatchNorm's weights (scales) stay 1: only its biases learn (airbench)")
    whiten_bias_epochs: int = opt(3, "model.whiten: the stem's bias learns in the first N epochs only", valid=NATURAL)
    warmup_epochs: float = opt(1.0, "linear LR warm-up from 0, in epochs (may be fractional)", valid=Range(0))
    warmup_from: float = opt(0.0, "the first warm-up step's fraction of optim.lr (airbench: 0.2)", valid=FRACTION)
    clip_grad_norm: float = opt(0.0, "clip the gradients' total L2 norm to this before each step (0 = off)",
                                valid=Range(0))  # fmt: skip
    muon_lr: float = opt(0.0, "Muon for the convolution filters, at this peak LR: each filter's step orthogonalized, "
                         "its norm kept (0 = off: SGD's step)", valid=Range(0))  # fmt: skip
    muon_momentum: float = opt(0.6, "Muon's Nesterov momentum (optim.momentum: the other parameters')", valid=FRACTION)


@dataclass
class DdpConfig:
    """DistributedDataParallel's own arguments (README: "1 GPU or N: the same run" says when to use each)."""

    bucket_cap_mb: float = opt(
        25.0, "gradients are all-reduced in buckets of this many MiB (larger: fewer, later all-reduces)",
        valid=Range(0, 2**20, low_open=True),  # 1 TiB: larger than any model; 1e300 overflowed DDP
    )  # fmt: skip
    gradient_as_bucket_view: bool = opt(True, "gradients are views into the buckets: no copy out of them, one less")
    static_graph: bool = opt(False, "the same parameters in every step: DDP skips per-step checks (allows unused ones)")
    find_unused_parameters: bool = opt(False, "some parameters unused in a step: DDP searches the graph each step")
    broadcast_buffers: bool = opt(
        True, "rank 0's buffers to all ranks before each forward, where it matters: train.dist_bn=reduce, no sync_bn"
    )
    comm_hook: str = opt(
        "allreduce", "allreduce: each bucket divided once (none: torch's own, each gradient) | fp16 / bf16: half "
        "the bytes sent", ("allreduce", "none", "fp16", "bf16"),
    )  # fmt: skip
    split_graph: bool = opt(
        True, "run.compile: the step's graph cut at the buckets, each all-reduce during the backward (torch's way) | "
        "false: one graph, the all-reduces after it (fewer launches; faster at world size 1 on an H100)",
    )  # fmt: skip


@dataclass
class RunConfig:
    out_dir: str = opt("runs/default", "where checkpoints, metrics.jsonl and config.yaml go")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N (under torchrun: auto/cuda = cuda:<local_rank>)")
    parallel: str = opt("auto", "auto = ddp for 2+ launched processes, else none | fsdp: FSDP2, 1/N of the state each",
                        ("auto", "none", "dp", "ddp", "fsdp"))  # fmt: skip
    backend: str = opt(
        "auto", "the process group's: auto = nccl on GPUs, gloo on CPUs | gloo: several ranks share a GPU (tests)",
        ("auto", "nccl", "gloo"),
    )  # fmt: skip
    launcher: str = opt(
        "auto", "who started the processes; auto = torchrun/accelerate variables, then SLURM (srun), then none",
        ("auto", "torchrun", "accelerate", "slurm", "none"),
    )  # fmt: skip
    seed: int = opt(0, "seed for weights, data order and augmentation", valid=Range(0, 2**32 - 1))
    amp: str = opt("off", "autocast dtype (fp16 adds a GradScaler; CUDA only) | fp16-weights: airbench's: fp16 "
                   "weights but BatchNorm's, no autocast, loss x batch (at most 1024)",
                   ("off", "bf16", "fp16", "fp16-weights"))  # fmt: skip
    compile: bool = opt(False, "torch.compile the model (before the DDP wrap)")
    compile_mode: str = opt("default", "torch.compile's mode (reduce-overhead: CUDA graphs, the fastest step on a GPU)",
                            ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))  # fmt: skip
    cuda_graph: str = opt("false", "true = the step recorded in one CUDA graph and replayed: one launch a step, no "
                          "compile (CUDA) | auto = where the run allows it", ("false", "true", "auto"))  # fmt: skip
    warmup_steps: int = opt(0, "throwaway steps and an evaluation before epoch 1 (compile, autotuning), all put back",
                            valid=NATURAL)  # fmt: skip
    channels_last: bool = opt(False, "NHWC memory format for model and inputs (faster convs on GPU)")
    resume: str = opt("auto", "auto = from the newest valid checkpoint in out_dir | never | PATH")
    save_every_steps: int = opt(200, "also checkpoint every N optimizer steps (0 = only at epoch ends and stops)",
                                valid=NATURAL)  # fmt: skip
    keep_last: int = opt(3, "numbered checkpoints kept in out_dir/checkpoints (the newest N)", valid=POSITIVE)
    stop_signal: str = opt("SIGTERM,SIGUSR1,SIGINT,SIGHUP",
                           "signals that stop at the next step with a checkpoint, exit 75 (none = off)")  # fmt: skip
    timeout_s: int = opt(300, "seconds a collective may wait before the run fails instead of hanging (torch's clocks "
                         "overflow past ~9e9)", valid=Range(1, 10**9))  # fmt: skip
    progress: bool = opt(True, "tqdm bar on rank 0 when stdout is a terminal")
    tensorboard: bool = opt(False, "TensorBoard scalars in out_dir/tensorboard (pip install 'ddp-cifar[tensorboard]')")
    debug: bool = opt(False, "show the Python traceback of errors instead of one line (for bug reports)")
    tf32: bool = opt(False, "TensorFloat-32 for CUDA matmuls and cuDNN convolutions (faster, ~10-bit mantissa)")
    cudnn_benchmark: bool = opt(False, "let cuDNN time its convolution algorithms for the fixed input shapes")
    profile: str = opt("", "A:B = a torch.profiler trace of global steps A..B-1 per rank in out_dir/profile, a "
                       "top-10 (empty = off)")  # fmt: skip
    deterministic: bool = opt(False, "deterministic algorithms only (torch, cuDNN, cuBLAS): bitwise-repeatable runs, "
                              "slower on GPU")  # fmt: skip


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ddp: DdpConfig = field(default_factory=DdpConfig)
    run: RunConfig = field(default_factory=RunConfig)


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_bool(text: str) -> bool | None:
    """A command-line boolean (true/false, 1/0, yes/no, on/off, any case), or None if it is none."""
    text = text.strip().lower()
    return text in _TRUE if text in _TRUE | _FALSE else None


def _coerce(key: str, value: Any, f: dataclasses.Field) -> Any:
    """`value` (a YAML scalar or a CLI string) as the type of field `f`, or UsageError."""
    kind = type(f.default)
    try:
        if isinstance(value, (dict, list)) or value is None:  # before str(): YAML's aliases made 350 bytes a
            raise ValueError  # billion items, whose str (and repr in the line) took minutes and gigabytes
        if kind is bool:
            parsed = value if isinstance(value, bool) else parse_bool(str(value))
            if parsed is None:
                raise ValueError
            return parsed
        if kind in (int, float) and isinstance(value, bool):
            raise ValueError  # YAML's true is no number
        if kind is int:
            if isinstance(value, float):
                raise ValueError
            return _in_range(key, int(str(value).strip()), f)
        if kind is float:
            number = float(str(value).strip())
            if not math.isfinite(number):
                raise UsageError(f"{key}: expected a finite float, got {value!r}")
            return _in_range(key, number, f)
        value = os.path.expanduser(str(value)) if key in PATHS else str(value)
        if key in PATHS and "\0" in value:  # YAML's "\0" (argv has none): os.stat's ValueError, a traceback
            raise UsageError(f"{key}: {value!r} holds a NUL character, which no path can")
    except ValueError:
        shown = {list: "a list", dict: "a mapping"}.get(type(value)) or repr(value)
        raise UsageError(f"{key}: expected {kind.__name__}, got {shown}") from None
    choices = f.metadata.get("choices")
    if "true" in choices and parse_bool(value) is not None:  # a switch with more than two settings (auto)
        value = str(parse_bool(value)).lower()
    if choices and value not in choices:
        raise UsageError(f"{key}: {value!r} is not one of {', '.join(choices)}")
    return value


def expanded(key: str, path: str) -> str:
    """A path's $NAME (${NAME}) as a shell expands it: a config file's `out_dir: $SCRATCH/runs/a` made a folder named
    "$SCRATCH" in the current one. A variable that is not set is refused, not kept as the folder's name."""
    path = os.path.expandvars(path)
    if unset := re.search(r"\$(\w+|\{[^}]*\})", path):
        raise UsageError(f"{key}={path}: the environment variable {unset[0]} is not set; set it, or write the path out")
    return path


def _in_range(key: str, value: float, f: dataclasses.Field) -> float:
    valid = f.metadata["valid"]
    if valid is not None and value not in valid:
        raise UsageError(f"{key}={value!r} is out of range: it must be {valid}")
    return value


def _section_fields(cfg: Config, section: str, key_for_msg: str) -> dict[str, dataclasses.Field]:
    names = [f.name for f in dataclasses.fields(cfg)]
    if section not in names:
        close = difflib.get_close_matches(section, names, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        where = f" in '{key_for_msg}'" if key_for_msg != section else ""  # one that sets no key: its name alone
        raise UsageError(f"unknown section '{section}'{where}{hint}; sections: {', '.join(names)}")
    return {f.name: f for f in dataclasses.fields(getattr(cfg, section))}


def _set(cfg: Config, dotted: str, value: Any) -> None:
    section, _, key = dotted.partition(".")
    if not key or "." in key:
        raise UsageError(f"'{dotted}': keys are section.key, e.g. optim.lr=0.1")
    fields = _section_fields(cfg, section, dotted)
    if key not in fields:
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f" (did you mean '{section}.{close[0]}'?)" if close else ""
        raise UsageError(f"unknown key '{dotted}'{hint}; valid keys in {section}: {', '.join(fields)}")
    setattr(getattr(cfg, section), key, _coerce(dotted, value, fields[key]))


def is_a_runs(path: Path) -> bool:
    """Whether the YAML file at `path` holds this config's sections only, as a run's config.yaml does (dump's)."""
    try:
        return set(config_file.read(str(path))) <= {f.name for f in dataclasses.fields(Config)}
    except UsageError:
        return False


def load(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults < YAML file at `path` < `section.key=value` overrides. A key whose default is not empty is
    never set empty: `run.out_dir=$DIR` with DIR unset would put the run in the current directory."""
    cfg = override(from_dict(config_file.read(path, settings())) if path else Config(), overrides)
    for key in PATHS:  # (the user's: a checkpoint's config, read as saved, is not expanded again)
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, expanded(key, getattr(getattr(cfg, section), name)))
    defaults = to_dict(Config())
    if empty := [(s, k) for s, keys in to_dict(cfg).items() for k, v in keys.items() if v == "" != defaults[s][k]]:
        section, key = empty[0]
        default = defaults[section][key]
        raise UsageError(f"{section}.{key} is empty: give it a value, or leave it out for its default {default!r}")
    return cfg


def override(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """`section.key=value` items applied to cfg in place (later items win); returns cfg."""
    for item in overrides:
        dotted, eq, value = item.partition("=")
        if not eq:
            named = item.lower().endswith((".yaml", ".yml"))  # (`ddp/train.py configs/fast.yaml`)
            hint = f"; a config file goes after --config: --config {item}" if named else ""
            raise UsageError(f"'{item}': overrides are section.key=value, e.g. optim.lr=0.1{hint}")
        _set(cfg, dotted.strip(), value)
    return cfg


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def settings() -> dict[str, list[str]]:
    """Every section's keys, in order."""
    return {section: list(keys) for section, keys in to_dict(Config()).items()}


def from_dict(d: dict[str, dict[str, Any]]) -> Config:
    """A Config from sections of keys (a YAML file's, to_dict's output in a checkpoint); unknown keys are errors."""
    cfg = Config()
    for section, values in d.items():
        _section_fields(cfg, str(section), str(section))  # its name checked, though it set no key
        for key, value in values.items():
            _set(cfg, f"{section}.{key}", value)
    return cfg


def dump(cfg: Config) -> str:
    return config_file.write(to_dict(cfg))


def reference() -> str:
    """Every key with its type, default and help: the text of --help and the README's reference."""
    lines = []
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory()):
            choices, valid = f.metadata["choices"], f.metadata["valid"]
            kind = " | ".join(choices) if choices else type(f.default).__name__ + (f" {valid}" if valid else "")
            lines.append(f"  {section.name}.{f.name} ({kind}, default {f.default!r}): {f.metadata['help']}")
    return "\n".join(lines)
