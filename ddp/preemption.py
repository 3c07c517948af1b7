"""Stopping on request: a stop signal (SLURM's warning before a time limit or preemption, `kill`, Ctrl-C,
a terminal's hang-up) only sets a flag, which the loop reads at its next step boundary; after the stop
checkpoint every rank leaves with Stopped (exit 75), and the same command resumes. A second Ctrl-C stops at once.

A pause (SIGTSTP from ddp/torchrun.py's Ctrl-Z: lifeline) is agreed the same way, and every rank stops its process
after the same step, with no collective under way: a pause outlasts run.timeout_s. Where a launcher that does not pass
Ctrl-Z on is stopped (plain torchrun, accelerate launch), every rank holds after the same step until it goes on.
"""

from __future__ import annotations

import shlex
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import TypeVar

from ddp import distributed, launchers, lifeline, logs, requeue
from ddp.devices import World
from ddp.errors import Stopped, UsageError

T = TypeVar("T")
HOLD, PAUSE, STOP = 1, 2, 3  # the flags of StopAgreement: the highest any rank sends wins
HOLD_S = 0.25  # how often held ranks agree again whether to go on
# How long a rank waits at an agreed pause for its own SIGTSTP. ddp/torchrun.py sends it to each rank in turn, and
# each one's watcher reads it once it has the interpreter's lock: at a GPU's steps of a few ms, another rank's, read
# a step earlier, may make the agreement first. Without the wait, this rank went on into the next step's collectives,
# where its watcher stopped it, with a collective under way.
PAUSE_WAIT_S = 2.0

# Signals the system sends for ordinary events: as a stop signal, each would stop a run that nobody stopped.
ORDINARY = {
    "SIGCHLD": "every child process's end (DataLoader workers end with each epoch)",
    "SIGWINCH": "every resize of the terminal",
    "SIGCONT": "every job that goes on after a stop (fg after Ctrl-Z)",
    "SIGURG": "urgent data on a socket",
    "SIGPIPE": "every write to a pipe whose reader has gone",
}
# Signals a crash raises in the thread that crashed: a handler returns to the faulting instruction, which faults
# again, so a crashed process (a bad memory access in a library, say) would hang for good instead of ending.
CRASHES = ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGSYS", "SIGTRAP")


# Ctrl-C ignored when this process started (a script's background job: `python ddp/train.py ... &`), as
# Python leaves it: then SIGINT is not taken as a stop signal either, and the job stays immune to Ctrl-C.
# So is a hang-up under nohup (`nohup python ddp/train.py ...`): SIGHUP is not a stop there.
IGNORED_AT_START = {name: signal.getsignal(signal.Signals[name]) == signal.SIG_IGN for name in ("SIGINT", "SIGHUP")}


def parse_signals(names: str) -> list[signal.Signals]:
    """ "SIGTERM,SIGUSR1" (or "TERM,USR1") as signals; "" or "none" for no handlers. SIGINT and SIGHUP are left
    out of them in a process that started with them ignored (IGNORED_AT_START: a background job's, nohup's)."""
    out, named = [], list(filter(None, (n.strip().upper() for n in names.split(","))))
    if not named:  # "," or " ": a typo; "none" says no handlers
        raise UsageError(f"run.stop_signal={names!r} names no signal: give them by name (e.g. SIGTERM,SIGUSR1), or "
                         "none for no stop on a signal")  # fmt: skip
    for name in named:
        if name == "NONE":
            continue
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full not in signal.Signals.__members__ or full in ("SIGKILL", "SIGSTOP"):
            raise UsageError(
                f"run.stop_signal: {name!r} is not a signal that can be caught; e.g. SIGTERM,SIGUSR1,SIGINT"
            )
        if full in CRASHES:
            raise UsageError(
                f"run.stop_signal: {full} is what a crash raises: caught, a crashed process would "
                "hang for good instead of ending; stop signals are ones sent for it, e.g. SIGTERM"
            )
        if full in ORDINARY:
            raise UsageError(f"run.stop_signal: {full} comes with {ORDINARY[full]}, not to stop a run; stop signals "
                             "are ones sent for it, e.g. SIGTERM,SIGUSR1,SIGINT")  # fmt: skip
        if not IGNORED_AT_START.get(full, False):
            out.append(signal.Signals[full])
    return out


