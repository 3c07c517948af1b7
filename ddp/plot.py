"""`python -m ddp.plot RUN_DIR [RUN_DIR ...] [--out DIR]`: charts of runs, as PNGs (headless,
matplotlib's Agg backend) from each run's metrics.jsonl (RUN_DIR, or that file named: a copy under another name,
runs/a.jsonl, is the run "a"), into --out (default: the first RUN_DIR, or the directory of the first file).

- curves.png: train loss and test accuracy per epoch, one line per run (e.g. 1 vs 2 vs 4 processes);
- per_class.png: per-class test accuracy of each run's last evaluated epoch, bars with class names (with more
  than 20 classes, as for CIFAR-100: the first run's 10 best and 10 worst classes);
- confusion-<run>.png: the confusion matrix of each run's last evaluation.
A file of a chart's name that ddp.plot did not write (a user's own curves.png) is refused, never replaced.
matplotlib is an optional extra: pip install 'ddp-cifar[plot]'.
"""

from __future__ import annotations

import os
import stat
import struct
import sys
from pathlib import Path
from typing import Any

from ddp.startup import quiet_startup

quiet_startup(__name__)  # run as a command: a Ctrl-C or a missing package in the imports below is one line

from ddp import cli, files, rundir
from ddp.errors import UsageError
from ddp.metrics import shown_classes

DPI = 100  # figure sizes below are in inches: PNG pixels = inches x DPI
SHOWN_LINES = 10  # line numbers named in a note of lines left out; the rest counted


def read_run(run: Path) -> list[dict[str, Any]]:
    """A run's epochs from its metrics.jsonl (`run` its out_dir, or the file); a line that is no whole record of one
    (a run killed while writing it, an edit) is left out, with a note on stderr."""
    path = run if _a_file(run) else rundir.metrics_path(run)
    if not files.existing(path) or not path.is_file():
        raise UsageError(f"{run}: no metrics.jsonl (is it a run.out_dir of ddp/train.py?)")
    rows, left_out = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        row = rundir.metrics_record(line) if line.strip() else None
        if row is not None and _plottable(row):
            rows.append(row)
        elif line.strip():
            left_out.append(str(number))
    more = f" and {len(left_out) - SHOWN_LINES:,} more" if len(left_out) > SHOWN_LINES else ""
    bad = f"line {', '.join(left_out[:SHOWN_LINES])}{more}: not an epoch's whole record"
    if not rows and left_out:  # a file that is no metrics.jsonl (a checkpoint named by mistake): its lines, not a list
        raise UsageError(f"{path}: {bad}" + (" (is it a run's metrics.jsonl?)" if more else ""))
    if not rows:
        raise UsageError(f"{path} is empty: the run has not finished an epoch yet")
    if left_out:
        print(f"note: {path}: {bad}, left out", file=sys.stderr)
    return rows


def _a_file(path: Path) -> bool:
    """Whether a file stands at `path`; False where this user may not look (Path.is_file() raised that before
    Python 3.14: read_run names the metrics file it could not read, not the run)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _plottable(row: dict[str, Any]) -> bool:
    """A record with what the charts draw: a loss, and where the epoch evaluated, its accuracy, its classes'
    names and accuracies (fractions; None for a class without test images) and, where kept, a confusion matrix
    of as many rows and columns as classes."""
    if not (_number(row.get("train_loss")) and _number(row["epoch"])):
        return False
    if "test_acc" not in row:  # an epoch that did not evaluate: its loss alone
        return True
    classes, accs = row.get("classes"), row.get("per_class_acc")
    if not (_fraction(row["test_acc"]) and isinstance(classes, list) and isinstance(accs, list)):
        return False
    n, confusion = len(classes), row.get("confusion")
    square = confusion is None or (  # metrics from before ddp-cifar kept it have none
        isinstance(confusion, list)
        and len(confusion) == n
        and all(isinstance(r, list) and len(r) == n and all(map(_number, r)) for r in confusion)
    )
    named = all(isinstance(c, str) for c in classes)
    return named and len(accs) == n and all(a is None or _fraction(a) for a in accs) and square


def _number(x: Any) -> bool:
    """A number the charts can draw: not a bool, nor an int past a float's range (10**400: an OverflowError)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (isinstance(x, float) or abs(x) < 2**1023)


