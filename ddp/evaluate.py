"""Evaluate any checkpoint on any device:

    python -m ddp.evaluate --checkpoint runs/quick/checkpoints/last.pt [--device cpu|cuda|cuda:N]
                           [--json] [--batch-size 1024] [--raw] [data.key=value ...]

Prints the accuracy, a per-class table with class names (as the PyTorch CIFAR-10 tutorial prints
it), the confusion matrix and images/s; --json prints the same as one JSON object. The model,
dataset and normalisation come from the checkpoint (saved in any mode: plain, DataParallel, DDP,
compiled); data.* overrides point at another copy of the data (e.g. data.path=... offline). A run
that kept a moving average of its weights (train.ema_decay) is evaluated with those, unless --raw.
With more than 20 classes (CIFAR-100) the table lists the 10 best and the 10 worst classes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ddp import checkpoint, config, distributed, loaders, metrics, models
from ddp import data as datasets
from ddp.cli import command
from ddp.config import RunConfig
from ddp.errors import UsageError


def run(path: str, device: str, batch_size: int, overrides: list[str], raw: bool = False) -> dict[str, Any]:
    state = checkpoint.load(path)
    cfg = config.from_dict(state["config"])
    if bad := [o for o in overrides if not o.startswith("data.")]:
        raise UsageError(f"{', '.join(bad)}: only data.* settings can change for evaluation (e.g. data.path=FILE)")
    config.override(cfg, overrides)
    world = distributed.resolve(RunConfig(device=device, parallel="none", launcher="none"))
    classes = state["classes"]
    test = datasets.load_test(cfg.data, world, classes)  # no training set needed
    model = models.build(cfg.model.name, len(classes), cfg.model.dropout, cfg.model.width).to(world.device)
    checkpoint.load_weights(state, model, raw)
    loader = loaders.eval_loader(test, batch_size, world, 0, "device")
    norm = state["normalize"]  # the training split's statistics, as the model saw them
    to_input = loaders.input_fn(norm["mean"], norm["std"], world.device, channels_last=False)
    metrics.synchronize(world.device)
    start = time.perf_counter()
    confusion = metrics.evaluate(model, loader, to_input, len(classes), world, None, cfg.train.tta_flip)
    seconds = metrics.elapsed(start, world.device)
    return {
        "checkpoint": str(path),
        "model": cfg.model.name,
        "dataset": cfg.data.dataset,
        "device": str(world.device),
        "epoch": state["epoch"],
        "weights": "raw" if raw or not state.get("ema") else "ema",
        "test_images": int(confusion.sum()),
        "accuracy": metrics.accuracy(confusion),
        "classes": classes,
        "per_class_accuracy": metrics.accuracy_per_class(confusion),
        "confusion": confusion.tolist(),
        "images_per_s": confusion.sum().item() / seconds,
    }


def table(r: dict[str, Any]) -> str:
    lines = [
        f"{r['checkpoint']}: {r['model']} ({'moving average' if r['weights'] == 'ema' else 'trained'} weights) "
        f"after {r['epoch']} epoch(s), on {r['dataset']} ({r['test_images']} test "
        f"images), {r['device']}, {r['images_per_s']:.0f} images/s",
        f"Accuracy of the network on the {r['test_images']} test images: {100 * r['accuracy']:.1f} %",
    ]
    width = max(len(c) for c in r["classes"])
    rows = [
        f"Accuracy for class: {name:{width}s} is " + (f"{100 * acc:.1f} %" if acc is not None else "n/a")
        for name, acc in zip(r["classes"], r["per_class_accuracy"])
    ]
    if len(rows) > 20:  # the 10 best and the 10 worst (classes without test images count as worst)
        order = sorted(range(len(rows)), key=lambda i: r["per_class_accuracy"][i] or -1, reverse=True)
        lines.append(f"The 10 best and the 10 worst of {len(rows)} classes (--json for all):")
        rows = [rows[i] for i in order[:10]] + ["..."] + [rows[i] for i in order[-10:]]
    lines += rows
    if len(r["classes"]) <= 20:  # a 100 x 100 matrix is for --json
        lines.append("Confusion matrix (rows: true class, columns: predicted):")
        cell = max(5, *(len(str(v)) + 1 for row in r["confusion"] for v in row))
        short = [c[: cell - 1] for c in r["classes"]]
        lines.append(" " * (width + 1) + "".join(f"{c:>{cell}}" for c in short))
        for name, row in zip(r["classes"], r["confusion"]):
            lines.append(f"{name:{width}s} " + "".join(f"{v:>{cell}}" for v in row))
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddp.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint written by ddp/train.py")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    parser.add_argument("--raw", action="store_true", help="the trained weights, not their moving average")
    parser.add_argument("overrides", nargs="*", help="data.key=value, e.g. data.path=cifar10-subset.npz")
    args = parser.parse_args(argv)
    result = run(args.checkpoint, args.device, args.batch_size, args.overrides, args.raw)
    print(json.dumps(result) if args.json else table(result))


if __name__ == "__main__":
    sys.exit(command(main))
