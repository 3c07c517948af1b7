"""Ctrl-Z of ddp/torchrun.py (SIGTSTP), torchrun's agent: it pauses the ranks, then itself, and fg or bg continues them
all; SLURM's suspend it leaves to the ranks; SIGUSR1/2 it sends on to them (pass_on); a stop after they all trained to
their last epoch is exit 0 (signalled). The ranks' side: lifeline (outside training), preemption.StopRequest (in it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ddp import launchers, processes

PAUSE_S = 30.0  # how long Ctrl-Z waits for a rank to pause before it stops it where it is (its watcher: 2 steps)
PASSED_ON = (signal.SIGUSR1, signal.SIGUSR2)  # what torch's agent leaves to their default action: its end


@contextlib.contextmanager
def passing_on() -> Iterator[None]:
    """While inside, pass_on for PASSED_ON in this process, torchrun's agent (ddp/torchrun.py,
    ddp/accelerate_launch.py); one ignored where this process started (`nohup`, a script's `&`) is left ignored.
    The handlers before are back after (a launcher's main called in a test's process)."""
    before = {passed: signal.getsignal(passed) for passed in PASSED_ON}
    for passed, handler in before.items():
        if handler == signal.SIG_DFL:
            signal.signal(passed, pass_on)
    try:
        yield
    finally:
        for passed, handler in before.items():
            signal.signal(passed, handler)


def pass_on(signum: int, frame: object) -> None:
    """PASSED_ON's handler in torchrun's agent: the signal to each of its ranks, which stop on it (run.stop_signal:
    SIGUSR1 by default) with their checkpoint, and the agent ends with their exit code. It ended the agent (exit
    138; under SLURM, `scancel --signal=USR1 JOB`: "srun: error: task 0: User defined signal 1"), and where the agent
    alone had it (`kill -USR1` of a launch file's pid) the ranks stopped on its end instead, a loss of the launcher.
    Before a rank runs (or after the last), the agent ends as on SIGTERM (torch's SignalException: 128 + N)."""
    ranks = processes.children()
    if not ranks:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
    for pid in ranks:
        _signal(pid, signal.Signals(signum), group=False)


@contextlib.contextmanager
def finish_marks() -> Iterator[Path]:
    """A folder of this agent's, named to its ranks (launchers.FINISHED_DIR in the environment they get from this
    process), where each leaves a mark as its training ends (launchers.record_finished); removed after."""
    ours = tempfile.mkdtemp(prefix="ddp-cifar-finished-")
    try:
        with launchers.environment_changed({launchers.FINISHED_DIR: ours}):
            yield Path(ours)
    finally:
        shutil.rmtree(ours, ignore_errors=True)


def signalled(signum: int, marks: Path) -> int:
    """The exit code of an agent that stop signal `signum` ended (torch's SignalException): 128 + N, as a shell says; 0
    where every rank it started had trained to its last epoch first (launchers.all_finished in `marks`). A SLURM
    preemption's or time limit's SIGTERM in a job's last seconds (its last evaluation and checkpoint, the ranks' exit)
    left the job FAILED (143), not requeued, with no word, though its work was done."""
    if not launchers.all_finished(marks):
        return 128 + int(signum)
    _say(f"note: {signal.Signals(int(signum)).name} came after every rank on {socket.gethostname()} had trained to its "
         "last epoch: the run is complete, nothing was stopped")  # fmt: skip
    return 0


class Pause:
    """Ctrl-Z (SIGTSTP): torchrun's ranks run in sessions of their own, which the terminal's Ctrl-Z does not reach:
    they trained on, and past run.timeout_s without the stopped agent's store they failed. Here the ranks of a job on
    one machine pause first, each where no collective is under way (lifeline.safe_point: a step boundary, or an
    evaluation batch, they agreed on), so that the pause may last; then this process stops, as any job does. fg or bg
    continues it, and it continues them. A rank that has not paused within PAUSE_S, or at a second Ctrl-Z, is
    stopped where it is. A job on several machines goes on: a pause of this one would stop them all.
    SLURM's suspend (`by_slurm`) is no Ctrl-Z: every process of the job, on each machine, has the SIGTSTP, and SLURM
    stops them all 2 s later and continues them at its resume. Each rank pauses by itself; this process neither waits
    for them nor stops itself (stopped by SLURM inside that wait and resumed, it waited on, then stopped its ranks and
    itself for good)."""

    def __init__(self, one_machine: bool, by_slurm: bool = False) -> None:
        self.one_machine, self.by_slurm = one_machine, by_slurm
        self.pausing, self.now, self.continued = False, False, False

    def __call__(self, signum: int, frame: object) -> None:
        if self.pausing:  # Ctrl-Z again while the ranks reach their step boundary: now
            self.now = True
            return
        if self.by_slurm:  # (sent on as well, where SLURM signals this process group alone: proctrack/pgid)
            for pid in processes.children():
                _signal(pid, signal.SIGTSTP, group=False)
            return
        if not self.one_machine or not (processes.PROC / "self").exists():
            why = ("a job on several machines (the others' ranks would wait for this one's past run.timeout_s)"
                   if not self.one_machine else "ranks it cannot find on this system (no /proc: macOS?)")  # fmt: skip
            _say(f"note: Ctrl-Z does not pause {why}: it goes on; Ctrl-C stops it with a checkpoint")
            return
        self.pausing, self.continued, ranks = True, False, processes.children()
        try:
            for pid in ranks:
                _signal(pid, signal.SIGTSTP, group=False)
            self.wait_for(ranks)
            # Stopped here until continued (fg, bg; kill %1 too, with SIGCONT). Not by SIGTSTP's default action: in an
            # orphaned process group (a SIGTSTP sent by hand to a nohup'd or setsid job) the system discards that
            # stop, and the ranks were continued at once. Not where this process was continued meanwhile (SLURM's
            # resume of a job in a terminal, srun --pty, suspended while its ranks took their time).
            if not self.continued:
                os.kill(os.getpid(), signal.SIGSTOP)
        finally:  # (also where a stop signal's handler raised: the ranks then take it)
            for pid in ranks:
                _signal(pid, signal.SIGCONT, group=True)  # (its DataLoader workers too, where they were stopped)
            self.pausing = self.now = False

    def resumed(self, signum: int, frame: object) -> None:
        """SIGCONT's handler: this process continued (fg, bg, SLURM's resume), and its ranks with it; a pause not yet
        taken is over."""
        self.continued = True
        for pid in processes.children():
            _signal(pid, signal.SIGCONT, group=True)

    def wait_for(self, ranks: list[int]) -> None:
        """Until each of `ranks` is stopped or has ended (after training a rank does not pause: it ends). One without a
        handler of SIGTSTP (starting: its lifeline does not watch yet) is stopped at once; one not stopped within
        PAUSE_S, or at a second Ctrl-Z, then."""
        start, said = time.monotonic(), False
        while (late := [pid for pid in ranks if _state(pid) not in "TtZX"]) and not self.continued:
            for pid in late:
                if not _handles_sigtstp(pid):
                    _signal(pid, signal.SIGSTOP, group=True)
            if self.now or time.monotonic() - start > PAUSE_S:
                break
            if time.monotonic() - start > 2 and not said:
                _say(f"(pausing: each rank where no collective is under way, up to {PAUSE_S:.0f} s; Ctrl-Z again: now)")
                said = True
            time.sleep(0.02)
        if self.continued:  # (a pause over before it was taken: stop no one)
            return
        for pid in late:
            _signal(pid, signal.SIGSTOP, group=True)
        if late:
            _say(
                f"note: paused {', '.join(_rank_name(pid) for pid in late)} where it was: a pause longer than "
                "run.timeout_s may end the run when it goes on"
            )


def by_slurm() -> bool:
    """Whether a SIGTSTP of this process is SLURM's suspend of its job: it runs in one (srun passes no Ctrl-Z on to its
    tasks), and is no terminal's foreground job (`srun --pty bash`, where a Ctrl-Z is the terminal's)."""
    if launchers.slurm_job() is None:
        return False
    try:
        terminal = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # none: a batch job's, srun's task
        return True
    try:
        return os.tcgetpgrp(terminal) != os.getpgrp()
    except OSError:
        return True
    finally:
        os.close(terminal)


def _state(pid: int) -> str:
    """/proc's state of `pid` (R, S, T: stopped, Z, ...); X for none."""
    return (processes.proc_stat(pid) or ["X"])[0]


def _handles_sigtstp(pid: int) -> bool:
    """Whether `pid` has a handler for SIGTSTP (a rank's lifeline installs one): /proc's SigCgt mask."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        caught = int(next(line for line in status if line.startswith("SigCgt:")).split()[1], 16)
    except (OSError, StopIteration, IndexError, ValueError):
        return False
    return bool(caught >> (signal.SIGTSTP - 1) & 1)


def _rank_name(pid: int) -> str:
    rank = processes.environment(pid).get("RANK")
    return f"process {pid}" if rank is None else f"rank {rank}"


def _signal(pid: int, sig: signal.Signals, group: bool) -> None:
    """`sig` to `pid`, or to its process group where it leads one of its own (a rank: its DataLoader workers too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group and os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
