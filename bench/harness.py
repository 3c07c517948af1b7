"""The measurements of `python -m bench`, each timed through ddp's own code: the training job that
ddp/train.py builds (train.build) and its step (train.train_step), the device-resident loader, the
DDP wrap, and ddp/train.py itself as a process. The peer is the tutorial pipeline (torchvision
transforms on PIL images in DataLoader workers) driving the same step.

Timing: warm-up calls first, the device synchronised around each timed window, median of repeats.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from ddp import checks, config, datasets, distributed, loaders, metrics, models, train
from ddp.config import DataConfig
from ddp.devices import World

REPO = Path(__file__).resolve().parent.parent
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
Batch = tuple[torch.Tensor, torch.Tensor]


def seconds_per_call(fn: Callable[[], Any], device: torch.device, warmup: int, calls: int, repeats: int) -> float:
    """Median over `repeats` windows of `calls` calls, after `warmup` calls; device synchronised."""
    for _ in range(warmup):
        fn()
    metrics.synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append(metrics.elapsed(start, device) / calls)
    return statistics.median(times)


def alternating(
    fns: dict[str, Callable[[], Any]], device: torch.device, warmup: int, calls: int, repeats: int
) -> dict[str, float]:
    """seconds_per_call of each of `fns`, their windows taken in turn (a, b, a, b, ...) so that
    clock ramps and drift hit them alike: the median per name."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(seconds_per_call(fn, device, 0, calls, 1))
    return {name: statistics.median(t) for name, t in times.items()}


def peak_memory_mb(device: torch.device) -> float:
    """GPU: the peak allocation since the last reset; CPU: the process's peak RSS so far."""
    if device.type == "cuda":
        return metrics.gpu_memory_mb(device)["peak"]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def job(name: str, global_batch: int, images: int, world: World, *extra: str) -> train.Job:
    """ddp/train.py's job for model `name` on `images` synthetic images, built by train.build: SGD,
    label smoothing 0.1, channels_last, and bf16 autocast on a GPU; `extra` settings last."""
    amp = "bf16" if world.device.type == "cuda" else "off"
    settings = [
        f"model.name={name}",
        f"train.batch_size={global_batch}",
        "data.dataset=synthetic",
        f"data.synthetic_train={images}",
        "data.synthetic_test=8",
        "optim.lr=0.01",
        "train.label_smoothing=0.1",
        "run.channels_last=true",
        f"run.amp={amp}",
        "run.resume=never",  # build() then reads and writes nothing in run.out_dir
        *extra,
    ]
    cfg = config.load(None, settings)
    data = datasets.read(cfg.data, world)
    per_rank = checks.split_batch(global_batch, world.world_size, "batch", cfg.train.grad_accum_steps)
    steps = checks.steps_per_epoch(cfg, images)
    precision = checks.precision(amp, world.device, global_batch)  # autocast, weights, loss scale
    recorded = checks.cuda_graph(cfg, world, print)  # run.cuda_graph=true: as asked (step_capture's dry run: a CPU)
    built, _ = train.build(cfg, world, data, checks.Plan(per_rank, steps, *precision, recorded=recorded))
    built.train_loader.sampler.set_epoch(1, start_step=0)
    return built


def cycle(loader: Any) -> Callable[[], Batch]:
    """next() over a loader, epoch after epoch."""
    state = {"it": iter(loader), "epoch": 1}

    def next_batch() -> Batch:
        try:
            return next(state["it"])
        except StopIteration:
            state["epoch"] += 1
            if hasattr(loader.sampler, "set_epoch"):
                loader.sampler.set_epoch(state["epoch"])
            state["it"] = iter(loader)
            return next(state["it"])

    return next_batch


def stepping(trained: train.Job, batches: Callable[[], Batch]) -> Callable[[], None]:
    """One call: the next batch through train.train_step."""
    return lambda: train.train_step(trained, *batches())


