"""How long a process of a run lives and waits: it leaves when the launcher that started it is gone, a stop signal ends
it within seconds also while it waits inside torch, and no wait outlasts its deadline. One watcher thread does the
three, because the main thread may be blocked in C++.

- The launcher's death: torchrun (and accelerate, mpirun) start their workers in sessions of their own, so a SIGKILL
  of the launcher does not reach them. The watcher sees the parent go (this process is given another parent), asks for
  a stop (the next step boundary saves a checkpoint and every rank leaves, exit 75) and, when no boundary comes within
  the grace, leaves at once (exit 1).
- A stop signal: Python runs its handler only when the main thread is back in Python; it also wakes the watcher
  (signal.set_wakeup_fd): before training it ends the process at once (exit 1, nothing to save; Ctrl-C:
  errors.INTERRUPTED's line, exit 130; SLURM's preemption: rank 0 requeues the job, exit 75); in training the loop
  takes it at its next step boundary (exit 75), and when none comes within the grace (a wait in a collective), the
  watcher ends the process (exit 1). After training, a launcher's stop (as one rank dies) gives the process the grace
  to end by itself, its line said.
- Deadlines: a wait that torch would let run past run.timeout_s (the store and the rendezvous) is ended by the watcher
  with one line that names what it waited for (exit 1); one inside torch that holds the interpreter's lock, where the
  watcher cannot run, by faulthandler's thread (distributed.backstop). They count time on `awake()`, which stands
  still while the process is stopped (SIGSTOP: SLURM's `scontrol suspend`): a job stopped whole and continued goes on
  waiting, where it left at once past its deadline.
- A pause (SIGTSTP: Ctrl-Z of ddp/torchrun.py, which sends it on to its ranks, a job on one machine; SLURM's suspend,
  2 s before its SIGSTOP, on every machine): the process stops itself where no collective is under way (safe_point:
  a step boundary or evaluation batch every rank agreed on), so that the pause may outlast run.timeout_s; the watcher
  stops it before training at once, and where no safe point came within two steps (a checkpoint's save); after
  training it ends. The agent (SLURM's resume) continues it. A launcher that does not pass Ctrl-Z on (plain torchrun,
  accelerate launch) seen stopped: the loop holds (launcher_held, preemption) until it goes on.
"""

from __future__ import annotations

import ctypes
import math
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Protocol

from ddp import launchers, processes, requeue
from ddp.devices import World
from ddp.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_STOPPED, INTERRUPTED

GRACE_S = 5.0  # after a stop is asked for: how long past the slowest step the loop has to take it
SLACK_S = 5.0  # how long a wait with a deadline of run.timeout_s may overrun it, torch's own timeout first
_POLL_S = 0.25  # how often the watcher looks at the parent, the deadlines and the grace
BACKSTOP_S = 10.0  # past a deadline and its slack, where the watcher could not end a wait: distributed.backstop
LATE_S = 1.0  # a watcher that looks again later than this after a SIGCONT was stopped: the time past it does not count
CONTINUED_S = 0.5  # how long the watcher waits for the SIGCONT of a stop after it looked late


class LoopStop(Protocol):
    """What the watcher needs of the training loop's stop (preemption.StopRequest): to ask for one,
    and how long a step has taken at most."""

    longest_step_s: float
    last_step_s: float

    def request(self, why: str) -> None: ...


