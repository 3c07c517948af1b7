"""Fault injection for the kill-and-resume tests: does nothing unless DDP_CIFAR_FAULT is set.

    DDP_CIFAR_FAULT=step:N[:rR]   SIGKILL rank R (default 0) right after global step N
    DDP_CIFAR_FAULT=write:N       SIGKILL rank 0 halfway through writing the checkpoint of global step N

A fault fires once per run directory: it leaves `fault-fired.<point>.<N>` in out_dir first, so the
restarted job (same command, same environment) runs through. SIGKILL is what a kill -9, the OOM killer or a
lost node does: no handler runs, nothing is flushed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

VAR = "DDP_CIFAR_FAULT"


def maybe_kill(point: str, n: int, rank: int, out_dir: str | Path) -> None:
    spec = os.environ.get(VAR)
    if not spec:
        return
    where, at, *who = spec.split(":")
    target = int(who[0].removeprefix("r")) if who else 0
    marker = Path(out_dir) / f"fault-fired.{where}.{at}"
    if where != point or int(at) != n or rank != target or marker.exists():
        return
    marker.write_text(spec)
    os.kill(os.getpid(), signal.SIGKILL)