class PILImages(torch.utils.data.Dataset):
    """What torchvision.datasets.CIFAR10 does per item: a PIL image from HWC uint8, then transforms."""

    def __init__(self, split: datasets.Split, transform: Callable) -> None:
        self.images = split.images.permute(0, 2, 3, 1).numpy()
        self.labels = split.labels.tolist()
        self.transform = transform
        from PIL import Image  # with torchvision's transforms, not at import: see tutorial_loader

        self.to_pil = Image.fromarray

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.to_pil(self.images[i])), self.labels[i]


def tutorial_loader(split: datasets.Split, batch: int, workers: int) -> torch.utils.data.DataLoader:
    """The usual pipeline: torchvision RandomCrop + flip + ToTensor + Normalize on PIL images in
    DataLoader workers."""
    from torchvision import transforms  # here: 1.7 s of imports that only the tutorial's pipeline needs

    steps = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor()]
    transform = transforms.Compose([*steps, transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    return torch.utils.data.DataLoader(
        PILImages(split, transform),
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
    )


def to_device(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """to_input for batches the tutorial pipeline has already normalised: the copy to the device."""
    return lambda x: x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)


def train_throughput(sizes: dict, devices: list[torch.device]) -> list[dict]:
    """img/s with our data path, with one pre-made batch repeated, and with the tutorial pipeline."""
    rows = []
    for device in devices:
        for name, batch in sizes["train"]:
            if device.type == "cpu" and [name, batch] in [list(p) for p in sizes["gpu_only"]]:
                continue
            row: dict[str, Any] = {"device": device_name(device), "model": name, "batch": batch}
            timing = (device, sizes["warmup"], sizes["steps"], sizes["repeats"])
            ours = job(name, batch, sizes["images"], World(0, 0, 1, device, "none"))
            row.update(step_rates(ours, batch, timing))
            loader = tutorial_loader(ours.data.train, batch, sizes["baseline_workers"])
            theirs = stepping(replace(ours, to_input=to_device(device)), cycle(loader))
            row["tutorial_pipeline_img_s"] = batch / seconds_per_call(theirs, *timing)
            del loader
            rows.append(row)
            print(f"  train {row['device']} {name} batch {batch}: {row['ours_img_s']:.0f} img/s", flush=True)
    return rows


def step_rates(trained: train.Job, batch: int, timing: tuple) -> dict[str, float]:
    """img/s of the job's step fed by its own loader, and fed one pre-made batch again and again
    (the data path's ceiling), their timing windows alternating; the peak memory of those steps;
    and on a GPU the MFU of the first."""
    device = timing[0]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    fixed = next(iter(trained.train_loader))
    steps = {"ours": stepping(trained, cycle(trained.train_loader)), "one_batch": stepping(trained, lambda: fixed)}
    row = {f"{k}_img_s": batch / s for k, s in alternating(steps, *timing).items()}
    row["peak_mb"] = peak_memory_mb(device)
    if device.type == "cuda":
        row.update(mfu(trained.trained.model, batch, row["ours_img_s"], device))
    return row


def first_two_steps_s(step: Callable[[], Any], device: torch.device) -> float:
    """Seconds of a step's first two calls: with torch.compile, the compile (the second call can
    recompile, e.g. for the optimizer's first step having run)."""
    start = time.perf_counter()
    step()
    step()
    return metrics.elapsed(start, device)


def compiled_sweep(sizes: dict, device: torch.device, mode: str = "default") -> list[dict]:
    """On a GPU: bf16 + channels_last + cudnn.benchmark + torch.compile (run.compile_mode=`mode`) at
    each (model, batch) of sizes["compiled"]: the compile (the first two steps), then img/s with our
    data path and on one batch repeated, and MFU. Each batch size compiles afresh (no dynamic-shape graph)."""
    rows = []
    timing = (device, sizes["warmup"], sizes["steps"], sizes["repeats"])
    for name, batch in sizes["compiled"]:
        torch._dynamo.reset()
        images = max(sizes["images"], 4 * batch)  # epochs of 4+ steps
        ours = job(name, batch, images, World(0, 0, 1, device, "none"), "run.compile=true",
                   f"run.compile_mode={mode}", f"run.cudnn_benchmark={device.type == 'cuda'}")  # fmt: skip
        row: dict[str, Any] = {"device": device_name(device), "model": name, "batch": batch, "compile_mode": mode}
        row["first_two_steps_s"] = first_two_steps_s(stepping(ours, cycle(ours.train_loader)), device)
        row.update(step_rates(ours, batch, timing))
        rows.append(row)
        print(f"  compiled {row['device']} {name} batch {batch}: {row['ours_img_s']:.0f} img/s, "
              f"compile {row['first_two_steps_s']:.0f} s", flush=True)  # fmt: skip
    return rows


_PEAK_BF16: dict[str, float] = {}


def mfu(model: nn.Module, batch: int, img_s: float, device: torch.device) -> dict[str, float]:
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


def synthetic_split(n: int, seed: int = 0) -> datasets.Split:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
    return datasets.Split(images, torch.randint(0, 10, (n,), generator=g))


def data_path(sizes: dict, devices: list[torch.device]) -> list[dict]:
    """Images/s of the loaders alone, each delivering normalised float batches on the device."""
    rows = []
    split = synthetic_split(sizes["images"])
    batch, calls = sizes["data_batch"], sizes["data_images"] // sizes["data_batch"]
    for device in devices:
        world = World(0, 0, 1, device, "none")
        loader = loaders.train_loader(split, batch, world, loaders.Augment(), 0, 0, "device")
        loader.sampler.set_epoch(1, start_step=0)
        to_input, ours = loaders.input_fn(CIFAR_MEAN, CIFAR_STD, device, True), cycle(loader)
        s = seconds_per_call(lambda: to_input(ours()[0]), device, 2, calls, sizes["repeats"])  # noqa: B023
        rows.append({"device": device_name(device), "loader": "device-resident (ours)", "img_s": batch / s})
        for workers in sorted({0, 2, os.cpu_count() or 1}):
            loader = tutorial_loader(split, batch, workers)
            theirs = cycle(loader)
            fetch = lambda: theirs()[0].to(device, non_blocking=True)  # noqa: B023, E731 (called right here)
            s = seconds_per_call(fetch, device, 2, calls, sizes["repeats"])
            loader_name = f"torchvision DataLoader, {workers} workers"
            rows.append({"device": device_name(device), "loader": loader_name, "img_s": batch / s})
            del loader
        print(f"  data path {device_name(device)}: " + ", ".join(f"{r['img_s']:.0f}" for r in rows[-4:]), flush=True)
    return rows


def _ddp_worker(
    rank: int, world_size: int, port: int, name: str, global_batch: int, sizes: dict, threads: int, out: Any
) -> None:
    """Seconds per DDP step on rank 0; at world size 1 also the bare model's and DDP's with torch's own
    reduction (ddp.comm_hook=none), in the same process with the same threads, measured alternately
    (bare, DDP, none, bare, ...) so that drift hits them alike; the
    per-step stop agreement (distributed.StopAgreement, the loop's) alone; and with (name, batch) in
    sizes["ddp_compiled"], DDP over the compiled model: its first two steps (the compile), then its
    step, alternating with the others."""
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    world = World(rank, rank, world_size, device, "ddp", "bench", f"tcp://127.0.0.1:{port}")
    timing = (device, sizes["warmup"], sizes["steps"], sizes["repeats"])
    with distributed.setup(world, 120) as world:
        compiled = world_size == 1 and [name, global_batch] in [list(c) for c in sizes["ddp_compiled"]]
        _time_ddp(world, name, global_batch, timing, out, compiled)


# DDP over the compiled model, each way torch offers to combine them: (torch._dynamo.config while it
# compiles and runs, "inductor." keys torch._inductor.config; ddp/train.py settings). ddp_compiled is
# run.compile=true as ddp/train.py runs it. inductor.triton.cudagraphs is torch.compile's
# mode="reduce-overhead" (CUDA graphs of the compiled graphs; run.compile_mode=reduce-overhead for ddp/train.py).
# What DDP built in python_reducer mode sets in inductor (ddp.bucket_cap_mb's default), patched here so
# that it is put back after the variant
PYTHON_REDUCER = {"optimize_ddp": "python_reducer", "compiled_autograd": True,
                  "inductor._fuse_ddp_communication": True, "inductor._fuse_ddp_bucket_size": 25}  # fmt: skip
COMPILED_DDP: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "ddp_compiled": ({}, ()),  # dynamo's DDPOptimizer: the graph split at DDP's buckets (torch's default)
    "static_graph": ({}, ("ddp.static_graph=true",)),  # DDP told the graph never changes
    "whole_graph": ({"optimize_ddp": False}, ()),  # one graph; DDP's hooks all-reduce as autograd runs it
    "cuda_graphs": ({"inductor.triton.cudagraphs": True}, ()),  # DDPOptimizer's graphs, each a CUDA graph
    "whole_graph_cuda_graphs": ({"optimize_ddp": False, "inductor.triton.cudagraphs": True}, ()),
    # DDP's all-reduce traced into the backward, which compiled autograd compiles (the step's backward runs
    # under it): DDP built in this mode has no C++ reducer. (With CUDA graphs too: bench/graphs_split.py's
    # pair, in a process of its own, as NCCL inside a CUDA graph may end the process.)
    "python_reducer": (PYTHON_REDUCER, ()),
}


def under_dynamo(settings: dict[str, Any], step: Callable[[], Any], backend: str = "inductor") -> Callable[[], Any]:
    """`step` with torch._dynamo.config (and, for "inductor." keys, torch._inductor.config) patched by
    `settings` while it runs (its compile included); with "compiled_autograd", each backward in it is
    compiled by torch.compile's `backend` (torch._dynamo.compiled_autograd: the flag alone acts only on a
    backward called inside a compiled function, and ddp/train.py's is not)."""
    import torch._inductor.config as inductor
    from torch._dynamo import compiled_autograd

    dynamo = {k: v for k, v in settings.items() if not k.startswith("inductor.")}
    induct = {k.removeprefix("inductor."): v for k, v in settings.items() if k.startswith("inductor.")}
    backward = torch.compile(backend=backend) if settings.get("compiled_autograd") else None
    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable  # (torch 2.4: `enable`)

    def patched() -> Any:
        with torch._dynamo.config.patch(**dynamo), inductor.patch(induct):
            if backward is None:
                return step()
            with enable(backward):
                return step()

    return patched


def ddp_reducer(wrapped: nn.Module) -> str | None:
    """Which reducer a DDP-wrapped model runs ("python" when built in python_reducer mode: none of DDP's C++
    one), None for a model DDP does not wrap."""
    if not hasattr(wrapped, "_use_python_reducer"):
        return None
    return "python" if wrapped._use_python_reducer else "c++"


@contextlib.contextmanager
def dynamo_inlining_kept() -> Iterator[None]:
    """DDP built in python_reducer mode adds its own module to dynamo's list of modules to inline, for
    good: the list as it was, after the block."""
    from torch._dynamo import trace_rules

    inline = set(trace_rules.LEGACY_MOD_INLINELIST)
    try:
        yield
    finally:
        if inline != trace_rules.LEGACY_MOD_INLINELIST:
            trace_rules.LEGACY_MOD_INLINELIST.intersection_update(inline)
            trace_rules.get_legacy_mod_inlinelist.cache_clear()


def _time_ddp(world: World, name: str, global_batch: int, timing: tuple, out: Any, compiled: bool) -> None:
    """Inside the process group, so that the DDP objects die before it does (distributed.setup)."""
    ddp = job(name, global_batch, global_batch, world)
    fixed = next(iter(ddp.train_loader))
    steps, result = {"ddp": stepping(ddp, lambda: fixed)}, {"bare": None}
    if world.world_size == 1:
        bare = job(name, global_batch, global_batch, World(0, 0, 1, world.device, "none"))
        steps["bare"] = stepping(bare, lambda: fixed)
        own = job(name, global_batch, global_batch, world, "ddp.comm_hook=none")  # torch's own reduction
        steps["ddp_torch_reduction"] = stepping(own, lambda: fixed)
    result.update(alternating(steps, *timing))
    if compiled:
        result["variants"] = {
            variant: compiled_variant(world, name, global_batch, how, steps["ddp"], fixed, timing)
            for variant, how in COMPILED_DDP.items()
        }
    agree = functools.partial(distributed.StopAgreement(world).after_step, False)  # as the loop calls it
    result["stop_agreement_s"] = seconds_per_call(agree, world.device, 10, 100, timing[3])
    if world.is_main:
        out.put(result)


def compiled_variant(
    world: World,
    name: str,
    global_batch: int,
    how: tuple[dict[str, Any], tuple[str, ...]],
    eager: Callable,
    fixed: Batch,
    timing: tuple,
) -> dict[str, Any]:
    """One way of COMPILED_DDP, compiled afresh: its first two steps (the compile), its step timed in
    turns with eager DDP's, for a CUDA-graph way how many of its graphs inductor ran without CUDA
    graphs (cudagraph_skips, the reason in its warning), and for a compiled-autograd way how many
    backwards it traced. A variant this torch cannot run ends in
    {"error": its first line}, not in the end of the bench: the next variant, and the sections after,
    still run."""
    from torch._dynamo.utils import counters

    settings, extra = how
    torch._dynamo.reset()  # each compiles afresh under its settings (else dynamo reuses the last graph)
    counters.clear()
    try:
        with dynamo_inlining_kept():
            built = under_dynamo(
                settings, lambda: job(name, global_batch, global_batch, world, "run.compile=true", *extra)
            )()
            step = under_dynamo(settings, stepping(built, lambda: fixed))  # DDP reads optimize_ddp as it is built
            first = first_two_steps_s(step, world.device)
            pair = alternating({"ddp": eager, "compiled": step}, *timing)
    except Exception as e:  # noqa: BLE001 (any failure of torch's is this variant's result)
        print(f"  compiled DDP with {settings} {extra} failed; the bench goes on:", file=sys.stderr, flush=True)
        traceback.print_exc()  # the whole of it in the bench's log, for the issue to file
        return {"error": f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:300]}
    result = {"first_two_steps_s": first, "step_s": pair["compiled"], "eager_s": pair["ddp"]}
    if settings.get("inductor.triton.cudagraphs"):
        result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    if settings.get("compiled_autograd"):  # backwards compiled autograd traced (0: none was, the variant is void)
        result["compiled_autograd_captures"] = counters["compiled_autograd"]["captures"]
        result["reducer"] = ddp_reducer(built.wrapped)
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_step_seconds(world_size: int, name: str, global_batch: int, sizes: dict) -> dict[str, float | None]:
    """Seconds per step of `world_size` DDP processes on this machine (each with its share of the
    cores): {"ddp": s, and at world size 1 "bare": s and "ddp_torch_reduction": s (ddp.comm_hook=none)}."""
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


