"""configs/fast.yaml's training step against airbench94's own, eager, on one device: where the time per epoch
goes (issue 33: epochs 2-10 took 0.0405 s a mean epoch for ours and 0.0272 s for airbench94 on an H100,
2026-11-26; on the CPU bench both steps dispatch about as many operators, bench/results/host-cost-cpu.md).

Each is profiled over its steps FIRST..END-1 (bench/host_cost.py's window) of one epoch of synthetic images:
ours is ddp/train.py --config configs/fast.yaml (its augmentation, bf16, channels_last, cudnn.benchmark) with
run.profile, and on a GPU again with run.amp=fp16 and fp16-weights; airbench94 its train94 at the same widths and batch,
its augmentation, fp16. Per step: host
operators (top level and all), GPU kernels and copies, their device time by kind (bench/graphs_split.py's
kinds), the span from the window's first kernel to its last (the step's wall when the GPU never waits), the
host's span, and each one's top kernels by device time with their launches.

    python bench/recipe_steps.py OUT_DIR [--airbench .gpu/airbench-0.1.8.tar.gz]    (OUT_DIR/recipe-steps.md, .json)

The archive is for a machine without the airbench package (the GPU's); without CUDA (the dry run) both run
on the CPU at host_cost's toy sizes, fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` and `ddp` from the checkout

from bench import host_cost  # noqa: E402
from bench.graphs_split import device_time  # noqa: E402

GPU = torch.cuda.is_available()
BATCH, WIDTH = (1024, 1.0) if GPU else (host_cost.BATCH, host_cost.WIDTH)


def measure(work: Path) -> dict[str, dict]:
    """Both steps' counts and device times; their traces left in `work` (ours/profile/rank0.json, airbench.json)."""
    steps = host_cost.END - host_cost.FIRST
    ours_args = (
        *host_cost.FAST, *(() if GPU else host_cost.FP32), "data.augment=true", f"model.width={WIDTH}",
        f"train.batch_size={BATCH}", f"data.synthetic_train={BATCH * host_cost.END}", "run.cuda_graph=false",  # eager
    )  # fmt: skip
    rows = {"ours (configs/fast.yaml)": ("ours", ())}
    if GPU:  # fp16 takes cuDNN's BatchNorm, as airbench94's fp16 does (bf16 takes torch's own), and adds a GradScaler;
        rows["ours, run.amp=fp16"] = ("ours-fp16", ("run.amp=fp16",))  # fp16-weights: airbench's, no autocast
        rows["ours, run.amp=fp16-weights"] = ("ours-fp16w", ("run.amp=fp16-weights",))
    measured = {}
    for label, (name, extra) in rows.items():
        counts = host_cost.ours([sys.executable], work / name, *ours_args, *extra)
        measured[label] = {**counts, **device_time(work / name / "profile" / "rank0.json", steps)}
    with host_cost.one_thread():
        theirs = host_cost.airbench_loop(work / "airbench.json", BATCH, WIDTH)
    return {**measured, "airbench94": {**theirs, **device_time(work / "airbench.json", steps)}}


def report(rows: dict[str, dict]) -> list[str]:
    device = torch.cuda.get_device_name(0) if GPU else "CPU (dry run: no kernels)"
    lines = [
        f"# configs/fast.yaml's step against airbench94's, eager ({device}, torch {torch.__version__})",
        "",
        f"Command: `python bench/recipe_steps.py OUT --airbench .gpu/airbench-0.1.8.tar.gz`; batch {BATCH}, "
        f"width {WIDTH}, synthetic images, steps {host_cost.FIRST}-{host_cost.END - 1} of one epoch, per step.",
        "",
        "| step | top-level ops | all ops | kernels + copies | device ms | kernels' span ms | host span ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, r in rows.items():
        lines.append(
            f"| {label} | {r['top_level_ops']:.1f} | {r['all_ops']:.1f} | {r['kernels']:.1f} | {r['device_ms']:.3f} "
            f"| {r['device_span_ms']:.3f} | {r['host_span_ms']:.3f} |"
        )
    kinds = sorted({k for r in rows.values() for k in r["kinds_ms"]})
    lines += ["", f"| device ms by kind | {' | '.join(rows)} |", "| --- |" + " ---: |" * len(rows)]
    lines += [f"| {k} | " + " | ".join(f"{r['kinds_ms'].get(k, 0):.3f}" for r in rows.values()) + " |" for k in kinds]
    for label, r in rows.items():  # fp16 and bf16 kernels differ in name: each side's own, not a difference
        top = sorted(r["by_name_ms"].items(), key=lambda kv: -kv[1])[:15]
        lines += ["", f"| {label}: top 15 kernels | ms a step | launches a step |", "| --- | ---: | ---: |"]
        lines += [f"| {n[:110]} | {ms:.3f} | {r['launches_by_name'][n]:.1f} |" for n, ms in top]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--airbench", type=Path, help="airbench-0.1.8.tar.gz, for a machine without the package")
    args = parser.parse_args()
    if args.airbench and not args.airbench.is_file():
        print(
            f"recipe_steps.py: --airbench {args.airbench}: no such file (make gpu-carry puts it in .gpu/)",
            file=sys.stderr,
        )
        return 64
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.airbench:
            from bench.airbench_subset import import_airbench

            import_airbench(args.airbench.resolve(), Path(tmp))
        rows = measure(Path(tmp))
    (args.out / "recipe-steps.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = report(rows)
    (args.out / "recipe-steps.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
