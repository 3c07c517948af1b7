"""Step by step, from a run.profile trace (ddp/profiling.py's rank<r>.json): how long each profiled step took
on the host, in its labelled parts (train_step's record_function labels), the time between steps (an epoch's
end: its evaluation, checkpoint, metrics), and on a GPU the kernels each step launched and their device time;
with the longest operator of each step. What it is for: on an H100 our first epoch after the warm-up took about
twice a later one (bench/results/nvidia-h100-80gb-hbm3-check-2026-11-27.md), airbench94's did not, and the
epochs' seconds cannot say which step, or which part of it, pays.

  python bench/step_times.py TRACE.json FIRST_STEP [--out FILE.md]

FIRST_STEP: the global step the trace begins at (run.profile=A:B's A).
"""

from __future__ import annotations

import argparse
import bisect
import json
from pathlib import Path

PARTS = ("data", "forward", "backward", "clip", "optimizer", "lookahead", "ema", "stop agreement")
DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def steps(events: list[dict]) -> list[dict]:
    """Each step's host span (its "data" label to the next one's), its parts and, where the trace has a
    device, its launches and their device time (each kernel counted in the step whose host launched it)."""
    labels = sorted((e for e in events if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    starts = [e["ts"] for e in labels if e["name"] == "data"]
    if not starts:
        raise SystemExit("step_times.py: no 'data' label in the trace: not a ddp/train.py run.profile trace")
    ends = starts[1:] + [max(e["ts"] + e["dur"] for e in labels)]
    rows = [{"start": s, "end": e, "parts": dict.fromkeys(PARTS, 0.0), "kernels": 0, "device_us": 0.0, "top": ("", 0.0)}
            for s, e in zip(starts, ends)]  # fmt: skip
    for e in labels:
        if e["name"] in PARTS:
            rows[max(bisect.bisect_right(starts, e["ts"]) - 1, 0)]["parts"][e["name"]] += e["dur"]
    for e in events:  # the longest operator (not a label) each step
        if e.get("cat") == "cpu_op" and e["ts"] >= starts[0]:
            row = rows[bisect.bisect_right(starts, e["ts"]) - 1]
            if e["dur"] > row["top"][1]:
                row["top"] = (e["name"], e["dur"])
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}  # fmt: skip
    for e in events:
        host = launched.get(e.get("args", {}).get("correlation")) if e.get("cat") in DEVICE else None
        if host is not None and host >= starts[0]:
            row = rows[bisect.bisect_right(starts, host) - 1]
            row["kernels"] += 1
            row["device_us"] += e["dur"]
    return rows


def table(rows: list[dict], first_step: int) -> list[str]:
    """One line a step, in milliseconds; 'between' is the step's span less its labelled parts."""
    head = ["step", "host ms", *PARTS, "between", "kernels", "device ms", "longest operator (ms)"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 2) + ["---"]) + " |"]
    for n, r in enumerate(rows, first_step):
        span, parts = r["end"] - r["start"], r["parts"]
        cells = [str(n), f"{span / 1e3:.3f}", *(f"{parts[p] / 1e3:.3f}" for p in PARTS),
                 f"{(span - sum(parts.values())) / 1e3:.3f}", str(r["kernels"]), f"{r['device_us'] / 1e3:.3f}",
                 f"{r['top'][0][:60].replace('|', '/')} ({r['top'][1] / 1e3:.3f})"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("first_step", type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        data = json.loads(args.trace.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"step_times.py: cannot read {args.trace} as a trace: {e}") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    text = "\n".join([f"Steps of {args.trace} (milliseconds):", "", *table(steps(events), args.first_step)]) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