def with_ratios(variant: dict[str, Any], bare_s: float) -> dict[str, Any]:
    """A compiled variant's result with its speed against eager DDP and against the eager bare model."""
    if "error" in variant:
        return variant
    return {**variant, "vs_eager": variant["eager_s"] / variant["step_s"], "vs_bare": bare_s / variant["step_s"]}


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
            "ddp1_torch_reduction_step_s": one["ddp_torch_reduction"],  # ddp.comm_hook=none
            "ddp1_torch_reduction_overhead": one["ddp_torch_reduction"] / bare_s - 1,
            "stop_agreement_s": one["stop_agreement_s"],
        }
        if "variants" in one:
            row["compiled_variants"] = {v: with_ratios(r, bare_s) for v, r in one["variants"].items()}
            default = row["compiled_variants"]["ddp_compiled"]
            if "error" not in default:
                row["compiled_first_two_steps_s"] = default["first_two_steps_s"]
                row["ddp1_compiled_step_s"] = default["step_s"]
        if n > 1:
            row.update({"processes": n, "ddpN_step_s": ddp_step_seconds(n, name, batch, sizes)["ddp"]})
            row["speedup_N_vs_1"] = one_s / row["ddpN_step_s"]
        rows.append(row)
        print(f"  ddp {name} batch {batch}: world size 1 costs {row['ddp1_overhead']:+.1%} over the bare model")
    return rows