class _Watcher:
    """The watcher thread's state. Its methods run on that thread, but for `deadline`."""

    def __init__(self, world: World, parent: int, stop_signals: tuple[signal.Signals, ...]) -> None:
        self.who = f"rank {world.rank} of {world.world_size}" if world.grouped else "the run"
        self.stop_signals = set(stop_signals)  # other handled signals wake the watcher too (SIGCHLD: loader workers)
        self.launched = world.launcher != "none"  # a plain process may outlive its shell (nohup)
        self.main, self.job = world.is_main, launchers.slurm_job()  # rank 0 requeues a job preempted in its start-up
        self.launchers = processes.launcher_processes(parent) if self.launched else []
        self.waits: dict[int, tuple[float, str]] = {}  # id -> (monotonic deadline, the line past it)
        self.stop_asked: tuple[float, str] | None = None  # (when, why) a stop was asked for in training
        self.wakeup_read, self.wakeup_write = os.pipe()
        os.set_blocking(self.wakeup_write, False)
        self.done = threading.Event()
        self.clock = (time.monotonic(), 0.0)  # (when the watcher last looked, the seconds stopped before), as one
        self.last_stop = (0.0, 0.0)  # (when the last stop the watcher saw ended, on time.monotonic(); its seconds)
        self.continued = False  # a SIGCONT came since the last look: the process was stopped (not only slow to look)
        self.late: float | None = None  # when the watcher looked after a gap over LATE_S, before its SIGCONT came
        self.looks = threading.Lock()
        # A pause asked for (SIGTSTP) and not yet taken, and when the watcher takes it where no safe point came.
        # Asked and cancelled (a SIGCONT: the agent continued the process) here, in the order the signals came.
        self.pause_asked, self.pause_by, self.pauses = False, None, threading.Lock()
        self.progressed = 0.0  # on awake(): the last safe point or busy() work (progress between step boundaries)
        self.evaluating = False  # in an evaluation: its pauses are agreed (progress)
        self.busy = 0  # busy() work under way: a stop's grace waits for it
        self.stopped_s = 0.0  # the stops' seconds, each from half a _POLL_S after the look before it (awake's: LATE_S)
        self.held, self.held_seen = False, False  # a launcher stopped (Ctrl-Z of a plain torchrun): watch_launchers

    def awake(self) -> float:
        """time.monotonic() less the time this process was stopped: the watcher's looks more than LATE_S apart with a
        SIGCONT between them. Past LATE_S since its last look (it has not looked since) the clock stands there."""
        looked, stopped = self.clock
        return min(time.monotonic(), looked + LATE_S) - stopped

    def looking(self) -> float:
        """A look: the clock moved on, and its time. A gap over LATE_S since the last look is a stop where a SIGCONT
        came (it counts as LATE_S), waited for up to CONTINUED_S: the process may run before its signal is handled.
        Without one (the watcher kept from the interpreter's lock by a long call) it counts whole."""
        with self.looks:  # (the watcher's, and the main thread's in stopped_lately)
            looked, stopped = self.clock
            now = time.monotonic()
            seen = self.late or now  # the first look after the gap
            if seen - looked > LATE_S:
                if not self.continued and now - seen < CONTINUED_S:
                    self.late = seen  # the clock stands meanwhile (awake)
                    return self.awake()
                if self.continued:
                    stopped += seen - looked - LATE_S
                    self.last_stop = (seen, seen - looked)
                    self.stopped_s += seen - looked - _POLL_S / 2  # (it began within a _POLL_S of that look)
            self.clock, self.late, self.continued = (now, stopped), None, False
            return self.awake()

    def run(self) -> None:
        try:
            self.watch()
        except Exception as e:  # (no watcher: no deadline would come, no stop signal be heard; a hang, later)
            _leave(f"error: {self.who}: its watcher thread failed ({type(e).__name__}: {e}): left")

    def watch(self) -> None:
        poller = select.poll()  # (select.select refuses a descriptor past 1023: a process with many files open, or
        poller.register(self.wakeup_read, select.POLLIN)  # ~500 runs in one before each closed its pipe)
        while not self.done.is_set():
            if poller.poll(_POLL_S * 1000) and not self.done.is_set():  # (done: watched's byte woke it, nothing to do)
                signums = os.read(self.wakeup_read, 64)
                if pausing := [s for s in signums if s in (signal.SIGTSTP, signal.SIGCONT)]:
                    self.asked_to_pause(pausing[-1] == signal.SIGTSTP)  # (a SIGTSTP then a SIGCONT: over)
                for signum in signums:
                    self.continued = self.continued or signum == signal.SIGCONT
                    if signum in self.stop_signals:
                        self.signalled(signal.Signals(signum).name)
            self.watch_launchers()
            now = self.looking()
            self.pause_if_late(now)
            for until, line in list(self.waits.values()):
                if now > until:
                    _leave(f"error: {self.who}: {line}", every_rank=True)
            if self.stop_asked and now > self.leave_by():
                asked_at, why = self.stop_asked
                slowest = f"; the slowest step took {_loop_stop.longest_step_s:.1f} s" if _loop_stop else ""
                waited = f"within {now - asked_at:.0f} s (a wait for another rank?{slowest})"
                _leave(f"error: {self.who}: stopping on {why} after training, but it had not ended {waited}: left"
                       if _loop_ended else f"error: {self.who}: stopping on {why}, but no step boundary came "
                       f"{waited}: left without a checkpoint")  # fmt: skip

    def watch_launchers(self) -> None:
        """A launcher's end asks for a stop. A launcher stopped in training, at this look and the one before (a job
        stopped whole, SLURM's suspend, may continue its ranks a moment before their launcher), holds the loop."""
        if self.launchers and (gone := self.launcher_gone()):
            why = f"the launcher's end (its process {gone} is gone)"
            if os.getpgrp() == os.getpid():  # (its DataLoader workers, where the launcher stopped them with it)
                os.killpg(os.getpid(), signal.SIGCONT)
            if _loop_ended:
                self.leaving(why)
            else:
                self.ask_to_stop(why, tell_the_loop=True)
            self.launchers = []
        seen = _loop_stop is not None and any((processes.proc_stat(pid) or [""])[0] == "T" for pid in self.launchers)
        self.held, self.held_seen = seen and self.held_seen, seen

    def asked_to_pause(self, asked: bool) -> None:
        """SIGTSTP (`asked`): before training this process stops at once, until continued; in training at its next
        safe point, or here within two steps; after it not (it is on its way out: a stop in the group's end would
        outlast faulthandler's backstop). A SIGCONT cancels a pause not yet taken (continued: it is over)."""
        with self.pauses:
            stop = _loop_stop
            self.pause_asked = asked and not _loop_ended
            self.pause_by = self.awake() + 2 * stop.last_step_s + 1.0 if self.pause_asked and stop else None
        if self.pause_asked and not stop:
            self.pause()

    def pause_if_late(self, now: float) -> None:
        """Takes a pause asked for in training where no safe point came by its time (`now`: awake())."""
        if self.pause_by is not None and now > self.pause_by and not self.evaluating:
            self.pause()

    def pause(self) -> float | None:
        """A pause asked for and not yet taken: this process stops here (once: the main thread's safe_point, or the
        watcher's), until continued. The seconds it was stopped; None for no pause."""
        with self.pauses:
            asked, self.pause_asked, self.pause_by = self.pause_asked, False, None
        if not asked:
            return None
        start = time.monotonic()
        os.kill(os.getpid(), signal.SIGSTOP)
        return time.monotonic() - start

    def launcher_gone(self) -> int | None:
        """The first of the launcher's processes that has ended, or None while they all run."""
        if os.getppid() != self.launchers[0]:  # this process was given another parent: its own is gone
            return self.launchers[0]
        return next((pid for pid in self.launchers[1:] if not processes.alive(pid)), None)

    def signalled(self, name: str) -> None:
        if _loop_stop is None and not _loop_ended and name == "SIGINT":  # Ctrl-C before training (torchrun's too)
            _leave(INTERRUPTED, code=EXIT_INTERRUPTED)
        if _loop_stop is None and not _loop_ended and self.main and (said := requeue.in_start_up(self.job, name)):
            _leave(f"{self.who}: {said}", code=EXIT_STOPPED)  # (SLURM's preemption: the job comes back)
        if _loop_stop is None and self.launched:  # the launcher stops its workers: it reports
            if not _loop_ended:  # before training: at once
                os._exit(EXIT_FAILURE)
            self.leaving(name)  # after it: leaving, maybe with a line (a lost rank's) to say first
            return
        self.ask_to_stop(name, tell_the_loop=False)  # in training the loop's own handler has it already

    def leaving(self, why: str) -> None:
        """A stop after training: the process is on its way out, and has the grace to end by itself; past it (a
        hang in the process group's end: torch 2.4's gloo, once in a suite), the watcher ends it."""
        self.stop_asked = self.stop_asked or (self.awake(), why)

    def ask_to_stop(self, why: str, tell_the_loop: bool) -> None:
        """A stop the loop takes at its next step boundary; before or after training, leave now."""
        stop = _loop_stop
        if stop is None:
            _leave(f"error: {self.who}: stopped on {why} outside the training loop: nothing to save")
        elif tell_the_loop:
            stop.request(why)
        self.stop_asked = self.stop_asked or (self.awake(), why)

    def leave_by(self) -> float:
        """When a stop asked for in training is late: the grace past the slowest step so far (none while busy())."""
        if self.busy:
            return math.inf
        stop = _loop_stop
        asked_at = max(self.stop_asked[0], self.progressed)  # (an evaluation is no wait for a lost rank)
        slowest = stop.longest_step_s if stop else 0.0
        return asked_at + GRACE_S + 3 * slowest  # the step it came in, the one its agreement takes, one spare


