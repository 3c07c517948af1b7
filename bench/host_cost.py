"""python -m bench --host-cost: what the host does for one training step, counted in torch.profiler
traces, so that the figures do not depend on the machine's speed (a GPU step that is host-bound
pays for every one of them). For the same model, batch and synthetic data:
  plain       a plain loop: the model, SGD (Nesterov, weight decay), label smoothing, an LR schedule
  plain DDP   the same loop with the model in DDP at world size 1 (gloo)
  ours        ddp/train.py in one process (python ddp/train.py, run.profile)
  ours 1 rank and ours 2 ranks   ddp/train.py under torchrun (rank 0's trace); at 1 rank with
              run.parallel=ddp, and as run.parallel=auto runs it: without DDP (nothing to all-reduce)
  ours fast.yaml   ddp/train.py in one process with configs/fast.yaml's toolbox (lookahead, the
              whitened stem, BatchNorm's own groups) at the same model, batch and data, fp32; without
              augmentation, and with its own (2-px reflect translation, alternating flip)
  airbench94  airbench94's own train94 (PyPI airbench 0.1.8) at the same widths, batch and data size,
              fp32, with its augmentation, and its SGD for-each as torch picks it on a GPU (on a CPU
              torch's default steps each parameter alone); its steps FIRST..END-1 are profiled from
              its LR scheduler's step, the last call of each. Its reads are of CPU tensors on a GPU
              too (its LR and lookahead schedules live there).
Per step: operators at the top level (called from Python) and in all (with the ones they call);
device reads (.item(), bool(), float(), int() of a tensor: aten::_local_scalar_dense, which on a GPU
is a device-to-host copy that waits for every queued kernel), apart from the stop agreement's read
of its CPU flag (the control group's gloo all-reduce: it never waits for the GPU); collectives
(gloo/nccl operations).
On a CPU `.cpu()` and `.tolist()` of a CPU tensor copy nothing and do not show; no step of ours calls
them on the training device's tensors. Ours runs without augmentation (data.augment=false), as the
plain loop has none; its uint8-to-float input conversion is counted.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

from ddp import models
from ddp.distributed import GLOO_PAUSE_S

REPO = Path(__file__).resolve().parent.parent
MODEL, WIDTH, BATCH = "fast", 0.25, 32  # small enough to run in seconds on a CPU
FIRST, END = 10, 30  # global steps FIRST..END-1 are counted (run.profile=10:30), after a warm-up
FAST, FP32 = ("--config", str(REPO / "configs" / "fast.yaml")), ("run.amp=off", "run.tf32=false")
FAST_YAML = (*FAST, *FP32)  # fast.yaml's recipe on this row's model and data (its own are the GPU's): fp32, as the rest
FAST_AUG = (*FAST_YAML, "data.augment=true")
SCALAR_READ = "aten::_local_scalar_dense"
STOP_AGREEMENT = "stop agreement"  # train.train_epoch's label: its read is of a CPU tensor of the control group
COLLECTIVE_PREFIXES = ("gloo:", "nccl:")


def per_step(trace: Path, steps: int) -> dict[str, float]:
    """Counts a step from a Chrome trace of `steps` steps: an operator (cat cpu_op) is top-level
    when no other operator of its thread encloses it."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    top, open_until = 0, {}
    for e in ops:
        if e["ts"] >= open_until.get(e["tid"], float("-inf")):
            top += 1
            open_until[e["tid"]] = e["ts"] + e["dur"]
    names = Counter(e["name"] for e in events)
    flags = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == STOP_AGREEMENT]
    flag_reads = sum(
        1
        for e in events
        if e["name"] == SCALAR_READ
        and any(f["tid"] == e["tid"] and f["ts"] <= e["ts"] <= f["ts"] + f["dur"] for f in flags)
    )
    collectives = sum(n for name, n in names.items() if name.startswith(COLLECTIVE_PREFIXES))
    return {
        "top_level_ops": top / steps,
        "all_ops": len(ops) / steps,
        "device_reads": (names[SCALAR_READ] - flag_reads) / steps,
        "flag_reads": flag_reads / steps,
        "collectives": collectives / steps,
        "collective_kinds": sorted({n for n in names if n.startswith(COLLECTIVE_PREFIXES)}),
    }


def plain_loop(ddp: bool, out: Path) -> dict[str, float]:
    """The plain loop's counts (DDP at world size 1 if `ddp`), in this process."""
    torch.manual_seed(0)
    model: nn.Module = models.build(MODEL, 10, 0.0, WIDTH).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 1000)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    x = torch.randn(BATCH, 3, 32, 32).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (BATCH,))
    if ddp:
        model = DistributedDataParallel(model)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        optimizer.step()
        scheduler.step()

    return _profiled(step, out)


def _profiled(step: Callable[[], None], out: Path) -> dict[str, float]:
    for _ in range(FIRST - 1):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(END - FIRST):
            step()
    p.export_chrome_trace(str(out))
    return per_step(out, END - FIRST)


def plain_in_ddp(out: Path) -> dict[str, float]:
    """plain_loop in DDP, inside a process group of one (gloo, a file store beside `out`)."""
    dist.init_process_group("gloo", init_method=f"file://{out.parent / 'store'}", rank=0, world_size=1)
    try:
        return plain_loop(True, out)
    finally:
        time.sleep(GLOO_PAUSE_S)  # (torch before 2.8: gloo's threads first, as ddp/distributed.py leaves)
        dist.destroy_process_group()


