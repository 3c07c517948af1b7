"""Two questions the 2026-11-26 leases left (issue 33, part 3), for one short device call:

  pair   the bare model and DDP at world size 1, each compiled with CUDA graphs (run.compile_mode=
         reduce-overhead), each timed in turns with the eager bare step: like for like, what does DDP
         cost once the launches are graph replays? (The bench compares compiled DDP with the eager
         bare model only.) Then each graphed step profiled: kernels, device time and spans per step, and
         the kernels DDP adds (it cost +3.0%, +35.3%, +26.0% and +37.5% in four samples, 2026-11-26/27).
         DDP again with dynamo's graph left whole (optimize_ddp=False: no split at DDP's buckets, the
         all-reduce after the backward). The same again with each backward compiled by compiled autograd,
         DDP's in python_reducer mode: its all-reduce traced into the backward's CUDA graphs instead of
         launched by its C++ reducer's hooks (2026-11-27: -1.0%, but both at 11.7-11.8 ms a step against
         the bare model's 4.30 without it: compiled autograd's host work each backward).
  fused  the eager bare step with the optimizer fused (ddp/optim.py's choice) and with torch's default
         (for-each on a GPU), the same optimizer and state, its groups' flag switched between calls, timed
         in turns: what fusing saves on a host-bound step (on the CPU it cut 104 of 220.5 top-level
         operators a step, where torch's default loops over the parameters)
  split  where a compiled step's GPU time goes (torch.profiler, CUDA kernels): convolutions and
         matrix products, against the rest (fused BatchNorm/ReLU/pooling, the optimizer, copies), and
         how much of the step's wall the kernels fill: what bounds MFU at the best batch.

  python bench/graphs_split.py OUT_DIR [pair] [fused] [split]     (each part writes OUT_DIR/<part>.md and .json)

On a CPU it runs the same code eager at toy sizes (the dry run tests/test_gpu_check.py makes).
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from bench import harness
from ddp import distributed, metrics
from ddp.devices import World

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda", 0) if GPU else torch.device("cpu")
TIMING = (DEVICE, 10, 50, 7) if GPU else (DEVICE, 1, 2, 2)  # warm-up calls, calls a window, windows
PAIR = ("fast", 1024 if GPU else 16)
PROFILED_STEPS = 20 if GPU else 2  # each graphed step of the pair, profiled after its timing
FUSED = [("fast", 256), ("fast", 1024), ("resnet18", 512)] if GPU else [("small", 16)]  # the bench's DDP rows
SPLIT = [("resnet18", 4096), ("fast", 8192)] if GPU else [("small", 16)]
MATMUL = ("conv", "gemm", "xmma", "cutlass", "cudnn", "triton_mm", "wgrad", "dgrad", "fprop", "implicit")
LAYOUT = ("nchwtonhwc", "nhwctonchw", "transpose")


def compiled(world: World, name: str, batch: int, mode: str) -> harness.train.Job:
    extra = ("run.compile=true", f"run.compile_mode={mode}", "run.cudnn_benchmark=true") if GPU else ()
    torch._dynamo.reset()  # each compiles afresh
    return harness.job(name, batch, batch, world, *extra)


# The pair's ways, each compiled with CUDA graphs: (label, under DDP, dynamo's settings). The last two
# compile each backward with compiled autograd, and DDP built in python_reducer mode traces its all-reduce
# into it: the way torch offers to put DDP's reduction inside the step's CUDA graphs. A way that fails leaves
# its error in its row; the pair's figures are written after each way (a call cut off keeps them).
GRAPHED_BACKWARD = {"compiled_autograd": True, "inductor.triton.cudagraphs": GPU}
WAYS = (("bare", False, {}), ("ddp", True, {}), ("ddp, one graph", True, {"optimize_ddp": False}),
        ("bare, compiled autograd", False, GRAPHED_BACKWARD),
        ("ddp, python reducer, compiled autograd", True, {**harness.PYTHON_REDUCER, **GRAPHED_BACKWARD}))  # fmt: skip
# DDP over the bare model for each two ways alike: (bare, ddp, how). "ddp, one graph" is ddp.split_graph=false and
# the bench's whole_graph_cuda_graphs (dynamo leaves the step whole, DDP's C++ reducer all-reduces after its backward):
# 4.32 ms a step on 2026-11-27 against 4.30 for the bare model here, in two processes; here in turns.
DDP_OVER_BARE = (
    ("bare", "ddp", ""),
    ("bare", "ddp, one graph", ", DDP's step one graph (optimize_ddp=False)"),
    ("bare, compiled autograd", "ddp, python reducer, compiled autograd", ", both with compiled autograd"),
)


def pair(out: Path) -> None:
    name, batch = PAIR
    world = World(0, 0, 1, DEVICE, "ddp", "bench", f"tcp://127.0.0.1:{harness.free_port()}")
    rows = []
    with distributed.setup(world, 120) as world:
        eager = harness.job(name, batch, batch, World(0, 0, 1, DEVICE, "none"))
        fixed = next(iter(eager.train_loader))
        anchor = harness.stepping(eager, lambda: fixed)
        for label, ddp, settings in WAYS:
            try:
                rows.append(graphed(label, world if ddp else World(0, 0, 1, DEVICE, "none"), settings, anchor, fixed))
            except Exception as e:  # noqa: BLE001 (a way torch cannot run is its row's result)
                traceback.print_exc()
                rows.append(
                    {"launch": label, "error": f"{type(e).__name__}: {(str(e).strip() or '-').splitlines()[0]}"}
                )
            write(out, "pair", rows, pair_lines(rows))


def graphed(label: str, world: World, settings: dict, anchor: Callable[[], None], fixed: tuple) -> dict:
    """One way of the pair: compiled afresh, timed in turns with the eager bare step, then profiled."""
    from torch._dynamo.utils import counters

    name, batch = PAIR
    counters.clear()
    backend = "inductor" if GPU else "eager"  # compiled autograd's compile; on a CPU the dry run's plumbing only
    with harness.dynamo_inlining_kept():
        built = harness.under_dynamo(settings, lambda: compiled(world, name, batch, "reduce-overhead"), backend)()
        step = harness.under_dynamo(settings, harness.stepping(built, lambda: fixed), backend)
        first = harness.first_two_steps_s(step, DEVICE)
        t = harness.alternating({"eager_bare": anchor, "graphs": step}, *TIMING)
        row = {"model": name, "batch": batch, "launch": label, "first_two_steps_s": first,
               "graphs_step_s": t["graphs"], "eager_bare_step_s": t["eager_bare"],
               "profiled": profiled(step, PROFILED_STEPS)}  # fmt: skip
    if settings.get("compiled_autograd"):
        row["compiled_autograd_captures"] = counters["compiled_autograd"]["captures"]
    if reducer := harness.ddp_reducer(built.wrapped):  # DDP: which reducer ran (python_reducer mode: none of C++)
        row["reducer"] = reducer
    row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]  # graphs run without CUDA graphs (why: the log)
    print(
        f"  {label} with CUDA graphs: {t['graphs'] * 1e3:.2f} ms, eager bare {t['eager_bare'] * 1e3:.2f} ms", flush=True
    )
    return row


def pair_lines(rows: list[dict]) -> list[str]:
    """The pair's tables: each way's step against the eager anchor, DDP over the bare model for each
    two ways alike, the profiled steps, and the kernels DDP adds to the graphed step."""
    lines = ["| launch | step ms, CUDA graphs | eager bare step ms (in turns) | compile s | backwards compiled "
             "| graphs without CUDA graphs |", "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['launch']} | failed: {r['error'][:200].replace('|', '/')} | | | | |")
            continue
        ms, anchor_ms = r["graphs_step_s"] * 1e3, r["eager_bare_step_s"] * 1e3
        launch = f"{r['launch']} ({r['reducer']} reducer)" if "reducer" in r else r["launch"]
        lines.append(f"| {launch} | {ms:.2f} | {anchor_ms:.2f} | {r['first_two_steps_s']:.1f} | "
                     f"{r.get('compiled_autograd_captures', '-')} | {r['cudagraph_skips']} |")  # fmt: skip
    done = {r["launch"]: r for r in rows if "error" not in r}
    for bare, ddp, how in DDP_OVER_BARE:
        if bare in done and ddp in done:
            b, d = done[bare], done[ddp]
            direct = d["graphs_step_s"] / b["graphs_step_s"] - 1
            anchored = (d["graphs_step_s"] / d["eager_bare_step_s"]) / (b["graphs_step_s"] / b["eager_bare_step_s"]) - 1
            lines.append(f"\nDDP over the bare model, both with CUDA graphs{how}: {direct:+.1%} (through the eager "
                         f"anchor: {anchored:+.1%})")  # fmt: skip
    lines += ["", "| launch, profiled | kernels + copies a step | device ms | kernels' span ms | host span ms |",
              "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for label, r in done.items():
        p = r["profiled"]
        lines.append(f"| {label} | {p['kernels']:.1f} | {p['device_ms']:.3f} | {p['device_span_ms']:.3f} "
                     f"| {p['host_span_ms']:.3f} |")  # fmt: skip
    if WAYS[0][0] in done and WAYS[1][0] in done:
        lines += where_ddp_goes(done[WAYS[0][0]]["profiled"], done[WAYS[1][0]]["profiled"])
    return lines


def profile_calls(step: Callable[[], None], calls: int) -> torch.profiler.profile:
    """`calls` calls of `step` under torch.profiler (the host, and the GPU's kernels when there is one)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if GPU else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            step()
        metrics.synchronize(DEVICE)
    return prof


def profiled(step: Callable[[], None], steps: int) -> dict:
    """`steps` calls of `step` profiled, per step: kernels and copies, device ms (all and by name), the
    kernels' span and the host's (device_time's figures, from the Chrome trace)."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        profile_calls(step, steps).export_chrome_trace(str(trace))
        return device_time(trace, steps)


def where_ddp_goes(bare: dict, ddp: dict) -> list[str]:
    """The kernels whose device time DDP adds to the graphed step (or launches more often)."""
    names = set(bare["by_name_ms"]) | set(ddp["by_name_ms"])
    ms = {n: (ddp["by_name_ms"].get(n, 0.0), bare["by_name_ms"].get(n, 0.0)) for n in names}
    launches = {n: (ddp["launches_by_name"].get(n, 0.0), bare["launches_by_name"].get(n, 0.0)) for n in names}
    more = sorted((n for n in names if ms[n][0] > ms[n][1] or launches[n][0] > launches[n][1]),
                  key=lambda n: ms[n][1] - ms[n][0])[:12]  # fmt: skip
    lines = ["", "| kernels DDP adds to the step | DDP ms | bare ms | DDP launches | bare launches |",
             "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    lines += [f"| {n[:110]} | {ms[n][0]:.3f} | {ms[n][1]:.3f} | {launches[n][0]:.1f} | {launches[n][1]:.1f} |"
              for n in more]  # fmt: skip
    return lines


def fused(out: Path) -> None:
    rows = []
    for name, batch in FUSED:
        built = harness.job(name, batch, batch, World(0, 0, 1, DEVICE, "none"))
        groups = built.trained.optimizer.param_groups
        if not all(group["fused"] for group in groups):
            print(f"  {name} {batch}: this torch has no fused optimizer here; nothing to compare", flush=True)
            continue
        fixed = next(iter(built.train_loader))

        def stepping(flag: bool | None, built: harness.train.Job = built, fixed: tuple = fixed) -> Callable[[], None]:
            def step() -> None:
                for group in built.trained.optimizer.param_groups:
                    group["fused"] = flag  # None: torch's default (for-each on a GPU), the same state
                harness.train.train_step(built, *fixed)

            return step

        t = harness.alternating({"fused": stepping(True), "default": stepping(None)}, *TIMING)
        rows.append({"model": name, "batch": batch, "fused_step_s": t["fused"], "default_step_s": t["default"]})
        print(
            f"  {name} {batch}: fused {t['fused'] * 1e3:.2f} ms, torch's default {t['default'] * 1e3:.2f} ms",
            flush=True,
        )
        del built
    lines = ["| model | batch | fused ms | torch's default ms | saved |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [
        f"| {r['model']} | {r['batch']} | {r['fused_step_s'] * 1e3:.2f} | {r['default_step_s'] * 1e3:.2f} | "
        f"{1 - r['fused_step_s'] / r['default_step_s']:+.1%} |"
        for r in rows
    ]
    write(out, "fused", rows, lines)


def kind(kernel: str) -> str:
    low = kernel.lower().replace("_", "")
    if any(k in low for k in LAYOUT):
        return "layout"
    if any(k.replace("_", "") in low for k in MATMUL):
        return "conv/matmul"
    if "memcpy" in low or "memset" in low:
        return "copy"
    return "other (fused elementwise, BatchNorm, pooling, optimizer)"


def kernels(prof: torch.profiler.profile, gpu: bool = GPU) -> dict[str, float]:
    """Self device time (s) per kernel name; on a CPU, self CPU time per operator (the dry run). The
    step's record_function labels ("forward", "optimizer", ...) show on the GPU's timeline too, as
    spans over their kernels: a name seen on both sides is such a label and is left out (counted, it
    made the first call's kernel time 133% of the step's wall, 2026-11-26). Inductor's Triton kernels are
    also named on the host (it marks each launch with the kernel's name): they are kernels, not labels
    (left out, the split of the third lease that day lost them: kernels 54% of the wall)."""
    averages = prof.key_averages()
    on_host = {e.key for e in averages if not str(e.device_type).endswith("CUDA") and not e.key.startswith("triton_")}
    times: dict[str, float] = {}
    for e in averages:
        if gpu and (not str(e.device_type).endswith("CUDA") or e.key in on_host):
            continue  # a host operator, or a label
        us = e.self_device_time_total if gpu else e.self_cpu_time_total
        if us > 0:
            times[e.key] = times.get(e.key, 0.0) + us / 1e6
    return times


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_time(trace: Path, steps: int) -> dict:
    """Per step, from a Chrome trace: kernels and copies, their device ms in all and by kind, the span (ms)
    from the first to the last of them, the host operators' span, and device ms and launches by kernel name."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    on_device = [e for e in events if e.get("cat") in DEVICE_CATS]
    on_host = [e for e in events if e.get("cat") == "cpu_op"]

    def span(es: list[dict]) -> float:
        return (max(e["ts"] + e["dur"] for e in es) - min(e["ts"] for e in es)) / 1e3 / steps if es else 0.0

    by_name: Counter[str] = Counter()
    launches: Counter[str] = Counter()
    for e in on_device:
        by_name[e["name"]] += e["dur"] / 1e3 / steps
        launches[e["name"]] += 1 / steps
    kinds: Counter[str] = Counter()
    for name, ms in by_name.items():
        kinds[kind(name)] += ms
    return {
        "kernels": len(on_device) / steps, "device_ms": sum(by_name.values()), "device_span_ms": span(on_device),
        "host_span_ms": span(on_host), "kinds_ms": dict(kinds), "by_name_ms": dict(by_name),
        "launches_by_name": dict(launches),
    }  # fmt: skip


def split(out: Path) -> None:
    rows, lines = [], []
    for name, batch in SPLIT:
        built = compiled(World(0, 0, 1, DEVICE, "none"), name, batch, "default")
        fixed = next(iter(built.train_loader))
        step = harness.stepping(built, lambda fixed=fixed: fixed)
        harness.first_two_steps_s(step, DEVICE)
        wall = harness.seconds_per_call(step, *TIMING)
        n = TIMING[2]
        per_step = {k: v / n for k, v in kernels(profile_calls(step, n)).items()}
        busy = sum(per_step.values())
        kinds: dict[str, float] = {}
        for k, v in per_step.items():
            kinds[kind(k)] = kinds.get(kind(k), 0.0) + v
        flops = harness.mfu(built.trained.model, batch, batch / wall, DEVICE) if GPU else {}
        mm = kinds.get("conv/matmul", 0.0)
        row = {"model": name, "batch": batch, "wall_step_s": wall, "kernel_s": busy, "kinds_s": kinds, **flops,
               "top": sorted(per_step.items(), key=lambda kv: -kv[1])[:12]}  # fmt: skip
        if flops:
            row["mfu_of_matmul_time"] = flops["mfu"] * wall / mm if mm else None
        rows.append(row)
        head = f"{name}, batch {batch}: step {wall * 1e3:.2f} ms wall, kernels {busy * 1e3:.2f} ms ({busy / wall:.0%})"
        if flops and mm:
            head += (
                f", MFU {flops['mfu']:.1%}; over the conv/matmul kernels' time alone {row['mfu_of_matmul_time']:.1%}"
            )
        print("  " + head, flush=True)
        lines += [f"\n### {head}", "", "| kernels | ms a step | share of kernel time |", "| --- | ---: | ---: |"]
        lines += [f"| {k} | {v * 1e3:.3f} | {v / busy:.0%} |" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
        lines += ["", "| top kernels | ms a step |", "| --- | ---: |"]
        lines += [f"| {k[:110]} | {v * 1e3:.3f} |" for k, v in row["top"]]
        write(out, "split", rows, lines)  # after each model: a call cut off keeps what finished
        del built, step


def write(out: Path, part: str, rows: list, lines: list[str]) -> None:
    (out / f"{part}.json").write_text(json.dumps(rows, indent=1, default=str))
    (out / f"{part}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 64
    out = Path(argv[0])
    named = {"pair": pair, "fused": fused, "split": split}
    parts = argv[1:] or list(named)
    if unknown := [p for p in parts if p not in named]:
        print(f"graphs_split.py: no part {unknown[0]!r} (the parts: {', '.join(named)})", file=sys.stderr)
        return 64
    out.mkdir(parents=True, exist_ok=True)
    for part in parts:
        named[part](out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
