"""`python -m ddp.plot RUN_DIR [RUN_DIR ...] [--out DIR]`: charts of runs, as PNGs (headless,
matplotlib's Agg backend) from each run's metrics.jsonl, into --out (default: the first RUN_DIR).

- curves.png: train loss and test accuracy per epoch, one line per run (e.g. 1 vs 2 vs 4 processes);
- per_class.png: per-class test accuracy of each run's last evaluated epoch, bars with class names (with more
  than 20 classes, as for CIFAR-100: the first run's 10 best and 10 worst classes);
- confusion-<run>.png: the confusion matrix of each run's last evaluation.
matplotlib is an optional extra: pip install 'ddp-cifar[plot]'.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ddp.launchers import quiet_startup

quiet_startup(__name__)  # run as a command: a Ctrl-C or a missing package in the imports below is one line

from ddp import cli, files, rundir
from ddp.errors import UsageError
from ddp.metrics import shown_classes

DPI = 100  # figure sizes below are in inches: PNG pixels = inches x DPI


def read_run(run_dir: Path) -> list[dict[str, Any]]:
    """A run's epochs from its metrics.jsonl; a line that is no whole record of one (a run killed while
    writing it, an edit) is left out, with a note on stderr."""
    path = rundir.metrics_path(run_dir)
    if not path.is_file():
        raise UsageError(f"{run_dir}: no metrics.jsonl (is it a run.out_dir of ddp/train.py?)")
    rows, left_out = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        row = rundir.metrics_record(line) if line.strip() else {}
        if row is None or row and not _plottable(row):
            left_out.append(str(number))
        elif row:
            rows.append(row)
    bad = f"line {', '.join(left_out)}: not an epoch's whole record"
    if not rows:
        raise UsageError(f"{path}: {bad}" if left_out else f"{path} is empty: the run has not finished an epoch yet")
    if left_out:
        print(f"note: {path}: {bad}, left out", file=sys.stderr)
    return rows


def _plottable(row: dict[str, Any]) -> bool:
    """A record with what the charts draw: a loss, and where the epoch evaluated, its accuracies and classes."""
    number = (int, float)
    tested = "test_acc" not in row or (
        isinstance(row["test_acc"], number)
        and isinstance(row.get("classes"), list)
        and isinstance(row.get("per_class_acc"), list)
        and len(row["classes"]) == len(row["per_class_acc"])
    )
    return isinstance(row.get("train_loss"), number) and tested


def names(run_dirs: list[Path]) -> list[str]:
    """Each run's name on the charts and in its confusion chart's file: its directory's name, or the least
    of its path that tells it from the others (runs/a/quick and runs/b/quick: a-quick and b-quick)."""
    parts = [d.resolve().parts for d in run_dirs]
    for n in range(1, max(map(len, parts)) + 1):
        found = ["-".join(p[-n:]) for p in parts]
        if len(set(found)) == len(found):
            return found
    return found


def label(name: str, rows: list[dict[str, Any]]) -> str:
    return f"{name} ({rows[-1].get('world_size', 1)} proc)"


def plot(run_dirs: list[Path], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("ddp.plot needs matplotlib: pip install 'ddp-cifar[plot]'") from None
    unique: dict[Path, Path] = {}
    for d in run_dirs:
        unique.setdefault(d.resolve(), d)  # a run named twice is drawn once
    run_dirs = list(unique.values())
    runs = list(zip(names(run_dirs), [read_run(d) for d in run_dirs]))
    tested = [(d, [r for r in rows if "test_acc" in r]) for d, rows in runs]  # the epochs that evaluated
    tested = [(d, rows) for d, rows in tested if rows]
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out={out} is a file: name a directory for the charts (made if missing)")
    written = []

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4), dpi=DPI)
    for d, rows in runs:
        loss_ax.plot([r["epoch"] for r in rows], [r["train_loss"] for r in rows], marker="o", label=label(d, rows))
    for d, rows in tested:
        acc_ax.plot([r["epoch"] for r in rows], [100 * r["test_acc"] for r in rows], marker="o", label=label(d, rows))
    loss_ax.set(title="train loss", xlabel="epoch", ylabel="loss")
    acc_ax.set(title="test accuracy", xlabel="epoch", ylabel="%")
    if tested:
        acc_ax.legend(fontsize="small")
    written.append(_save(fig, out / "curves.png", plt))
    if not tested:  # no epoch has evaluated yet (train.eval_every): no accuracy to show per class
        return written

    first = tested[0][1][-1]
    shown = shown_classes(first["per_class_acc"])
    classes = [first["classes"][c] for c in shown]
    fig, ax = plt.subplots(figsize=(10, 4), dpi=DPI)
    width = 0.8 / len(tested)
    for i, (d, rows) in enumerate(tested):
        accs = [100 * (rows[-1]["per_class_acc"][c] or 0) for c in shown]
        ax.bar([c + (i - (len(tested) - 1) / 2) * width for c in range(len(accs))], accs, width, label=label(d, rows))
    ax.set_xticks(range(len(classes)), classes, rotation=45, fontsize="small")
    some = "" if len(shown) == len(first["classes"]) else f": the 10 best and 10 worst of {len(first['classes'])}"
    ax.set(title=f"per-class test accuracy, last evaluated epoch{some}", ylabel="%", ylim=(0, 100))
    ax.legend(fontsize="small")
    written.append(_save(fig, out / "per_class.png", plt))

    for d, rows in tested:
        last = rows[-1]
        if not isinstance(last.get("confusion"), list):
            continue  # metrics from before ddp-cifar kept the confusion matrix
        fig, ax = plt.subplots(figsize=(7, 6), dpi=DPI)
        image = ax.imshow(last["confusion"], cmap="Blues")
        fig.colorbar(image, ax=ax)
        n = len(last["classes"])
        if n <= 20:
            ax.set_xticks(range(n), last["classes"], rotation=45, fontsize="small")
            ax.set_yticks(range(n), last["classes"], fontsize="small")
            for t in range(n):
                for p in range(n):
                    ax.text(p, t, last["confusion"][t][p], ha="center", va="center", fontsize="x-small")
        ax.set(title=f"confusion, epoch {last['epoch']} ({d})", xlabel="predicted", ylabel="true")
        written.append(_save(fig, out / f"confusion-{d}.png", plt))
    return written


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    with files.atomic(path) as png:  # whole or not at all (a full disk: one line, the old chart kept)
        fig.savefig(png, format="png", dpi=DPI)  # no bbox_inches="tight": the PNG keeps the figure's size
    plt.close(fig)
    return path


def main(argv: list[str]) -> None:
    usage = "usage: python -m ddp.plot RUN_DIR [RUN_DIR ...] [--out DIR]"
    options, run_dirs = cli.parse(argv, f"{usage}\n\n{__doc__}", [cli.Option("--out", "DIR")])
    if not run_dirs:
        raise UsageError(f"name at least one run: {usage}")
    paths = [Path(d) for d in run_dirs]
    for path in plot(paths, Path(options["out"]) if options["out"] else paths[0]):
        print(path)


if __name__ == "__main__":
    cli.leave(cli.command(main))
