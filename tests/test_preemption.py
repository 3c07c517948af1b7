"""Stop signals (ddp/preemption.py) in one process; the real ones through torchrun and SLURM are in
test_resume.py and test_slurm.py."""

import contextlib
import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    REPORT,
    TINY,
    TORCHRUN,
    assert_free_and_whole,
    children,
    clean_env,
    cmdline,
    descendants,
    kill_orphans,
    seconds_until_gone,
)

from ddp import lifeline, metrics, preemption, requeue, train
from ddp.cli import command
from ddp.devices import World
from ddp.errors import EXIT_INTERRUPTED, Stopped, UsageError


@pytest.fixture(autouse=True)
def _keep_signal_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_signal_inside_only_requests_a_stop():
    with preemption.StopRequest([signal.SIGUSR1]) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.received == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # an ordinary exit puts the old handler back


def test_an_epochs_end_is_no_steps_time_for_a_stops_grace(tmp_path, monkeypatch):
    """The grace of a stop that no step boundary takes counts 3 of the slowest steps. An epoch's end (its evaluation,
    its checkpoint), between its last step and the next epoch's first, counted as a step: a 30 s evaluation on a CPU
    made the grace 95 s, past the 30 s a scheduler gives after its SIGTERM. (Here the first evaluation 1.5 s slower.)"""
    stops, evaluated, enter, logits = [], [], preemption.StopRequest.__enter__, metrics._logits
    monkeypatch.setattr(preemption.StopRequest, "__enter__", lambda self: stops.append(self) or enter(self))

    def slowly(*args):
        time.sleep(0 if evaluated else 1.5)
        evaluated.append(True)
        return logits(*args)

    monkeypatch.setattr(metrics, "_logits", slowly)
    train.main([f"run.out_dir={tmp_path}", *TINY])  # 2 epochs, 8 steps each
    assert stops[0].longest_step_s < 1.0, f"the slowest step took {stops[0].longest_step_s:.1f} s"


def test_leaving_with_the_stop_checkpoint_ignores_late_signals():
    """torchrun SIGTERMs the ranks still exiting once one has left with 75; Python's own handlers
    fall back to the default action as the interpreter exits, ignored signals do not."""
    with pytest.raises(Stopped), preemption.StopRequest([signal.SIGUSR1]):
        raise Stopped("stopped")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN and signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN


def test_a_second_ctrl_c_stops_at_once_in_one_line_and_130(capsys):
    """The first SIGINT asks for the stop checkpoint; a second before the boundary stops now, without it:
    through cli.command, one line (no traceback) and 128 + SIGINT; the handlers before it are back."""
    steps = []

    def main(argv):
        with preemption.StopRequest([signal.SIGINT]) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            steps.append(stop.requested)
            os.kill(os.getpid(), signal.SIGINT)
            steps.append("not reached")

    before = signal.getsignal(signal.SIGINT)
    assert command(main, ["run.out_dir=unused"]) == EXIT_INTERRUPTED == 130 and steps == [True]
    err = capsys.readouterr().err
    assert err == "stopped at once on SIGINT (Ctrl-C), without a checkpoint\n", err
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("names", ["SIGKILL", "FOO", "TERM,STOP"])
def test_signals_that_cannot_be_caught_are_refused(names):
    with pytest.raises(UsageError, match="is not a signal that can be caught"):
        preemption.parse_signals(names)


@pytest.mark.parametrize("names", ["SIGCHLD", "TERM,winch", "SIGCONT", "URG", "SIGPIPE"])
def test_signals_of_ordinary_events_are_refused_as_stop_signals(names):
    """SIGCHLD would stop a run with loader=torch when its workers end with epoch 1; SIGWINCH, when the terminal
    is resized."""
    with pytest.raises(UsageError, match="^run.stop_signal: SIG[A-Z]+ comes with .*, not to stop a run; stop signals"):
        preemption.parse_signals(names)


@pytest.mark.parametrize("names", ["SIGSEGV", "TERM,bus", "SIGFPE", "ILL"])
def test_signals_a_crash_raises_are_refused_as_stop_signals(names):
    """A handler of SIGSEGV returns to the access that faulted: the process faulted again, and hung for good."""
    with pytest.raises(UsageError, match="^run.stop_signal: SIG[A-Z]+ is what a crash raises: caught, a crashed"):
        preemption.parse_signals(names)


@pytest.mark.parametrize("names", [",", " , ", ",,"])
def test_a_stop_signal_that_names_none_is_refused(names):
    with pytest.raises(UsageError, match="names no signal: give them by name .* or none for no stop on a signal"):
        preemption.parse_signals(names)
    assert preemption.parse_signals("none") == []


