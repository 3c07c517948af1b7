"""The recipe toolbox's cost, one process on this machine's device: time per optimizer step
(train.train_step on train.build's job) with the weights' moving average, MixUp, CutMix, all of them,
side by side with none; and each model's parameter count and time per training step.

    python bench/toolbox.py [--model fast --width 0.25 --batch 128] [--steps 20] [--repeats 5]
        [--models-batch 16] [--out bench/results/toolbox-cpu.md]

Costs: the cases are measured in turns (case 1..N, then again), repeats times, and each case's median
is kept, so a machine that slows down in between slows every case alike.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from bench import harness
from ddp import config, devices, metrics, mixing, models, train

CUTMIX = mixing.Mix(0.75, (8, 24, 8, 24))
CASES = [  # (what, settings, the mix each step takes)
    ("none", [], None),
    ("EMA (train.ema_decay=0.99)", ["train.ema_decay=0.99"], None),
    ("MixUp (data.mixup_alpha=0.8)", [], mixing.Mix(0.7)),
    ("CutMix (data.cutmix_alpha=1)", [], CUTMIX),
    ("EMA + CutMix + clip_grad_norm=1", ["train.ema_decay=0.99", "optim.clip_grad_norm=1"], CUTMIX),
]


def alone(world, args) -> list[tuple[str, float]]:
    """The added operations by themselves: an EMA update of the model, mixing a normalised batch."""
    width = f"model.width={args.width}"
    job = harness.job(args.model, args.batch, args.batch * 4, world, width, "train.ema_decay=0.99")
    images, labels = harness.cycle(job.train_loader)()
    x, classes = job.to_input(images), job.data.num_classes
    ops = [
        ("EMA update", lambda: job.trained.ema.update(job.trained.model)),
        ("MixUp of the batch", lambda: mixing.apply(mixing.Mix(0.7), x, labels, classes)),
        ("CutMix of the batch", lambda: mixing.apply(CUTMIX, x, labels, classes)),
        ("mixing.draw", lambda: mixing.draw(config.load(None, ["data.cutmix_alpha=1"]).data, 0, 1, 2, 0)),
    ]
    return [(what, harness.seconds_per_call(op, world.device, 5, 50, 5) * 1e3) for what, op in ops]


def costs(world, args) -> list[tuple[str, float]]:
    width = f"model.width={args.width}"
    runs = []
    for what, settings, mix in CASES:
        job = harness.job(args.model, args.batch, args.batch * 4, world, width, *settings)
        batches = harness.cycle(job.train_loader)
        runs.append((what, lambda job=job, batches=batches, mix=mix: train.train_step(job, *batches(), mix)))
    times: dict[str, list[float]] = {what: [] for what, _ in runs}
    for _ in range(args.repeats):  # in turns: every case sees the machine's slow moments alike
        for what, step in runs:
            times[what].append(harness.seconds_per_call(step, world.device, warmup=2, calls=args.steps, repeats=1))
    return [(what, statistics.median(times[what]) * 1e3) for what, _ in runs]


def model_times(world, batch: int) -> list[tuple[str, int, float]]:
    rows = []
    for name in models.MODELS:
        job = harness.job(name, batch, batch * 4, world, "run.channels_last=false")
        step = harness.stepping(job, harness.cycle(job.train_loader))
        heavy = models.PARAMS[name] > 5e6
        seconds = harness.seconds_per_call(step, world.device, warmup=1, calls=2 if heavy else 5, repeats=3)
        rows.append((name, models.PARAMS[name], seconds * 1e3))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="fast")
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models-batch", type=int, default=16)
    parser.add_argument("--out", default="bench/results/toolbox-cpu.md")
    args = parser.parse_args()
    world = devices.resolve(config.load(None, ["run.parallel=none", "run.launcher=none"]).run)
    started = time.perf_counter()
    rows, ops = costs(world, args), alone(world, args)
    model_rows = model_times(world, args.models_batch)
    metrics.synchronize(world.device)
    base = rows[0][1]
    lines = [
        f"# The recipe toolbox's cost ({harness.device_name(world.device)}, "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        "one process)",
        "",
        f"Command: `python bench/toolbox.py --model {args.model} --width {args.width} --batch {args.batch} "
        f"--steps {args.steps} --repeats {args.repeats} --models-batch {args.models_batch}` "
        f"({time.perf_counter() - started:.0f} s).",
        "",
        f"## Per optimizer step: {args.model} (model.width={args.width}), batch {args.batch}, fp32",
        "",
        f"Median of {args.repeats} windows of {args.steps} steps; the cases measured in turns.",
        "",
        "| setting | ms per step | vs none |",
        "| --- | --- | --- |",
        *[f"| {what} | {ms:.1f} | {ms / base - 1:+.1%} |" for what, ms in rows],
        "",
        "The operations alone (median of 5 windows of 50 calls), against the step without them:",
        "",
        "| operation | ms | share of a step |",
        "| --- | --- | --- |",
        *[f"| {what} | {ms:.3f} | {ms / base:.2%} |" for what, ms in ops],
        "",
        f"## Each model: one training step of batch {args.models_batch} (SGD, fp32, 32x32 inputs)",
        "",
        "| model | parameters | ms per step | ms per image |",
        "| --- | --- | --- | --- |",
        *[f"| {n} | {p / 1e6:.2f}M | {ms:.0f} | {ms / args.models_batch:.1f} |" for n, p, ms in model_rows],
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