def _fraction(x: Any) -> bool:
    return _number(x) and 0 <= x <= 1  # NaN is not


def named(run_dirs: list[Path]) -> list[tuple[str, Path]]:
    """Each run once (one named twice is drawn once), with its name on the charts and in its confusion chart's
    file: its directory's name (a metrics file of another name: that name, less a .jsonl suffix), or the least of its
    path that tells it from the others (runs/a/quick and runs/b/quick: a-quick and b-quick; runs/a and runs/a.jsonl,
    whole paths alike: a-... and a-...-2)."""
    first: dict[tuple[str, ...], Path] = {}
    for d in run_dirs:
        first.setdefault(d.resolve().parts, d)
    stems = [d.with_suffix("") if _a_file(d) and d.suffix == ".jsonl" else d for d in first.values()]
    paths = [d.resolve().parts[1:] for d in stems]  # without the root: a name has no "/" in it
    depth = [1] * len(paths)
    while True:
        found = ["-".join(parts[-n:]) for parts, n in zip(paths, depth)]
        clash = [i for i, name in enumerate(found) if found.count(name) > 1 and depth[i] < len(paths[i])]
        if not clash:
            found = [name if found[:i].count(name) == 0 else f"{name}-{found[:i].count(name) + 1}" for i, name in
                     enumerate(found)]  # fmt: skip
            return list(zip(found, first.values()))
        for i in clash:  # more of their paths, for those of one name only
            depth[i] += 1


def label(name: str, rows: list[dict[str, Any]]) -> str:
    return f"{drawable(name)} ({rows[-1].get('world_size', 1)} proc)"


def drawable(name: str) -> str:
    """A run's name as matplotlib can draw it: bytes of its path that are not UTF-8 (Python's surrogates, which
    matplotlib's font refused with a traceback) as the replacement character."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".svg", ".pdf")
MARK = "ddp-cifar ddp.plot"  # each chart's PNG text "Software": what tells ddp.plot's charts from a user's files
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def foreign(path: Path) -> str | None:
    """What stands at a chart's `path` that ddp.plot did not write, in words (None: nothing, or a chart with its
    MARK in a tEXt chunk before the image data): a user's own curves.png in --out was replaced without a word. An
    OSError other than a missing file (a loop, a folder not open to this user) is raised, said as for any path."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if not stat.S_ISREG(mode):
        return "not a file"
    with open(path, "rb") as png:
        if png.read(len(PNG_SIGNATURE)) != PNG_SIGNATURE:
            return "not a PNG"
        for _ in range(64):  # matplotlib writes its text chunks first: a lying PNG is read no further than this
            head = png.read(8)
            length, kind = struct.unpack(">I4s", head) if len(head) == 8 else (0, b"IEND")
            if kind in (b"IDAT", b"IEND") or length > 2**20:
                break
            if png.read(length) == b"Software\0" + MARK.encode() and kind == b"tEXt":
                return None
            png.seek(4, os.SEEK_CUR)  # past the chunk's CRC
    return "a PNG that ddp.plot did not write (or wrote before it marked its charts)"


