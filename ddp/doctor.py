"""Check a machine and a launch before training: `python -m ddp.doctor`, or under any launcher
(`torchrun --nproc_per_node=4 -m ddp.doctor`, `srun python -m ddp.doctor`) to check every rank.

Reports, per rank, the launcher variables and the rank and device they resolve to; torch, CUDA,
cuDNN and NCCL versions; each visible GPU with its memory; TF32 and cudnn.benchmark; whether the
rendezvous port is free (before a launch); /dev/shm's size (too small for NCCL between a machine's
GPUs: a problem); whether run.out_dir is writable and is the same directory
on every rank (a shared filesystem across nodes); on each machine (local rank 0), the data as
ddp/train.py would read it (a CIFAR download it would make is said, not made, and its address must
answer there: a compute node without internet is a problem). Under a launcher it
also runs one all_reduce on the real backend. Takes the training's arguments (--config FILE,
key=value) so it checks that setup.

Exit codes: 0 all good; 1 problems found (each printed with its fix); 2 a usage error, the same one
ddp/train.py would stop with.
"""

from __future__ import annotations

import collections
import copy
import errno
import os
import shutil
import socket
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from ddp.startup import quiet_startup

quiet_startup(__name__)  # run as a command: a Ctrl-C or a missing package in the imports below is one line

import torch
import torch.distributed as dist

from ddp import (
    alike,
    checkpoint,
    checks,
    cifar,
    config,
    cpus,
    datasets,
    devices,
    distributed,
    files,
    launchers,
    logs,
    lost_rank,
    metrics,
    network,
    preemption,
    profiling,
    rundir,
)
from ddp.cli import command, leave, parse_args, show
from ddp.config import DataConfig
from ddp.devices import World
from ddp.errors import EXIT_FAILURE, EXIT_OK, UsageError, path_refused


def versions() -> dict[str, str]:
    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else "n/a"
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda) if cuda else f"{torch.version.cuda} (no GPU visible)",
        "cudnn": str(torch.backends.cudnn.version()) if cuda else "n/a",
        "nccl": nccl,
        "gloo": str(dist.is_gloo_available()),
    }


def gpus() -> list[dict[str, Any]]:
    out = []
    for i in range(torch.cuda.device_count()):
        memory = metrics.gpu_memory_mb(i)
        out.append(
            {
                "index": i,
                "name": torch.cuda.get_device_properties(i).name,
                "total_gib": torch.cuda.get_device_properties(i).total_memory / 2**30,
                "allocated_gib": memory["allocated"] / 2**10,
                "reserved_gib": memory["reserved"] / 2**10,
            }
        )
    return out


def port_free(addr: str, port: int) -> bool | None:
    """Whether `port` is free to listen on at `addr`; None where `addr` is no address of this machine (another's, or
    none: the rendezvous is not served here; binding it said "IN USE")."""
    if (at := network.resolve(addr)) is None:
        return None
    with socket.socket(network.family(at)) as s:
        try:
            s.bind(("" if at == "127.0.0.1" else at, port))  # (loopback: every address, where torch's store listens)
            return True
        except OSError as e:
            return None if e.errno == errno.EADDRNOTAVAIL else False


def check_out_dir(out_dir: str) -> tuple[str | None, str | None]:
    """(token written there, problem) on rank 0: a file only this run knows, removed at the end."""
    token = f".doctor-{uuid.uuid4().hex}"
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / token).write_text(token)
    except OSError as e:
        why = files.in_the_way(Path(out_dir), e)
        return None, f"run.out_dir={out_dir} is not writable ({why}); choose another run.out_dir"
    return token, run_files_problem(out_dir)


def run_files_problem(out_dir: str) -> str | None:
    """Why the run could not use run.out_dir's files: ones of a run's names that no run wrote (which it would
    replace), or a checkpoints/ it may not list or write."""
    try:
        rundir.check_own_files(out_dir)
        if rundir.checkpoint_dir(out_dir).is_dir():
            rundir.check_checkpoints(out_dir)
    except UsageError as e:
        return str(e)
    return None


