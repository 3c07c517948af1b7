"""Gradient accumulation and synchronised BatchNorm under DDP: time per optimizer step at one global
batch for train.grad_accum_steps K = 1, 2, 4, the gradient all-reduces per optimizer step (counted by
a comm hook), and the cost of train.sync_bn. Each step is train.train_step on train.build's job.

    torchrun --standalone --nproc_per_node=2 bench/accumulation.py [--model small] [--batch 128]
        [--steps 20] [--out bench/results/accumulation-cpu.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from bench import harness
from ddp import config, devices, distributed

CASES = [  # (what, settings)
    ("K=1", ["train.grad_accum_steps=1"]),
    ("K=2", ["train.grad_accum_steps=2"]),
    ("K=4", ["train.grad_accum_steps=4"]),
    ("K=1, sync_bn", ["train.sync_bn=true"]),
]


def measure(world, model: str, batch: int, steps: int, settings: list[str]) -> dict:
    # ddp.comm_hook=none: the all-reduces are counted by a hook of ours, which does what the default one does
    job = harness.job(model, batch, batch * 4, world, "run.channels_last=false", "ddp.comm_hook=none", *settings)
    counted: list[int] = []

    def count(state, bucket):
        counted.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    job.wrapped.register_comm_hook(None, count)
    step = harness.stepping(job, harness.cycle(job.train_loader))
    seconds = harness.seconds_per_call(step, world.device, warmup=3, calls=steps, repeats=3)
    return {"step_ms": seconds * 1e3, "allreduces_per_step": len(counted) / (3 + 3 * steps)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="bench/results/accumulation-cpu.md")
    args = parser.parse_args()
    world = devices.resolve(config.load(None, []).run)
    with distributed.setup(world, timeout_s=300) as world:
        rows = [(what, measure(world, args.model, args.batch, args.steps, settings)) for what, settings in CASES]
    if world.is_main:
        report(args, world.world_size, rows)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    return platform.machine()


def report(args: argparse.Namespace, world_size: int, rows: list[tuple[str, dict]]) -> None:
    base = rows[0][1]["step_ms"]
    lines = [
        f"# Gradient accumulation and sync_bn: {args.model}, global batch {args.batch}, {world_size} ranks (gloo, CPU)",
        "",
        f"Measured with `torchrun --standalone --nproc_per_node={world_size} bench/accumulation.py "
        f"--model {args.model} --batch {args.batch} --steps {args.steps}` on {cpu_name()} "
        f"({torch.get_num_threads()} thread(s) per rank), torch {torch.__version__}. Median of 3 windows of "
        f"{args.steps} optimizer steps (train.train_step), after 3 warm-up steps.",
        "",
        "| setting | ms per optimizer step | vs K=1 | gradient all-reduces per optimizer step |",
        "| --- | ---: | ---: | ---: |",
    ]
    for what, r in rows:
        lines.append(f"| {what} | {r['step_ms']:.1f} | {r['step_ms'] / base:.2f}x | {r['allreduces_per_step']:.2f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
