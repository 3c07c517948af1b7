"""configs/fast.yaml's epochs against airbench94's in ONE process, in turns: issue 33's "epochs 2-10 no slower per
epoch than airbench94's", with its spread. Until now each run was a process of its own (bench/gpu_rounds.sh), and
processes of one configuration differed by up to 31% in one call on an H100 (2026-11-27): a pair of processes could
show anything from 0.92x to 1.58x. Here airbench94 (its train94, its own timer), fast.yaml as gpu-check's fast step
runs it (bf16) and fast.yaml with run.amp=fp16-weights run PAIRS times each in one process (CUDA context, cuDNN's
autotuning and the GPU's clocks shared), the order reversed in every other pair; airbench's warm-up (warmup94)
once first, ours (run.warmup_steps=3) in each run, as each one's own runs do. Ours with run.seed=the pair's number;
airbench94 draws its own. Each arm's mean epoch from epoch 2 on (training seconds: ours metrics.jsonl's train_s,
airbench94's timer), its epoch 1 and its final test accuracy (airbench94's with its TTA) go to OUT_DIR/pairs.jsonl
and pairs.md after each run, so a call cut off keeps what it finished; the runs' logs and metrics.jsonl to
OUT_DIR/pairs/.

    python bench/epoch_pairs.py OUT_DIR [--pairs N] [--arms A,B] [--data .gpu/cifar10-subset.npz] [--airbench ARCHIVE]
    python bench/epoch_pairs.py OUT_DIR --dry-run [--pairs N] [--arms A,B]  (the CPU, toy sizes, every arm float32
                                                                           and eager, no airbench94)

--arms: which of ours (default fast,fast-recorded,fast-graphs: eager; run.cuda_graph=true, the step recorded in one
CUDA graph without a compile; compiled with CUDA graphs. Also fast-fp16w and fast-fp16w-graphs: run.amp=fp16-weights).
ARCHIVE: airbench's source archive (default .gpu/airbench-*.tar.gz: make gpu-carry).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `bench` and `ddp` from the checkout

from bench import airbench_subset  # noqa: E402
from bench.gpu_summary import airbench_later_epoch_s, later_epoch_s  # noqa: E402
from ddp import train  # noqa: E402
from ddp.plot import read_run  # noqa: E402

EAGER = ("run.cuda_graph=false",)  # fast.yaml's is auto: recorded on a GPU
GRAPHS = (*EAGER, "run.compile=true", "run.compile_mode=reduce-overhead")  # CUDA graphs, compiled in the warm-up
ARMS = {"fast": EAGER, "fast-fp16w": (*EAGER, "run.amp=fp16-weights"), "fast-graphs": GRAPHS,
        "fast-fp16w-graphs": ("run.amp=fp16-weights", *GRAPHS), "fast-recorded": ("run.cuda_graph=true",)}  # fmt: skip
# ours, beside "airbench94". A compiled arm compiles in its first run's warm-up (39.6 s on an H100 on 2026-11-27); the
# later runs of the process reuse that code (dynamo takes a new model of the same net as new inputs: on the CPU a
# warm-up of 22.8 s, then 0.0 s and 0.0 s for seeds 1 and 2)
DEFAULT_ARMS = "fast,fast-recorded,fast-graphs"  # fp16-weights was no faster than bf16 (2026-11-27-b)
TOY = ("data.dataset=synthetic", "data.synthetic_train=128", "data.synthetic_test=64", "train.epochs=2",
       "train.batch_size=64", "model.width=0.25", "run.device=cpu", "run.amp=off", "run.channels_last=false",
       "run.cudnn_benchmark=false")  # fmt: skip


def ours(out: Path, data: Path | None, settings: tuple[str, ...], seed: int) -> dict:
    """One run of ddp/train.py in this process, as gpu-check's fast step runs it: its later epochs' mean,
    epoch 1 and final accuracy; its stdout and stderr in OUT.log, its checkpoints removed."""
    sizes = TOY if data is None else ("data.dataset=npz", f"data.path={data}")
    argv = ["--config", str(ROOT / "configs" / "fast.yaml"), *sizes, "run.warmup_steps=3", "run.resume=never",
            "run.progress=false", f"run.out_dir={out}", f"run.seed={seed}", *settings]  # fmt: skip
    with open(f"{out}.log", "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            train.main(argv)
        except (Exception, SystemExit) as e:  # a failed arm is reported, and the pairs go on
            print(f"failed: {type(e).__name__}: {e}")
            return {"failed": f"{type(e).__name__}: {e}"[:200]}
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    rows = read_run(out)
    return {"later_s": later_epoch_s(rows), "epoch1_s": rows[0]["train_s"], "accuracy": rows[-1].get("test_acc")}


class Airbench:
    """airbench94 on the subset, as bench/airbench_subset.py runs it, warmed up once."""

    def __init__(self, archive: Path, data: Path) -> None:
        self.airbench, work, _ = airbench_subset.prepare(archive, data, "pairs-airbench-")
        os.chdir(work)  # train94 evaluates on ./cifar10/test.pt
        from airbench.lib_airbench94 import hyp

        self.hyp = hyp
        self.loader = self.airbench.CifarLoader("cifar10", train=True, batch_size=hyp["opt"]["batch_size"],
                                                aug=hyp["aug"], altflip=True)  # fmt: skip
        self.test = self.airbench.CifarLoader("cifar10", train=False, batch_size=2000)
        self.airbench.warmup94(train_loader=self.loader, verbose=False)  # once, untimed, as its own runs do

    def run(self, out: Path) -> dict:
        """One train94 run: as ours() reports one, a failure too."""
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                model = self.airbench.train94(train_loader=self.loader, verbose=True)
            per_epoch = airbench_subset.per_epoch(printed.getvalue())  # its table: an empty one fails the run
            accuracy = float(self.airbench.evaluate(model, self.test, tta_level=self.hyp["net"]["tta_level"]))
            first = per_epoch[0]["total_time_seconds"]
        except Exception as e:  # a failed arm is reported, and the pairs go on
            return {"failed": f"{type(e).__name__}: {e}"[:200]}
        finally:
            Path(f"{out}.log").write_text(printed.getvalue())
        return {"later_s": airbench_later_epoch_s(per_epoch), "epoch1_s": first, "accuracy": accuracy}


def cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "failed" in r:
        return f"failed ({r['failed'][:60]})"
    acc = f", {100 * r['accuracy']:.2f}%" if r.get("accuracy") is not None else ""
    return f"{r['later_s']:.4f} (epoch 1 {r['epoch1_s']:.4f}{acc})" if r["later_s"] else f"- (epoch 1 only{acc})"


def ratio(a: dict | None, b: dict | None) -> float | None:
    ok = a and b and a.get("later_s") and b.get("later_s")
    return a["later_s"] / b["later_s"] if ok else None


def report(pairs: list[dict], header: str, arms: list[str]) -> list[str]:
    """The pairs' table, then per arm the median of its later epochs and of its ratios to airbench94."""
    head = ["pair", "order", "airbench94 s an epoch, epoch 2 on", *(x for a in arms for x in (a, f"{a} / airbench94"))]
    lines = [header, "", "| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (len(head) - 2)]
    for p in pairs:
        cells = [str(p["pair"]), ", ".join(p["order"]), cell(p.get("airbench94"))]
        for a in arms:
            r = ratio(p.get(a), p.get("airbench94"))
            cells += [cell(p.get(a)), f"{r:.2f}x" if r else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for arm in ("airbench94", *arms):
        later = [p[arm]["later_s"] for p in pairs if (p.get(arm) or {}).get("later_s")]
        if not later:
            continue
        runs = f"{len(later)} run{'s' * (len(later) != 1)} ({min(later):.4f}-{max(later):.4f})"
        line = f"- {arm}: median {statistics.median(later):.4f} s an epoch over {runs}"
        ratios = [r for p in pairs if (r := ratio(p.get(arm), p.get("airbench94")))] if arm != "airbench94" else []
        if ratios:
            line += (f"; against airbench94 of the same pair: median {statistics.median(ratios):.2f}x "
                     f"({min(ratios):.2f}x-{max(ratios):.2f}x), no slower in {sum(r <= 1 for r in ratios)} "
                     f"of {len(ratios)}")  # fmt: skip
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/epoch_pairs.py")
    parser.add_argument("out", type=Path)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--data", type=Path, default=ROOT / ".gpu" / "cifar10-subset.npz")
    parser.add_argument("--airbench", type=Path, default=next((ROOT / ".gpu").glob("airbench-*.tar.gz"), None))
    parser.add_argument("--arms", default=DEFAULT_ARMS, help=f"ours, comma-separated, of: {', '.join(ARMS)}")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, not {args.pairs}")
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown or len(set(arms)) < len(arms):
        parser.error(f"--arms={args.arms}: each once, of {', '.join(ARMS)} ({', '.join(unknown) or 'a repeat'})")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: airbench94 trains on a GPU only (--dry-run: ours alone, on the CPU, toy sizes)")
    if not args.dry_run and not (args.data.is_file() and args.airbench and args.airbench.is_file()):
        parser.error(f"no {args.data} or no airbench archive (--airbench): make gpu-carry")
    out = args.out.resolve()
    (out / "pairs").mkdir(parents=True, exist_ok=True)
    data = None if args.dry_run else args.data.resolve()
    theirs = None if args.dry_run else Airbench(args.airbench.resolve(), data)
    device = torch.cuda.get_device_name(0) if not args.dry_run else "CPU (dry run: toy sizes, float32, no airbench94)"
    header = (f"# configs/fast.yaml against airbench94 in one process, in turns (bench/epoch_pairs.py)\n\n{device}, "
              f"torch {torch.__version__}; each cell: training s a mean epoch from epoch 2 on (epoch 1 s, final "
              "test accuracy)")  # fmt: skip
    pairs: list[dict] = []
    for k in range(1, args.pairs + 1):
        order = ["airbench94", *arms] if k % 2 else [*reversed(arms), "airbench94"]
        pair = {"pair": k, "order": order}
        pairs.append(pair)
        for arm in order:
            where = out / "pairs" / f"{k}-{arm}"
            if arm != "airbench94":
                settings = () if args.dry_run else ARMS[arm]  # dry: float32, eager (fp16 convolutions: 100x slower)
                pair[arm] = ours(where, data, settings, k)
            elif theirs:
                pair[arm] = theirs.run(where)
            (out / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
            (out / "pairs.md").write_text("\n".join(report(pairs, header, arms)) + "\n")
    print((out / "pairs.md").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
