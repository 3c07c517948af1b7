"""SLURM's requeue of a job (`scontrol requeue`), asked by rank 0 after its stop checkpoint or on a preemption before
training, and by slurm/train.sh for a job SLURM preempts before srun, or whose step a stop ended before any checkpoint.
Imports no torch: the batch shell's checks are a Python start and a scontrol call."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time

from ddp.errors import EXIT_STOPPED

# A step's exit code for a stop signal (128 + SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2): torchrun's agent ended so.
STOPPED_BY = {128 + s: s.name for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)}


def outcome(result: subprocess.CompletedProcess) -> str:
    """What `scontrol requeue` did. The requeue stops the job's processes at once, and scontrol is one of
    them: ended by a signal (SIGKILL: it ignores SIGTERM) before it exits 0, it did requeue, most likely."""
    if result.returncode == 0:
        return "requeued"
    if result.returncode < 0:
        return (
            f"scontrol ended by {signal.Signals(-result.returncode).name} as the job stopped (the requeue, or a cancel)"
        )
    return result.stderr.strip() or f"scontrol exited {result.returncode}"


def scontrol(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`scontrol ARGS`, SIGTERM ignored: a stop or a requeue signals the job's processes, scontrol among them. It starts
    with SIGTERM blocked (posix_spawn's mask; from any thread), until its shell ignores it (kept across exec): a second
    SIGTERM (torchrun's, sent on) that came as it started ended it, and what it was asked went unanswered. One
    that does not answer within `timeout_s` (slurmctld down) exits 1, saying so."""
    cmd = ["sh", "-c", 'trap "" TERM; exec "$@"', "sh", "scontrol", *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        dup = [(os.POSIX_SPAWN_DUP2, out.fileno(), 1), (os.POSIX_SPAWN_DUP2, err.fileno(), 2)]
        pid = os.posix_spawnp(cmd[0], cmd, os.environ, file_actions=dup, setsigmask={signal.SIGTERM})
        until = time.monotonic() + timeout_s
        while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > until:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return subprocess.CompletedProcess(cmd, 1, "", f"scontrol {args[0]}: no answer within {timeout_s:g} s")
            time.sleep(0.01)
        said = [f.seek(0) or f.read().decode(errors="replace") for f in (out, err)]
    return subprocess.CompletedProcess(cmd, os.waitstatus_to_exitcode(ended[1]), *said)


def shown(job: str, timeout_s: float = 60) -> dict[str, str]:
    """The job's fields as `scontrol show job -o` says them (JobState=RUNNING: {"JobState": "RUNNING"}); {} where it
    says nothing (within `timeout_s`)."""
    said = scontrol("show", "job", "-o", job, timeout_s=timeout_s).stdout
    return dict(w.split("=", 1) for w in said.split() if "=" in w)


def state(job: str) -> tuple[str, str]:
    """The job's (JobState, Reason); ("", "") where scontrol says nothing."""
    fields = shown(job)
    return fields.get("JobState", ""), fields.get("Reason", "")


def preempted(fields: dict[str, str]) -> str | None:
    """When SLURM chose the job (its `shown` fields) for preemption, if it did and the job still runs: PreemptTime.
    None where it did not, and for a job ever suspended (PreemptMode=SUSPEND and gang scheduling set PreemptTime too,
    and SuspendTime: the job goes on after its resume)."""
    unset = ("", "None", "Unknown")
    if fields.get("JobState") != "RUNNING" or fields.get("SuspendTime", "") not in unset:
        return None
    return None if fields.get("PreemptTime", "") in unset else fields["PreemptTime"]


def ask(job: str, now: tuple[str, str] | None = None) -> tuple[bool | None, str]:
    """`scontrol requeue JOB`: whether it was requeued (None: not known), and what came of it. Not where `scancel`
    ended the job (JobState COMPLETING, Reason None; CANCELLED): the requeue brought it back, PENDING, and it ran
    again. SIGTERM before its time limit (RUNNING), at it (COMPLETING, Reason TimeLimit) or a preemption requeue it, as
    does a state scontrol does not say. `now`: its state, if just read."""
    job_state, reason = now or state(job)
    if job_state == "CANCELLED" or job_state == "COMPLETING" and reason == "None":
        scancel = "scancel ended it; scancel --signal=TERM stops a job to requeue it"
        return False, f"not requeued: the job is {job_state} ({scancel})"
    result = scontrol("requeue", job)
    requeued = True if result.returncode == 0 else None if result.returncode < 0 else False  # (< 0: ended by it)
    return requeued, f"scontrol requeue {job}: {outcome(result)}"


def before_step(job: str, stop_seen: str) -> str | None:
    """slurm/train.sh's check before srun: SLURM's preemption in the job's start-up (its rendezvous port, the preflight)
    signals its steps (SIGTERM), none yet: lost, the job trained on through the GraceTime until SLURM killed it. Such a
    job is requeued here instead of started, as is one whose shell got `stop_seen` (SIGTERM, say: scancel -b) by then;
    the line that says so. None where neither came."""
    fields = shown(job)
    if (when := preempted(fields)) is None and not stop_seen:
        return None
    requeued, said = ask(job, (fields.get("JobState", ""), fields.get("Reason", "")))
    came = f"{stop_seen} came for this shell" if stop_seen else f"SLURM chose the job for preemption at {when}"
    chosen = f"{came}, before its step (no rank to signal), so it does not start"
    return f"slurm/train.sh: {chosen}; {said}; {_how_it_goes_on(job, requeued)}"


def in_start_up(job: str | None, signal_name: str) -> str | None:
    """Rank 0's stop signal before training (lifeline), under SLURM: where SLURM chose the job for preemption (its
    SIGTERM came while the ranks started, with nothing to save yet), the job is requeued, and the line that says so.
    None for any other: a stop not SLURM's (scancel --signal, a step's end as a task failed) requeues nothing."""
    if job is None:
        return None
    if "JobState" not in (fields := shown(job, timeout_s=10)):  # no answer (slurmctld busy with the preemption?):
        fields = shown(job, timeout_s=10)  # asked once more, well within its grace
    if (when := preempted(fields)) is None:
        return None
    requeued, said = ask(job, (fields.get("JobState", ""), fields.get("Reason", "")))
    stopped = f"stopped on {signal_name} before training (SLURM's preemption at {when}): nothing to save yet"
    return f"{stopped}; {said}; {_how_it_goes_on(job, requeued)}"


def after_step(job: str, code: int, shell_signalled: bool) -> str | None:
    """slurm/train.sh's last word on a step that exited `code`: a stop signal (SLURM's preemption, its warning before
    the time limit, scancel --signal; scancel -b's, which the shell sent on) that ended it before training (the agent's
    start, the rendezvous, a rank's before its first step), where no rank saved or requeued, requeues the job; the line
    that says so. None for any other code, and where the shell's own signal was the job's end: a requeue (rank 0's)
    and scancel signal the batch shell too, and leave the job COMPLETING or CANCELLED."""
    if code not in STOPPED_BY:
        return None
    now = state(job)
    if shell_signalled and now[0] != "RUNNING":
        return None
    requeued, said = ask(job, now)
    ended = f"the job's step ended on {STOPPED_BY[code]} (exit {code}) and no rank requeued it"
    return f"slurm/train.sh: {ended} (a stop before training); {said}; {_how_it_goes_on(job, requeued)}"


def _how_it_goes_on(job: str, requeued: bool | None) -> str:
    again = "submit it again with this job's run.out_dir (slurm/train.sh gives a new job an out_dir of its own)"
    if requeued is None:  # scontrol ended by the requeue's signal, most likely
        return f"if SLURM does not start the job again (squeue -j {job}), {again}"
    if requeued:
        return "SLURM starts the job again, and it resumes from the out_dir's last checkpoint, if any"
    return f"to go on, {again}"


def main(argv: list[str]) -> int:
    """slurm/train.sh's `python -c 'import sys; from ddp import requeue; sys.exit(requeue.main(sys.argv[1:]))'` with
    `before JOB STOP_SEEN` (before_step: exit 75 where the job must not start) or `after JOB CODE STOP_SEEN`
    (after_step; STOP_SEEN: the stop signal the shell got, if any): the line, if any, on stdout. Its own requeue
    signals it (SIGTERM) with the job: ignored, to say so."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if argv[0] == "before":
        said = before_step(argv[1], argv[2])
    else:
        said = after_step(argv[1], int(argv[2]), bool(argv[3]))
    if said:
        print(said, flush=True)
    return EXIT_STOPPED if argv[0] == "before" and said else 0
