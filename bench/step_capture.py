"""DDP at world size 1 against the bare model, each step captured whole in one CUDA graph (issue 33, part 3).

torch.compile's CUDA graphs left DDP +3% to +55% over the bare model in five samples (bench/graphs_split.py
pair, 2026-11-26/27): dynamo cuts the step at DDP's buckets, and DDP's C++ reducer still runs on the host each
backward. Here torch.cuda.graph records the whole step instead, NCCL's all-reduce inside it (NCCL >= 2.9.6 allows
that), the way torch's CUDA-semantics notes describe for DDP: DDP built on a side stream, 11 eager steps before
the capture. A replay then launches the step's every kernel, the all-reduce's too, from one host call.

The ways, in one process, one fixed batch a size (on a GPU the bench's DDP rows: fast at 1024 and 256,
resnet18 at 512), timed in turns (bench.harness.alternating):
  - eager: a plain step (zero_grad, forward under bf16 autocast, label-smoothed loss, backward, ddp/optim.py's
    fused SGD step), bare and under DDP;
  - train_step: ddp/train.py's step (its gradient norm, schedule and bookkeeping besides) on the same two jobs;
  - recorded: train_step with run.cuda_graph=true (ddp/graphed.py's Recorder), bare and under DDP;
  - captured (a GPU): the plain step recorded whole by the same Recorder, bare and under DDP, each its own job.
A replay repeats the recorded step as recorded: a scheduler or anything else decided on the host between steps is
not in it (the plain step has none; the Recorder runs them after each replay). Each recorded way's replay is
profiled (kernels a step; NCCL's among them). Then for each pair alike (eager, recorded, captured) the DDP job is
set to the bare one's weights, buffers and momentum in place and each takes one step: DDP at world size 1 averages
over one rank, so the weights must agree (2026-11-27's first lease compared them after some 377 steps of their
own on one batch instead: 0.12 apart, which says nothing at bf16).

  python bench/step_capture.py OUT_DIR          (writes OUT_DIR/capture.md and capture.json)

On a CPU (no CUDA graphs) it runs the eager ways at toy sizes over gloo: the dry run of the plumbing
(tests/test_bench.py).
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `bench` and `ddp` from the checkout

from bench import graphs_split, harness  # noqa: E402
from ddp import distributed, graphed  # noqa: E402
from ddp.devices import World  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = graphs_split.DEVICE
SIZES = [("fast", 1024), ("fast", 256), ("resnet18", 512)] if GPU else [("small", 16)]  # the bench's DDP rows
TIMING = graphs_split.TIMING


def plain_step(job: harness.train.Job) -> graphed.GradientStep:
    """The plain step on a batch already on the device: zero_grad, the forward under autocast, the loss, the backward,
    the fused SGD step; (loss, loss), as graphed.Recorder takes a step."""
    amp = job.plan.amp

    def step(images: torch.Tensor, labels: torch.Tensor) -> graphed.Pair:
        job.trained.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=amp, enabled=amp is not None):
            loss = job.criterion(job.wrapped(images), labels)
        loss.backward()
        job.trained.optimizer.step()
        return loss.detach(), loss.detach()

    return step


def eager(job: harness.train.Job, fixed: harness.Batch) -> Callable[[], object]:
    """A call: the plain step of `job` on `fixed`, normalised once (the input copy is no part of the step)."""
    step, batch = plain_step(job), (job.to_input(fixed[0]), fixed[1].to(DEVICE))
    return lambda: step(*batch)


def captured(job: harness.train.Job, fixed: harness.Batch, world: World) -> Callable[[], object]:
    """A call: the plain step of `job` on `fixed` replayed, recorded whole by ddp/graphed.py's Recorder after its
    eager steps (as many for bare and DDP)."""
    recorder = graphed.Recorder(plain_step(job), job.trained.optimizer, world)
    batch = (job.to_input(fixed[0]), fixed[1].to(DEVICE))
    for _ in range(max(graphed.EAGER_STEPS.values()) + 1):
        recorder(*batch)
    return lambda: recorder(*batch)


def run(out: Path) -> list[dict]:
    world = World(0, 0, 1, DEVICE, "ddp", "bench", f"tcp://127.0.0.1:{harness.free_port()}")
    rows: list[dict] = []
    side = torch.cuda.Stream(DEVICE) if GPU else None
    with distributed.setup(world, 120) as world, torch.cuda.stream(side) if GPU else contextlib.nullcontext():
        for model, batch in SIZES:  # DDP built on the side stream, every way stepped there (its accumulators' stream)
            done = one_size(model, batch, world, rows)
            write(out, rows)  # after each size: a call cut off keeps what finished
            if not done:
                break  # a failed recording may leave the device unusable: its error is kept
    return rows


def one_size(model: str, batch: int, world: World, rows: list[dict]) -> bool:
    """Every way at one model and batch, timed in turns, then each alike pair one step apart; its rows into
    `rows`. False when a recording failed (its error is a row)."""
    size = {"model": model, "batch": batch}
    jobs = {f"eager {label}": harness.job(model, batch, batch, w) for label, w in
            (("bare", World(0, 0, 1, DEVICE, "none")), ("ddp", world))}  # fmt: skip
    fixed = next(iter(jobs["eager bare"].train_loader))
    steps: dict[str, Callable[[], object]] = {k: eager(j, fixed) for k, j in jobs.items()}
    for label in ("bare", "ddp"):  # ddp/train.py's step (its norms, schedule, bookkeeping) on the same jobs
        steps[f"train_step {label}"] = harness.stepping(jobs[f"eager {label}"], lambda: fixed)
    for label, w in (("bare", World(0, 0, 1, DEVICE, "none")), ("ddp", world)):
        way = f"recorded {label}"
        try:
            recorded(way, harness.job(model, batch, batch, w, "run.cuda_graph=true"), fixed, jobs, steps)
            if GPU:  # the plain step recorded whole, without ddp/train.py
                jobs[f"captured {label}"] = job = harness.job(model, batch, batch, w)
                way = f"captured {label}"
                steps[way] = captured(job, fixed, w)
        except Exception as e:  # noqa: BLE001 (a way torch cannot record is its row's result)
            traceback.print_exc()
            rows.append({"way": way, **size, "error": f"{type(e).__name__}: {str(e).strip()[:300]}"})
            return False
    for way, s in harness.alternating(steps, *TIMING).items():
        row = {"way": way, **size, "step_s": s}
        if way.startswith("recorded"):
            row["replays"] = jobs[way].recorded.replays
        if way.startswith(("captured", "recorded")) and GPU:
            row["profiled"] = {k: v for k, v in graphs_split.profiled(steps[way], 5).items() if k != "by_name_ms"}
            row["nccl_kernels"] = sum(n for k, n in row["profiled"]["launches_by_name"].items() if "nccl" in k)
        rows.append(row)
    for how in ("eager", "recorded", "captured"):
        if f"{how} bare" in steps and f"{how} ddp" in steps:
            diff = one_step_apart(jobs[f"{how} bare"], jobs[f"{how} ddp"], steps[f"{how} bare"], steps[f"{how} ddp"])
            rows.append({"way": f"weights after one step from the same state, {how} ddp against {how} bare", **size,
                         "max_abs_diff": diff})  # fmt: skip
    return True


def recorded(way: str, job: harness.train.Job, fixed: harness.Batch, jobs: dict, steps: dict) -> None:
    """ddp/train.py's train_step with run.cuda_graph=true (graphed.Recorder) as `way`, taken past its eager
    steps and its recording."""
    jobs[way], steps[way] = job, harness.stepping(job, lambda: fixed)
    for _ in range(max(graphed.EAGER_STEPS.values()) + 1):  # as many for both: the same LR from the schedule
        steps[way]()


def one_step_apart(a: harness.train.Job, b: harness.train.Job, step_a: Callable, step_b: Callable) -> float:
    """b's weights, buffers and momentum set to a's, in place (a recorded graph keeps its tensors), then one
    step of each: the largest difference of a weight. DDP at world size 1 averages over one rank: none."""
    with torch.no_grad():
        for pa, pb in zip(a.trained.model.parameters(), b.trained.model.parameters(), strict=True):
            pb.copy_(pa)
            state_a, state_b = a.trained.optimizer.state.get(pa, {}), b.trained.optimizer.state.get(pb, {})
            for key, value in state_a.items():
                if torch.is_tensor(value) and torch.is_tensor(state_b.get(key)):
                    state_b[key].copy_(value)
        for ba, bb in zip(a.trained.model.buffers(), b.trained.model.buffers(), strict=True):
            bb.copy_(ba)
    step_a()
    step_b()
    with torch.no_grad():
        pairs = zip(a.trained.model.parameters(), b.trained.model.parameters(), strict=True)
        return max((pa - pb).abs().max().item() for pa, pb in pairs)


def lines(rows: list[dict]) -> list[str]:
    head = f"# DDP at world size 1, each step one CUDA graph ({harness.device_name(DEVICE)}, torch {torch.__version__})"
    window = f"{TIMING[1]} calls a window, {TIMING[2]} windows, medians"
    out = [head, "", f"One fixed batch a size, the ways timed in turns in one process ({window})."]
    for model, batch in dict.fromkeys((r["model"], r["batch"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["batch"]) == (model, batch)]
        out += size_lines(model, batch, mine)
    return out


def size_lines(model: str, batch: int, rows: list[dict]) -> list[str]:
    out = ["", f"## {model} at batch {batch}", "", "| way | step ms | kernels a step | NCCL kernels a step | device ms "
           "| replays |", "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    by_way = {r["way"]: r for r in rows if "step_s" in r}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['way']} | failed: {r['error'][:200].replace('|', '/')} | | | | |")
        elif "step_s" in r:
            p = r.get("profiled")
            more = f"{p['kernels']:.1f} | {r['nccl_kernels']:.1f} | {p['device_ms']:.3f}" if p else "- | - | -"
            out.append(f"| {r['way']} | {r['step_s'] * 1e3:.3f} | {more} | {r.get('replays', '-')} |")
    out.append("")
    for how in ("eager", "train_step", "recorded", "captured"):
        bare, ddp = by_way.get(f"{how} bare"), by_way.get(f"{how} ddp")
        if bare and ddp:
            out.append(f"- DDP over the bare model, {how}: {ddp['step_s'] / bare['step_s'] - 1:+.1%}")
    if "captured bare" in by_way and "eager bare" in by_way:
        ratio = by_way["captured bare"]["step_s"] / by_way["eager bare"]["step_s"]
        out.append(f"- captured bare against eager bare: {ratio:.2f}x")
    out += [f"- {r['way']}: max abs diff {r['max_abs_diff']:.3g}" for r in rows if "max_abs_diff" in r]
    return out


def write(out: Path, rows: list[dict]) -> None:
    (out / "capture.json").write_text(json.dumps(rows, indent=1, default=str))
    (out / "capture.md").write_text("\n".join(lines(rows)) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 64
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    print("\n".join(lines(run(out))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
