"""FSDP2 against DDP: what each rank holds (parameters, gradients, optimizer state: bytes of this
rank's tensors, a DTensor counted by its local shard), its peak memory (resident; on a GPU also the
peak allocated), and the time of an optimizer step and images/s, for one model and global batch at
several world sizes. Each step is train.train_step on train.build's job (bf16 on a GPU).

    python bench/fsdp_memory.py [--model resnet18] [--batch 64] [--ranks 2 4] [--steps 5]
        [--backend auto|gloo] [--amp auto|off] [--out bench/results/fsdp-cpu.md]   (torchrun per mode and size)

--amp off on a GPU: float32 (auto: bf16 on a GPU, where FSDP2 then shards each BatchNorm on its own, to
keep it in float32: 27 FSDP2 units in resnet18 instead of 8).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from bench import harness
from bench.accumulation import cpu_name
from ddp import config, devices, distributed

MODES = ("ddp", "fsdp")


def held_bytes(tensors) -> int:  # noqa: ANN001 (any iterable of tensors)
    return sum(distributed.local(t).numel() * t.element_size() for t in tensors if t is not None)


def measure(args: argparse.Namespace) -> None:
    """One rank of one run: its numbers, gathered on rank 0 and written to --json."""
    world = devices.resolve(config.load(None, [f"run.parallel={args.parallel}", f"run.backend={args.backend}"]).run)
    with distributed.setup(world, timeout_s=300) as world:
        amp = ["run.amp=off"] if args.amp == "off" else []
        job = harness.job(args.model, args.batch, args.batch * 4, world, "run.channels_last=false", *amp)
        step = harness.stepping(job, harness.cycle(job.train_loader))
        seconds = harness.seconds_per_call(step, world.device, warmup=2, calls=args.steps, repeats=3)
        params = list(job.trained.model.parameters())
        optimizer_state = [t for s in job.trained.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        mine = {
            "params_mb": held_bytes(params) / 2**20,
            "grads_mb": held_bytes(p.grad for p in params) / 2**20,
            "optimizer_mb": held_bytes(optimizer_state) / 2**20,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "gpu_peak_mb": torch.cuda.max_memory_allocated(world.device) / 2**20 if world.device.type == "cuda" else 0,
        }
        ranks = distributed.gather_objects(mine, world)
    if world.is_main:
        mean = {key: sum(r[key] for r in ranks) / len(ranks) for key in mine}
        row = {"parallel": args.parallel, "ranks": world.world_size, "backend": world.process_group_backend,
               "device": str(world.device.type), "step_ms": seconds * 1e3, "images_per_s": args.batch / seconds,
               **mean}  # fmt: skip
        Path(args.json).write_text(json.dumps(row) + "\n")


def run_all(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            for parallel in MODES:
                out = Path(tmp) / f"{parallel}-{ranks}.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                       __file__, "--rank-run", "--parallel", parallel, "--json", str(out), "--model", args.model,
                       "--batch", str(args.batch), "--steps", str(args.steps), "--backend", args.backend,
                       "--amp", args.amp]  # fmt: skip
                subprocess.run(cmd, check=True, capture_output=True)
                rows.append(json.loads(out.read_text()))
    report(args, rows)


def machine() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else cpu_name()


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    lines = [
        f"# FSDP2 against DDP: {args.model}, global batch {args.batch}",
        "",
        f"Measured with `python bench/fsdp_memory.py --model {args.model} --batch {args.batch} --ranks "
        f"{' '.join(map(str, args.ranks))} --steps {args.steps} --backend {args.backend} --amp {args.amp}` "
        f"on {machine()}, "
        f"torch {torch.__version__}. "
        "Per rank, the mean over the ranks: the bytes of the tensors it holds after an optimizer step (a "
        "sharded one by its own slice; DDP's gradient buckets, a second copy of the gradients, not counted), "
        "and its peak resident memory (the process: torch, the data, activations). ms per optimizer step: "
        f"median of 3 windows of {args.steps} steps (train.train_step), after 2 warm-up steps.",
        "",
        "| mode | ranks | backend, device | parameters MB | gradients MB | optimizer state MB | peak RSS MB "
        "| GPU peak MB | ms per step | images/s |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['parallel']} | {r['ranks']} | {r['backend']}, {r['device']} | {r['params_mb']:.1f} "
            f"| {r['grads_mb']:.1f} | {r['optimizer_mb']:.1f} | {r['peak_rss_mb']:.0f} | {r['gpu_peak_mb']:.0f} "
            f"| {r['step_ms']:.1f} | {r['images_per_s']:.0f} |"
        )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="bench/results/fsdp-cpu.md")
    parser.add_argument("--backend", choices=("auto", "gloo"), default="auto", help="gloo: ranks share one GPU")
    parser.add_argument("--amp", choices=("auto", "off"), default="auto", help="auto: bf16 on a GPU; off: float32")
    parser.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)  # one torchrun worker
    parser.add_argument("--parallel", choices=MODES, default="fsdp")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    measure(args) if args.rank_run else run_all(args)


if __name__ == "__main__":
    main()
