"""The figures of a `make gpu-check` folder as markdown (the end of its summary.md): per-epoch test
accuracy and time of the fast and resnet18 runs, airbench94 and Lightning on the same subset, and
where the bench's own report is.

    python bench/gpu_summary.py OUT_DIR
    python bench/gpu_summary.py --later-epochs OUT_DIR RUN_DIR...

The second form prints only the table of epochs 2 to the last (training seconds a mean epoch) of OUT_DIR's
fast run and of each RUN_DIR (a run.out_dir: gpu_probe.sh's fast-* runs), each against OUT_DIR's
airbench94: issue 33's "epochs 2-10 no slower than airbench94's", read in the call that ran them.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from ddp.errors import UsageError
from ddp.plot import read_run


def runs(out: Path) -> list[str]:
    lines = [
        "| run | epochs | final test accuracy | training + evaluation s | per epoch (acc %, s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in ("fast", "resnet18"):
        try:
            rows = read_run(out / name)
        except UsageError:  # the step failed before an epoch ended
            lines.append(f"| {name} | - | no finished epoch (no metrics.jsonl or an empty one) | - | - |")
            continue
        per_epoch = ", ".join(f"{100 * r['test_acc']:.1f}/{r['seconds']:.1f}" for r in rows if "test_acc" in r)
        total = sum(r["seconds"] for r in rows)
        warm = f" (warm-up {rows[0]['warmup_s']:.1f} s before them)" if "warmup_s" in rows[0] else ""
        lines.append(f"| {name} | {len(rows)} | {100 * rows[-1]['test_acc']:.2f}% | {total:.1f}{warm} | {per_epoch} |")
    return lines


NOT_WHOLE = "its airbench.json is not whole"


def read_airbench(out: Path) -> dict | str | None:
    """OUT_DIR's airbench.json as bench/airbench_subset.py wrote it; None where airbench94 did not run, NOT_WHOLE
    where the file was cut off as it was written."""
    path = out / "airbench.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return NOT_WHOLE


def airbench(out: Path) -> list[str]:
    r = read_airbench(out)
    if r is None:
        return ["airbench94: not run"]
    if r == NOT_WHOLE:
        return [f"airbench94: {NOT_WHOLE} (cut off as it was written)"]
    if "skipped" in r:
        return [f"airbench94: skipped ({r['skipped']})"]
    lines = [
        f"airbench94 on the same {r['train_images']} / {r['test_images']} images, {r['device']}: "
        f"{100 * r['accuracy']:.2f}% in {r['seconds']:.1f} s ({r['epochs']} epochs)"
    ]
    if r.get("per_epoch"):
        lines += ["", "| epoch | airbench94 acc (no TTA) | its training s so far | ours: fast acc (TTA) "
                  "| ours: training s so far | ours: s so far (evaluations in) |",
                  "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        ours, trained, elapsed = {}, 0.0, 0.0  # train_s: the training alone, as airbench's timer counts
        for row in fast_rows(out):
            trained, elapsed = trained + row.get("train_s", float("nan")), elapsed + row["seconds"]
            acc = f"{100 * row['test_acc']:.2f}%" if "test_acc" in row else "-"
            ours[row["epoch"]] = f"{acc} | {trained:.2f} | {elapsed:.2f}"
        for a in r["per_epoch"]:
            mine = ours.get(a["epoch"], "- | - | -")
            lines.append(f"| {a['epoch']} | {100 * a['val_acc']:.2f}% | {a['total_time_seconds']:.2f} | {mine} |")
    return lines


def fast_rows(out: Path) -> list[dict]:
    """The fast run's metrics.jsonl rows, none if it did not finish an epoch."""
    try:
        return read_run(out / "fast")
    except UsageError:
        return []