_watcher: _Watcher | None = None
_loop_stop: LoopStop | None = None  # the training loop's, while it runs: a stop is taken at its next step
_loop_ended = False  # the training loop has run: what is left is leaving


def awake() -> float:
    """The clock deadlines count on: time.monotonic() less the time this process was stopped (SIGSTOP:
    SLURM's suspend), as the watcher saw it. Without a watcher (a plain process, a test), time.monotonic()."""
    watcher = _watcher
    return watcher.awake() if watcher is not None else time.monotonic()


def stopped_lately(within_s: float) -> float:
    """How long this process was last stopped, if that stop ended within `within_s` (+ SLACK_S); else 0."""
    if (watcher := _watcher) is None:
        return 0.0
    watcher.looking()  # (the watcher may not have looked since the process was continued)
    while watcher.late is not None:  # a gap seen before its SIGCONT was noted (by another thread?): CONTINUED_S
        time.sleep(0.01)  # (the main thread's handler, _noted, may note it meanwhile)
        watcher.looking()
    ended, seconds = watcher.last_stop
    return seconds if time.monotonic() - ended <= within_s + SLACK_S else 0.0


def stopped_s() -> float:
    """The seconds this process has been stopped (SIGSTOP, a pause, SLURM's suspend) as the watcher saw them, to
    within _POLL_S / 2 each; 0 without a watcher (a plain process, a test)."""
    if (watcher := _watcher) is None:
        return 0.0
    watcher.looking()  # (the watcher may not have looked since the process was continued)
    return watcher.stopped_s