def check_data(
    data: DataConfig, world: World, cfg: config.Config | None = None
) -> tuple[str, str | None, datasets.Data | None]:
    """(a line on the data ddp/train.py would read, a problem or None, the data or None): read here as the run
    would, without a download (one the run would make is said); with `cfg`, its steps checked against that data
    as the run checks them (a batch larger than the split, run.profile beyond the run's steps)."""
    try:
        found = datasets.read(replace(data, download=False), world)
    except cifar.DataMissing as e:
        if not data.download:
            return "data: missing", str(e), None
        if problem := cifar.download_problem(data):
            return "data: missing, and no download", problem, None
        return f"data: {data.dataset} is not in data.root={data.root} yet: the run downloads it", None, None
    except UsageError as e:
        return "data: unusable", str(e), None
    except OSError as e:  # a path too long, or not open to this user: said as the run says it
        if (line := path_refused(e)) is None:
            raise
        return "data: unusable", line, None
    train, test = len(found.train.labels), len(found.test.labels)
    line = f"data: {train} training and {test} test images, {len(found.classes)} classes"
    try:
        if cfg is not None:
            profiling.parse(cfg.run.profile, checks.steps_per_epoch(cfg, train) * cfg.train.epochs)
    except UsageError as e:
        return line, str(e), found
    return line, None, found


SHM_NEEDED_MIB = 1024  # NVIDIA's containers are started with docker run --shm-size=1g


def shared_memory_mib(path: str = "/dev/shm") -> float | None:
    try:
        return shutil.disk_usage(path).total / 2**20
    except OSError:
        return None


def shared_memory_problem(r: dict[str, Any], gpu_ranks: int = 0) -> str | None:
    """NCCL between the GPUs of one machine (nn.DataParallel's too) keeps its buffers in /dev/shm: in a Docker
    container's 64 MiB its start crashes (ncclShmOpen; pytorch/tutorials' CI has --shm-size=2gb for it). The
    GPUs: those `r`'s rank sees, or the `gpu_ranks` on its host (each may see one: srun --gpus-per-task=1)."""
    gpus = max(len(r["gpus"]), gpu_ranks)
    if gpus < 2 or r["shm_mib"] is None or r["shm_mib"] >= SHM_NEEDED_MIB:
        return None
    return (f"on {r['host']}: /dev/shm holds {r['shm_mib']:,.0f} MiB, and NCCL between its {gpus} GPUs "
            f"keeps buffers there; give it {SHM_NEEDED_MIB} MiB or more: docker run --shm-size=1g (or --ipc=host); "
            "Kubernetes: an emptyDir of medium Memory mounted at /dev/shm")  # fmt: skip


