"""The one training loop: a single device, nn.DataParallel and DDP differ only in distributed.wrap.

    python ddp/train.py --config configs/quick.yaml optim.lr=0.05
    torchrun --standalone --nproc_per_node=2 ddp/train.py --config configs/quick.yaml

main(argv) returns the last epoch's metrics; cli(argv) is the command line (UsageError -> one line on
stderr, exit 2). Owns the order of things (build, resume, compile, wrap) and the step; devices and
process groups belong to distributed.py, data to data.py, files to checkpoint.py and logs.py.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (python/torchrun ddp/train.py): import ddp from the repo
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np
import torch
from torch import nn

from ddp import checkpoint, config, distributed, logs, models
from ddp import data as datasets
from ddp.config import Config, OptimConfig
from ddp.distributed import World
from ddp.errors import EXIT_USAGE, UsageError

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


def train_epoch(
    wrapped: nn.Module,
    loader: torch.utils.data.DataLoader,
    to_input: Callable[[torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    criterion: nn.Module,
    world: World,
    amp: torch.dtype | None,
    progress: bool,
    desc: str,
) -> tuple[torch.Tensor, int]:
    """One pass over this rank's shard: (sum of loss x images, images) on this rank."""
    wrapped.train()
    loss_sum, seen = torch.zeros((), device=world.device), 0
    for images, labels in logs.bar(loader, world.is_main and progress, desc):
        x = to_input(images)
        y = labels.to(world.device, non_blocking=True)
        with torch.autocast(world.device.type, dtype=amp, enabled=amp is not None):
            loss = criterion(wrapped(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces (averages) gradients during backward
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        loss_sum += loss.detach().float() * len(y)  # stays on the device: no sync per step
        seen += len(y)
    return loss_sum, seen


@torch.no_grad()
def evaluate(
    module: nn.Module,
    loader: torch.utils.data.DataLoader,
    to_input: Callable[[torch.Tensor], torch.Tensor],
    num_classes: int,
    world: World,
    amp: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, total) per class over the whole test set, summed over ranks: each image once."""
    module.eval()
    correct = torch.zeros(num_classes, dtype=torch.int64, device=world.device)
    total = torch.zeros_like(correct)
    for images, labels in loader:
        x = to_input(images)
        y = labels.to(world.device, non_blocking=True)
        with torch.autocast(world.device.type, dtype=amp, enabled=amp is not None):
            predicted = module(x).argmax(dim=1)
        total.index_add_(0, y, torch.ones_like(y))
        correct.index_add_(0, y, (predicted == y).long())  # no boolean indexing: no sync per batch
    distributed.all_reduce_sum(correct, world)
    distributed.all_reduce_sum(total, world)
    return correct.cpu(), total.cpu()


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
        except OSError as e:
            error = e
    if not distributed.all_agree(error is None, world):
        raise UsageError(f"cannot write to run.out_dir={cfg.run.out_dir} ({error or 'failed on rank 0'})")


def run(
    cfg: Config, world: World, per_rank_batch: int, amp: torch.dtype | None, resume_from: Path | None
) -> dict[str, Any] | None:
    """Train up to cfg.train.epochs inside an initialised World; the last epoch's metrics."""
    seed_everything(cfg.run.seed)

    data = datasets.load(cfg.data, world)
    steps_per_epoch = len(data.train.labels) // cfg.train.batch_size
    if steps_per_epoch == 0:
        raise UsageError(
            f"train.batch_size={cfg.train.batch_size} exceeds the {len(data.train.labels)} training images"
        )

    model = models.build(cfg.model.name, data.num_classes).to(world.device)  # raw module: the one we save
    if cfg.run.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer, scheduler = make_optimizer(model, cfg.optim, cfg.train.epochs * steps_per_epoch, steps_per_epoch)
    scaler = torch.amp.GradScaler(world.device.type, enabled=cfg.run.amp == "fp16")
    done, last = 0, None
    if resume_from:
        state = checkpoint.load(resume_from)
        checkpoint.check_compatible(state, config.to_dict(cfg), resume_from)
        checkpoint.restore(state, model, optimizer, scheduler, scaler)
        done, last = state["epoch"], state.get("metrics")
        if world.is_main:
            logs.say(
                f"resumed from {resume_from}: {done} epoch(s) done (saved at world_size "
                f"{state.get('world_size')}, now {world.world_size}; global batch {cfg.train.batch_size})"
            )
    wrapped = distributed.wrap(torch.compile(model) if cfg.run.compile else model, world)
    start_run_dir(cfg, world, done)

    train_dl = datasets.train_loader(
        data.train, per_rank_batch, world, cfg.data.augment, cfg.data.workers, cfg.run.seed
    )
    eval_dl = datasets.eval_loader(
        data.test, max(1, cfg.train.eval_batch_size // world.world_size), world, cfg.data.workers
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
    to_input = datasets.input_fn(data, world.device, cfg.run.channels_last)
    if world.is_main:
        params = sum(p.numel() for p in model.parameters())
        logs.say(
            f"{cfg.model.name} ({params / 1e6:.2f}M params) on {cfg.data.dataset} "
            f"({len(data.train.labels)} train / {len(data.test.labels)} test, {data.num_classes} classes); "
            f"parallel={world.parallel} world_size={world.world_size} device={world.device} "
            f"global batch {cfg.train.batch_size} ({per_rank_batch} per rank), amp={cfg.run.amp}"
        )
    for epoch in range(done + 1, cfg.train.epochs + 1):
        started = time.perf_counter()
        train_dl.sampler.set_epoch(epoch)  # a new permutation each epoch, the same on every rank
        loss_sum, seen = train_epoch(
            wrapped, train_dl, to_input, optimizer, scheduler, scaler, criterion, world, amp, cfg.run.progress,
            f"epoch {epoch}",
        )  # fmt: skip
        train_seconds = elapsed(started, world.device)
        distributed.sync_buffers(model, world)
        correct, total = evaluate(distributed.for_eval(wrapped), eval_dl, to_input, data.num_classes, world, amp)
        loss_and_count = distributed.all_reduce_sum(
            torch.stack([loss_sum, torch.tensor(float(seen), device=world.device)]), world
        )
        train_loss, images = loss_and_count.tolist()
        last = {
            "epoch": epoch,
            "train_loss": train_loss / images,
            "test_acc": correct.sum().item() / total.sum().item(),
            "test_images": int(total.sum()),
            "per_class_acc": [c / t if t else None for c, t in zip(correct.tolist(), total.tolist())],
            "classes": data.classes,
            "lr": scheduler.get_last_lr()[0],
            "images_per_s": images / train_seconds,
            "seconds": elapsed(started, world.device),
            "world_size": world.world_size,
            "parallel": world.parallel,
            "device": str(world.device),
        }
        if world.is_main:
            logs.say(logs.epoch_line(last, cfg.train.epochs))
            logs.append(cfg.run.out_dir, last)
            state = checkpoint.make_state(
                model, optimizer, scheduler, scaler, epoch, config.to_dict(cfg), last, world.world_size
            )
            checkpoint.save(state, checkpoint.last_path(cfg.run.out_dir))
    if done >= cfg.train.epochs and world.is_main:
        logs.say(f"nothing to do: {done} of train.epochs={cfg.train.epochs} already done (raise train.epochs to go on)")
    return last


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    path, overrides, print_config = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = config.load(path, overrides)
    if print_config:
        print(config.dump(cfg), end="")
        return None
    world = distributed.resolve(cfg.run)
    # Checks that need no process group, made before joining one: a bad value must not leave the
    # other ranks waiting in the rendezvous.
    per_rank_batch = world.split(cfg.train.batch_size, "train.batch_size")
    amp = autocast_dtype(cfg.run.amp, world.device)
    resume_from = checkpoint.to_resume(cfg.run.resume, cfg.run.out_dir)
    with distributed.setup(world, cfg.run.timeout_s):
        return run(cfg, world, per_rank_batch, amp, resume_from)


def cli(argv: list[str] | None = None) -> int:
    try:
        main(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(cli())