def pause_asked() -> bool:
    """Whether a pause was asked for (SIGTSTP) and not yet taken: the training loop's flag (preemption.PAUSE)."""
    return _watcher is not None and _watcher.pause_asked


def launcher_held() -> bool:
    """Whether a launcher of this process is stopped (Ctrl-Z of a plain torchrun or accelerate launch, which do not
    pass it on to their ranks; a SIGSTOP), as the watcher last saw in training: the loop's flag (preemption.HOLD)."""
    return (watcher := _watcher) is not None and watcher.held


@contextmanager
def holding() -> Iterator[None]:
    """Around the training loop's hold while its launcher is stopped (preemption): its time counts as stopped time
    (stopped_s: no epoch's time), and as progress for a stop's grace."""
    start, before = time.monotonic(), stopped_s()
    try:
        yield
    finally:
        if (watcher := _watcher) is not None:
            watcher.stopped_s += time.monotonic() - start - (stopped_s() - before)  # (stopped itself meanwhile)
            watcher.progressed = watcher.awake()


def safe_point(wait_s: float = 0.0) -> float | None:
    """From the main thread where no collective of this process is under way and none of another waits on it (a
    step boundary, or evaluation batch, every rank agreed to pause at): a pause asked for is taken here, or asked for
    within `wait_s` (this rank's SIGTSTP may be on its way); its seconds, None for none. Also progress (below)."""
    if (watcher := _watcher) is None:
        return None
    watcher.progressed = watcher.awake()
    until = time.monotonic() + wait_s
    while not watcher.pause_asked and time.monotonic() < until:
        time.sleep(0.005)
    return watcher.pause()


def progress(evaluating: bool = True) -> None:
    """An evaluation batch done, or its start (`evaluating`), or its end: progress for a stop's grace. While evaluating,
    a pause is taken only after a batch every rank agreed on (preemption.agreed_pauses), never by the watcher: stopped
    in a long batch, a rank held the others in the agreement's collective, and past run.timeout_s the run ended."""
    if (watcher := _watcher) is not None:
        watcher.progressed, watcher.evaluating = watcher.awake(), evaluating


def set_loop_stop(stop: LoopStop | None) -> None:
    """The training loop's stop as it starts (None as it ends), from preemption.StopRequest."""
    global _loop_stop, _loop_ended
    _loop_stop, _loop_ended = stop, _loop_ended or stop is None