def report(world: World, out_dir: str, mine: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's facts; with `mine` (alike.described's), what every rank must have alike."""
    return {"alike": mine} | {
        "host": socket.gethostname(),
        "network": network.gloo_interface(),
        "pid": os.getpid(),
        "rank": world.rank,
        "local_rank": world.local_rank,
        "world_size": world.world_size,
        "launcher": world.launcher,
        "device": str(world.device),
        "variables": launchers.launch_variables(),
        "versions": versions(),
        "gpus": gpus(),
        "tf32": {
            "matmul": torch.backends.cuda.matmul.allow_tf32,
            "cudnn": torch.backends.cudnn.allow_tf32,
            "cudnn.benchmark": torch.backends.cudnn.benchmark,
        },
        "out_dir": str(Path(out_dir).resolve()),
        "shm_mib": shared_memory_mib(),
        "cpus": {
            "affinity": cpus.affinity(),
            "quota": cpus.cgroup_quota(),
            "usable": cpus.usable(),
            "threads": torch.get_num_threads(),
        },
    }


def print_report(r: dict[str, Any]) -> None:
    show(
        f"rank {r['rank']}/{r['world_size']}  local_rank {r['local_rank']}  host {r['host']}  pid {r['pid']}  "
        f"launcher {r['launcher']}  device {r['device']}"
    )
    show(f"  network: {r['network']}")
    show("  variables: " + (" ".join(f"{k}={v}" for k, v in r["variables"].items()) or "(none: one process)"))
    show("  versions:  " + "  ".join(f"{k} {v}" for k, v in r["versions"].items()))
    for g in r["gpus"]:
        show(
            f"  cuda:{g['index']} {g['name']}: {g['total_gib']:.1f} GiB total, "
            f"{g['allocated_gib']:.2f} allocated, {g['reserved_gib']:.2f} reserved"
        )
    if not r["gpus"]:
        show("  GPUs: none visible")
    show("  TF32: " + "  ".join(f"{k} {v}" for k, v in r["tf32"].items()))
    show("  /dev/shm: " + ("none" if r["shm_mib"] is None else f"{r['shm_mib']:,.1f} MiB"))
    c = r["cpus"]
    quota = f"its cgroup's quota {c['quota']:g}" if c["quota"] else "no cgroup quota"
    show(f"  CPUs: {c['usable']} to use ({c['affinity']} in its affinity, {quota}); torch threads {c['threads']}")


def machine_problems(reports: list[tuple[Any, ...]], mismatch: str | None) -> list[str]:
    """What rank 0 finds in every rank's (report, ...), once per machine: SLURM's tasks against its GPUs (but rank
    0's own `mismatch`, said already), a /dev/shm too small for NCCL between its GPUs, and other code, settings or
    data than rank 0's (alike.differences: the run would stop on them)."""
    gpu_ranks = collections.Counter(r["host"] for r, *_ in reports if r["device"].startswith("cuda"))
    shm = {p for r, *_ in reports if (p := shared_memory_problem(r, gpu_ranks[r["host"]]))}
    first = reports[0][0]
    unlike = {
        f"rank {r['rank']} on {r['host']} {d} than rank 0 on {first['host']}: every machine must run the same "
        "checkout, settings and data"
        for r, *_ in reports
        if (d := alike.differences(first["alike"], r["alike"]))
    }
    return sorted({m for _, _, m, _ in reports if m and m != mismatch}) + sorted(shm) + sorted(unlike)


def one_process(cfg: config.Config, world: World) -> list[str]:
    """diagnose's problems where no launcher started ranks: this machine's report, the rendezvous it would use,
    run.out_dir and the data."""
    run, problems = cfg.run, []
    print_report(here := report(world, run.out_dir))
    problems += [p] if (p := shared_memory_problem(here)) else []
    addr, port, source = launchers.planned_rendezvous()
    try:
        network.check_master(addr, port, node_rank=0, timeout_s=0)  # node 0: whether it resolves
    except UsageError as e:
        problems.append(str(e))
    free = port_free(addr, port)
    show(f"rendezvous port {port} ({source}): " + {True: "free", False: "IN USE", None: f"at {addr}, not here"}[free])
    if free is False:
        problems.append(f"port {port} ({source}) is in use on this machine: set MASTER_PORT to a free port")
    token, problem = check_out_dir(run.out_dir)
    problems += [problem] if problem else []
    if token:
        (Path(run.out_dir) / token).unlink()
        show(f"run.out_dir {Path(run.out_dir).resolve()}: writable")
    line, problem, _ = check_data(cfg.data, world, cfg)
    show(line)
    return problems + ([problem] if problem else [])


def diagnose(cfg: config.Config, mine: dict[str, Any]) -> list[str]:
    """Problems on this rank and, under a launcher, across ranks (`mine`: alike.described's); prints the reports."""
    run, data = cfg.run, cfg.data
    world = devices.resolve(run)
    devices.share_cpus(run)  # the threads a run here would take
    problems = []
    if mismatch := launchers.slurm_gpu_problem(torch.cuda.device_count()):
        problems.append(mismatch)
    if not world.grouped:
        return problems + one_process(cfg, world)
    with distributed.setup(world, run.timeout_s) as world:
        token, problem = check_out_dir(run.out_dir) if world.is_main else (None, None)
        shared = distributed.gather_objects((token, problem), world)[0]
        # Every rank looks for rank 0's file: missing means another filesystem (not shared across nodes).
        sees = shared[0] is not None and (Path(run.out_dir) / shared[0]).is_file()
        reduced = distributed.all_reduce_sum(torch.tensor([float(world.rank)], device=world.device), world)
        # One a machine (local rank 0):
        line, problem, found = check_data(data, world, cfg) if world.is_local_main else (None, None, None)
        mine = mine | alike.data_of(data, found) if found else mine  # the data's digest, where this machine read it
        checked = (line, problem) if line else None
        reports = distributed.gather_objects((report(world, run.out_dir, mine), sees, mismatch, checked), world)
        if world.is_main:
            for r, _, _, data_checked in reports:  # (line, problem) on one rank a machine
                print_report(r)
                if data_checked:
                    show(f"  {data_checked[0]}")
                    problems += [f"on {r['host']}: {data_checked[1]}"] if data_checked[1] else []
            want, got = world.world_size * (world.world_size - 1) / 2, reduced.item()
            backend = dist.get_backend()
            show(f"all_reduce over {world.world_size} ranks ({backend}): {got:g} (expected {want:g})")
            if got != want:
                problems.append(f"all_reduce gave {got:g}, not {want:g}: the {backend} backend is broken")
            if shared[1]:
                problems.append(shared[1])
            blind = [r["rank"] for r, seen, _, _ in reports if not seen]
            if shared[0] and blind:
                problems.append(
                    f"ranks {blind} do not see rank 0's files in run.out_dir={run.out_dir}: it must be on a "
                    "filesystem every node shares (checkpoints are written by rank 0 and read by all)"
                )
            elif shared[0]:
                show(f"run.out_dir {Path(run.out_dir).resolve()}: writable, the same directory on every rank")
            problems += machine_problems(reports, mismatch)
        distributed.barrier(world)  # everyone has looked before rank 0 removes the file
        if world.is_main and shared[0]:
            (Path(run.out_dir) / shared[0]).unlink()
    return problems if world.is_main else []


USAGE = """usage: python -m ddp.doctor [--config FILE.yaml] [section.key=value ...]
       torchrun --nproc_per_node=N -m ddp.doctor [the same arguments]   (or under srun, accelerate launch)

Checks the setup that ddp/train.py with the same arguments would use. Keys:
"""


@lost_rank.telling_the_waiting()  # a machine's mistake before the ranks met: the others hear it, not time out
def main(argv: list[str]) -> int:
    args = parse_args(argv, USAGE)
    cfg = config.load(args.config, args.overrides)
    cfg.run = launchers.accelerate_flags(cfg.run)
    checks.settings(copy.deepcopy(cfg), devices.resolve(cfg.run))  # those ddp/train.py refuses first: its line, exit 2
    checks.unused(cfg, show if launchers.detect_launch(launcher=cfg.run.launcher).rank == 0 else None)  # its notes
    preemption.parse_signals(cfg.run.stop_signal)
    if cfg.run.tensorboard:
        logs.check_tensorboard()
    checkpoint.check_resume(cfg)  # run.resume, and the settings of the checkpoint it would read
    problems = diagnose(cfg, alike.described(cfg))
    for p in problems:
        print(f"doctor: PROBLEM: {p}", file=sys.stderr)
    if not problems and launchers.detect_launch(launcher=cfg.run.launcher).rank == 0:
        show("doctor: OK")
    return EXIT_FAILURE if problems else EXIT_OK


if __name__ == "__main__":
    leave(command(main, prog="doctor"))
