"""Save / load time and size of a full ResNet-18 training checkpoint (model, SGD momentum, RNG,
checksum), through ddp.checkpoint as training uses it.

    python bench/checkpoint_io.py [--repeats 5] [--out bench/results/checkpoint-io-cpu.md]

Save = checksum + serialise + write + fsync + rename + last.pt link; load = read + unpickle
(weights_only) + verify the checksum. Median of the repeats, after one warm-up.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ddp import checkpoint, config, metrics, models, optim
from ddp.devices import World


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results/checkpoint-io-cpu.md")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = models.build("resnet18", 10)
    cfg = config.Config()
    optimizer, scheduler = optim.make_optimizer(model, cfg.optim, 1000, 100)
    model(torch.randn(8, 3, 32, 32)).sum().backward()
    optimizer.step()  # momentum buffers exist, as in any checkpoint after step 1
    trained = checkpoint.Trained(model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False))
    normalize, classes = {"mean": [0.5] * 3, "std": [0.25] * 3}, [str(c) for c in range(10)]
    info = checkpoint.RunInfo(config.to_dict(cfg), 1, 50000, normalize, classes)
    world = World(0, 0, 1, torch.device("cpu"), "none")
    saves, loads = [], []
    with tempfile.TemporaryDirectory() as out_dir:
        checkpoints = checkpoint.Checkpoints(config.RunConfig(out_dir=out_dir, keep_last=2), world, trained, info)
        for i in range(args.repeats + 1):
            started = time.perf_counter()
            path = checkpoints.save(checkpoint.Position(1, 0, 100 + i), metrics.StepStats(world.device), None)
            saved = time.perf_counter()
            checkpoint.load(path)
            loaded = time.perf_counter()
            if i:  # the first round warms caches and allocators
                saves.append(saved - started)
                loads.append(loaded - saved)
        size = path.stat().st_size
    params = sum(p.numel() for p in model.parameters())

    def row(what: str, xs: list[float]) -> str:
        return f"| {what} | {statistics.median(xs):.3f} s | {min(xs):.3f} s | {max(xs):.3f} s |\n"

    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"
    table = (
        f"# Checkpoint I/O, ResNet-18 (CIFAR stem, {params / 1e6:.1f}M parameters) + SGD momentum\n\n"
        f"`python bench/checkpoint_io.py --repeats {args.repeats}` on {machine}, torch {torch.__version__}.\n\n"
        "| what | median | min | max |\n| --- | --- | --- | --- |\n"
        + row("save (checksum, write, fsync, rename, link)", saves)
        + row("load (weights_only, verify checksum)", loads)
        + f"| file size | {size / 1e6:.1f} MB | | |\n"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table)
    print(table)


if __name__ == "__main__":
    main()