class StopRequest:
    """Context manager: while inside, the given signals request a stop instead of killing, and the
    lifeline may request one (the launcher's end). The loop asks at_step_boundary() after each step. `main`:
    rank 0's, which asks SLURM as it enters whether a preemption came that signalled no rank."""

    def __init__(self, signals: list[signal.Signals] | tuple[signal.Signals, ...], main: bool = False) -> None:
        self.signals, self.received, self._previous, self.main = signals, None, {}, main
        self.last_boundary = time.monotonic()
        self.longest_step_s = 0.0  # the longest time between two step boundaries: what a stop may take
        self.last_step_s = 0.0  # the last one: what a pause may take (lifeline)

    @property
    def requested(self) -> bool:
        return self.received is not None

    def at_step_boundary(self) -> bool:
        """Whether a stop was requested, asked at a step boundary (which this also times)."""
        now = time.monotonic()
        self.last_step_s = now - self.last_boundary
        self.longest_step_s = max(self.longest_step_s, self.last_step_s)
        self.last_boundary = now
        return self.requested

    def flag(self) -> int:
        """This rank's flag: stop, pause, hold (its launcher is stopped) or 0."""
        return STOP if self.requested else PAUSE if lifeline.pause_asked() else HOLD if lifeline.launcher_held() else 0

    def agreed(self, agreement: distributed.StopAgreement) -> bool:
        """At a step boundary: this rank's flag sent on, and whether every rank stops now; an agreed hold or pause
        is taken here (take). A step late: the flags of the step before, on any rank."""
        self.at_step_boundary()
        return self.take(agreement.after_step(self.flag()), agreement)

    def take(self, agreed: int, agreement: distributed.StopAgreement) -> bool:
        """An agreed hold or pause taken; whether the agreement (StopAgreement's, or its wait() at an epoch's end) says
        stop. A hold: every rank agrees again every HOLD_S, until no launcher is stopped (or a rank asks to stop or
        pause). A pause: a rank that was not asked for one within PAUSE_WAIT_S goes on (no one would continue it)."""
        if agreed == HOLD:
            if agreement.world.is_main:
                logs.say("note: holding: a launcher of this job is stopped (Ctrl-Z of torchrun or accelerate launch; "
                         "fg continues it). Every rank waits after the same step with no collective under way, so "
                         "the hold may outlast run.timeout_s")  # fmt: skip
            with lifeline.holding():
                while (agreed := distributed.highest(self.flag(), agreement.world)) == HOLD:  # (none on their way)
                    time.sleep(HOLD_S)
        if agreed == PAUSE:
            _pause(agreement.world, "a step boundary")
        if agreed in (HOLD, PAUSE):
            self.last_boundary = time.monotonic()  # the hold or pause is no step's time
        return agreed == STOP

    def epoch_started(self) -> None:
        """The epoch's end before (its evaluation, its checkpoint) is no step's time: its progress is lifeline's."""
        self.last_boundary = time.monotonic()

    def request(self, why: str) -> None:
        """A stop for another reason than a signal (from another thread)."""
        self.received = self.received or why

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without the checkpoint
        self.received = signal.Signals(signum).name

    def __enter__(self) -> StopRequest:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self.last_boundary = time.monotonic()
        lifeline.set_loop_stop(self)
        if self.main and signal.SIGTERM in self.signals and (job := launchers.slurm_job()):
            if why := _preempted_unsignalled(job):
                self.request(why)
        return self

    def __exit__(self, kind: type | None, value: BaseException | None, tb: TracebackType | None) -> None:
        lifeline.set_loop_stop(None)
        if kind is None:  # trained to the last epoch, saved: a stop signal from here on stops nothing (its agent says)
            launchers.record_finished()
        if kind is not None and issubclass(kind, Stopped):
            # Leaving with a checkpoint on disk: a late signal must not turn exit 75 into a kill. When
            # one rank has exited, torchrun SIGTERMs the others while they are still on their way out,
            # and Python puts the default action back on its own handlers as the interpreter exits;
            # an ignored signal stays ignored.
            for sig in {*self.signals, signal.SIGTERM}:
                signal.signal(sig, signal.SIG_IGN)
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _preempted_unsignalled(job: str) -> str | None:
    """Rank 0's ask as training starts (StopRequest, `main`): SLURM's preemption before the job's step (a batch
    script's set-up before srun: its modules, its environment, ddp's preflight) signalled no rank, and the job trained
    on through its GraceTime until SLURM killed it. A stop's reason where SLURM chose the job, else None."""
    if (when := requeue.preempted(requeue.shown(job, timeout_s=10))) is None:
        return None
    return f"SLURM's preemption at {when} (its SIGTERM came before this job's step: to no rank)"