def later_epochs(out: Path, more: list[Path]) -> list[str]:
    """Epochs 2 to the last, training seconds a mean epoch (ours: train_s; airbench94: its timer's), and the
    training seconds to the first epoch at 70% test accuracy (ours with its TTA, airbench94's without, as its
    per-epoch rows are), each run against airbench94's of the same call."""
    lines = ["| run | epochs | training s a mean epoch, epoch 2 on | against airbench94 | training s to 70% "
             "| against airbench94 | final test accuracy |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    r, theirs, their_70 = read_airbench(out), None, None
    if r == NOT_WHOLE:
        lines.append(f"| airbench94 | - | {NOT_WHOLE} | - | - | - | - |")
    per_epoch = r.get("per_epoch", []) if isinstance(r, dict) else []
    theirs = airbench_later_epoch_s(per_epoch)
    if theirs is not None:
        their_70 = first_at_70([(a["val_acc"], a["total_time_seconds"], a["epoch"]) for a in per_epoch])
        lines.append(f"| airbench94 | {len(per_epoch)} | {theirs:.4f} | 1.00x | {shown(their_70)} "
                     f"| {'1.00x' if their_70 else '-'} | {100 * r['accuracy']:.2f}% (its TTA) |")  # fmt: skip
    for run in [out / "fast", *more]:
        try:
            rows = read_run(run)
        except UsageError:  # the run failed before an epoch ended
            lines.append(f"| {run.name} | - | no finished epoch | - | - | - | - |")
            continue
        later = later_epoch_s(rows)
        mean = f"{later:.4f}" if later is not None else "-"
        ratio = f"{later / theirs:.2f}x" if theirs and later is not None else "-"
        trained = itertools.accumulate(row.get("train_s", float("nan")) for row in rows)
        ours_70 = first_at_70([(row.get("test_acc", 0.0), s, row["epoch"]) for row, s in zip(rows, trained)])
        ratio_70 = f"{ours_70[0] / their_70[0]:.2f}x" if ours_70 and their_70 else "-"
        acc = f"{100 * rows[-1]['test_acc']:.2f}%" if "test_acc" in rows[-1] else "-"
        lines.append(f"| {run.name} | {len(rows)} | {mean} | {ratio} | {shown(ours_70)} | {ratio_70} | {acc} |")
    return lines


def later_epoch_s(rows: list[dict]) -> float | None:
    """Our run's training seconds a mean epoch from epoch 2 on (metrics.jsonl's train_s); None with one epoch."""
    later = [row["train_s"] for row in rows[1:] if "train_s" in row]
    return sum(later) / len(later) if later else None


def airbench_later_epoch_s(per_epoch: list[dict]) -> float | None:
    """airbench94's, from its per-epoch rows (bench/airbench_subset.py: its timer's seconds so far at each epoch's
    end); None with fewer than two epochs."""
    times = [a["total_time_seconds"] for a in per_epoch]
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def first_at_70(epochs: list[tuple[float, float, int]]) -> tuple[float, int] | None:
    """(training seconds so far, epoch) of the first (accuracy, seconds so far, epoch) at 70% or more."""
    return next(((seconds, epoch) for acc, seconds, epoch in epochs if acc >= 0.70), None)


def shown(at: tuple[float, int] | None) -> str:
    return f"{at[0]:.3f} (epoch {at[1]})" if at else "not reached"


def lightning(out: Path, ours: list[dict] | None) -> list[str]:
    path = out / "lightning.json"
    if not path.is_file():
        return ["Lightning: not run"]
    r = json.loads(path.read_text())
    last = r["epochs"][-1] if r["epochs"] else {"test_acc": float("nan")}
    line = (
        f"{r['framework']} ({r['precision']}, DDP on one device, {r['device']}), the same {r['model']} net and "
        f"recipe, batch {r['batch']}, {len(r['epochs'])} epochs: {100 * last['test_acc']:.2f}% in "
        f"{r['fit_wall_s']:.1f} s (trainer.fit)"
    )
    if r.get("left_out"):
        line += f", without {', '.join(r['left_out'])}"
    if ours:
        line += f"; ddp/train.py: {100 * ours[-1]['test_acc']:.2f}% in {sum(o['seconds'] for o in ours):.1f} s"
    return [line]


def main(out: Path) -> None:
    reports = sorted(p.name for p in out.glob("*.md") if p.name != "summary.md")
    lines = [*runs(out), "", *airbench(out), "", *later_epochs(out, []), "", *lightning(out, fast_rows(out)), ""]
    print("\n".join([*lines, "bench report: " + (", ".join(reports) or "none")]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--later-epochs"] and len(sys.argv) > 2:
        print("\n".join(later_epochs(Path(sys.argv[2]), [Path(a) for a in sys.argv[3:]])))
    else:
        main(Path(sys.argv[1]))