def plot(run_dirs: list[Path], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("ddp.plot needs matplotlib: pip install 'ddp-cifar[plot]'") from None
    runs = [(name, read_run(d)) for name, d in named(run_dirs)]
    tested = [(d, [r for r in rows if "test_acc" in r]) for d, rows in runs]  # the epochs that evaluated
    tested = [(d, rows) for d, rows in tested if rows]
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out={out} is a file: name a directory for the charts (made if missing)")
    if not out.exists() and out.suffix.lower() in IMAGE_SUFFIXES:  # --out curves.png: a directory of that name
        raise UsageError(f"--out={out} names a directory for the charts (it writes several PNGs), not an image: "
                         f"e.g. --out {out.with_suffix('')}")  # fmt: skip
    confusions = [(d, rows[-1]) for d, rows in tested if rows[-1].get("confusion") is not None]  # old runs: none
    charts = [out / "curves.png"] + [out / "per_class.png"] * bool(tested)
    charts += [out / f"confusion-{d}.png" for d, _ in confusions]
    for chart in charts:  # all before any is written: a refusal leaves --out as it was
        if why := foreign(chart):
            raise UsageError(f"{chart}: {why}; ddp.plot replaces only the charts it wrote: move it, or name "
                             "another --out")  # fmt: skip
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

    written.append(_save(_per_class(tested, plt), out / "per_class.png", plt))
    for d, last in confusions:
        written.append(_save(_confusion(d, last, plt), out / f"confusion-{d}.png", plt))
    return written


def _per_class(tested: list[tuple[str, list[dict[str, Any]]]], plt: Any) -> Any:
    """Bars of each run's per-class accuracy in its last evaluated epoch, for the runs of the first one's
    classes (another's would not line up: the rest are left out, with a note)."""
    first = tested[0][1][-1]
    alike = [(d, rows) for d, rows in tested if rows[-1]["classes"] == first["classes"]]
    for d, _ in tested[1:]:
        if d not in dict(alike):
            print(f"note: {d} has other classes than {tested[0][0]}: left out of per_class.png", file=sys.stderr)
    shown = shown_classes(first["per_class_acc"])
    classes = [first["classes"][c] for c in shown]
    fig, ax = plt.subplots(figsize=(10, 4), dpi=DPI)
    width = 0.8 / len(alike)
    for i, (d, rows) in enumerate(alike):
        accs = [100 * (rows[-1]["per_class_acc"][c] or 0) for c in shown]
        ax.bar([c + (i - (len(alike) - 1) / 2) * width for c in range(len(accs))], accs, width, label=label(d, rows))
    ax.set_xticks(range(len(classes)), classes, rotation=45, fontsize="small")
    some = "" if len(shown) == len(first["classes"]) else f": the 10 best and 10 worst of {len(first['classes'])}"
    ax.set(title=f"per-class test accuracy, last evaluated epoch{some}", ylabel="%", ylim=(0, 100))
    ax.legend(fontsize="small")
    return fig


def _confusion(name: str, last: dict[str, Any], plt: Any) -> Any:
    """The confusion matrix of a run's last evaluation, with the counts written in it up to 20 classes."""
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
    ax.set(title=f"confusion, epoch {last['epoch']} ({drawable(name)})", xlabel="predicted", ylabel="true")
    return fig


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    with files.atomic(path) as png:  # whole or not at all (a full disk: one line, the old chart kept)
        # no bbox_inches="tight": the PNG keeps the figure's size; its mark: the chart is ddp.plot's to replace
        fig.savefig(png, format="png", dpi=DPI, metadata={"Software": MARK})
    plt.close(fig)
    return path


def main(argv: list[str]) -> None:
    usage = "usage: python -m ddp.plot RUN_DIR [RUN_DIR ...] [--out DIR]"
    options, run_dirs = cli.parse(argv, f"{usage}\n\n{__doc__}", [cli.Option("--out", "DIR")])
    if not run_dirs:
        raise UsageError(f"name at least one run: {usage}")
    paths = [Path(d).parent if Path(d).name == "metrics.jsonl" and _a_file(Path(d)) else Path(d) for d in run_dirs]
    first_dir = paths[0].parent if _a_file(paths[0]) else paths[0]
    for path in plot(paths, Path(options["out"]) if options["out"] else first_dir):
        cli.show(str(path))


if __name__ == "__main__":
    cli.leave(cli.command(main))
