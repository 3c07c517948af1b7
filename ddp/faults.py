"""Fault injection for the kill-and-resume tests: DDP_CIFAR_FAULT, read once when training starts
(`arm`); unset, nothing is installed and nothing runs. SIGKILL is what a kill -9, the OOM killer or
a lost node does: no handler runs, nothing is flushed.

    DDP_CIFAR_FAULT=step:N[:rR]   SIGKILL rank R (default 0) in global step N, once its optimizer step is taken
    DDP_CIFAR_FAULT=write:N       SIGKILL rank 0 as it writes the checkpoint of global step N: the
                                  temporary file is left cut in half, as a kill halfway through leaves it
    DDP_CIFAR_FAULT=launcher:N    SIGKILL rank 0's launcher (its parent, torchrun say) as rank 0 writes
                                  the checkpoint of global step N; rank 0 itself goes on
    DDP_CIFAR_FAULT=node:N[:rR]   SIGKILL rank R's launcher, then rank R, in global step N: its node is
                                  lost (with one process per node)
    DDP_CIFAR_FAULT=pause:N[:rR]  SIGSTOP rank R in global step N, once its optimizer step is taken: the test
                                  that sends a stop signal then, and SIGCONTs it, knows the step it lands in
    DDP_CIFAR_FAULT=wait:N[:rR]   rank R waits in global step N, once its optimizer step is taken, until its stop
                                  signal has come (WAIT_S at most): a test whose stop comes seconds after it asks for
                                  one (SLURM's preemption) knows that it lands in training, however fast the steps;
                                  wait:0 before the first step (its rendezvous and build done): a stop in start-up
    DDP_CIFAR_FAULT=wait:preflight the preflight (ddp/train.py --preflight: slurm/train.sh's, before srun) waits until
                                  SLURM chose its job for preemption, or the test writes "go" into its marker (WAIT_S
                                  at most): a preemption that signals no step; a signal for the shell in its preflight
    DDP_CIFAR_FAULT=oom:N[:rR]    rank R runs out of memory in global step N (a CUDA OutOfMemoryError's text, raised
                                  as its optimizer step is taken): an error of that rank alone, said by it
    DDP_CIFAR_FAULT=memory:N[:rR] rank R takes memory in global step N, 64 MB at a time, until the kernel's
                                  out-of-memory killer ends it (the test limits its memory cgroup; past 64 GB an error)

A fault fires once per run directory: it leaves rundir.fault_marker there first, so the restarted
job (same command, same environment) runs through.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from ddp import launchers, requeue, rundir

VAR = "DDP_CIFAR_FAULT"
WAIT_S = 120.0  # wait:N's longest wait for the stop signal
START_UP_S = 5.0  # wait:0's time in start-up after its signal: the watcher ends the process within it


def arm(out_dir: str, rank: int, steps_done: int) -> None:
    """Install this rank's fault, if DDP_CIFAR_FAULT names one for it that has not fired in out_dir
    (a run resumed after `steps_done` global steps)."""
    spec = os.environ.get(VAR)
    if not spec:
        return
    point, at, *who = spec.split(":")
    if at == "preflight":  # the preflight's: preflight()
        return
    target, step = (int(who[0].removeprefix("r")) if who else 0), int(at)
    marker = rundir.fault_marker(out_dir, point, step)
    if rank != target or marker.exists():
        return
    if point == "wait" and step == 0:
        marker.write_text(spec)
        _wait_for_a_signal(WAIT_S)
        # still in start-up, where the watcher (lifeline) ends this process: without the wait the loop began first, at
        # times, and its handler took the signal instead (seen once: a stop with its checkpoint at step 2)
        time.sleep(START_UP_S)
    elif point in ("step", "node", "pause", "wait", "oom", "memory"):
        steps = itertools.count(steps_done + 1)  # the global step each optimizer step completes

        def after_optimizer_step(*_: Any) -> None:
            if next(steps) == step:
                if point == "pause":
                    marker.write_text(spec)
                    os.kill(os.getpid(), signal.SIGSTOP)  # on until the test's SIGCONT
                    return
                if point == "wait":
                    marker.write_text(spec)
                    _wait_for_a_signal(WAIT_S)
                    return
                if point == "oom":
                    marker.write_text(spec)
                    raise RuntimeError(f"CUDA out of memory. Tried to allocate 2.00 GiB (DDP_CIFAR_FAULT={spec})")
                if point == "memory":
                    marker.write_text(spec)
                    _take_memory()
                if point == "node":
                    os.kill(os.getppid(), signal.SIGKILL)
                _kill(marker, spec, os.getpid())

        register_optimizer_step_post_hook(after_optimizer_step)
    elif point in ("write", "launcher"):
        temporary = f".{rundir.step_path(out_dir, step).name}."  # files.replace's temporary file of that checkpoint

        def on_rename(event: str, args: tuple) -> None:  # a Python audit hook: called for audited events
            if event == "os.rename" and Path(args[0]).name.startswith(temporary) and not marker.exists():
                if point == "write":
                    os.truncate(args[0], os.path.getsize(args[0]) // 2)
                _kill(marker, spec, os.getpid() if point == "write" else os.getppid())

        sys.addaudithook(on_rename)


def preflight(out_dir: str) -> None:
    """wait:preflight, once per out_dir: here until SLURM chose this job for preemption or the marker says go, WAIT_S at
    most."""
    marker = rundir.fault_marker(out_dir, "wait", "preflight")
    if os.environ.get(VAR) != "wait:preflight" or marker.exists() or not (job := launchers.slurm_job()):
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("wait:preflight")
    until = time.monotonic() + WAIT_S
    while requeue.preempted(requeue.shown(job)) is None and marker.read_text() != "go" and time.monotonic() < until:
        time.sleep(0.1)


def _wait_for_a_signal(seconds: float) -> None:
    """Here until a signal that has a handler of its own comes (the run's stop signals: their handlers run too),
    `seconds` at most."""
    came, previous = [], {}

    def noted(signum: int, frame: Any) -> None:
        came.append(signum)
        previous[signum](signum, frame)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        if callable(handler := signal.getsignal(sig)):
            previous[sig] = handler
            signal.signal(sig, noted)
    try:
        until = time.monotonic() + seconds
        while not came and time.monotonic() < until:
            time.sleep(0.01)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _take_memory() -> None:
    """Memory, 64 MB at a time and each byte written (untouched pages cost nothing), until this process is killed."""
    taken = [bytearray(b"\x01") * (64 << 20) for _ in range(1024)]
    raise RuntimeError(f"{VAR}=memory: {len(taken) * 64 / 1024:g} GB taken and still not killed: no memory limit?")


def _kill(marker: Path, spec: str, pid: int) -> None:
    marker.write_text(spec)
    os.kill(pid, signal.SIGKILL)
