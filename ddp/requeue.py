"""SLURM's requeue of a job (`scontrol requeue`), asked by rank 0 after its stop checkpoint, and by slurm/train.sh for a
step a stop signal ended before any checkpoint (in its start-up): not for a job scancel ended. Imports no torch."""

from __future__ import annotations

import signal
import subprocess

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


def scontrol(*args: str) -> subprocess.CompletedProcess:
    """`scontrol ARGS`, SIGTERM ignored (kept across exec): a stop or a requeue signals the job's processes, scontrol
    among them. One that does not answer within 60 s (slurmctld down) exits 1, saying so."""
    cmd = ["sh", "-c", 'trap "" TERM; exec "$@"', "sh", "scontrol", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 1, "", f"scontrol {args[0]}: no answer within 60 s")


def state(job: str) -> tuple[str, str]:
    """The job's (JobState, Reason) as `scontrol show job -o` says them; ("", "") where it says nothing."""
    fields = dict(w.split("=", 1) for w in scontrol("show", "job", "-o", job).stdout.split() if "=" in w)
    return fields.get("JobState", ""), fields.get("Reason", "")


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
    again = "submit it again with this job's run.out_dir (slurm/train.sh gives a new job an out_dir of its own)"
    how = f"to go on, {again}"
    if requeued is None:  # scontrol ended by the requeue's signal, most likely
        how = f"if SLURM does not start the job again (squeue -j {job}), {again}"
    if requeued:
        how = "SLURM starts the job again, and it resumes from the out_dir's last checkpoint, if any"
    ended = f"the job's step ended on {STOPPED_BY[code]} (exit {code}) and no rank requeued it"
    return f"slurm/train.sh: {ended} (a stop before training); {said}; {how}"


def main(argv: list[str]) -> None:
    """`python -c 'import sys; from ddp import requeue; requeue.main(sys.argv[1:])' JOB CODE SIGNALLED`: after_step's
    line, if any, on stdout. Its own requeue signals it (SIGTERM) with the job: ignored, to say so."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    job, code, signalled = argv
    if said := after_step(job, int(code), signalled == "1"):
        print(said, flush=True)
