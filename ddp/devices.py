"""This process's place in the job, decided before any CUDA or network work: a frozen World (rank,
local_rank, world_size, device, parallel mode) from who started it (launchers.py) and run.device,
run.parallel and run.backend. Each rank's GPU is cuda:<local_rank>; a bad combination is a UsageError.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ddp import cpus, launchers
from ddp.config import RunConfig
from ddp.errors import UsageError
from ddp.launchers import Env, Launch

GROUPED = ("ddp", "fsdp")  # the parallel modes of a process group: one process per device, launched together
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:(\d+))$")
OTHER_ACCELERATORS = {"mps": "Apple's GPU (mps)", "xpu": "Intel's GPU (xpu)", "hpu": "Gaudi (hpu)",
                      "xla": "a TPU (xla)", "npu": "an Ascend NPU (npu)"}  # fmt: skip


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int  # processes in the job; 1 for none and dp
    device: torch.device  # this rank's device; under dp the first of the GPUs it spreads over
    parallel: str  # "none" | "dp" | "ddp" | "fsdp", resolved from run.parallel
    launcher: str = "none"  # who started the processes: torchrun | accelerate | slurm | none
    init_method: str | None = None  # tcp://host:port where rank 0 serves the store; None: torchrun's agent's
    backend: str = "auto"  # run.backend: "gloo" on a GPU lets ranks share it; auto = nccl on CUDA, gloo on CPU
    # Set by distributed.setup on CUDA: a gloo group for flags on the host (the rule: distributed.py).
    control: Any = field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints and writes files."""
        return self.rank == 0

    @property
    def grouped(self) -> bool:
        """One of the processes of a process group (ddp or fsdp): collectives reach the other ranks."""
        return self.parallel in GROUPED

    @property
    def process_group_backend(self) -> str:
        """nccl for CUDA devices unless run.backend=gloo; gloo for CPUs."""
        return "nccl" if self.device.type == "cuda" and self.backend != "gloo" else "gloo"

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the one process per node that downloads."""
        return self.local_rank == 0


def resolve_device(spec: str, launch: Launch | None, cuda_count: int, backend: str = "auto") -> torch.device:
    """run.device as a torch.device; launch is None for a single process. With backend gloo, ranks
    beyond the visible GPUs share them (local rank r takes cuda:<r mod GPUs>): nccl refuses that."""
    m, kind = _DEVICE.match(spec), spec.split(":")[0]
    if kind in OTHER_ACCELERATORS:  # a Mac's GPU (mps), Intel's (xpu), ...: torch knows them, ddp-cifar does not
        raise UsageError(f"run.device={spec}: {OTHER_ACCELERATORS[kind]} is not supported (ddp-cifar runs and is "
                         "tested on CPUs and CUDA GPUs only); use run.device=cpu")  # fmt: skip
    if not m:
        raise UsageError(f"run.device={spec!r} is not a device; use auto, cpu, cuda or cuda:N (e.g. cuda:0)")
    if spec == "cpu" or (spec == "auto" and cuda_count == 0):
        return torch.device("cpu")
    if cuda_count == 0:
        raise UsageError(
            f"run.device={spec} but no CUDA GPU is visible (torch.cuda.is_available() is False); "
            "use run.device=cpu or auto"
        )
    if m.group(2) is not None:
        index = int(m.group(2))
        if launch is not None:
            raise UsageError(
                f"run.device={spec}: under {launch.launcher} each rank uses cuda:<local_rank>; "
                "use run.device=cuda (or auto) and CUDA_VISIBLE_DEVICES to pick GPUs"
            )
    elif launch is None:
        index = 0
    elif cuda_count == 1 and (launch.launcher == "slurm" or launch.local_world_size == 1):
        index = 0  # SLURM (--gpus-per-task=1) or CUDA_VISIBLE_DEVICES gave this process its own GPU
    elif backend == "gloo":
        index = launch.local_rank % cuda_count  # ranks share GPUs: for testing, gloo only
    elif cuda_count == 1:
        raise UsageError(
            f"{launch.local_world_size} processes on this node but 1 GPU is visible to each: ranks cannot "
            "share a GPU under nccl; start one process per GPU (e.g. --nproc_per_node=1), use run.device=cpu, "
            "or run.backend=gloo to test several ranks on one GPU"
        )
    else:
        index = launch.local_rank
    if index >= cuda_count:
        what = f"run.device={spec}" if launch is None else f"local rank {index}"
        raise UsageError(
            f"{what} but only {cuda_count} GPU(s) are visible (cuda:0..cuda:{cuda_count - 1}); "
            + ("pick one of those" if launch is None else "start at most that many processes per node")
        )
    return torch.device("cuda", index)


def _single_process(run: RunConfig, cuda_count: int) -> World:
    """The World of a process that no launcher started: one device, or nn.DataParallel over them all."""
    device = resolve_device(run.device, None, cuda_count)
    parallel = "none" if run.parallel == "auto" else run.parallel
    if parallel in GROUPED:
        raise UsageError(
            f"run.parallel={parallel} needs one process per device: "
            "torchrun --standalone --nproc_per_node=N ddp/train.py ..."
        )
    if parallel == "dp":
        if cuda_count < 2:
            raise UsageError(
                f"run.parallel=dp needs at least 2 visible GPUs, found {cuda_count}; "
                "use run.parallel=none (one device) or torchrun for DDP"
            )
        if device != torch.device("cuda", 0):
            raise UsageError(
                f"run.parallel=dp spreads over every visible GPU from cuda:0, not {device}; "
                "choose the GPUs with CUDA_VISIBLE_DEVICES"
            )
    return World(0, 0, 1, device, parallel)


def launched_parallel(parallel: str, processes: int) -> str:
    """run.parallel for `processes` launched processes: auto is ddp from 2 on, and none for one (it has
    nothing to all-reduce: no process group, no DDP wrapper); any other value as given."""
    return parallel if parallel != "auto" else "ddp" if processes > 1 else "none"


def resolve(run: RunConfig, env: Env = os.environ, cuda_count: int | None = None) -> World:
    """The World this process will be: its rank, local_rank and world_size from the launcher's
    variables, its device cuda:<local_rank> (or the CPU). Pure: no CUDA call beyond counting the
    devices, no network, so every error comes before any work."""
    launch = launchers.detect_launch(env, run.launcher)
    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if run.backend == "nccl" and (run.device == "cpu" or cuda_count == 0):
        raise UsageError("run.backend=nccl needs CUDA GPUs (nccl has no CPU path); use run.backend=auto or gloo")
    if launch.launcher == "none":
        return _single_process(run, cuda_count)
    parallel = launched_parallel(run.parallel, launch.world_size)
    if parallel == "dp":
        raise UsageError(f"run.parallel=dp is a single-process mode; under {launch.launcher} use ddp (or auto)")
    if parallel == "none" and launch.world_size > 1:
        raise UsageError(
            f"run.parallel=none under {launch.launcher} with world size {launch.world_size} would train "
            f"{launch.world_size} unrelated models; use run.parallel=ddp (or auto)"
        )
    device = resolve_device(run.device, launch, cuda_count, run.backend)
    if parallel not in GROUPED:
        return World(0, launch.local_rank, 1, device, parallel, launch.launcher, backend=run.backend)
    return World(
        launch.rank, launch.local_rank, launch.world_size, device, parallel, launch.launcher, launch.init_method,
        backend=run.backend,
    )  # fmt: skip


def share_cpus(run: RunConfig, env: Env = os.environ) -> int:
    """torch's threads in this process: unless OMP_NUM_THREADS says how many, its share of the CPUs it may use
    (cpus.usable: its affinity and its cgroup's quota, a container's --cpus, which torch's default does not see) among
    the processes on this machine, never more than torch's default. Returns the threads."""
    if "OMP_NUM_THREADS" not in env:
        share = cpus.threads(launchers.detect_launch(env, run.launcher).local_world_size)
        torch.set_num_threads(min(share, torch.get_num_threads()))
    return torch.get_num_threads()


def oversubscribed(run: RunConfig, device: torch.device, env: Env = os.environ, threads: int = 0) -> str | None:
    """On the CPU, an OMP_NUM_THREADS that gives this machine's processes more threads (`threads` each, torch's now)
    than the CPUs they may use, which then take turns while every step waits for them (a shell's export, where
    share_cpus would have given each process its share); its note for the start line, or None."""
    if device.type != "cpu" or "OMP_NUM_THREADS" not in env:
        return None
    processes = launchers.detect_launch(env, run.launcher).local_world_size
    threads, usable = threads or torch.get_num_threads(), cpus.usable()
    if threads <= cpus.threads(processes):  # (its share, or 1 where the processes outnumber the CPUs)
        return None
    return (f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}: {threads} threads in each of {processes} process(es) on this "
            f"machine, which may use {usable} CPUs: they take turns, and each step waits for them; unset it, and "
            "each process takes its share")  # fmt: skip


def planned(run: RunConfig, processes: int, node: int | None) -> World:
    """The World that the checks before a launch of `processes` per node (train.py --preflight) stand
    for: rank 0, or on a node other than 0 its last rank; on a GPU if there is one."""
    device = torch.device("cuda" if run.device != "cpu" and torch.cuda.device_count() else "cpu")
    # none and dp stand for auto here: under a launcher each rank's resolve says what is wrong with them
    parallel = launched_parallel(run.parallel if run.parallel in GROUPED else "auto", processes)
    return World(0 if not node else processes - 1, 0, processes, device, parallel)
