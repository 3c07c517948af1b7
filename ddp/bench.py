"""python -m ddp.bench [--quick] [--out bench/results] [--data PATH.npz]

Speed on whatever devices are here (the CPU, and the GPU when there is one), written as JSON and a
Markdown table under --out, named after the machine:
- training images/s per model x batch size x device, with our data path, with one pre-made batch
  repeated (the data path's ceiling), and with the plain tutorial pipeline (torchvision transforms on
  PIL images in DataLoader workers, the same model and optimiser): ratios, not only numbers;
- the data path alone: the device-resident loader against torchvision's DataLoader with 0, 2 and N
  workers;
- DDP overhead: DDP at world size 1 against the bare model, and 1 against N processes at the same
  global batch (gloo on CPU, nccl on GPUs);
- time from process start to the first training step, and peak memory;
- on a GPU, model-FLOPs utilisation against the bf16 matmul rate measured in the same run;
- with --data (the real subset) and without --quick: time-to-accuracy of configs/fast.yaml against
  the tutorial pipeline on the CPU.
Timing: warm-up steps first, the device synchronised around each timed window, median of repeats.
--quick is the same code with small sizes (under a minute on a CPU; the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp
from PIL import Image
from torch import nn
from torchvision import transforms

from ddp import data as datasets
from ddp import distributed, models
from ddp.distributed import World

REPO = Path(__file__).resolve().parent.parent
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], Any], device: torch.device, warmup: int, calls: int, repeats: int) -> float:
    """Median over `repeats` windows of `calls` calls, after `warmup` calls; device synchronised."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def peak_memory_mb(device: torch.device) -> float:
    """GPU: max_memory_allocated since the last reset; CPU: the process's peak RSS so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def synthetic_split(n: int, seed: int = 0) -> datasets.Split:
    g = torch.Generator().manual_seed(seed)
    return datasets.Split(
        torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8), torch.randint(0, 10, (n,), generator=g)
    )


class PILImages(torch.utils.data.Dataset):
    """What torchvision.datasets.CIFAR10 does per item: a PIL image from HWC uint8, then transforms."""

    def __init__(self, split: datasets.Split, transform: Callable) -> None:
        self.images = split.images.permute(0, 2, 3, 1).numpy()
        self.labels = split.labels.tolist()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(Image.fromarray(self.images[i])), self.labels[i]


def tutorial_loader(
    split: datasets.Split, batch: int, workers: int, augment: bool = True
) -> torch.utils.data.DataLoader:
    """The usual pipeline: torchvision transforms on PIL images in DataLoader workers."""
    steps = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if augment else []
    transform = transforms.Compose([*steps, transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    return torch.utils.data.DataLoader(
        PILImages(split, transform),
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
    )


def cycle(loader: Any) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """next() over a loader, epoch after epoch."""
    state = {"it": iter(loader), "epoch": 0}

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return next(state["it"])
        except StopIteration:
            state["epoch"] += 1
            if hasattr(loader, "sampler") and hasattr(loader.sampler, "set_position"):
                loader.sampler.set_position(state["epoch"], 0)
            state["it"] = iter(loader)
            return next(state["it"])

    return next_batch


def device_loader(split: datasets.Split, batch: int, device: torch.device) -> datasets.DeviceLoader:
    loader = datasets.DeviceLoader(split, batch, World(0, 0, 1, device, "none"), augment_seed=0, seed=0)
    loader.sampler.set_position(1, 0)
    return loader


def normaliser(device: torch.device, channels_last: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    stats = datasets.Data(None, None, [], CIFAR_MEAN, CIFAR_STD)  # type: ignore[arg-type]
    return datasets.input_fn(stats, device, channels_last)


def training_step(
    model: nn.Module,
    device: torch.device,
    batches: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    to_input: Callable[[torch.Tensor], torch.Tensor] | None,
) -> Callable[[], None]:
    """One SGD step as ddp/train.py takes it (bf16 autocast and channels_last on GPU)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    layout = torch.channels_last  # as build() lays out the model

    def step() -> None:
        images, labels = batches()
        x = to_input(images) if to_input else images.to(device, non_blocking=True).contiguous(memory_format=layout)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = criterion(model(x), labels.to(device, non_blocking=True))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def build(name: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return models.build(name, 10).to(device, memory_format=torch.channels_last)


def train_throughput(sizes: dict, devices: list[torch.device]) -> list[dict]:
    """img/s with our data path, with one pre-made batch repeated, and with the tutorial pipeline."""
    rows = []
    split = synthetic_split(sizes["images"])
    for device in devices:
        for name, batch in sizes["train"]:
            if device.type == "cpu" and [name, batch] in [list(p) for p in sizes["gpu_only"]]:
                continue
            row: dict[str, Any] = {"device": device_name(device), "model": name, "batch": batch}
            timing = (device, sizes["warmup"], sizes["steps"], sizes["repeats"])
            model = build(name, device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            ours = training_step(model, device, cycle(device_loader(split, batch, device)), normaliser(device, True))
            row["ours_img_s"] = batch / seconds_per_call(ours, *timing)
            row["peak_mb"] = peak_memory_mb(device)
            fixed = next(iter(device_loader(split, batch, device)))
            repeated = training_step(model, device, lambda fixed=fixed: fixed, normaliser(device, True))
            row["one_batch_img_s"] = batch / seconds_per_call(repeated, *timing)
            loader = tutorial_loader(split, batch, sizes["baseline_workers"])
            baseline = training_step(model, device, cycle(loader), None)
            row["tutorial_pipeline_img_s"] = batch / seconds_per_call(baseline, *timing)
            del loader
            if device.type == "cuda":
                row.update(mfu(model, name, batch, row["ours_img_s"], device))
            rows.append(row)
            print(f"  train {row['device']} {name} batch {batch}: {row['ours_img_s']:.0f} img/s", flush=True)
    return rows


_PEAK_BF16: dict[str, float] = {}


def mfu(model: nn.Module, name: str, batch: int, img_s: float, device: torch.device) -> dict[str, float]:
    """Model-FLOPs utilisation: counted training FLOPs per image x img/s over the measured bf16 peak."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(batch, 3, 32, 32, device=device).contiguous(memory_format=torch.channels_last)
    counter = FlopCounterMode(display=False)
    with counter, torch.autocast("cuda", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    flops_per_image = counter.get_total_flops() / batch
    if str(device) not in _PEAK_BF16:
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        s = seconds_per_call(lambda: a @ a, device, warmup=3, calls=10, repeats=5)
        _PEAK_BF16[str(device)] = 2 * 8192**3 / s
    peak = _PEAK_BF16[str(device)]
    return {
        "gflops_per_image": flops_per_image / 1e9,
        "peak_bf16_tflops": peak / 1e12,
        "mfu": flops_per_image * img_s / peak,
    }


def data_path(sizes: dict, devices: list[torch.device]) -> list[dict]:
    """Images/s of the loaders alone, each delivering normalised float batches on the device."""
    rows = []
    split = synthetic_split(sizes["images"])
    batch, images = sizes["data_batch"], sizes["data_images"]
    calls = images // batch
    for device in devices:
        to_input = normaliser(device, True)
        ours = cycle(device_loader(split, batch, device))
        s = seconds_per_call(lambda: to_input(ours()[0]), device, 2, calls, sizes["repeats"])  # noqa: B023
        rows.append({"device": device_name(device), "loader": "device-resident (ours)", "img_s": batch / s})
        for workers in sorted({0, 2, os.cpu_count() or 1}):
            loader = tutorial_loader(split, batch, workers)
            theirs = cycle(loader)
            fetch = lambda: theirs()[0].to(device, non_blocking=True)  # noqa: B023, E731 (called right here)
            s = seconds_per_call(fetch, device, 2, calls, sizes["repeats"])
            rows.append(
                {
                    "device": device_name(device),
                    "loader": f"torchvision DataLoader, {workers} workers",
                    "img_s": batch / s,
                }
            )
            del loader
        print(f"  data path {device_name(device)}: " + ", ".join(f"{r['img_s']:.0f}" for r in rows[-4:]), flush=True)
    return rows


def _ddp_worker(
    rank: int, world_size: int, port: int, name: str, global_batch: int, sizes: dict, threads: int, out: Any
) -> None:
    """Seconds per DDP step on rank 0; at world size 1 also the bare model's, in the same process with
    the same threads, measured alternately (bare, DDP, bare, DDP) so that drift hits both alike."""
    torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    world = World(rank, rank, world_size, device, "ddp", "bench", f"tcp://127.0.0.1:{port}")
    timing = (device, sizes["warmup"], sizes["steps"], sizes["repeats"])
    with distributed.setup(world, 120):
        fixed = next(iter(device_loader(synthetic_split(global_batch), global_batch // world_size, device)))
        ddp = training_step(
            distributed.wrap(build(name, device), world), device, lambda: fixed, normaliser(device, True)
        )
        bare = training_step(build(name, device), device, lambda: fixed, normaliser(device, True))
        rounds = 2 if world_size == 1 else 1
        times = {"ddp": [], "bare": []}
        for _ in range(rounds):
            if world_size == 1:
                times["bare"].append(seconds_per_call(bare, *timing))
            times["ddp"].append(seconds_per_call(ddp, *timing))
        if rank == 0:
            out.put({k: statistics.mean(v) if v else None for k, v in times.items()})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_step_seconds(world_size: int, name: str, global_batch: int, sizes: dict) -> dict[str, float | None]:
    """Seconds per step of `world_size` DDP processes on this machine (each with its share of the
    cores): {"ddp": s, "bare": s at world size 1, else None}."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // world_size) if not torch.cuda.is_available() else 1
    port = free_port()
    procs = [
        ctx.Process(target=_ddp_worker, args=(r, world_size, port, name, global_batch, sizes, threads, out))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a DDP benchmark process failed: exit codes {[p.exitcode for p in procs]}")
    return out.get(timeout=10)


def ddp_overhead(sizes: dict) -> list[dict]:
    rows = []
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    n = torch.cuda.device_count() if device.type == "cuda" else 2
    for name, batch in sizes["ddp"]:
        one = ddp_step_seconds(1, name, batch, sizes)
        bare_s, one_s = one["bare"], one["ddp"]
        row = {
            "device": device_name(device),
            "model": name,
            "global_batch": batch,
            "bare_step_s": bare_s,
            "ddp1_step_s": one_s,
            "ddp1_overhead": one_s / bare_s - 1,
        }
        if n > 1:
            row.update({"processes": n, "ddpN_step_s": ddp_step_seconds(n, name, batch, sizes)["ddp"]})
            row["speedup_N_vs_1"] = one_s / row["ddpN_step_s"]
        rows.append(row)
        print(
            f"  ddp {name} batch {batch}: world size 1 costs {row['ddp1_overhead']:+.1%} over the bare model",
            flush=True,
        )
    return rows


def startup(out_dir: Path) -> dict:
    """Process start to the end of the first training step of ddp/train.py (its startup_s metric)."""
    args = [
        "--config",
        str(REPO / "configs" / "smoke.yaml"),
        "train.epochs=1",
        f"run.out_dir={out_dir}",
        "run.progress=false",
    ]
    subprocess.run(
        [sys.executable, str(REPO / "ddp" / "train.py"), *args], check=True, capture_output=True, timeout=300
    )
    first = json.loads((out_dir / "metrics.jsonl").read_text().splitlines()[0])
    return {
        "command": "python ddp/train.py --config configs/smoke.yaml (CPU, one process)",
        "startup_s": first["startup_s"],
    }


def time_to_accuracy(npz: Path, out_dir: Path, tutorial_epochs: int) -> dict:
    """On the CPU: configs/fast.yaml through ddp/train.py against the PyTorch tutorial's pipeline
    (ToTensor + Normalize(0.5) on PIL images, batch 4, 2 workers, the tutorial net, SGD 0.001/0.9)."""
    data_args = ["data.dataset=npz", f"data.path={npz}", "run.device=cpu", "run.progress=false"]
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            str(REPO / "ddp" / "train.py"),
            "--config",
            str(REPO / "configs" / "fast.yaml"),
            "run.amp=off",
            *data_args,
            f"run.out_dir={out_dir / 'fast'}",
        ],
        check=True,
        capture_output=True,
        timeout=3600,
    )
    total = time.perf_counter() - start
    ours, elapsed = [], 0.0
    for line in (out_dir / "fast" / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        elapsed += m["seconds"]
        ours.append({"epoch": m["epoch"], "seconds": elapsed, "test_acc": m["test_acc"]})

    with np.load(npz) as z:
        train = datasets._split(z["x_train"], z["y_train"])
        test = datasets._split(z["x_test"], z["y_test"])
    torch.manual_seed(0)
    net = models.build("tutorial", 10)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    loader = torch.utils.data.DataLoader(PILImages(train, transform), batch_size=4, shuffle=True, num_workers=2)
    test_loader = torch.utils.data.DataLoader(PILImages(test, transform), batch_size=256, num_workers=2)
    theirs, elapsed = [], 0.0
    for epoch in range(1, tutorial_epochs + 1):
        start = time.perf_counter()
        net.train()
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
        net.eval()
        with torch.no_grad():
            correct = sum(int((net(x).argmax(1) == y).sum()) for x, y in test_loader)
        elapsed += time.perf_counter() - start
        theirs.append({"epoch": epoch, "seconds": elapsed, "test_acc": correct / len(test.labels)})
        print(f"  tutorial pipeline epoch {epoch}: {theirs[-1]['test_acc']:.1%} at {elapsed:.0f} s", flush=True)
    target = max(t["test_acc"] for t in theirs)
    reached = next((o["seconds"] for o in ours if o["test_acc"] >= target), None)
    return {
        "data": str(npz),
        "fast_recipe": ours,
        "fast_recipe_wall_s": total,
        "tutorial_pipeline": theirs,
        "tutorial_best_acc": target,
        "fast_seconds_to_tutorial_best": reached,
        "tutorial_seconds_to_its_best": next(t["seconds"] for t in theirs if t["test_acc"] >= target),
    }


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


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


SIZES = {
    "full": {
        "images": 8192, "warmup": 2, "steps": 5, "repeats": 5, "baseline_workers": 2, "data_batch": 512,
        "data_images": 8192, "ddp": [("small", 256), ("fast", 256)],
        "train": [("tutorial", 128), ("small", 128), ("small", 512), ("fast", 256), ("fast", 1024), ("resnet18", 256)],
        "gpu_only": [("fast", 1024), ("resnet18", 256)],  # minutes per row on a 2-core CPU
    },
    "quick": {
        "images": 1024, "warmup": 1, "steps": 3, "repeats": 3, "baseline_workers": 0, "data_batch": 256,
        "data_images": 1024, "train": [("small", 128)], "ddp": [("small", 64)], "gpu_only": [],
    },
}  # fmt: skip


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# ddp.bench on {', '.join(m['gpus']) or 'CPU only'} ({'quick' if result['quick'] else 'full'})",
        "",
        f"{m['date']}; CPU: {m['cpu']} ({m['cores']} cores); torch {m['torch']}; python {m['python']}.",
        f"Command: `{result['command']}`",
        "",
        "## Training images/s",
        "",
        "| device | model | batch | ours (device data path) | one batch repeated | ours / one batch "
        "| tutorial pipeline | ours / tutorial | peak memory MB | MFU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["train"]:
        mfu_text = f"{r['mfu']:.1%}" if "mfu" in r else "n/a (CPU)"
        lines.append(
            f"| {r['device']} | {r['model']} | {r['batch']} | {r['ours_img_s']:.0f} | {r['one_batch_img_s']:.0f} | "
            f"{r['ours_img_s'] / r['one_batch_img_s']:.0%} | {r['tutorial_pipeline_img_s']:.0f} | "
            f"{r['ours_img_s'] / r['tutorial_pipeline_img_s']:.2f}x | {r['peak_mb']:.0f} | {mfu_text} |"
        )
    lines += [
        "",
        "Tutorial pipeline: torchvision RandomCrop + flip + ToTensor + Normalize on PIL images in "
        f"{result['sizes']['baseline_workers']} DataLoader workers, the same model and optimiser. CPU peak memory "
        "is the process's peak RSS so far (cumulative); GPU is max_memory_allocated per row.",
        "",
        "## Data path alone (normalised batches on the device)",
        "",
        "| device | loader | img/s | vs ours |",
        "| --- | --- | --- | --- |",
    ]
    for r in result["data_path"]:
        ours = next(o["img_s"] for o in result["data_path"] if o["device"] == r["device"] and "ours" in o["loader"])
        lines.append(f"| {r['device']} | {r['loader']} | {r['img_s']:.0f} | {ours / r['img_s']:.1f}x |")
    lines += [
        "",
        "## DDP overhead (one pre-made batch, same global batch)",
        "",
        "| device | model | global batch | bare step ms | DDP world size 1 ms | overhead | N processes | step ms "
        "| speed-up N vs 1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["ddp"]:
        n = (
            f"{r['processes']} | {r['ddpN_step_s'] * 1e3:.1f} | {r['speedup_N_vs_1']:.2f}x"
            if "processes" in r
            else "n/a | | "
        )
        lines.append(
            f"| {r['device']} | {r['model']} | {r['global_batch']} | {r['bare_step_s'] * 1e3:.1f} | "
            f"{r['ddp1_step_s'] * 1e3:.1f} | {r['ddp1_overhead']:+.1%} | {n} |"
        )
    s = result["startup"]
    lines += [
        "",
        f"## Startup\n\nProcess start to the end of the first training step: {s['startup_s']:.2f} s ({s['command']}).",
    ]
    if "time_to_accuracy" in result:
        t = result["time_to_accuracy"]
        lines += [
            "",
            f"## Time to accuracy on the CPU ({t['data']})",
            "",
            "| pipeline | epoch | seconds | test accuracy |",
            "| --- | --- | --- | --- |",
        ]
        lines += [
            f"| configs/fast.yaml (ours) | {o['epoch']} | {o['seconds']:.0f} | {o['test_acc']:.1%} |"
            for o in t["fast_recipe"]
        ]
        lines += [
            f"| tutorial pipeline | {o['epoch']} | {o['seconds']:.0f} | {o['test_acc']:.1%} |"
            for o in t["tutorial_pipeline"]
        ]
        reached = t["fast_seconds_to_tutorial_best"]
        lines += [
            "",
            f"The tutorial pipeline's best, {t['tutorial_best_acc']:.1%}, took it "
            f"{t['tutorial_seconds_to_its_best']:.0f} s; "
            + (
                f"the fast recipe reached it in {reached:.0f} s."
                if reached is not None
                else "the fast recipe did not reach it."
            ),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: under a minute on a CPU")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"), help="directory for the JSON and Markdown")
    parser.add_argument("--data", help="the real CIFAR-10 subset (.npz) for the time-to-accuracy check")
    parser.add_argument("--tutorial-epochs", type=int, default=10)
    args = parser.parse_args(argv)
    sizes = SIZES["quick" if args.quick else "full"]
    devices = [torch.device("cpu")] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])
    result: dict[str, Any] = {
        "machine": machine(),
        "quick": args.quick,
        "sizes": sizes,
        "command": "python -m ddp.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print("training throughput", flush=True)
    result["train"] = train_throughput(sizes, devices)
    print("data path", flush=True)
    result["data_path"] = data_path(sizes, devices)
    print("DDP overhead", flush=True)
    result["ddp"] = ddp_overhead(sizes)
    with tempfile.TemporaryDirectory() as tmp:
        result["startup"] = startup(Path(tmp) / "startup")
        if args.data and not args.quick:
            print("time to accuracy", flush=True)
            result["time_to_accuracy"] = time_to_accuracy(Path(args.data).resolve(), Path(tmp), args.tutorial_epochs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = ("quick-" if args.quick else "") + "-".join((result["machine"]["gpus"][:1] or ["cpu"])[0].lower().split())
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown(result))
    print(f"wrote {out / stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