def airbench_loop(out: Path, batch: int = BATCH, width: float = WIDTH) -> dict[str, float]:
    """airbench94's counts: its train94 over `batch` x END synthetic images (one epoch), in this process; with
    CUDA, as airbench runs itself there (fp16, cudnn.benchmark) and its kernels in the trace too."""
    from bench.airbench_cpu import on_the_cpu, replaced
    from bench.airbench_steps import imported_airbench

    airbench, cuda = imported_airbench(), torch.cuda.is_available()
    g = torch.Generator().manual_seed(0)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    profiler, scheduler_steps = profile(activities=activities), [-1]  # LambdaLR steps once when built
    scheduler_step, sgd = torch.optim.lr_scheduler.LambdaLR.step, torch.optim.SGD

    def counted_step(self, *args, **kwargs) -> None:  # noqa: ANN001 (LambdaLR.step's own arguments)
        scheduler_step(self, *args, **kwargs)
        scheduler_steps[0] += 1
        if scheduler_steps[0] == FIRST:
            profiler.start()
        elif scheduler_steps[0] == END:
            profiler.stop()

    data = out.parent / "airbench" / "cifar10"
    data.mkdir(parents=True)
    for split, n in (("train", batch * END), ("test", batch)):
        images = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, 10, (n,), generator=g)
        torch.save({"images": images, "labels": labels, "classes": [str(c) for c in range(10)]}, data / f"{split}.pt")
    convs = [m.out_channels for m in models.build(MODEL, 10, 0.0, width).modules() if isinstance(m, nn.Conv2d)]
    net = dict(zip(("block1", "block2", "block3"), convs[1::2]))  # the stem, then 2 convolutions a block
    stand_ins = [
        (torch.optim.lr_scheduler.LambdaLR, "step", counted_step),
        (torch.optim, "SGD", lambda *args, **kwargs: sgd(*args, foreach=True, **kwargs)),
        (torch.backends.cudnn, "benchmark", cuda),  # what importing airbench sets (imported_airbench puts it back)
    ]
    cwd = os.getcwd()
    os.chdir(data.parent)  # train94 reads its test images from ./cifar10 (contextlib.chdir: Python 3.11 on)
    try:
        with contextlib.nullcontext() if cuda else on_the_cpu(airbench), replaced(stand_ins):
            hyp = airbench.lib_airbench94.hyp
            loader = airbench.CifarLoader("cifar10", train=True, batch_size=batch, aug=hyp["aug"], altflip=True)
            airbench.train94(
                train_loader=loader, epochs=1, make_net=lambda: airbench.make_net94(widths=net), verbose=False
            )
    finally:
        os.chdir(cwd)
    profiler.export_chrome_trace(str(out))
    return per_step(out, END - FIRST)


def ours(launch: list[str], out_dir: Path, *extra: str) -> dict[str, float]:
    """ddp/train.py, started by `launch`, profiled over steps FIRST..END-1: rank 0's counts."""
    settings = [
        f"model.name={MODEL}", f"model.width={WIDTH}", f"train.batch_size={BATCH}", "train.epochs=1",
        "data.dataset=synthetic", f"data.synthetic_train={BATCH * END}", "data.synthetic_test=32",
        "data.augment=false", "run.channels_last=true", f"run.profile={FIRST}:{END}", "run.progress=false",
        f"run.out_dir={out_dir}", "run.save_every_steps=0", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launch, str(REPO / "ddp" / "train.py"), *settings], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(launch)} ddp/train.py failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return per_step(out_dir / "profile" / "rank0.json", END - FIRST)


def measure() -> list[dict[str, Any]]:
    """The nine rows, in the order of the module's docstring."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    rows: list[tuple[str, Callable[[Path], dict[str, float]]]] = [
        ("plain", lambda d: plain_loop(False, d / "plain.json")),
        ("plain DDP, world size 1", lambda d: plain_in_ddp(d / "plain-ddp.json")),
        ("ours, one process", lambda d: ours([sys.executable], d / "ours")),
        ("ours, torchrun 1 rank", lambda d: ours([*torchrun, "--nproc_per_node=1"], d / "ours1", "run.parallel=ddp")),
        ("ours, torchrun 1 rank, auto (no DDP)", lambda d: ours([*torchrun, "--nproc_per_node=1"], d / "ours1-auto")),
        ("ours, torchrun 2 ranks", lambda d: ours([*torchrun, "--nproc_per_node=2"], d / "ours2")),
        ("ours, configs/fast.yaml, one process", lambda d: ours([sys.executable], d / "fast", *FAST_YAML)),
        ("ours, configs/fast.yaml with its augmentation", lambda d: ours([sys.executable], d / "fast-aug", *FAST_AUG)),
        ("airbench94's own step (its augmentation)", lambda d: airbench_loop(d / "airbench.json")),
    ]
    with one_thread(), tempfile.TemporaryDirectory() as tmp:
        return [{"loop": name, **count(Path(tmp))} for name, count in rows]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """This process on one thread while inside, as ours runs (OMP_NUM_THREADS=1): the same operators."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def table(rows: Iterable[dict[str, Any]]) -> str:
    lines = [
        f"model `{MODEL}` at width {WIDTH}, batch {BATCH}, synthetic data, CPU, steps {FIRST}-{END - 1} counted",
        "",
        "| loop | top-level ops / step | all ops / step | device reads / step | stop-flag reads / step "
        "| collectives / step | which |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        which = ", ".join(r["collective_kinds"]) or "-"
        lines.append(
            f"| {r['loop']} | {r['top_level_ops']:.1f} | {r['all_ops']:.1f} | {r['device_reads']:.2f} "
            f"| {r['flag_reads']:.2f} | {r['collectives']:.2f} | {which} |"
        )
    return "\n".join(lines) + "\n"