@pytest.mark.parametrize(
    "shown, requeued",
    [("JobState=RUNNING Reason=None", True),  # SIGTERM before its time limit (--signal=TERM@120)
     ("JobState=COMPLETING Reason=TimeLimit", True),  # at it (seen, slurm-wlm 22.05)
     ("JobState=COMPLETING Reason=None", False),  # scancel (seen)
     ("JobState=CANCELLED Reason=None", False),
     ("", True)],  # scontrol said nothing (no controller): as before
)  # fmt: skip
def test_a_job_is_requeued_unless_scancel_ended_it(tmp_path, monkeypatch, shown, requeued):
    """requeue.ask asks `scontrol show job -o` first: a job scancel ended came back when requeued, and ran
    again to its end; one at or before its time limit is requeued as before. (scontrol: a stand-in on PATH.)"""
    calls = tmp_path / "calls"
    (tmp_path / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "JobId=7 {shown}"\n')
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    done, said = requeue.ask("7")
    assert calls.read_text().splitlines() == ["show job -o 7", *["requeue 7"] * requeued]
    assert said == "scontrol requeue 7: requeued" if requeued else said.startswith("not requeued: the job is ")
    assert done is requeued


def stand_in_scontrol(tmp_path: Path) -> tuple[Path, Path, Callable[..., tuple[int, str]]]:
    """A stand-in scontrol on PATH (its calls in the file returned; `show job` says JobId and the state given; requeue
    refuses where the state says NoRequeue), the state's file, and slurm/train.sh's call of requeue.main with it:
    (exit code, stdout) for (state, *argv), torch not imported."""
    calls, state = tmp_path / "calls", tmp_path / "state"
    refused = f'[ "$1" = requeue ] && grep -q NoRequeue {state} && echo "error: disabled for job $2" >&2 && exit 1\n'
    (tmp_path / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n{refused}echo "JobId=$4 $(cat {state})"\n')
    (tmp_path / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    script = "import sys; from ddp import requeue; code = requeue.main(sys.argv[1:]); print('torch' in sys.modules)"
    script += "; sys.exit(code)"

    def requeue_main(shown: str, *argv: str) -> tuple[int, str]:
        state.write_text(shown)
        run = subprocess.run([sys.executable, "-c", script, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert run.stdout.endswith("False\n") and not run.stderr, run  # (no torch imported)
        return run.returncode, run.stdout.removesuffix("False\n")

    return calls, state, requeue_main


def test_a_slurm_step_a_stop_signal_ended_before_training_is_requeued_by_its_batch_shell_without_torch(tmp_path):
    """slurm/train.sh after its step: SLURM's preemption signals the steps alone, and one it stopped before training
    (exit 143, no rank to save or requeue) ended the job FAILED. The shell requeues it then, in a Python without
    torch, also where it got the signal itself and sent it on (scancel -b: the job still RUNNING); not after rank 0's
    requeue or scancel (the shell signalled, the job COMPLETING), nor for a code no stop signal's. Where scancel ended
    the job and the shell did not see it, it says so. (scontrol: a stand-in on PATH; the real one: test_slurm.py.)"""
    calls, _, requeue_main = stand_in_scontrol(tmp_path)
    said, running, ended = {}, "JobState=RUNNING Reason=None", "JobState=COMPLETING Reason=None"
    cases = [("1", 143, "", running), ("2", 143, "SIGTERM", running), ("3", 138, "SIGUSR2", ended),
             ("4", 0, "", running), ("5", 137, "", running), ("6", 129, "", ended)]  # fmt: skip
    for job, code, signalled, shown in cases:
        code, said[job] = requeue_main(shown, "after", job, str(code), signalled)
        assert code == 0
    shown = ["show job -o 1", "requeue 1", "show job -o 2", "requeue 2", "show job -o 3", "show job -o 6"]
    assert calls.read_text().splitlines() == shown
    line = (
        "slurm/train.sh: the job's step ended on SIGTERM (exit 143) and no rank requeued it (a stop before training); "
        "scontrol requeue 1: requeued; SLURM starts the job again, and it resumes from the out_dir's last checkpoint, "
        "if any\n"
    )
    assert said["1"] == line and said["2"] == line.replace("requeue 1", "requeue 2")  # (the same line, its own job)
    assert "requeue 2: requeued" in said["2"] and said["3"] == said["4"] == said["5"] == ""
    assert said["6"].startswith("slurm/train.sh: the job's step ended on SIGHUP (exit 129) and no rank requeued it")
    assert "not requeued: the job is COMPLETING (scancel ended it" in said["6"] and "to go on, submit it" in said["6"]


def test_a_slurm_job_preempted_before_its_step_is_requeued_by_its_batch_shell_instead_of_started(tmp_path):
    """slurm/train.sh before srun: SLURM's preemption in the job's start-up signals its steps, none yet, and the job
    trained on through the GraceTime. One SLURM chose (PreemptTime, RUNNING) is requeued and not started (exit 75);
    not one that SLURM preempts nothing, that is no longer RUNNING, or that was ever suspended (SUSPEND, gang
    scheduling: PreemptTime too, and it goes on), nor where scontrol says nothing. One SLURM does not requeue
    (sbatch --no-requeue) does not start either, and says how to go on. Nor does one whose shell got a stop signal by
    then (scancel -b): requeued, unless scancel ended it. (The real scontrol: test_slurm.py.)"""
    calls, _, requeue_main = stand_in_scontrol(tmp_path)
    chosen = "JobState=RUNNING Reason=None PreemptTime=2026-12-07T05:20:00 SuspendTime=None"
    code, said = requeue_main(chosen, "before", "1", "")
    assert code == 75 and said == (
        "slurm/train.sh: SLURM chose the job for preemption at 2026-12-07T05:20:00, before its step (no rank to "
        "signal), so it does not start; scontrol requeue 1: requeued; SLURM starts the job again, and it resumes from "
        "the out_dir's last checkpoint, if any\n"
    )
    others = [("2", "JobState=RUNNING Reason=None PreemptTime=None SuspendTime=None"),
              ("3", chosen.replace("RUNNING", "COMPLETING")),
              ("4", chosen.replace("SuspendTime=None", "SuspendTime=2026-12-07T05:19:00")), ("5", "")]  # fmt: skip
    for job, shown in others:
        assert requeue_main(shown, "before", job, "") == (0, ""), job
    code, said = requeue_main(f"{chosen} NoRequeue=1", "before", "6", "")
    assert code == 75 and said.endswith(
        "scontrol requeue 6: error: disabled for job 6; to go on, submit it again with "
        "this job's run.out_dir (slurm/train.sh gives a new job an out_dir of its own)\n"
    )
    code, said = requeue_main(others[0][1], "before", "7", "SIGTERM")  # (scancel -b --signal=TERM in the preflight)
    assert code == 75 and said.startswith(
        "slurm/train.sh: SIGTERM came for this shell, before its step (no rank to signal), so it does not start; "
        "scontrol requeue 7: requeued; SLURM starts the job again"
    )
    code, said = requeue_main("JobState=CANCELLED Reason=None", "before", "8", "SIGTERM")  # (scancel's TERM)
    assert code == 75 and "; not requeued: the job is CANCELLED (scancel ended it;" in said
    shows = [f"show job -o {j}" for j, _ in others]
    assert calls.read_text().splitlines() == [
        "show job -o 1", "requeue 1", *shows, "show job -o 6", "requeue 6", "show job -o 7", "requeue 7",
        "show job -o 8",
    ]  # fmt: skip


def test_rank_0_takes_a_slurm_preemption_that_signalled_no_rank_as_a_stop_as_training_starts(tmp_path, monkeypatch):
    """A batch script's own set-up before srun (modules, an environment): SLURM's preemption then signalled no rank,
    and the job trained on through its GraceTime. Rank 0 asks as training starts (one scontrol call): a job SLURM chose
    stops at its next step boundary, as on the signal. Not the other ranks, a run that takes no SIGTERM as a stop
    (run.stop_signal), one SLURM did not choose, or one outside SLURM. (The real scontrol: test_slurm.py.)"""
    calls, state, _ = stand_in_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    state.write_text("JobState=RUNNING Reason=None PreemptTime=2026-12-07T05:20:00 SuspendTime=None")
    with preemption.StopRequest([signal.SIGTERM], main=True) as stop:
        said = stop.received
    assert said == "SLURM's preemption at 2026-12-07T05:20:00 (its SIGTERM came before this job's step: to no rank)"
    for signals, main in (([signal.SIGTERM], False), ([signal.SIGUSR1, signal.SIGINT], True)):
        with preemption.StopRequest(signals, main) as stop:
            assert not stop.requested
    state.write_text("JobState=RUNNING Reason=None PreemptTime=None SuspendTime=None")
    with preemption.StopRequest([signal.SIGTERM], main=True) as stop:
        assert not stop.requested
    monkeypatch.delenv("SLURM_JOB_ID")
    with preemption.StopRequest([signal.SIGTERM], main=True) as stop:
        assert not stop.requested
    assert calls.read_text().splitlines() == ["show job -o 9", "show job -o 9"]


def test_scontrol_answers_while_sigterms_keep_coming_to_the_job(tmp_path):
    """A requeue, a stop and torchrun's signals sent on reach every process of the job, scontrol among them, often
    twice: one that came as it started (its shell before `trap "" TERM`) ended it, unanswered (seen: a rank's
    `scontrol show job` in 2 of 8 real preemptions in its start-up, ended by SIGTERM, no output). A process group that
    gets SIGTERM every half millisecond asks 50 times: each time it is answered (before: 1 of 50)."""
    stand_in_scontrol(tmp_path)[1].write_text("JobState=RUNNING")
    script = (
        "import os, signal, threading, time\nfrom ddp import requeue\n"
        "signal.signal(signal.SIGTERM, lambda *_: None)\ndone = []\n"
        "def spam():\n    while not done:\n        os.killpg(0, signal.SIGTERM)\n        time.sleep(0.0005)\n"
        "threading.Thread(target=spam, daemon=True).start()\n"
        "print([requeue.scontrol('show', 'job', '-o', '1').returncode for _ in range(50)])\ndone.append(1)\n"
    )
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60, start_new_session=True)  # fmt: skip
    assert run.returncode == 0 and run.stdout == f"{[0] * 50}\n", run


def test_rank_0_stopped_in_its_start_up_requeues_a_job_slurm_preempted_and_no_other(tmp_path, monkeypatch):
    """SLURM's preemption in the ranks' start-up (before the first step) ended the job FAILED, Restarts 0, where no
    shell of ours requeues it (`srun python ddp/train.py`). Rank 0's stop signal there (lifeline) asks SLURM: a job it
    chose is requeued; not one it did not choose (scancel --signal=TERM, srun's end of a step whose task failed: its
    requeue would start a failing job again and again), one ever suspended, nor where scontrol says nothing, nor
    outside SLURM (no call). (The real scontrol, and lifeline's call: test_slurm.py.)"""
    calls, state, _ = stand_in_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    chosen = "JobState=RUNNING Reason=None PreemptTime=2026-12-07T05:20:00 SuspendTime=None"
    state.write_text(chosen)
    assert requeue.in_start_up("9", "SIGTERM") == (
        "stopped on SIGTERM before training (SLURM's preemption at 2026-12-07T05:20:00): nothing to save yet; "
        "scontrol requeue 9: requeued; SLURM starts the job again, and it resumes from the out_dir's last checkpoint, "
        "if any"
    )
    others = ["JobState=RUNNING Reason=None PreemptTime=None SuspendTime=None",
              chosen.replace("SuspendTime=None", "SuspendTime=2026-12-07T05:19:00"), ""]  # fmt: skip
    for shown in others:
        state.write_text(shown)
        assert requeue.in_start_up("9", "SIGTERM") is None, shown
    assert requeue.in_start_up(None, "SIGTERM") is None
    state.write_text(f"{chosen} NoRequeue=1")
    assert requeue.in_start_up("9", "SIGUSR1").endswith("scontrol requeue 9: error: disabled for job 9; to go on, "
                                                        "submit it again with this job's run.out_dir (slurm/train.sh "
                                                        "gives a new job an out_dir of its own)")  # fmt: skip
    asked = ["show job -o 9", "requeue 9", *["show job -o 9"] * 5, "requeue 9"]  # (no answer: asked twice)
    assert calls.read_text().splitlines() == asked


def test_a_stopped_run_says_how_it_resumes_and_under_slurm_names_its_out_dir():
    """The same command resumes a run in its out_dir; but `sbatch slurm/train.sh ARGS` again is a new job, which
    wrote to runs/slurm-<its id>, and started afresh: a job SLURM did not requeue (scancel ended it, or the requeue
    failed) names the out_dir to resume with, quoted for a shell."""
    assert preemption.how_to_resume(None, None, "runs/x") == "run the same command to resume"
    assert preemption.how_to_resume("7", True, "runs/slurm-7").startswith("SLURM starts the job again, and it resumes")
    assert preemption.how_to_resume("7", False, "my runs/slurm-7") == (
        "to resume, run it again with run.out_dir='my runs/slurm-7' (slurm/train.sh gives a new job an out_dir of its "
        "own)"
    )
    assert preemption.how_to_resume("7", False, "runs/x") == "to resume, run it again with run.out_dir=runs/x"  # srun
    unknown = preemption.how_to_resume("7", None, "runs/slurm-7")  # scontrol ended by the requeue's signal, most likely
    assert unknown == "if SLURM does not start the job again (squeue -j 7), resume with run.out_dir=runs/slurm-7"


def test_what_scontrol_requeue_did_is_said_also_when_the_requeue_ended_it():
    """The requeue stops every process of the job, scontrol among them: it printed "scontrol requeue 2: " and
    nothing more when SIGTERM ended scontrol before it exited 0 (the job was requeued: Restarts=1)."""

    def ran(code: int, err: str = "") -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(["scontrol", "requeue", "2"], code, "", err)

    assert requeue.outcome(ran(0)) == "requeued"
    assert requeue.outcome(ran(-15)).startswith("scontrol ended by SIGTERM as the job stopped")
    assert requeue.outcome(ran(1, "Invalid job id specified\n")) == "Invalid job id specified"
    assert requeue.outcome(ran(1)) == "scontrol exited 1"


SIGNALS_SEEN = """
import signal, subprocess, sys
sys.path.insert(0, "tests")
import conftest  # (as pytest imports it in each of its processes)
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.getsignal(signal.SIGHUP) == signal.SIG_IGN)
seen = "import signal as s; print(s.getsignal(s.SIGINT) is s.default_int_handler, int(s.getsignal(s.SIGHUP)))"
print(subprocess.run([sys.executable, "-c", seen], capture_output=True, text=True).stdout, end="")
"""


def test_a_suite_started_with_ctrl_c_and_hang_ups_ignored_starts_its_runs_with_them_not_ignored():
    """`nohup make test &` in a script: the suite started with SIGINT and SIGHUP ignored, and so did every run a
    test started (9 tests of Ctrl-C and hang-ups failed). The runs get the defaults; pytest itself takes a Ctrl-C as
    Python does, and SIGHUP still leaves it running."""

    def ignoring() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = subprocess.run([sys.executable, "-c", SIGNALS_SEEN], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, preexec_fn=ignoring, timeout=120)  # fmt: skip
    assert proc.stdout == "True False\nTrue 0\n", proc.stderr  # pytest's own; then a run's (0: SIG_DFL)


def test_a_run_started_with_ctrl_c_or_hang_ups_ignored_keeps_them_ignored(tmp_path):
    """A script's background job (`python ddp/train.py ... &` in a script) starts with SIGINT ignored, so that
    a Ctrl-C for the script leaves it running; Python leaves it so, and so do we now: SIGINT mid-run is not a
    stop request there (before, it stopped the run with its checkpoint, exit 75). So is SIGHUP under nohup,
    which ignores it to keep the run going after the terminal is gone. SIGTERM still stops it."""
    import sys

    from conftest import REPO, clean_env

    job = [sys.executable, str(REPO / "ddp" / "train.py"), "model.name=tutorial", "data.dataset=synthetic",
           "data.synthetic_train=4096", "data.synthetic_test=32", "train.batch_size=32", "train.epochs=3",
           "run.progress=false", f"run.out_dir={tmp_path}"]  # fmt: skip

    def ignoring() -> None:  # what `&` in a script does to SIGINT, and nohup to SIGHUP
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = subprocess.Popen(job, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ignoring,
                            env=clean_env(PYTHONUNBUFFERED="1"))  # fmt: skip
    try:
        lines = [proc.stdout.readline()]
        for epoch, signals in ((1, (signal.SIGINT, signal.SIGHUP)), (2, (signal.SIGTERM,))):  # ignored, not SIGTERM
            while not lines[-1].startswith(f"epoch {epoch}/3"):
                assert lines[-1], "".join(lines) + proc.stderr.read()
                lines.append(proc.stdout.readline())
            assert proc.poll() is None  # an epoch to go at least
            for sig in signals:
                proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75 and "stopped on SIGTERM" in out + err, out + err
    assert "SIGINT" not in out + err and "SIGHUP" not in out + err, out + err
    assert preemption.IGNORED_AT_START == {"SIGINT": False, "SIGHUP": False}  # this test process's own: stop signals
    assert preemption.parse_signals("SIGTERM,SIGINT,HUP") == [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


def test_a_hung_up_terminal_stops_the_run_with_its_checkpoint_and_a_refused_stderr_keeps_the_exit_code(tmp_path):
    """The run on a terminal that hangs up (an ssh session that dropped: its pty closed) gets SIGHUP, a stop
    signal: it stops at the next step with its checkpoint and exits 75, though its stdout and stderr now refuse
    every write (EIO). It was killed, losing the steps since its last checkpoint; with SIGHUP a stop signal, the
    OSError of the stop's line on stderr made it exit 1. A stderr on a full disk (/dev/full: ENOSPC, as SLURM's
    output file on a full quota) or closed keeps a mistake's exit 2 too."""
    import fcntl
    import sys
    import termios

    from conftest import REPO, clean_env, metrics

    from ddp import rundir

    train = [sys.executable, str(REPO / "ddp" / "train.py"), "model.name=tutorial", "data.dataset=synthetic",
             "data.synthetic_train=4096", "data.synthetic_test=32", "train.batch_size=32", "train.epochs=3",
             "run.progress=false", f"run.out_dir={tmp_path}"]  # fmt: skip
    with open("/dev/full", "w") as full:
        mistake = subprocess.run([*train, "train.epochs=0"], stdout=subprocess.PIPE, stderr=full, env=clean_env(),
                                 timeout=60)  # fmt: skip
    assert mistake.returncode == 2
    # stderr closed (`2>&-`): fd 2 is /dev/null from the start, so no file opened later takes its number (torch's
    # C++ warnings on fd 2 went into it) and a mistake still exits 2 (it was 1 before, 120 with LossyStderr alone)
    closed = lambda: os.close(2)  # noqa: E731
    mistake = subprocess.run([*train, "train.epochs=0"], stdout=subprocess.PIPE, preexec_fn=closed, env=clean_env(),
                             timeout=60)  # fmt: skip
    assert mistake.returncode == 2
    opened = subprocess.run([sys.executable, "-c", "import os; from ddp import startup; startup.quiet_startup("
                             "'__main__'); print(os.open(os.devnull, os.O_RDONLY))"], stdout=subprocess.PIPE,
                            preexec_fn=closed, env=clean_env(), cwd=REPO, text=True, timeout=60)  # fmt: skip
    assert opened.returncode == 0 and opened.stdout == "3\n", opened
    terminal, tty = os.openpty()
    controlled = lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # noqa: E731 (the pty its session's terminal)
    proc = subprocess.Popen(train, stdin=tty, stdout=tty, stderr=tty, start_new_session=True, preexec_fn=controlled,
                            env=clean_env(PYTHONUNBUFFERED="1"))  # fmt: skip
    os.close(tty)
    try:
        said = b""
        while b"epoch 1/3" not in said:
            chunk = os.read(terminal, 4096)
            assert chunk, said.decode()
            said += chunk
        os.close(terminal)  # the hang-up: SIGHUP to the session's processes, then EIO on every write
        assert proc.wait(timeout=120) == 75
    finally:
        proc.kill()
    assert rundir.step_files(tmp_path) and len(metrics(tmp_path)) == 1


def test_a_launchers_stop_after_training_gives_the_process_the_grace_to_say_its_line(monkeypatch, capsys):
    """torchrun stops the others (SIGTERM) as one rank dies. With torch 2.4.1's torchrun that came after the
    survivor's loop had ended on the lost rank and before it had said so: the watcher ended it at once and in
    silence, as it does before training (test_resume's kill test lost its 'lost contact' line). After training
    the process now has the grace to end by itself; past it the watcher ends it, with a line."""
    watcher = lifeline._Watcher(World(0, 0, 2, torch.device("cpu"), "ddp", "torchrun"), os.getppid(), (signal.SIGTERM,))
    exits = []
    monkeypatch.setattr(os, "_exit", lambda code: (exits.append(code), watcher.done.set()))
    monkeypatch.setattr(lifeline, "_loop_stop", None)
    monkeypatch.setattr(lifeline, "_loop_ended", False)
    watcher.signalled("SIGTERM")  # before training: at once, silent (the launcher reports)
    assert exits == [1] and not capsys.readouterr().err
    monkeypatch.setattr(lifeline, "_loop_ended", True)
    watcher.signalled("SIGTERM")  # after training: not at once
    assert exits == [1] and watcher.stop_asked[1] == "SIGTERM"
    watcher.stop_asked = (time.monotonic() - lifeline.GRACE_S - 1, "SIGTERM")  # the grace has passed
    watcher.done.clear()
    watcher.run()
    assert exits == [1, 1] and re.fullmatch(
        r"error: rank 0 of 2: stopping on SIGTERM after training, but it had not ended within \d+ s \(a wait for "
        r"another rank\?\): left\n",
        capsys.readouterr().err,
    )


def test_a_process_whose_launcher_is_gone_after_training_leaves_within_the_grace(monkeypatch, capsys):
    """A torchrun killed while its worker ended the run (torch 2.4.1's gloo hung in destroy_process_group, once in a
    suite): the worker was left with init as its parent, asleep for an hour; the watcher took no notice of the
    launcher's end after training. Now it ends the process past the grace, with a line."""
    world = World(0, 0, 2, torch.device("cpu"), "ddp", "torchrun")
    watcher = lifeline._Watcher(world, os.getppid(), (signal.SIGTERM,))
    watcher.launchers = [os.getppid() + 1]  # a launcher that is not this process's parent: it is gone
    exits = []
    monkeypatch.setattr(os, "_exit", lambda code: (exits.append(code), watcher.done.set()))
    monkeypatch.setattr(lifeline, "_loop_stop", None)
    monkeypatch.setattr(lifeline, "_loop_ended", True)
    monkeypatch.setattr(lifeline, "GRACE_S", 0.5)
    started, watching = time.monotonic(), threading.Thread(target=watcher.run, daemon=True)
    watching.start()
    watching.join(10)  # the old watcher never left
    watcher.done.set()
    watching.join(1)  # and gone while this test's stand-ins are in place
    assert exits == [1] and 0.5 < time.monotonic() - started < 5
    assert re.fullmatch(r"error: rank 0 of 2: stopping on the launcher's end \(its process \d+ is gone\) after "
                        r"training, but it had not ended within \d+ s \(a wait for another rank\?\): left\n",
                        capsys.readouterr().err)  # fmt: skip


def test_a_group_end_that_hangs_holding_the_interpreter_is_ended_by_the_backstop(tmp_path):
    """torch 2.4's gloo once hung in destroy_process_group holding the GIL: the watcher's deadline, a Python thread,
    never ran, and the rank outlived its killed launcher by an hour (py-spy: the watcher's loop stopped 7 s into
    the run). Here the group's end is a C call that holds the GIL (ctypes.PyDLL), in a process with the watcher:
    faulthandler's thread ends it, exit 1, its stack on stderr, at run.timeout_s + SLACK_S + BACKSTOP_S."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = f"""
import ctypes, os, signal, torch
import torch.distributed as dist
from ddp import distributed, lifeline
from ddp.devices import World
lifeline.SLACK_S, lifeline.BACKSTOP_S = 0.5, 1.0
world = World(0, 0, 1, torch.device("cpu"), "ddp", "bench", "tcp://127.0.0.1:{port}")
with lifeline.watched(world, (signal.SIGTERM,), os.getppid()), distributed.setup(world, 1) as world:
    dist.destroy_process_group = lambda: ctypes.PyDLL(None).sleep(60)  # libc's sleep, the GIL held
"""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    took = time.monotonic() - started
    assert proc.returncode == 1 and proc.stderr.startswith("Timeout (0:00:02.5"), proc.stderr
    assert re.search(r'ddp/distributed.py", line \d+ in setup', proc.stderr), proc.stderr  # where it hung
    assert took < 20, took  # 2.5 s past the group's end, not the 60 s of the sleep


def test_the_clock_of_deadlines_stands_still_while_the_process_is_stopped(monkeypatch):
    """lifeline.awake(): a watcher whose last look was 5 s ago, a SIGCONT since (the process was stopped), counts
    LATE_S of them, before its next look and after it alike; stopped_lately says how long the stop was, while it is
    recent; stopped_s (an epoch's time leaves it out) the 5 s to within half a look. Where the main thread asks first (a
    lost rank's line; another thread may handle the SIGCONT after this one goes on) it waits for the SIGCONT up to
    CONTINUED_S: before, it said "not stopped" at once (a possible cause, not shown, of a suite's rank 0 line that
    once lacked "stopped for N s just before").
    Without a SIGCONT (the watcher kept from the interpreter's lock by a long call) the 5 s count whole."""
    watcher = lifeline._Watcher(World(0, 0, 2, torch.device("cpu"), "ddp", "torchrun"), os.getppid(), ())
    monkeypatch.setattr(lifeline, "_watcher", watcher)
    looked = time.monotonic() - 5
    watcher.clock = (looked, 0.0)
    assert lifeline.awake() == pytest.approx(looked + lifeline.LATE_S)  # stands where the look was late
    lifeline._noted(signal.SIGCONT, None)  # the main thread's handler, as the process goes on
    assert lifeline.stopped_lately(3) == pytest.approx(5, abs=0.5)  # (it looks: the stop is counted now)
    assert lifeline.awake() == pytest.approx(time.monotonic() - 5 + lifeline.LATE_S, abs=0.1)
    assert lifeline.stopped_lately(3) == pytest.approx(5, abs=0.5)  # a stop seen once, said again
    assert lifeline.stopped_s() == pytest.approx(5 - lifeline._POLL_S / 2, abs=0.05)
    watcher.last_stop = (time.monotonic() - 10, 5.0)
    assert lifeline.stopped_lately(3) == 0  # one that ended longer ago than the deadline and its slack
    stopped = watcher.clock[1]
    watcher.clock = (time.monotonic() - 5, stopped)  # late to look, no SIGCONT yet: the watcher waits for one
    assert watcher.looking() == pytest.approx(time.monotonic() - 4 - stopped, abs=0.1) and watcher.late is not None
    assert lifeline.awake() == pytest.approx(time.monotonic() - 4 - stopped, abs=0.1)  # standing meanwhile
    noted = threading.Timer(0.2, lifeline._noted, (signal.SIGCONT, None))  # as another thread handles it
    noted.start()
    started = time.monotonic()
    assert lifeline.stopped_lately(3) == pytest.approx(5.2, abs=0.5)  # the main thread, asking first, waits for it
    assert 0.15 < time.monotonic() - started < lifeline.CONTINUED_S and watcher.late is None
    stopped = watcher.clock[1]
    watcher.clock = (time.monotonic() - 5, stopped)
    started = time.monotonic()  # none comes within CONTINUED_S: it was not stopped (a long call), the 5 s count whole
    assert lifeline.stopped_lately(3) == pytest.approx(5.2, abs=0.5)  # (the last stop's, said again)
    assert lifeline.CONTINUED_S <= time.monotonic() - started < 1.5 and watcher.clock[1] == stopped
    assert watcher.late is None and lifeline.awake() == pytest.approx(time.monotonic() - stopped, abs=0.1)
    monkeypatch.setattr(lifeline, "_watcher", None)
    assert lifeline.awake() == pytest.approx(time.monotonic()) and lifeline.stopped_lately(3) == 0  # no watcher
    assert lifeline.stopped_s() == 0


def test_the_watcher_keeps_its_clock_past_descriptor_1023_and_each_run_gives_its_descriptors_back():
    """Each run (lifeline.watched) left its wake-up pipe open: ~500 runs in one process (a notebook's train.main, seen
    with a loop of them) put it past 1023, where select.select raised in the watcher's thread, which ended; its clock,
    awake(), stood (no deadline on it came), and stop signals went unheard. (A suite's worker reaches ~130.)"""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"needs 1100 open files; this machine's hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100) if soft != resource.RLIM_INFINITY else soft, hard))
    world = World(0, 0, 1, torch.device("cpu"), "none")
    held = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        open_before = len(os.listdir("/proc/self/fd"))
        with lifeline.watched(world, (signal.SIGTERM,), os.getppid()):
            start, awake = time.monotonic(), lifeline.awake()
            time.sleep(1.3)  # past LATE_S (1 s): a watcher that no longer looks leaves awake() standing there
            assert 1.25 < lifeline.awake() - awake <= time.monotonic() - start  # (a sleep under load may run long)
        with lifeline.watched(world, (signal.SIGTERM,), os.getppid()):
            pass
        assert len(os.listdir("/proc/self/fd")) == open_before
        assert not [t for t in threading.enumerate() if t.name == "ddp-lifeline"]
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_watcher_thread_that_fails_ends_the_run_with_a_line_where_its_end_was_a_hang_later(monkeypatch):
    """The watcher's thread ended by an error (as select.select's above): the run went on with no deadline and no stop
    signal heard. Now its line, and the process ends (played here: _leave noted, not taken)."""
    watcher = lifeline._Watcher(World(0, 0, 1, torch.device("cpu"), "none"), os.getppid(), ())
    left = []
    monkeypatch.setattr(lifeline, "_leave", left.append)
    monkeypatch.setattr(watcher, "looking", lambda: 1 / 0)
    try:
        watcher.run()
    finally:
        os.close(watcher.wakeup_read)
        os.close(watcher.wakeup_write)
    assert left == ["error: the run: its watcher thread failed (ZeroDivisionError: division by zero): left"]


def test_a_pause_is_taken_once_at_a_safe_point_or_by_the_watcher_in_time_and_a_sigcont_first_ends_it(monkeypatch):
    """The watcher reads SIGTSTP (a pause: Ctrl-Z of ddp/torchrun.py) and SIGCONT in the order they came. In training
    the pause waits for a safe point (lifeline.safe_point: the main thread, where no collective is under way), or the
    watcher takes it two steps and a second later (not in an evaluation, whose ranks agree on it per batch); before
    training at once; after it not (the process ends). Taken once: a process stopped twice is never continued. A
    SIGCONT before it is taken ends it (the agent continued the process: it stopped it itself)."""
    watcher = lifeline._Watcher(World(0, 0, 2, torch.device("cpu"), "ddp", "torchrun"), os.getppid(), ())
    stops = []
    monkeypatch.setattr(lifeline, "_watcher", watcher)
    monkeypatch.setattr(os, "kill", lambda pid, sig: stops.append((pid, sig)))
    loop = preemption.StopRequest(())
    loop.last_step_s = 0.5
    monkeypatch.setattr(lifeline, "_loop_stop", loop)
    monkeypatch.setattr(lifeline, "_loop_ended", False)  # (an earlier test's loop may have ended in this process)
    watcher.asked_to_pause(True)
    assert lifeline.pause_asked() and watcher.pause_by == pytest.approx(lifeline.awake() + 2, abs=0.1) and not stops
    lifeline.safe_point()
    lifeline.safe_point()
    assert stops == [(os.getpid(), signal.SIGSTOP)] and not lifeline.pause_asked() and watcher.pause_by is None
    watcher.asked_to_pause(True)
    watcher.pause_if_late(lifeline.awake())  # (a look: not yet)
    assert len(stops) == 1 and lifeline.pause_asked()
    watcher.pause_if_late(lifeline.awake() + 2.5)  # no safe point came in time: the watcher's look takes it
    lifeline.safe_point()
    assert len(stops) == 2 and not lifeline.pause_asked()
    watcher.asked_to_pause(True)
    lifeline.progress()  # an evaluation: its pause is taken where the ranks agree (agreed_pauses), never the watcher's
    watcher.pause_if_late(lifeline.awake() + 2.5)
    assert len(stops) == 2 and lifeline.pause_asked()
    lifeline.progress(evaluating=False)  # its end: late as before
    watcher.pause_if_late(lifeline.awake() + 2.5)
    assert len(stops) == 3 and not lifeline.pause_asked()
    stops.pop()
    watcher.asked_to_pause(True)
    watcher.asked_to_pause(False)  # a SIGCONT came after it, before a safe point
    lifeline.safe_point()
    assert len(stops) == 2 and not lifeline.pause_asked() and watcher.pause_by is None
    later = threading.Timer(0.3, watcher.asked_to_pause, (True,))  # at an agreed pause, this rank's SIGTSTP late
    later.start()
    started = time.monotonic()
    lifeline.safe_point(wait_s=5)
    assert 0.25 < time.monotonic() - started < 2 and len(stops) == 3  # it waited for it: taken
    started = time.monotonic()
    lifeline.safe_point(wait_s=0.2)
    assert 0.2 <= time.monotonic() - started < 1 and len(stops) == 3  # none came: it goes on
    stops.pop()
    monkeypatch.setattr(lifeline, "_loop_stop", None)
    watcher.asked_to_pause(True)  # before training: at once
    assert len(stops) == 3 and not lifeline.pause_asked()
    monkeypatch.setattr(lifeline, "_loop_ended", True)
    watcher.asked_to_pause(True)  # after it: on its way out, not at all
    lifeline.safe_point()
    assert len(stops) == 3 and not lifeline.pause_asked()
    monkeypatch.setattr(lifeline, "_watcher", None)
    lifeline.safe_point()
    assert len(stops) == 3 and not lifeline.pause_asked()  # a plain process, a test: nothing


def test_a_job_stopped_whole_goes_on_from_its_rendezvous_and_says_so_where_torch_ends_it(tmp_path):
    """SLURM's `scontrol suspend` (a SIGSTOP of each process) of a job. (1) Its rank 0 waits at the rendezvous for a
    rank still loading: time.monotonic() runs on while they are stopped, and rank 0 left as they were continued ("rank 1
    did not come ... within run.timeout_s", or the watcher's deadline). Those waits now count on lifeline.awake(),
    which stands still while the process is stopped: they meet, and an all-reduce goes through. (2) Stopped in
    training with an all-reduce under way: torch's own timeout (gloo's, NCCL's watchdog) counts the stop and ends
    it as it is continued, which no code here can change; each rank's line now says that it was stopped, and that
    a longer run.timeout_s outlasts such stops (it said only "no answer within run.timeout_s=4: hung"). Rank 1 goes
    on 1 s before rank 0: continued together, rank 0's data may come before rank 1 looks at its clock, and the
    all-reduce goes on (as in 4 of 6 jobs SLURM suspended, README)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    go = tmp_path / "go"
    script = f"""
import os, signal, sys, time, torch
import torch.distributed as dist
from ddp import distributed, lifeline, lost_rank
from ddp.devices import World
from ddp.errors import PeerLost
lifeline.SLACK_S = 0.5
rank = int(sys.argv[1])
waiting = lost_rank.wait_for_everyone
def announced(*args, **kwargs):  # (not the port: its own client may still be connecting, on torch's clock)
    print("waiting", flush=True)
    waiting(*args, **kwargs)
lost_rank.wait_for_everyone = announced
while rank == 1 and not os.path.exists({str(go)!r}):  # rank 1 still loading
    time.sleep(0.02)
world = World(rank, rank, 2, torch.device("cpu"), "ddp", "bench", "tcp://127.0.0.1:{port}")
with lifeline.watched(world, (signal.SIGTERM,), os.getppid()):
    try:
        with distributed.setup(world, 4) as world:
            total = torch.ones(1)
            dist.all_reduce(total)
            print("sum", int(total.item()), flush=True)
            until = time.monotonic() + 30
            while time.monotonic() < until:  # until the second stop ends it
                dist.all_reduce(total)
    except PeerLost as e:
        sys.exit(str(e))
    sys.exit("the second stop did not end it")
"""
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(r)], cwd=REPO, env=clean_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]  # fmt: skip

    def stopped(seconds: float, skew_s: float = 0.0) -> None:
        """Both stopped, rank 0 first, `seconds`; both continued, rank 1 first, `skew_s` apart each time."""
        for rank in ranks:
            rank.send_signal(signal.SIGSTOP)
            time.sleep(skew_s)
        time.sleep(seconds)
        go.touch()
        for rank in reversed(ranks):
            rank.send_signal(signal.SIGCONT)
            time.sleep(skew_s)

    try:
        assert ranks[0].stdout.readline() == "waiting\n", ranks[0].communicate()  # at the rendezvous
        stopped(5)  # past run.timeout_s=4 and the watcher's deadline (+0.5)
        said = [ranks[0].stdout.readline(), *(ranks[1].stdout.readline() for _ in "12")]
        assert said == ["sum 2\n", "waiting\n", "sum 2\n"], [r.communicate() for r in ranks]
        stopped(5, skew_s=1)  # rank 1 waits in an all-reduce for rank 0, past its deadline, and goes on first
        outs = [rank.communicate(timeout=60) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [1, 1], outs
    for r, (_, err) in enumerate(outs):
        assert re.search(rf"^rank {r} of 2: lost contact with rank {1 - r} \(.*; this process was stopped for [5-9] s "
                         r"just before \(SLURM's suspend\? a SIGSTOP\?\), and torch's timeouts count that time: "
                         r"a longer run.timeout_s outlasts such stops\) \[", err, re.M), err  # fmt: skip


class Terminal:
    """An interactive bash in a pseudo-terminal, with job control: what a user types Ctrl-Z, fg and bg into."""

    def __init__(self, cwd: Path) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: bash, the terminal's session leader
            os.chdir(cwd)
            os.execvpe("bash", ["bash", "--norc", "--noprofile", "-i"], clean_env(PS1="$ ", TERM="dumb"))
        self.out = self.seen = b""

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def wait_for(self, pattern: bytes, timeout_s: float = 60) -> re.Match:
        """Reads the terminal until `pattern` shows in what came since the last match."""
        deadline = time.monotonic() + timeout_s
        while not (found := re.search(pattern, self.out)):
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no {pattern!r} within {timeout_s} s in:\n{self.out.decode(errors='replace')}"
            try:
                self.out += os.read(self.fd, 65536)
            except OSError:  # the shell has gone
                raise AssertionError(f"no {pattern!r} in:\n{self.out.decode(errors='replace')}") from None
        self.seen += self.out[: found.end()]
        self.out = self.out[found.end() :]
        return found

    def close(self, marker: str) -> None:
        """The shell, and every process whose command line holds `marker` (its jobs: their ranks run in sessions of
        their own, which the shell's end does not reach)."""
        for proc in Path("/proc").glob("[0-9]*"):
            if marker.encode() in _cmdline(proc):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(proc.name), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        os.close(self.fd)
        os.waitpid(self.pid, 0)


PAUSED = ["--config", "configs/smoke.yaml", "train.epochs=2", "data.synthetic_train=2048", "run.timeout_s=3"]


@pytest.fixture(scope="module")
def unpaused(tmp_path_factory) -> list[dict]:
    """The epochs of the command the pause tests pause (PAUSED, 2 ranks), run without a pause or a terminal."""
    out = tmp_path_factory.mktemp("unpaused")
    torchrun = [sys.executable, "ddp/torchrun.py", "--standalone", "--nproc_per_node=2", "ddp/train.py", *PAUSED]
    reference = subprocess.run([*torchrun, f"run.out_dir={out}"], cwd=REPO, env=clean_env(), capture_output=True,
                               text=True, timeout=300)  # fmt: skip
    assert reference.returncode == 0, reference.stderr
    return epochs_of(out)


def epochs_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_as_never_paused(epochs: list[dict], unpaused: list[dict]) -> None:
    """Every epoch's numbers as the run never paused has them, to the last digit; epoch 2's train_s without the
    pause's 6 s."""
    for key in ("train_loss", "grad_norm_mean", "grad_norm_max", "test_acc", "confusion"):
        assert [e[key] for e in epochs] == [e[key] for e in unpaused], key
    assert epochs[1]["train_s"] < unpaused[1]["train_s"] + 2, (epochs, unpaused)


def test_ctrl_z_pauses_a_torchrun_job_at_a_step_boundary_past_run_timeout_s_and_fg_goes_on_with_the_same_numbers(
    tmp_path, unpaused
):
    """Ctrl-Z of `bash launch/torchrun.sh` in a terminal. torchrun's ranks run in sessions of their own: the Ctrl-Z
    stopped torchrun alone; its ranks trained on, and failed past run.timeout_s without its store. Now each rank
    pauses at its next step boundary, where no collective is under way, then torchrun stops ("Stopped"): a pause
    twice run.timeout_s long, then fg, and the run ends as one never paused does, to the last digit of every loss;
    the paused epoch's train_s counts the time it ran."""
    terminal = Terminal(REPO)
    try:
        terminal.wait_for(rb"\$ ")
        terminal.type(f"NPROC=2 bash launch/torchrun.sh {' '.join(PAUSED)} run.out_dir={tmp_path}\n".encode())
        terminal.wait_for(rb"epoch 1/2 ")  # epoch 2's steps begin (1.5 s of them)
        time.sleep(0.2)
        terminal.type(b"\x1a")  # Ctrl-Z
        terminal.wait_for(rb"Stopped")
        agent = next(p for p in Path("/proc").glob("[0-9]*") if re.search(rb"torchrun\.py.*" + str(tmp_path).encode(),
                                                                            _cmdline(p)))  # fmt: skip
        ranks = [int(p.name) for p in Path("/proc").glob("[0-9]*") if _stat(p)[1:2] == [agent.name]]
        assert len(ranks) == 2 and all(_stat(Path(f"/proc/{r}"))[0] == "T" for r in ranks), ranks
        time.sleep(6)  # twice run.timeout_s
        assert all(_stat(Path(f"/proc/{r}"))[0] == "T" for r in ranks)
        terminal.type(b"fg\n")
        terminal.wait_for(rb"epoch 2/2 .*\n(.|\n)*\$ ")
        terminal.type(b"echo rc=$?\n")
        terminal.wait_for(rb"rc=\d+")
        said = terminal.seen.decode(errors="replace")
    finally:
        terminal.close(str(tmp_path))
    assert "rc=0" in said and "note: paused rank" not in said, said  # (no rank was late, and stopped where it was)
    assert re.search(r"note: continued after [6-9] s paused at a step boundary every rank agreed on", said), said
    assert_as_never_paused(epochs_of(tmp_path), unpaused)


SLOW_EVALUATION = f"""
import os, sys, time
sys.path.insert(0, {str(REPO)!r})  # (this repository's ddp, not the one an editable install names)
from ddp import metrics, train
original, rank = metrics._logits, int(os.environ["RANK"])
def slowly(module, *args, **kwargs):  # epoch 1's evaluation (16 batches): rank 0 says it begins, rank 1 takes its time
    slowly.batches += 1
    if slowly.batches == 1 and rank == 0:
        print("evaluating", flush=True)
    if slowly.batches <= 16 and rank == 1:
        time.sleep(0.2)
    return original(module, *args, **kwargs)
slowly.batches = 0
metrics._logits = slowly
sys.exit(train.cli(sys.argv[1:]))
"""


def test_a_pause_in_evaluation_is_taken_after_a_batch_every_rank_agreed_on_where_another_waits_for_a_slow_rank(
    tmp_path, unpaused
):
    """SLURM's suspend (SIGTSTP to every rank, SIGSTOP 2 s later, SIGCONT at the resume) while rank 0 has evaluated
    its share and rank 1 is still at its own (16 batches of 8 images, 0.2 s each). Each rank paused between two
    batches of its own, and rank 0, waiting in the counts' all-reduce, was stopped there: stopped twice
    run.timeout_s, the run ended as it went on (rank 0 of 2: lost contact with rank 1; 8 of 8 such runs by hand).
    Now a pause in evaluation is agreed per batch, as a step's is, and every rank pauses after the same batch: the
    run ends as one never paused, to the last digit (the batch's size changes no count here)."""
    script = tmp_path / "slow_evaluation.py"
    script.write_text(SLOW_EVALUATION)
    torchrun_py = [sys.executable, "ddp/torchrun.py", "--standalone", "--nproc_per_node=2", str(script), *PAUSED,
                   "train.eval_batch_size=16"]  # fmt: skip
    agent = subprocess.Popen([*torchrun_py, f"run.out_dir={tmp_path / 'run'}"], cwd=REPO, env=clean_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    ranks = []
    try:
        while (line := agent.stdout.readline()) and line != "evaluating\n":
            pass
        assert line, agent.communicate()
        ranks = [pid for pid in children(agent.pid) if str(script).encode() in cmdline(pid)]
        time.sleep(0.3)  # (rank 0 in the all-reduce, before)
        for sig, then_s in ((signal.SIGTSTP, 2), (signal.SIGSTOP, 4), (signal.SIGCONT, 0)):
            for rank in ranks:
                os.kill(rank, sig)
            time.sleep(then_s)
        out, err = agent.communicate(timeout=120)
    finally:
        agent.kill()
        kill_orphans(ranks)
    assert len(ranks) == 2 and agent.returncode == 0, (ranks, err)
    assert re.search(r"note: continued after [3-7] s paused at an evaluation batch every rank agreed on", out), out
    assert_as_never_paused(epochs_of(tmp_path / "run"), unpaused)


def test_a_plain_torchrun_stopped_holds_its_ranks_after_one_step_past_run_timeout_s_and_goes_on_with_the_same_numbers(
    tmp_path, unpaused
):
    """Ctrl-Z of plain `torchrun` (or accelerate launch), which passes nothing on to its ranks: it stopped alone, and
    its ranks trained on. Now they see it stopped (here SIGSTOP, what Ctrl-Z does to it), and hold after the same
    step with no collective under way, one line saying so: 6 s, twice run.timeout_s, with no epoch done and next to
    no CPU. SIGCONT (fg), and the run ends as one never stopped does."""
    agent = subprocess.Popen([TORCHRUN, "--standalone", "--nproc_per_node=2", "ddp/train.py", *PAUSED,
                              f"run.out_dir={tmp_path}"], cwd=REPO, env=clean_env(), text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        while not (line := agent.stdout.readline()).startswith("epoch 1/2") and line:
            pass
        time.sleep(0.2)
        agent.send_signal(signal.SIGSTOP)
        said = agent.stdout.readline()
        ranks = [p for p in Path("/proc").glob("[0-9]*") if _stat(p)[1:2] == [str(agent.pid)]]
        cpu = [sum(int(t) for t in _stat(p, 13)[11:13]) for p in ranks]
        time.sleep(6)
        cpu = [sum(int(t) for t in _stat(p, 13)[11:13]) - c for p, c in zip(ranks, cpu, strict=True)]
        held = len(epochs_of(tmp_path)), [_stat(p)[0] for p in ranks]
        agent.send_signal(signal.SIGCONT)
        rest = agent.communicate(timeout=120)[0]
    finally:
        agent.kill()
    assert said.startswith("note: holding: a launcher of this job is stopped"), said
    assert held == (1, ["S", "S"]) and max(cpu) < 0.5 * os.sysconf("SC_CLK_TCK"), (held, cpu)
    assert agent.returncode == 0 and "epoch 2/2" in rest, rest
    assert_as_never_paused(epochs_of(tmp_path), unpaused)


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def _stat(proc: Path, fields: int = 2) -> list[str]:
    """/proc/PID/stat's first `fields` after the name: state and parent, ... ([] for a process gone)."""
    try:
        return (proc / "stat").read_text().rsplit(")", 1)[1].split()[:fields]
    except (OSError, IndexError):
        return []


EVERY_RANK = (
    "[os.kill(int(pid), signal.SIGTERM) for pid in "  # (the launcher's children: as SLURM signals them)
    "open(f'/proc/{os.getppid()}/task/{os.getppid()}/children').read().split()]"
)
SLOWLY = {  # the first call of each: it says so, or signals its own process (every rank), then it takes its time
    "evaluation": ("metrics", "_logits", 'print("evaluating", flush=True)', 0.05),
    "save": ("torch", "save", "os.kill(os.getpid(), signal.SIGTERM)", 2.0),
    "save, 2 ranks": ("files", "link", EVERY_RANK, 2.0),  # (rank 0's: last.pt after the file; torch.save pickles too)
}


@pytest.mark.parametrize("slow", SLOWLY)
def test_a_stop_signal_in_a_long_evaluation_or_save_waits_for_it_and_saves_the_epoch(tmp_path, slow):
    """SIGTERM (SLURM's warning) while the first epoch evaluates, or just before a checkpoint's save (a large one on a
    slow disk): the stop's grace counted from the signal alone, and past GRACE_S + 3 steps the watcher left without a
    checkpoint ("no step boundary came"): the epoch's training was lost. Each evaluation batch is progress now, and a
    save is busy (lifeline.busy): the grace counts from its end. The epoch is recorded and saved, exit 75. (The grace
    0.5 s; each evaluation batch 50 ms slower, 3 s in all; or the save 2 s slower.) On 2 ranks (torchrun) rank 1
    waits for rank 0's write: its grace waits for it too."""
    module, name, first, seconds = SLOWLY[slow]
    script = f"""
import os, signal, sys, time, torch
from ddp import files, lifeline, metrics, train
lifeline.GRACE_S = 0.5
original = {module}.{name}
def slowly(*args, **kwargs):
    if slowly.first:
        {first}
    slowly.first = False
    time.sleep({seconds})
    return original(*args, **kwargs)
slowly.first = True
{module}.{name} = slowly
sys.exit(train.cli(sys.argv[1:]))
"""
    args = ["--config", "configs/smoke.yaml", "train.epochs=2", "data.synthetic_train=256", "data.synthetic_test=512",
            "train.eval_batch_size=8", f"run.out_dir={tmp_path}"]  # fmt: skip
    (tmp_path / "slowly.py").write_text(script)
    python = [TORCHRUN, "--standalone", "--nproc_per_node=2"] if "2 ranks" in slow else [sys.executable]
    run = subprocess.Popen([*python, str(tmp_path / "slowly.py"), *args], cwd=REPO, env=clean_env(), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        if slow == "evaluation":
            while (line := run.stdout.readline()) and line != "evaluating\n":  # (the run's first line before)
                pass
            assert line, run.communicate()
            run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert "no step boundary came" not in err, err
    assert run.returncode == (1 if "2 ranks" in slow else 75), err  # (torchrun: 1, each rank's exit code below)
    assert "2 ranks" not in slow or err.count("exitcode  : 75") == 2, err
    assert "stopped on SIGTERM" in err and (tmp_path / "checkpoints" / "last.pt").exists(), err
    assert [json.loads(line)["epoch"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


AGENT = """
import os, signal, subprocess, sys, time
from ddp import pausing
pausing.PAUSE_S = float(sys.argv[2])
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True, env={**os.environ, "RANK": "1"},
                        stdout=subprocess.PIPE, text=True)
assert rank.stdout.readline() == "ready\\n"
pause = pausing.Pause(one_machine=sys.argv[3] == "one machine", by_slurm=pausing.by_slurm())  # (as ddp/torchrun.py)
signal.signal(signal.SIGTSTP, pause)
signal.signal(signal.SIGCONT, pause.resumed)
print(rank.pid, flush=True)
time.sleep(60)
"""
# A rank whose step does not end: it takes SIGTSTP (its lifeline's handler) and does not pause; it says each one.
SLOW_RANK = ("import signal, sys, time; signal.signal(signal.SIGTSTP, lambda *a: print('TSTP', file=sys.stderr, "
             "flush=True)); print('ready', flush=True); time.sleep(60)")  # fmt: skip


def agent(pause_s: float = 30, machines: str = "one machine", **env: str) -> tuple[subprocess.Popen, int]:
    """AGENT with SLOW_RANK: (the agent, the rank's pid). A process group of its own, as a shell's job has: in an
    orphaned one (a pytest-xdist worker's) the system discards the agent's SIGTSTP to itself, and it goes on at once."""
    started = subprocess.Popen([sys.executable, "-c", AGENT, SLOW_RANK, str(pause_s), machines], cwd=REPO,
                               env=clean_env(**env), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=os.setpgrp)  # fmt: skip
    return started, int(started.stdout.readline())


def stopped(*pids: int, until: bool | None = None, within_s: float = 5) -> list[bool]:
    """Whether each of `pids` is stopped (/proc's T; running or asleep: not), once they all are `until` (or `within_s`
    has passed); at once without it."""
    from ddp import pausing

    deadline = time.monotonic() + within_s
    while until is not None and {pausing._state(pid) == "T" for pid in pids} != {until} and time.monotonic() < deadline:
        time.sleep(0.01)
    return [pausing._state(pid) == "T" for pid in pids]


def test_a_second_ctrl_z_stops_a_rank_late_to_pause_at_once_and_the_agent_with_it_and_fg_continues_them():
    """The agent (ddp/torchrun.py's Pause as its SIGTSTP handler, PAUSE_S 30 s) and a rank whose step does not end:
    at Ctrl-Z the agent waits for the rank to pause; a second Ctrl-Z, in that wait, stops the rank where it is and
    then the agent, at once, with a line naming the rank. A SIGCONT (fg) of the agent continues the rank."""
    started, rank = agent()
    try:
        started.send_signal(signal.SIGTSTP)
        time.sleep(0.5)
        waiting = stopped(started.pid, rank)
        started.send_signal(signal.SIGTSTP)
        both = stopped(started.pid, rank, until=True)
        started.send_signal(signal.SIGCONT)
        assert (waiting, both, stopped(rank, until=False)) == ([False, False], [True, True], [False])
    finally:
        os.kill(rank, signal.SIGKILL)
        started.kill()
    assert started.communicate(timeout=30)[1].splitlines() == [
        "TSTP",  # (the rank's: the first Ctrl-Z, passed on)
        "note: paused rank 1 where it was: a pause longer than run.timeout_s may end the run when it goes on",
    ]


@pytest.mark.parametrize("how", ["paused", "stopped where they were"])
def test_a_paused_job_whose_agent_is_killed_stops_with_a_checkpoint_and_frees_its_lock(tmp_path, how):
    """Ctrl-Z of ddp/torchrun.py (its ranks paused, it stopped), then `kill -9 %1`: the ranks stayed stopped for good
    (seen: T 8 s later), their memory and the run's lock held, and the same command refused to start. Each rank now
    has the kernel continue it as its launcher ends (PR_SET_PDEATHSIG): its watcher sees the launcher gone, and the
    run stops at its next step boundary with a checkpoint, the lock free, within 10 s. Also where the agent stopped
    its ranks where they were (late to pause: a second Ctrl-Z, PAUSE_S), their DataLoader workers with them: without
    the rank continuing those, it waited on them and they stayed stopped (seen by hand)."""
    args = [*PAUSED, "data.loader=torch", "data.workers=1"] if how == "stopped where they were" else PAUSED
    torchrun_py = [sys.executable, "ddp/torchrun.py", "--standalone", "--nproc_per_node=2", "ddp/train.py", *args]
    agent = subprocess.Popen([*torchrun_py, f"run.out_dir={tmp_path}"], cwd=REPO, env=clean_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=os.setpgrp)  # fmt: skip
    ranks, workers = [], []
    try:
        deadline = time.monotonic() + 120
        while not ((tmp_path / "metrics.jsonl").exists() and epochs_of(tmp_path)):  # (epoch 2's steps begin)
            assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()
            time.sleep(0.05)
        ranks = [pid for pid in children(agent.pid) if b"ddp/train.py" in cmdline(pid)]
        workers = [worker for rank in ranks for worker in descendants(rank)]
        if how == "paused":
            agent.send_signal(signal.SIGTSTP)
        else:  # as the agent stops a rank late to pause, then itself
            for rank in ranks:
                os.killpg(rank, signal.SIGSTOP)
            agent.send_signal(signal.SIGSTOP)
        paused = stopped(agent.pid, *ranks, *workers, until=True)
        agent.kill()
        gone = seconds_until_gone(ranks + workers, time.monotonic())
        out, err = agent.communicate(timeout=30)
    finally:
        agent.kill()
        kill_orphans(ranks + workers)
    assert len(ranks) == 2 and paused == [True] * (3 + len(workers)), (ranks, paused)
    assert len(workers) == (0 if how == "paused" else 4), workers  # each rank's training and evaluation worker
    assert "stopped on the launcher's end" in err, err
    # the stop's checkpoint (the step's own: an epoch's end may have saved it just before)
    saved = re.search(r"stopping on the launcher's end \(its process \d+ is gone\): checkpoint (\S+)", out)
    assert saved and Path(saved[1]).is_file(), out
    assert_free_and_whole(tmp_path)
    REPORT.append(f"kill -9 of a paused ddp/torchrun.py: its ranks stopped with a checkpoint {gone:.1f} s later")


@pytest.mark.parametrize("where", ["batch job", "terminal's job"])
def test_slurms_suspend_stops_the_agent_and_its_ranks_and_its_resume_leaves_none_of_them_stopped(where):
    """SLURM's suspend of a job whose step takes longer than its 2 s between SIGTSTP and SIGSTOP (ResNet-18 on CPU),
    then its resume: SIGTSTP, SIGSTOP and SIGCONT to every process. The agent waited for its ranks to pause, SLURM
    stopped it inside that wait, and after the resume it waited on, then stopped its ranks where they were and
    itself, for good (an sbatch job held its node until cancelled, by hand). In a batch job (no terminal: by_slurm)
    the agent leaves the pause to its ranks, and passes the SIGTSTP on (where SLURM signals its process group alone);
    in a terminal's (`srun --pty bash`) it waits, and the resume ends that wait. Either way, none stays stopped, and
    no line says that a rank was paused where it was (PAUSE_S 1 s: the old wait was over at the resume)."""
    started, rank = agent(pause_s=1, **({"SLURM_JOB_ID": "7"} if where == "batch job" else {}))
    try:
        started.send_signal(signal.SIGTSTP)  # (the rank's own SIGTSTP, from SLURM, left out: the agent passes it on)
        time.sleep(0.3)
        waiting = stopped(started.pid, rank)
        for pid in (started.pid, rank):  # 2 s later
            os.kill(pid, signal.SIGSTOP)
        time.sleep(1.5)  # (past PAUSE_S)
        for pid in (started.pid, rank):
            os.kill(pid, signal.SIGCONT)
        time.sleep(1.5)  # (what stopped them for good did so within 0.1 s, in a free machine)
        after = stopped(started.pid, rank)
    finally:
        os.kill(rank, signal.SIGKILL)
        started.kill()
    assert (waiting, after) == ([False, False], [False, False])
    assert started.communicate(timeout=30)[1].splitlines() == ["TSTP"]


def test_a_sigtstp_is_slurms_suspend_in_a_slurm_job_but_a_terminals_in_its_foreground_job():
    """pausing.by_slurm: in a SLURM job a SIGTSTP is its suspend (srun passes no Ctrl-Z on to its tasks: seen, srun
    stopped and its tasks ran on), unless the process is a terminal's foreground job (`srun --pty bash`), where it is
    Ctrl-Z. Asked of a process in a terminal's foreground, in its background (`&`), and with no terminal."""
    marker = f"asked-by-{os.getpid()}"  # (what close() kills: in no other process's command line, pytest's included)
    ask = f"python -c 'from ddp import pausing; print(\"by_slurm\", pausing.by_slurm())' {marker}"
    terminal = Terminal(REPO)
    try:
        terminal.wait_for(rb"\$ ")
        answers = []
        for line in (f"SLURM_JOB_ID=7 {ask}", f"SLURM_JOB_ID=7 {ask} &", ask):
            terminal.type(f"{line}\n".encode())
            answers.append(terminal.wait_for(rb"by_slurm (\w+)")[1].decode())
    finally:
        terminal.close(marker)
    alone = subprocess.run(["bash", "-c", ask], cwd=REPO, env=clean_env(SLURM_JOB_ID="7"), capture_output=True,
                           text=True, start_new_session=True)  # fmt: skip
    assert answers == ["False", "True", "False"] and alone.stdout == "by_slurm True\n", (answers, alone)


def test_ctrl_z_of_one_machine_of_a_job_on_several_says_so_and_the_job_goes_on(tmp_path):
    """Node 0 of a job on two machines, its agent waiting for the other at the rendezvous: Ctrl-Z (SIGTSTP) would
    stop its agent, whose store the other machine's ranks use, and a pause of its ranks alone would hold the others
    in their collectives past run.timeout_s. It says so and goes on (not stopped); Ctrl-C stops the job."""
    from ddp import pausing

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = subprocess.Popen(
        [sys.executable, "ddp/torchrun.py", "--nnodes=2", "--node_rank=0", "--nproc_per_node=1", "--rdzv_backend=c10d",
         f"--rdzv_endpoint=127.0.0.1:{port}", "ddp/train.py", "--config=configs/smoke.yaml", f"run.out_dir={tmp_path}"],
        cwd=REPO, env=clean_env(), text=True, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not pausing._handles_sigtstp(agent.pid) and time.monotonic() < deadline and agent.poll() is None:
            time.sleep(0.05)
        agent.send_signal(signal.SIGTSTP)
        while (line := agent.stderr.readline()) and not line.startswith("note: Ctrl-Z"):
            pass
        assert line.startswith("note: Ctrl-Z does not pause a job on several machines"), agent.communicate()
        assert pausing._state(agent.pid) not in "TtZX"
    finally:
        agent.terminate()
        agent.communicate(timeout=30)


def test_the_agent_stops_a_rank_without_a_pause_handler_at_once_and_one_late_to_pause_after_its_wait(
    monkeypatch, capsys
):
    """ddp/pausing.py's wait for the ranks to pause: a process with no SIGTSTP handler (a rank still starting: its
    lifeline does not watch yet) is stopped at once; one with a handler that does not stop (a step longer than
    PAUSE_S, 1 s here) after the wait, with a line naming it."""
    from ddp import pausing

    handler = "import signal, time; signal.signal(signal.SIGTSTP, lambda *a: None); print('ready', flush=True)"
    starting = subprocess.Popen(["sleep", "60"], start_new_session=True)
    stepping = subprocess.Popen([sys.executable, "-c", f"{handler}; time.sleep(60)"], start_new_session=True,
                                stdout=subprocess.PIPE, env={**clean_env(), "RANK": "1"}, text=True)  # fmt: skip
    try:
        assert stepping.stdout.readline() == "ready\n"
        monkeypatch.setattr(pausing, "PAUSE_S", 1.0)
        pause = pausing.Pause(one_machine=True)
        waited = []
        for ranks in ([starting.pid], [starting.pid, stepping.pid]):  # (the one that starts does not hurry the other)
            os.kill(starting.pid, signal.SIGCONT)
            started = time.monotonic()
            pause.wait_for(ranks)
            waited.append(time.monotonic() - started)
        deadline = time.monotonic() + 5  # (a SIGSTOP takes effect as the process next runs)
        while {pausing._state(p.pid) for p in (starting, stepping)} != {"T"} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [pausing._state(p.pid) for p in (starting, stepping)] == ["T", "T"]
        assert waited[0] < 0.8 and 1.0 <= waited[1] < 5, waited
        assert capsys.readouterr().err.splitlines() == [
            "note: paused rank 1 where it was: a pause longer than run.timeout_s may end the run when it goes on"
        ]
    finally:
        for process in (starting, stepping):
            process.kill()
            process.wait()