def train_py(*args: str, timeout: float) -> None:
    """python ddp/train.py ARGS as a process of its own, its output captured (raised on failure)."""
    command = [sys.executable, str(REPO / "ddp" / "train.py"), *args]
    subprocess.run(command, check=True, capture_output=True, timeout=timeout)


def startup(out_dir: Path) -> dict:
    """Process start to the end of the first training step of ddp/train.py (its startup_s metric)."""
    smoke = str(REPO / "configs" / "smoke.yaml")
    train_py("--config", smoke, "train.epochs=1", f"run.out_dir={out_dir}", "run.progress=false", timeout=300)
    first = json.loads((out_dir / "metrics.jsonl").read_text().splitlines()[0])
    return {
        "command": "python ddp/train.py --config configs/smoke.yaml (CPU, one process)",
        "startup_s": first["startup_s"],
    }


def time_to_accuracy(npz: Path, out_dir: Path, tutorial_epochs: int) -> dict:
    """On the CPU: configs/fast.yaml through ddp/train.py against the PyTorch tutorial's pipeline
    (ToTensor + Normalize(0.5) on PIL images, batch 4, 2 workers, the tutorial net, SGD 0.001/0.9)."""
    start = time.perf_counter()
    recipe = ["--config", str(REPO / "configs" / "fast.yaml"), "run.amp=off", "run.device=cpu", "run.progress=false"]
    train_py(*recipe, "data.dataset=npz", f"data.path={npz}", f"run.out_dir={out_dir / 'fast'}", timeout=3600)
    total = time.perf_counter() - start
    ours, elapsed = [], 0.0
    for line in (out_dir / "fast" / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        elapsed += m["seconds"]
        ours.append({"epoch": m["epoch"], "seconds": elapsed, "test_acc": m["test_acc"]})
    theirs = tutorial_run(npz, tutorial_epochs)
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


def tutorial_run(npz: Path, epochs: int) -> list[dict]:
    """The PyTorch CIFAR-10 tutorial's training, as written there, on the same data: accuracy and
    cumulative seconds per epoch."""
    data = datasets.read(DataConfig(dataset="npz", path=str(npz)), World(0, 0, 1, torch.device("cpu"), "none"))
    torch.manual_seed(0)
    net = models.build("tutorial", 10)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9)
    from torchvision import transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    loader = torch.utils.data.DataLoader(PILImages(data.train, transform), batch_size=4, shuffle=True, num_workers=2)
    test_loader = torch.utils.data.DataLoader(PILImages(data.test, transform), batch_size=256, num_workers=2)
    theirs, elapsed = [], 0.0
    for epoch in range(1, epochs + 1):
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
        theirs.append({"epoch": epoch, "seconds": elapsed, "test_acc": correct / len(data.test.labels)})
        print(f"  tutorial pipeline epoch {epoch}: {theirs[-1]['test_acc']:.1%} at {elapsed:.0f} s", flush=True)
    return theirs
