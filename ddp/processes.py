"""A process's state, its children and its launchers, from Linux's /proc (elsewhere: nothing is known, no child is
found, and the parent alone is a launcher): the lifeline's watch of a run's launchers, the launchers' of their ranks."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PROC = Path("/proc")  # Linux's processes (self: this one); a system without them (macOS) has none to find
OOM_FIRST = 500  # what a rank adds to its oom_score_adj (of -1000..1000): first_for_the_oom_killer

# Commands that start a run's processes and stay their parents (or grandparents) while they run.
_LAUNCHER_WORDS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "accelerate", "mpirun",
                   "mpiexec", "orterun", "prterun", "accelerate_launch.py")  # fmt: skip


def first_for_the_oom_killer() -> None:
    """A rank raises its oom_score_adj by OOM_FIRST (its DataLoader workers inherit it): where memory runs out, the
    kernel ends a rank first, and the launcher says which and that memory ran out (torchrun.killed). Killed itself, a
    launcher said nothing: torchrun's agent, in its first seconds as large as a rank (torch imported, the preflight
    run), was the first to go of 32 ranks in a 2 GiB cgroup, and the job ended as the shell's "Killed". The kernel
    counts the raise as that share (/1000) of the memory it weighs, a cgroup's limit: 200 was 419 MB there, less than
    the agent's 556 MB over a rank just started (the full suite's test: its agent killed once in three runs); 500 is
    half of it. Only Linux has the file; a raise refused (a read-only /proc) changes nothing."""
    path = PROC / "self" / "oom_score_adj"
    with contextlib.suppress(OSError, ValueError):
        path.write_text(str(min(1000, int(path.read_text()) + OOM_FIRST)))


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name ([state, ppid, ...]), None for no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def launcher_processes(parent: int) -> list[int]:
    """The processes whose end ends this run's process: `parent` (the one that started it) and each
    ancestor above it that is a launcher too (accelerate above the mpirun that started this process),
    nearest first. Linux /proc; elsewhere the parent alone."""
    chain, pid = [parent], parent
    while (stat := proc_stat(pid)) is not None and (pid := int(stat[1])) > 1:
        if not any(word.endswith(_LAUNCHER_WORDS) for word in (command_line(pid) or [])[:3]):
            break
        chain.append(pid)
    return chain


def command_line(pid: int) -> list[str] | None:
    """/proc/PID/cmdline's words (each ends in a NUL), None for no such process."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [word.decode(errors="replace") for word in words.removesuffix(b"\0").split(b"\0")] if words else []


def environment(pid: int) -> dict[str, str]:
    """/proc/PID/environ as a dict; {} where it cannot be read (the process gone, another user's, no /proc)."""
    try:
        pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").partition("=")[::2] for p in pairs if b"=" in p)


def nearest_running(parent: int, script: str, depth: int = 3) -> list[int]:
    """The processes below `parent`, nearest to it, that run `script` (a word of their command line): mpirun's ranks,
    its children under Open MPI and its proxy's (hydra_pmi_proxy) under MPICH and Intel MPI. Not an MPI launcher whose
    arguments name it: Intel MPI's mpirun is a shell script that starts mpiexec.hydra with them (which took the Ctrl-C
    sent to it as its own, and a second one as "force abort": the ranks ended, none saved). None without /proc."""
    found, below = [], children(parent)
    for _ in range(depth):
        level, below = below, []
        for pid in level:
            words = command_line(pid) or []
            if script in words and not Path(words[0]).name.startswith(("mpirun", "mpiexec")):
                found.append(pid)
            else:
                below += children(pid)
    return found


def children(parent: int | None = None) -> list[int]:
    """The processes this one (or `parent`) started that run (not zombies): the ranks, started by the agent."""
    try:
        me, pids = str(parent or os.getpid()), [int(name) for name in os.listdir(PROC) if name.isdigit()]
    except OSError:  # no /proc
        return []
    return [pid for pid in pids if (stat := proc_stat(pid)) and stat[1] == me and stat[0] != "Z"]