def _leave(line: str, every_rank: bool = False, code: int = EXIT_FAILURE) -> None:
    """One line (local rank 0's unless `every_rank`), then the process ends: no handler runs, no
    file is half written (every write is a rename), the lock dies with the process."""
    if every_rank or launchers.speaks_for_its_machine():
        print(line, file=sys.stderr, flush=True)
    launchers.record_error(line)  # torchrun's report shows it
    os._exit(code)


def _noted(signum: int, frame: object) -> None:
    """Before and after training: the watcher, woken by the same signal, decides. A SIGCONT (the process was
    stopped) is noted here too, before the main thread goes on (and asks stopped_lately)."""
    watcher = _watcher
    if signum == signal.SIGCONT and watcher is not None:
        watcher.continued = True


@contextmanager
def watched(world: World, stop_signals: tuple[signal.Signals, ...], parent: int) -> Iterator[None]:
    """While inside: the launcher's death (`parent`: its pid, read when this process started), stop
    signals and deadlines end this process in bounded time. From the main thread, before the rendezvous."""
    global _watcher, _loop_ended
    watcher, _loop_ended = _Watcher(world, parent, stop_signals), False
    previous_fd = signal.set_wakeup_fd(watcher.wakeup_write, warn_on_full_buffer=False)
    # SIGTSTP: torchrun's agent (ddp/torchrun.py) pauses the ranks of a job on one machine with it, and continues
    # them; SLURM's suspend sends it to every process of the job, on each machine, 2 s before its SIGSTOP (which
    # stopped a rank inside a collective: past run.timeout_s, the run ended as it was resumed). Its default action
    # does nothing in a torchrun rank (its process group is orphaned). Others keep it: a plain process stops at once,
    # as it should; mpirun's ranks as mpirun has them (its Ctrl-Z sends them SIGSTOP, which no handler sees).
    whole = world.launcher == "torchrun" and not launchers.spans_machines() or launchers.slurm_job() is not None
    pause = whole and signal.getsignal(signal.SIGTSTP) == signal.SIG_DFL
    previous = {sig: signal.signal(sig, _noted) for sig in (*stop_signals, signal.SIGCONT, *[signal.SIGTSTP] * pause)}
    _watcher = watcher
    if watcher.launched:  # the kernel's SIGCONT as the launcher ends (PR_SET_PDEATHSIG; Linux): a rank paused (Ctrl-Z)
        with suppress(OSError, AttributeError):  # whose launcher was then killed stayed stopped for good, lock held
            ctypes.CDLL(None).prctl(1, signal.SIGCONT)  # (continued, its watcher sees the launcher gone: it stops)
    thread = threading.Thread(target=watcher.run, name="ddp-lifeline", daemon=True)
    thread.start()
    try:
        yield
    finally:
        _watcher = None
        watcher.done.set()
        for sig, handler in previous.items():
            if signal.getsignal(sig) is _noted:  # not one the stop's exit has set to SIG_IGN
                signal.signal(sig, handler)
        signal.set_wakeup_fd(previous_fd)
        with suppress(BlockingIOError):  # the watcher woken (done; a byte that is no signal), its pipe closed after it
            os.write(watcher.wakeup_write, b"\0")
        thread.join(timeout=2 * _POLL_S)
        if not thread.is_alive():  # (else left open: a descriptor closed under a thread may be another file's by then)
            os.close(watcher.wakeup_read)
            os.close(watcher.wakeup_write)


@contextmanager
def busy() -> Iterator[None]:
    """Around work that may outlast a stop's grace and is no wait for a lost rank (a checkpoint's save: a large one
    on a slow disk, where a SIGTERM before it left without a checkpoint): the grace counts from its end."""
    watcher = _watcher
    if watcher is not None:
        watcher.busy += 1
    try:
        yield
    finally:
        if watcher is not None:
            watcher.busy -= 1
            watcher.progressed = watcher.awake()


@contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """A wait that must end within `seconds` (+ SLACK_S): past it the watcher ends the process with
    one line naming `what`. Without a watcher (a plain process, a test), nothing."""
    watcher, key = _watcher, object()
    if watcher is not None:
        line = f"{what}: no answer within run.timeout_s={seconds:g} s (+{SLACK_S:g})"
        watcher.waits[id(key)] = (watcher.awake() + seconds + SLACK_S, line)
    try:
        yield
    finally:
        if watcher is not None:
            watcher.waits.pop(id(key), None)
