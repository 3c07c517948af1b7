"""`python -m ddp.evaluate`: any checkpoint on any device, its accuracy, a per-class table with class
names (as the PyTorch CIFAR-10 tutorial prints it), the confusion matrix and images/s.

    python -m ddp.evaluate --checkpoint runs/quick/checkpoints/last.pt [--device cpu|cuda|cuda:N]
                           [--json] [--batch-size 1024] [--raw] [data.key=value ...]

The model, dataset and normalisation come from the checkpoint (saved in any mode: plain, DataParallel,
DDP, compiled); data.* overrides point at another copy of the data (e.g. data.path=... offline). A run
that kept a moving average of its weights (train.ema_decay) is evaluated with those, unless --raw. What
`python -m ddp.checkpoint export` wrote (the weights alone) evaluates too, on the data that data.* names.
With more than 20 classes (CIFAR-100) the table lists the 10 best and the 10 worst classes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ddp.startup import quiet_startup

quiet_startup(__name__)  # run as a command: a Ctrl-C or a missing package in the imports below is one line

from ddp import (
    __version__,
    checkpoint,
    checks,
    cli,
    config,
    datasets,
    devices,
    files,
    loaders,
    metrics,
    models,
    weights,
)
from ddp.config import RunConfig
from ddp.errors import CorruptCheckpoint, UsageError


def _read(path: str) -> tuple[dict[str, Any], config.Config]:
    """The checkpoint at `path` and its settings; or what `export` wrote there, as a checkpoint of its model whose
    data settings are the defaults (data.* name the data) and whose epoch is None."""
    source = files.seekable(Path(path))  # (a pipe: read whole, once)
    try:
        state = checkpoint.load(path, source)
    except CorruptCheckpoint:
        if (export := weights.exported(checkpoint.loaded(source), path)) is None:
            raise
        tta = export.get("tta") or {}  # (an export made before it was kept: none)
        model = {"name": export["model_name"], "width": export["width"], "dropout": export["dropout"]}
        try:  # its settings, checked as a config's (a name this version builds, in range)
            train = {"tta_flip": tta.get("flip", False), "tta_translate": tta.get("translate", False)}
            cfg = config.from_dict({"model": model, "train": train})
        except UsageError as e:
            raise UsageError(f"{path}: an export whose settings this ddp-cifar does not take: {e}") from None
        state = {"model": export["model"], "classes": export["classes"], "normalize": export["normalize"],
                 "epoch": None, "config": {"model": {"name": cfg.model.name}}, "versions": {}}  # fmt: skip
        return state, cfg
    try:
        return state, config.from_dict(state["config"])
    except UsageError as e:  # a key this version does not know: a checkpoint of a newer ddp-cifar
        written = state.get("versions", {}).get("ddp_cifar", "another version")
        raise UsageError(f"{path} was written by ddp-cifar {written}, this is {__version__}: {e}") from None


def measure(path: str, device: str, batch_size: int, overrides: list[str], raw: bool = False) -> dict[str, Any]:
    """The checkpoint at `path` evaluated on `device` over the whole test set: accuracy, per class, confusion."""
    if bad := [o for o in overrides if not o.startswith("data.")]:
        raise UsageError(f"{', '.join(bad)}: only data.* settings can change for evaluation (e.g. data.path=FILE)")
    state, cfg = _read(path)
    named = any(o.startswith(("data.path=", "data.root=", "data.dataset=")) for o in overrides)
    if state["epoch"] is None and not named:  # (the defaults' CIFAR-10 download was tried)
        raise UsageError(f"{path} is an export, which names no data: give its test data, e.g. data.dataset=npz "
                         "data.path=FILE.npz, or data.dataset=cifar10 data.root=DIR")  # fmt: skip
    if state["epoch"] is None and raw:  # (it was not evaluated otherwise without a word)
        raise UsageError(f"--raw: {path} is an export, which holds one set of weights (export --raw chooses them)")
    config.override(cfg, overrides)
    checks.unused(cfg, lambda note: print(note, file=sys.stderr), [o.partition("=")[0].strip() for o in overrides])
    try:
        world = devices.resolve(run := RunConfig(device=device, parallel="none", launcher="none"))
    except UsageError as e:  # what the user typed here is --device
        raise UsageError(str(e).replace("run.device", "--device")) from None
    devices.share_cpus(run)  # its threads: as a run's, within a container's quota
    classes = state["classes"]
    try:
        test = datasets.read_test(cfg.data, world, classes)  # no training set needed
    except UsageError as e:  # the run's data settings, as it named them where it ran (a relative path, say)
        if named:
            raise
        key = "data.path=FILE.npz" if cfg.data.dataset == "npz" else "data.root=DIR"
        raise UsageError(f"{e} (the run's data, as its checkpoint names it: give this machine's, {key})") from None
    model = models.build(cfg.model.name, len(classes), cfg.model.dropout, cfg.model.width).to(world.device)
    weights.load(state, model, path, raw)
    loader = loaders.eval_loader(test, batch_size, world, 0, "device")
    norm = state["normalize"]  # the training split's statistics, as the model saw them
    to_input = loaders.input_fn(norm["mean"], norm["std"], world.device, channels_last=False)
    metrics.synchronize(world.device)
    start = metrics.clock()
    confusion = metrics.confusion_matrix(model, loader, to_input, len(classes), world, None, cfg.train.tta_flip,
                                         cfg.train.tta_translate)  # fmt: skip
    seconds = metrics.elapsed(start, world.device)
    return {
        "checkpoint": str(path),
        "model": cfg.model.name,
        "dataset": cfg.data.dataset,
        "device": str(world.device),
        "epoch": state["epoch"],
        "weights": "exported" if state["epoch"] is None else "raw" if raw or not state.get("ema") else "ema",
        "test_images": int(confusion.sum()),
        "accuracy": metrics.accuracy(confusion),
        "classes": classes,
        "per_class_accuracy": metrics.accuracy_per_class(confusion),
        "confusion": confusion.tolist(),
        "images_per_s": confusion.sum().item() / seconds,
    }


WEIGHTS = {"ema": "moving average weights", "raw": "trained weights", "exported": "exported weights"}


def table(r: dict[str, Any]) -> str:
    lines = [
        f"{r['checkpoint']}: {r['model']} ({WEIGHTS[r['weights']]})"
        + (f" after {r['epoch']} epoch(s)" if r["epoch"] is not None else "")
        + f", on {r['dataset']} ({r['test_images']} test "
        f"images), {r['device']}, {r['images_per_s']:.0f} images/s",
        f"Accuracy of the network on the {r['test_images']} test images: {100 * r['accuracy']:.1f} %",
    ]
    width = max(len(c) for c in r["classes"])
    rows = [
        f"Accuracy for class: {name:{width}s} is " + (f"{100 * acc:.1f} %" if acc is not None else "n/a")
        for name, acc in zip(r["classes"], r["per_class_accuracy"])
    ]
    shown = metrics.shown_classes(r["per_class_accuracy"])
    if len(shown) < len(rows):  # the 10 best and the 10 worst
        lines.append(f"The 10 best and the 10 worst of {len(rows)} classes (--json for all):")
        rows = [rows[i] for i in shown[:10]] + ["..."] + [rows[i] for i in shown[10:]]
    lines += rows
    if len(r["classes"]) <= 20:  # a 100 x 100 matrix is for --json
        lines.append("Confusion matrix (rows: true class, columns: predicted):")
        cell = max(5, *(len(str(v)) + 1 for row in r["confusion"] for v in row))
        short = [c[: cell - 1] for c in r["classes"]]
        lines.append(" " * (width + 1) + "".join(f"{c:>{cell}}" for c in short))
        for name, row in zip(r["classes"], r["confusion"]):
            lines.append(f"{name:{width}s} " + "".join(f"{v:>{cell}}" for v in row))
    return "\n".join(lines)


def _checkpoint(value: str | None) -> str:
    if not value:
        raise UsageError("--checkpoint needs a file: --checkpoint runs/quick/checkpoints/last.pt")
    return value


OPTIONS = [
    cli.Option("--checkpoint", "PATH", _checkpoint),
    cli.Option("--device", "DEVICE", default="auto"),
    cli.Option("--batch-size", "N", cli.positive_int("--batch-size needs a number of images, e.g. 1024"), default=1024),
    cli.Option("--json"),
    cli.Option("--raw"),
]


USAGE = "usage: python -m ddp.evaluate --checkpoint PATH [--device D] [--batch-size N] [--json] [--raw] [data.k=v ...]"


def main(argv: list[str]) -> None:
    options, overrides = cli.parse(argv, f"{USAGE}\n\n{__doc__}", OPTIONS)
    path = next((word for word in overrides if "=" not in word), None)  # (`ddp.checkpoint inspect PATH`'s way)
    if options["checkpoint"] is None:
        hint = f" (a path goes after it: --checkpoint {path})" if path else ""
        raise UsageError(f"--checkpoint is required{hint}: python -m ddp.evaluate --checkpoint PATH [...]")
    if path:  # (a second checkpoint, say), before any file is read
        raise UsageError(f"'{path}' is no setting: evaluate takes one --checkpoint PATH, and data.* settings")
    result = measure(options["checkpoint"], options["device"], options["batch_size"], overrides, options["raw"])
    cli.show(json.dumps(result) if options["json"] else table(result))


if __name__ == "__main__":
    cli.leave(cli.command(main))
