"""python -m bench [--quick] [--out bench/results] [--data PATH.npz]   (make bench [DATA=...])

Speed on whatever devices are here (the CPU, and the GPU when there is one), written as JSON and a
Markdown table under --out, named after the machine:
- training images/s per model x batch size x device, through ddp/train.py's own job and step: with
  our data path, with one pre-made batch repeated (the data path's ceiling), and with the plain
  tutorial pipeline (torchvision transforms on PIL images in DataLoader workers, the same model and
  optimiser): ratios, not only numbers;
- the data path alone: the device-resident loader against torchvision's DataLoader with 0, 2 and N
  workers;
- DDP overhead: DDP at world size 1 against the bare model, and 1 against N processes at the same
  global batch (gloo on CPU, nccl on GPUs);
- time from process start to the first training step, and peak memory;
- on a GPU, model-FLOPs utilisation against the bf16 matmul rate measured in the same run, also
  with torch.compile at larger batches (the compile's seconds beside), and DDP over the compiled
  model; the per-step stop agreement's all-reduce alone;
- with --data (the real subset) and without --quick: time-to-accuracy of configs/fast.yaml against
  the tutorial pipeline on the CPU;
- without --quick, on the CPU: the host's cost of a step, counted in profiler traces (bench/host_cost.py:
  operators, device reads and collectives a step, a plain loop against ours); --host-cost runs only
  that (about a minute) and writes host-cost-cpu.md.
--quick is the same code with small sizes (under a minute on a CPU; the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import harness, host_cost
from bench.report import markdown

SIZES = {
    "full": {
        "images": 8192, "warmup": 5, "steps": 5, "repeats": 7, "baseline_workers": 2, "data_batch": 512,
        "data_images": 8192, "ddp": [("small", 256), ("fast", 256), ("fast", 1024), ("resnet18", 512)],
        "train": [("tutorial", 128), ("small", 128), ("small", 512), ("fast", 256), ("fast", 1024), ("resnet18", 256)],
        "gpu_only": [("fast", 1024), ("resnet18", 256)],  # minutes per row on a 2-core CPU
        "compiled": [("fast", 2048), ("fast", 4096), ("fast", 8192), ("resnet18", 1024), ("resnet18", 2048),
                     ("resnet18", 4096)],  # GPU only
        "ddp_compiled": [("fast", 1024)],  # GPU only, world size 1
    },
    "quick": {
        "images": 1024, "warmup": 1, "steps": 3, "repeats": 3, "baseline_workers": 0, "data_batch": 256,
        "data_images": 1024, "train": [("small", 128)], "ddp": [("small", 64)], "gpu_only": [],
        "compiled": [], "ddp_compiled": [],
    },
}  # fmt: skip


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: under a minute on a CPU")
    parser.add_argument("--out", default=str(harness.REPO / "bench" / "results"), help="where the JSON and .md go")
    parser.add_argument("--data", help="the real CIFAR-10 subset (.npz) for the time-to-accuracy check")
    parser.add_argument("--tutorial-epochs", type=int, default=10, help="epochs of the tutorial net's run (--data)")
    parser.add_argument("--gpu-only", action="store_true", help="no CPU rows (make gpu-check)")
    parser.add_argument("--host-cost", action="store_true", help="only the host's cost of a step (CPU, ~1 min)")
    args = parser.parse_args(argv)
    check(parser, args)
    if args.host_cost and (args.quick or args.gpu_only):
        parser.error("--host-cost runs alone, on the CPU: without --quick and --gpu-only")
    if args.host_cost:
        return write_host_cost(Path(args.out), argv)
    sizes = SIZES["quick" if args.quick else "full"]
    cuda = [torch.device("cuda", 0)] if torch.cuda.is_available() else []
    if args.gpu_only and not cuda:
        parser.error("--gpu-only: no CUDA device here")
    devices = ([] if args.gpu_only else [torch.device("cpu")]) + cuda
    result: dict[str, Any] = {
        "machine": machine(),
        "quick": args.quick,
        "sizes": sizes,
        "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = ("quick-" if args.quick else "") + "-".join((result["machine"]["gpus"][:1] or ["cpu"])[0].lower().split())

    def keep(section: str | None) -> None:  # the JSON so far, after each section: a run cut off keeps what it measured
        if section:
            result.setdefault("done", []).append(section)
        else:  # the end: complete, no list of what is done
            result.pop("done")
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))

    print("training throughput", flush=True)
    result["train"] = harness.train_throughput(sizes, devices)
    keep("train")
    print("DDP overhead", flush=True)
    result["ddp"] = harness.ddp_overhead(sizes)
    keep("ddp")
    if cuda and sizes["compiled"]:
        print("compiled", flush=True)
        result["compiled"] = harness.compiled_sweep(sizes, cuda[0])
        keep("compiled")
    print("data path", flush=True)
    result["data_path"] = harness.data_path(sizes, devices)
    keep("data_path")
    if not args.quick and not args.gpu_only:
        print("host cost of a step", flush=True)
        result["host_cost"] = host_cost.measure()
    with tempfile.TemporaryDirectory() as tmp:
        result["startup"] = harness.startup(Path(tmp) / "startup")
        if args.data and not args.quick:
            print("time to accuracy", flush=True)
            npz = Path(args.data).resolve()
            result["time_to_accuracy"] = harness.time_to_accuracy(npz, Path(tmp), args.tutorial_epochs)
    keep(None)
    (out / f"{stem}.md").write_text(markdown(result))
    print(f"wrote {out / stem}.md and .json")
    return 0


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The values minutes of measuring would fail on (or ignore), refused before any: one line, exit 2."""
    if not args.out or (Path(args.out).exists() and not Path(args.out).is_dir()):
        parser.error(f"--out={args.out!r}: name a directory for the results (made if missing)")
    if args.data is not None and (args.quick or args.host_cost):
        parser.error("--data is the full bench's time-to-accuracy check: without --quick and --host-cost")
    if args.data is not None and not Path(args.data).is_file():
        parser.error(f"--data={args.data}: no such file (the CIFAR-10 subset, .npz)")
    if args.tutorial_epochs < 1:
        parser.error(f"--tutorial-epochs={args.tutorial_epochs}: 1 or more")


def write_host_cost(out: Path, argv: list[str] | None) -> int:
    """--host-cost: bench/host_cost.py's table alone, in out/host-cost-cpu.md and .json."""
    rows = host_cost.measure()
    command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
    m = machine()
    page = f"# The host's cost of a training step\n\n{m['date']}; CPU: {m['cpu']}; torch {m['torch']}.\n"
    page += f"Command: `{command}`\n\n{host_cost.table(rows)}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "host-cost-cpu.json").write_text(json.dumps({"machine": m, "command": command, "rows": rows}, indent=1))
    (out / "host-cost-cpu.md").write_text(page)
    print(page, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