def agreed_pauses(batches: Iterable[T], world: World) -> Iterator[T]:
    """An evaluation's batches (as many on every rank: loaders.EvalBatches), with a pause (SIGTSTP) taken after the same
    batch by every rank, agreed as a step's is. A rank that paused by itself between two batches, while another
    already waited for it in the counts' all-reduce, stopped that one's wait past run.timeout_s: the run ended."""
    agreement = distributed.StopAgreement(world)
    lifeline.progress()
    try:
        for batch in batches:
            yield batch
            lifeline.progress()
            if agreement.after_step(PAUSE if lifeline.pause_asked() else 0):  # the batch before's flags
                _pause(world, "an evaluation batch")
        if agreement.wait():
            _pause(world, "an evaluation batch")
    finally:
        lifeline.progress(evaluating=False)


def _pause(world: World, where: str) -> None:
    """A pause every rank agreed on, taken: stopped here until continued (fg, bg: its launcher continues it; SLURM's
    resume), and said where the job's log shows nothing else of it (SLURM's)."""
    if (paused_s := lifeline.safe_point(PAUSE_WAIT_S)) is not None and world.is_main:
        logs.say(f"note: continued after {paused_s:.0f} s paused at {where} every rank agreed on (SIGTSTP: Ctrl-Z, "
                 "SLURM's suspend): no collective was under way, so the pause could outlast run.timeout_s")  # fmt: skip


def how_to_resume(job: str | None, requeued: bool | None, out_dir: str | Path) -> str:
    """The stop's last words: how this run goes on. A job that SLURM did not requeue resumes only with its out_dir
    named: `sbatch slurm/train.sh` again wrote to the new job's own (runs/slurm-<its id>), and started afresh."""
    again = f"run.out_dir={shlex.quote(str(out_dir))}"
    if job is None:
        return "run the same command to resume"
    if requeued:
        return "SLURM starts the job again, and it resumes from this checkpoint"
    if requeued is None:
        return f"if SLURM does not start the job again (squeue -j {job}), resume with {again}"
    why = " (slurm/train.sh gives a new job an out_dir of its own)" if Path(out_dir).name == f"slurm-{job}" else ""
    return f"to resume, run it again with {again}{why}"


def finish_stop(signal_name: str | None, saved: Path | None, world: World, out_dir: str | Path) -> None:
    """After the stop checkpoint: rank 0 says why (its own reason, else the first rank's that had
    one), asks SLURM to requeue the job (if in one, and it runs), and how the run resumes; all ranks leave."""
    causes = distributed.gather_objects(signal_name, world)
    cause = signal_name or next((f"{why} (rank {rank})" for rank, why in enumerate(causes) if why), "a signal")
    job, requeued = launchers.slurm_job(), None
    if world.is_main:
        logs.say(f"stopping on {cause}: checkpoint {saved}")
        if job:
            requeued, said = requeue.ask(job)
            logs.say(said)
    distributed.barrier(world)  # leave together, after rank 0's checkpoint is on disk
    why = f"stopped on {cause}; {how_to_resume(job, requeued, out_dir)}"
    raise Stopped(why if world.is_main else "")  # other ranks print nothing but errors
