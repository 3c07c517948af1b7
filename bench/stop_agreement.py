"""The per-step stop agreement's cost to the host: the blocking all-reduce of each step's flag
(distributed.any_rank, the loop's before 2026-11-26) against the loop's distributed.StopAgreement, which
reads a step's flags one step later. Each step is host work alone (a busy wait, as a GPU step's kernel
launches are): the same on every rank, or 2 and 4 ms taking turns (the ranks out of step, as a host's
hiccups make them). Alternated, so that drift hits both alike.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/stop_agreement.py
        [--steps 500] [--out bench/results/stop-agreement-cpu.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
import torch.distributed as dist

from bench.__main__ import machine
from ddp import devices, distributed

HOST_WORK = {"even": lambda step, rank: 0.003, "uneven": lambda step, rank: 0.002 * (1 + (step + rank) % 2)}


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(world: devices.World, how: str, work: str, steps: int) -> tuple[float, float]:
    """(ms a call of the agreement, ms a step) on this rank."""
    agreement = distributed.StopAgreement(world)
    agree = agreement.after_step if how == "one step late" else lambda flag: distributed.any_rank(flag, world)
    in_calls, started = 0.0, time.perf_counter()
    for step in range(steps):
        busy(HOST_WORK[work](step, world.rank))
        t = time.perf_counter()
        agree(False)
        in_calls += time.perf_counter() - t
    agreement.wait()
    return in_calls / steps * 1e3, (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--out", default="bench/results/stop-agreement-cpu.md")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = devices.World(rank, rank, dist.get_world_size(), torch.device("cpu"), "ddp")
    world = replace(world, control=dist.group.WORLD)
    rows = []
    for work in HOST_WORK:
        for repeat in range(2):
            for how in ("blocking", "one step late"):
                call_ms, step_ms = measure(world, how, work, args.steps)
                rows.append(f"| {work} | {how} | {repeat + 1} | {call_ms:.3f} | {step_ms:.3f} |")
    if rank == 0:
        cpu = machine()["cpu"]
        text = "\n".join([
            "# The stop agreement's cost to the host", "",
            f"{time.strftime('%Y-%m-%d')}; {os.cpu_count()} cores ({cpu}); torch {torch.__version__}; "
            f"{world.world_size} gloo ranks, {args.steps} steps each.",
            f"Command: `OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node={world.world_size} "
            f"bench/stop_agreement.py --steps {args.steps}`", "",
            "host work a step: even = 3 ms on every rank; uneven = 2 and 4 ms by turns, the ranks out of step "
            "(both: 3 ms a step on average)", "",
            "| host work | agreement | run | ms a call (rank 0) | ms a step (rank 0) |",
            "| --- | --- | ---: | ---: | ---: |", *rows, "",
        ])  # fmt: skip
        Path(args.out).write_text(text)
        print(text)
    time.sleep(distributed.GLOO_PAUSE_S)  # (torch before 2.8: gloo's threads first, as ddp/distributed.py leaves)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
