"""Real SLURM: a one-node cluster on this machine (slurm/cluster.sh: slurmctld, slurmd, munge), real
sbatch / srun / scancel / scontrol requeue. CPU jobs with gloo."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    REPO,
    REPORT,
    TINY,
    TRAIN,
    assert_free_and_whole,
    clean_env,
    cmdline,
    has_fsdp2,
    metrics,
    ok,
    require,
    seconds_until_gone,
    torchrun,
)
from slurm_hosts import private_munged

from ddp import rundir

CLUSTER = REPO / "slurm" / "cluster.sh"
# Long enough (4 epochs x 32 steps, ~1 s an epoch) that a stop signal lands mid-run.
PREEMPTIBLE = [*TINY, "data.synthetic_train=1024", "train.epochs=4", "run.save_every_steps=10"]


@pytest.fixture(scope="module")
def slurm() -> dict[str, str]:
    """The environment in which sbatch/srun reach the local cluster (started if it is not running)."""
    require("slurmctld", "apt-get install slurm-wlm slurmctld slurmd munge, or: bash slurm/cluster.sh install")
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (slurmd starts jobs as their user): run the tests as root")
    started = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, f"slurm/cluster.sh start failed:\n{started.stdout}\n{started.stderr}"
    conf = started.stdout.strip().splitlines()[-1].removeprefix("export SLURM_CONF=")
    return clean_env(SLURM_CONF=conf)


def submit(env: dict[str, str], out_root: Path, *args: str, sbatch_args: tuple[str, ...] = ()) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--output={out_root}/log-%j.out", *sbatch_args, "slurm/train.sh", *args],
        cwd=REPO, env={**env, "OUT_ROOT": str(out_root)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_field(env: dict[str, str], job: str, name: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in shown.split() if w.startswith(f"{name}=")), "")


def wait_until_done(env: dict[str, str], job: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_field(env, job, "JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"):
            return state
        time.sleep(0.3)
    subprocess.run(["scancel", job], env=env)
    pytest.fail(f"job {job} still {job_field(env, job, 'JobState')} after {timeout} s (cancelled)")


def held_job(env: dict[str, str], out_root: Path, step: int | str, *args: str) -> tuple[str, Path]:
    """A job submitted with DDP_CIFAR_FAULT=wait:STEP (rank 0 waits there for its stop signal; wait:preflight, the
    preflight for SLURM's preemption), and its out_dir, once it waits."""
    job = submit({**env, "DDP_CIFAR_FAULT": f"wait:{step}"}, out_root, *args)
    out, deadline = out_root / f"slurm-{job}", time.monotonic() + 120
    while not rundir.fault_marker(out, "wait", step).exists():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env)
            pytest.fail(f"rank 0 of job {job} not waiting after 120 s: {job_field(env, job, 'JobState')} (cancelled)")
        time.sleep(0.05)
    return job, out


def preempt(env: dict[str, str], out_root: Path) -> str:
    """An urgent job (slurm/cluster.sh's partition that preempts) that needs both CPUs: its id."""
    urgent = ["sbatch", "--parsable", "--partition=urgent", "--ntasks=2", f"--output={out_root}/urgent-%j.out"]
    return ok(subprocess.run([*urgent, "--wrap=sleep 1"], env=env, capture_output=True, text=True)).stdout.strip()


def test_sbatch_runs_torchrun_per_node_and_writes_metrics_and_a_checkpoint(slurm, tmp_path):
    parallel = "fsdp" if has_fsdp2() else "ddp"  # ddp: the 2-node sbatch test (tests/test_hosts.py)
    start = time.monotonic()
    job = submit(slurm, tmp_path, *TINY, f"run.parallel={parallel}")
    state = wait_until_done(slurm, job, timeout=180)
    log = (tmp_path / f"log-{job}.out").read_text()
    assert state == "COMPLETED", log
    out = tmp_path / f"slurm-{job}"  # out_dir per job id
    assert [m["epoch"] for m in metrics(out)] == [1, 2] and metrics(out)[-1]["world_size"] == 2
    assert (out / "checkpoints" / "last.pt").is_file()
    assert "--rdzv_backend=c10d" in log and f"launcher=torchrun parallel={parallel}" in log
    version = subprocess.run(["sbatch", "--version"], env=slurm, capture_output=True, text=True).stdout.strip()
    REPORT.append(f"sbatch slurm/train.sh ({version}, CPU, 2 ranks, 2 epochs, {parallel}): {state} "
                  f"in {time.monotonic() - start:.1f} s from submit to done")  # fmt: skip


def test_a_rendezvous_port_taken_on_the_first_node_fails_the_job_in_one_line(slurm, tmp_path):
    with socket.socket() as held:  # another program listening on the job's port (MASTER_PORT sets it)
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        job = submit({**slurm, "MASTER_PORT": str(port)}, tmp_path, *TINY)
        state = wait_until_done(slurm, job, timeout=120)
    log = (tmp_path / f"log-{job}.out").read_text()
    assert state == "FAILED" and f"error: MASTER_PORT={port} is taken on" in log, log
    assert "Traceback" not in log and "+ srun" not in log, log


def test_srun_starts_the_ranks_directly(slurm, tmp_path):
    """With SLURM's PMI-2 (a cluster's MpiDefault=pmi2), whose PMI_RANK and PMI_SIZE without MPICH's other variables
    were a KeyError's traceback in every task; plain srun: the srun-killed test below."""
    parallel = "fsdp" if has_fsdp2() else "ddp"  # ddp: the srun-killed test here, srun on 2 nodes (test_hosts.py)
    proc = subprocess.run(
        ["srun", "--mpi=pmi2", "--ntasks=2", "python", str(TRAIN), *TINY, "train.epochs=1", f"run.out_dir={tmp_path}",
         f"run.parallel={parallel}"],
        cwd=REPO, env=slurm, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    ok(proc)
    assert f"launcher=slurm parallel={parallel} world_size=2" in proc.stdout
    assert metrics(tmp_path)[0]["world_size"] == 2


@pytest.mark.parametrize("task", [1, 0])
def test_a_task_that_stops_before_the_ranks_meet_ends_the_others_at_once_with_its_line(slurm, tmp_path, task):
    """Plain srun (SLURM's default leaves the other tasks running when one fails), one task's data.path a file it has
    not (node-local disks): the other, waiting for it in the store rank 0 serves, stops with its line at once, exit
    2. It waited out run.timeout_s, then said only "Timed out after 61 seconds waiting for clients. 1/2 clients
    joined". Task 0 (rank 0) serves that store for the others to hear it (lost_rank.serve_word): task 1 ends on
    its usage error, exit 2, where it waited out run.timeout_s and ended with exit 1."""
    x = np.zeros((64, 32, 32, 3), dtype=np.uint8) + np.arange(64, dtype=np.uint8)[:, None, None, None]
    np.savez(tmp_path / "data.npz", x_train=x, y_train=np.arange(64) % 10, x_test=x[:20], y_test=np.arange(20) % 10)
    missing = tmp_path / "not-on-this-node.npz"
    one_task_misses = f'if [ "$SLURM_PROCID" = {task} ]; then set -- "$@" "data.path=$MISSING"; fi; exec python "$@"'
    proc = subprocess.run(
        ["srun", "--ntasks=2", "bash", "-c", one_task_misses, "task", str(TRAIN), *TINY, "data.dataset=npz",
         f"data.path={tmp_path / 'data.npz'}", f"run.out_dir={tmp_path / 'run'}", "run.timeout_s=300"],
        cwd=REPO, env={**slurm, "MISSING": str(missing)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and all(f"task {t}: Exited with exit code 2" in proc.stderr for t in (0, 1))
    # Rank 0 speaks for the machine: its own line, or task 1's (task 1 on a machine of its own says task 0's line;
    # the unit test has that line).
    said = f"rank 1 on {socket.gethostname()} stopped before the ranks met: " if task == 1 else ""
    assert f"error: {said}data.path={missing}: no such file" in proc.stderr, proc.stderr


def test_two_sruns_at_once_in_one_allocation_each_meet_their_own_ranks_and_finish(slurm, tmp_path):
    """Two `srun -n2 python ddp/train.py` at once in one salloc (a small sweep): each step's ranks meet at a port of
    its own (slurm_port of the job and the step). Both took the job's one port: the second's rank 0 could not
    listen there, its rank 1 joined the first run's store, and the first run, trained to its end, failed there
    (`lost contact with rank 0`)."""
    run = f"srun -n2 --overlap python {TRAIN} {' '.join(TINY)} train.epochs=1 run.progress=false run.out_dir={tmp_path}"
    both = f"{run}/a > {tmp_path}/a.log 2>&1 & {run}/b > {tmp_path}/b.log 2>&1; b=$?; wait $!; echo $? $b"
    proc = subprocess.run(["salloc", "-n4", "--overcommit", "bash", "-c", both], cwd=REPO, env=slurm,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    logs = {run: (tmp_path / f"{run}.log").read_text() for run in "ab"}
    assert proc.stdout.split() == ["0", "0"], (proc.stdout, proc.stderr, logs)
    learnt = [[(m["train_loss"], m["test_acc"]) for m in metrics(tmp_path / run)] for run in "ab"]
    assert learnt[0] == learnt[1] and len(learnt[0]) == 1  # the same run, twice


def test_doctor_under_srun_checks_every_task(slurm, tmp_path):
    proc = subprocess.run(
        ["srun", "--ntasks=2", "python", "-m", "ddp.doctor", f"run.out_dir={tmp_path}", "data.dataset=synthetic"],
        cwd=REPO, env=slurm, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    ok(proc)
    assert "rank 0/2" in proc.stdout and "rank 1/2" in proc.stdout and "launcher slurm" in proc.stdout
    assert "SLURM_PROCID=1" in proc.stdout and "the same directory on every rank" in proc.stdout
    assert proc.stdout.count("doctor: OK") == 1


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The out_dir of PREEMPTIBLE run by torchrun on this machine, 2 ranks, outside SLURM: what a job of it ends with
    however SLURM stops, kills, suspends or resumes it."""
    out = tmp_path_factory.mktemp("uninterrupted")
    ok(torchrun(2, str(TRAIN), *PREEMPTIBLE, f"run.out_dir={out}"))
    return out


@pytest.mark.parametrize("launch", ["sbatch", "srun"])
def test_a_job_suspended_past_run_timeout_s_pauses_at_a_step_boundary_and_ends_as_one_never_suspended(
    slurm, tmp_path, uninterrupted, launch
):
    """`scontrol suspend` of a training job (PreemptMode=SUSPEND, gang scheduling), then `scontrol resume`. SLURM sends
    each process SIGTSTP, SIGSTOP 2 s later, and SIGCONT at the resume. srun's ranks took no SIGTSTP, and were stopped
    where they were: inside a collective, a suspension past run.timeout_s ended the run as it was resumed (5 of 6
    jobs suspended 10 s with run.timeout_s=4, by hand). Now each rank pauses at a step boundary all ranks agree on, and
    the suspension may last. ddp/torchrun.py (sbatch slurm/train.sh) leaves it to its ranks: it waited for them and
    then stopped itself, and where SLURM stopped it in that wait (steps over 2 s), it stopped them and itself for good
    after the resume. Suspended twice run.timeout_s in epoch 2: the job completes, with every epoch's numbers as a run
    never suspended has them, and epoch 2's train_s without the suspension."""
    args = [*PREEMPTIBLE, "run.timeout_s=3"]
    env = {**slurm, "OUT_ROOT": str(tmp_path)}
    if launch == "sbatch":
        job = submit(env, tmp_path, *args)
        out = tmp_path / f"slurm-{job}"
    else:
        out = tmp_path / "run"
        wrap = shlex.join(["srun", "--kill-on-bad-exit=1", "python", str(TRAIN), *args, f"run.out_dir={out}"])
        sbatch = ["sbatch", "--parsable", "--ntasks=2", f"--output={tmp_path}/log-%j.out", f"--wrap={wrap}"]
        job = ok(subprocess.run(sbatch, cwd=REPO, env=env, capture_output=True, text=True)).stdout.strip()
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").exists() and metrics(out)):
        assert time.monotonic() < deadline, job_field(slurm, job, "JobState")
        time.sleep(0.05)
    time.sleep(0.3)  # (epoch 2's steps: about 1 s of them)
    ok(subprocess.run(["scontrol", "suspend", job], env=slurm, capture_output=True, text=True))
    time.sleep(6)
    ok(subprocess.run(["scontrol", "resume", job], env=slurm, capture_output=True, text=True))
    state = wait_until_done(slurm, job, timeout=120)
    log = (tmp_path / f"log-{job}.out").read_text()
    assert state == "COMPLETED" and "error" not in log, log[-3000:]
    # SLURM's SIGSTOP comes 2 s after its SIGTSTP: the ranks had paused; its log says so once (rank 0), and nothing else
    notes = re.findall(r"note: .*", log)
    assert len(notes) == 1 and re.match(r"note: continued after [5-9] s paused at a step boundary every", notes[0]), log
    epochs, reference = metrics(out), metrics(uninterrupted)
    for key in ("train_loss", "grad_norm_mean", "grad_norm_max", "test_acc", "confusion"):
        assert [e[key] for e in epochs] == [e[key] for e in reference], key
    assert epochs[1]["train_s"] < reference[1]["train_s"] + 3, (epochs, reference)


def test_scancel_ends_a_job_with_a_checkpoint_and_does_not_requeue_it(slurm, tmp_path):
    """`scancel JOB`: SLURM ends the job (COMPLETING) and sends its processes SIGTERM. The run took that as SLURM's
    warning before a time limit: it saved, and requeued the job, which came back PENDING (Restarts=1): one scancel did
    not end it. Rank 0 now asks SLURM first: a job it ended is not requeued, and the line says so; the stop's
    checkpoint is kept, and its out_dir named to resume with. (`scancel --signal=TERM`, the job still RUNNING, requeues
    it: tests/test_hosts.py.)"""
    job = submit(slurm, tmp_path, *PREEMPTIBLE)
    out, log = tmp_path / f"slurm-{job}", tmp_path / f"log-{job}.out"
    deadline = time.monotonic() + 120
    while not list((out / "checkpoints").glob("step-*.pt")):
        assert time.monotonic() < deadline, job_field(slurm, job, "JobState")
        time.sleep(0.1)
    try:
        ok(subprocess.run(["scancel", job], env=slurm, capture_output=True, text=True))
        while not re.search(r"not requeued|scontrol requeue", log.read_text()):  # (rank 0's answer)
            assert time.monotonic() < deadline + 60, log.read_text()[-3000:]
            time.sleep(0.1)
        wait_until_done(slurm, job, timeout=60)
        time.sleep(1)  # (a requeue makes it PENDING)
        said = log.read_text()
    finally:
        subprocess.run(["scancel", job], env=slurm)  # (where it came back: no later job waits for it)
    assert (job_field(slurm, job, "JobState"), job_field(slurm, job, "Restarts")) == ("CANCELLED", "0"), said[-3000:]
    assert "stopping on SIGTERM: checkpoint" in said and "not requeued: the job is COMPLETING (scancel ended it" in said
    again = f"stopped on SIGTERM; to resume, run it again with run.out_dir={out} (slurm/train.sh gives a new job"
    assert again in said, said[-3000:]  # ("run the same command" was a new job's new out_dir: a fresh start)


def test_a_sigterm_for_the_batch_shell_stops_the_job_with_a_checkpoint_and_requeues_it(slurm, tmp_path):
    """`scancel -b --signal=TERM JOB`, as `#SBATCH --signal=B:TERM@120` sends it: SIGTERM for the batch shell
    alone. That shell was srun (slurm/train.sh ended in `exec srun`), which takes SIGTERM as the job's end: it killed
    the ranks, and the job ended FAILED without a checkpoint. The shell now runs srun as its child and sends the
    signal on to the job's steps: the ranks stop with a checkpoint and rank 0 requeues the job."""
    job = submit(slurm, tmp_path, *PREEMPTIBLE)
    out, log = tmp_path / f"slurm-{job}", tmp_path / f"log-{job}.out"
    deadline = time.monotonic() + 120
    try:
        while not list((out / "checkpoints").glob("step-*.pt")):
            assert time.monotonic() < deadline, job_field(slurm, job, "JobState")
            time.sleep(0.1)
        ok(subprocess.run(["scancel", "--batch", "--signal=TERM", job], env=slurm, capture_output=True, text=True))
        while "scontrol requeue" not in log.read_text() and job_field(slurm, job, "JobState") not in ("FAILED", ""):
            assert time.monotonic() < deadline + 60, log.read_text()[-3000:]
            time.sleep(0.1)
        said, restarts = log.read_text(), job_field(slurm, job, "Restarts")
    finally:
        subprocess.run(["scancel", job], env=slurm)  # (requeued: no later job waits for it)
    saved = re.search(r"^stopping on SIGTERM: checkpoint (\S+)$", said, re.M)
    assert saved and Path(saved[1]).is_file() and f"scontrol requeue {job}: requeued" in said, said[-3000:]
    assert restarts == "1", said[-3000:]


def test_a_job_preempted_by_an_urgent_one_saves_requeues_itself_and_ends_as_one_never_preempted(
    slurm, tmp_path, uninterrupted
):
    """SLURM's preemption (slurm/cluster.sh: partition priorities, PreemptMode=CANCEL, GraceTime=60): a job of the
    urgent partition needs both CPUs, and SLURM sends the running job SIGTERM, to cancel it at the end of its grace
    time. The ranks stop with a checkpoint, rank 0 requeues the job (still running: scancel's COMPLETING is not this),
    the urgent job runs, and the requeued one resumes and ends with the numbers of a run never preempted.
    (PreemptMode=REQUEUE, where SLURM requeues it too: the same, by hand.) Rank 0 waits in global step 40 for the
    stop signal (DDP_CIFAR_FAULT=wait): the urgent job was sent after epoch 1, and on a fast machine (0.5-1.1 s epochs)
    the job had ended its last epoch before the preemption's SIGTERM came (exit 143 from the agent then: FAILED)."""
    job, out = held_job(slurm, tmp_path, 40, *PREEMPTIBLE)
    urgent = preempt(slurm, tmp_path)
    state = wait_until_done(slurm, job, timeout=180)
    log = (tmp_path / f"log-{job}.out").read_text()
    ended = (state, job_field(slurm, job, "Restarts"), wait_until_done(slurm, urgent, 30))
    assert ended == ("COMPLETED", "1", "COMPLETED"), (ended, log[-3000:])
    said = ["stopping on SIGTERM: checkpoint", f"scontrol requeue {job}: requeued", "resumed from",
            "stopped on SIGTERM; SLURM starts the job again, and it resumes from this checkpoint"]  # fmt: skip
    assert all(line in log for line in said) and "slurm/train.sh: the job's step" not in log, log[-3000:]
    stopped_at = int(re.search(r"^stopping on SIGTERM: checkpoint \S+step-(\d+)\.pt$", log, re.M)[1])
    assert 40 <= stopped_at <= 42, log[-3000:]  # (the agreement is a step late; the signal may reach ranks apart)
    epochs, reference = metrics(out), metrics(uninterrupted)
    for key in ("train_loss", "grad_norm_mean", "grad_norm_max", "test_acc", "confusion"):
        assert [e[key] for e in epochs] == [e[key] for e in reference], key


@pytest.mark.parametrize("stop", ["preemption", "batch shell"])
def test_a_job_stopped_before_training_is_requeued_and_runs_again_to_its_end(slurm, tmp_path, stop):
    """SLURM's preemption signals the job's steps, not its batch shell. One that came in a job's start-up (the
    agent's, the rendezvous, a rank's before its first step) ended the step, exit 143, with no rank to save or
    requeue: the job ended FAILED, Restarts 0, its log ending in srun's "task 0: Exited with exit code 143". Rank 0
    requeues a job SLURM chose (the shell, seeing the requeue, says nothing more); slurm/train.sh requeues one stopped
    by a stop it got itself and sent on (scancel -b, --signal=B:TERM), which rank 0 does not take for SLURM's.
    Rank 0 waits before its first step for the stop signal (DDP_CIFAR_FAULT=wait:0)."""
    job, out = held_job(slurm, tmp_path, 0, *TINY)
    if stop == "preemption":
        urgent = preempt(slurm, tmp_path)
    else:
        ok(subprocess.run(["scancel", "--batch", "--signal=TERM", job], env=slurm, capture_output=True, text=True))
    state = wait_until_done(slurm, job, timeout=180)
    log = (tmp_path / f"log-{job}.out").read_text()
    others = wait_until_done(slurm, urgent, 30) if stop == "preemption" else "COMPLETED"
    ended = (state, job_field(slurm, job, "Restarts"), others)
    assert ended == ("COMPLETED", "1", "COMPLETED"), (ended, log[-3000:])
    shell = (f"slurm/train.sh: the job's step ended on SIGTERM (exit 143) and no rank requeued it (a stop before "
             f"training); scontrol requeue {job}: requeued; SLURM starts the job again")  # fmt: skip
    rank_0 = (r"^rank 0 of 2: stopped on SIGTERM before training \(SLURM's preemption at \S+\): nothing to save yet; "
              f"scontrol requeue {job}: requeued; SLURM starts the job again")  # fmt: skip
    if stop == "preemption":
        assert re.search(rank_0, log, re.M) and "slurm/train.sh: the job's step" not in log, log[-3000:]
    else:
        assert shell in log and "before training (SLURM's preemption" not in log, log[-3000:]
    assert "stopping on" not in log and "resumed from" not in log, log[-3000:]  # (nothing to resume)
    assert len(metrics(out)) == 2, log[-3000:]


@pytest.mark.parametrize("stop", ["preemption", "batch shell"])
def test_a_job_stopped_before_its_step_is_requeued_at_once_and_runs_again_to_its_end(slurm, tmp_path, stop):
    """SLURM's preemption in a job's start-up before srun (the preflight) signalled no process: the job trained on
    through its GraceTime, until SLURM killed it; a short one ran to its end, COMPLETED, Restarts 0, while the urgent
    job waited. A stop signal for the batch shell then (scancel -b) ended the shell, FAILED. slurm/train.sh requeues
    either job instead of starting it, and says so. The preflight waits until SLURM chose the job, or the test says go
    (DDP_CIFAR_FAULT=wait:preflight): bash takes the shell's signal once the preflight ends."""
    job, out = held_job(slurm, tmp_path, "preflight", *TINY)
    if stop == "preemption":
        urgent, came = preempt(slurm, tmp_path), "SLURM chose the job for preemption at "
    else:
        ok(subprocess.run(["scancel", "--batch", "--signal=TERM", job], env=slurm, capture_output=True, text=True))
        time.sleep(1)  # (slurmd's signal on its way to the shell)
        urgent, came = None, "slurm/train.sh: SIGTERM came for this shell"
        rundir.fault_marker(out, "wait", "preflight").write_text("go")
    state = wait_until_done(slurm, job, timeout=180)
    log = (tmp_path / f"log-{job}.out").read_text()
    ended = (state, job_field(slurm, job, "Restarts"), wait_until_done(slurm, urgent, 30) if urgent else "COMPLETED")
    assert ended == ("COMPLETED", "1", "COMPLETED"), (ended, log[-3000:])
    said = f"before its step (no rank to signal), so it does not start; scontrol requeue {job}: requeued; SLURM starts"
    assert came in log and said in log, log[-3000:]
    assert log.count("+ srun ") == 1 and len(metrics(out)) == 2, log[-3000:]  # one step: the job's second start


@pytest.mark.parametrize("when", ["set-up", "start-up"])
def test_a_batch_script_of_ones_own_preempted_before_training_is_requeued_and_runs_to_its_end(slurm, tmp_path, when):
    """A user's own batch script, `srun python ddp/train.py` after its set-up (modules, an environment; here a wait
    for the test): SLURM's preemption in the set-up signalled no rank, and the job trained on through its GraceTime,
    until SLURM killed it (a short one ran to its end, Restarts 0). Rank 0 asks SLURM as training starts: the job stops
    at its next step boundary with its checkpoint, requeues itself and resumes from it to its end. Its SIGTERM in the
    ranks' start-up (rank 0 waits before its first step: DDP_CIFAR_FAULT=wait:0) ended the job FAILED, Restarts 0, no
    shell of ours there to requeue it: rank 0 requeues it then, and it runs again from the start."""
    out, waiting, go = tmp_path / "run", tmp_path / "waiting", tmp_path / "go"
    train = shlex.join(["srun", "python", str(TRAIN), *TINY, f"run.out_dir={out}"])
    set_up = (
        f'[ "${{SLURM_RESTART_COUNT:-0}}" != 0 ] || {{ touch {waiting}; while [ ! -e {go} ]; do sleep 0.1; done; }}\n'
    )
    (script := tmp_path / "own.sh").write_text(
        f"#!/bin/bash\n#SBATCH --requeue\n#SBATCH --open-mode=append\nset -e\n{set_up * (when == 'set-up')}{train}\n"
    )
    sbatch = ["sbatch", "--parsable", "--ntasks=1", f"--output={tmp_path}/log-%j.out", str(script)]
    env = slurm if when == "set-up" else {**slurm, "DDP_CIFAR_FAULT": "wait:0"}
    job = ok(subprocess.run(sbatch, cwd=REPO, env=env, capture_output=True, text=True)).stdout.strip()
    deadline, held = time.monotonic() + 60, waiting if when == "set-up" else rundir.fault_marker(out, "wait", 0)
    while not held.exists():
        assert time.monotonic() < deadline, job_field(slurm, job, "JobState")
        time.sleep(0.05)
    urgent = preempt(slurm, tmp_path)
    while when == "set-up" and job_field(slurm, job, "PreemptTime") == "None":  # chosen: its SIGTERM went to no step
        assert time.monotonic() < deadline, job_field(slurm, job, "JobState")
        time.sleep(0.05)
    go.touch()
    state = wait_until_done(slurm, job, timeout=180)
    log = (tmp_path / f"log-{job}.out").read_text()
    ended = (state, job_field(slurm, job, "Restarts"), wait_until_done(slurm, urgent, 30))
    assert ended == ("COMPLETED", "1", "COMPLETED"), (ended, job_field(slurm, job, "PreemptTime"), log[-3000:])
    if when == "set-up":
        said = "stopping on SLURM's preemption at "
        assert said in log and f"scontrol requeue {job}: requeued" in log and "resumed from" in log, log[-3000:]
    else:
        said = (r"^the run: stopped on SIGTERM before training \(SLURM's preemption at \S+\): nothing to save yet; "
                f"scontrol requeue {job}: requeued; SLURM starts the job again")  # fmt: skip
        assert re.search(said, log, re.M) and "stopping on" not in log and "resumed from" not in log, log[-3000:]
    assert [m["epoch"] for m in metrics(out)] == [1, 2], log[-3000:]


def test_a_job_scancel_ends_before_training_is_not_requeued(slurm, tmp_path):
    """The other side of the batch shell's requeue: scancel signals the batch shell too (a requeue does), and a job
    the user cancelled in its start-up stays CANCELLED: it did not come back."""
    job, _ = held_job(slurm, tmp_path, 0, *TINY)
    try:
        ok(subprocess.run(["scancel", job], env=slurm, capture_output=True, text=True))
        wait_until_done(slurm, job, timeout=60)
        time.sleep(2)  # (the shell's requeue, were there one, makes it PENDING)
        ended, log = (job_field(slurm, job, "JobState"), job_field(slurm, job, "Restarts")), tmp_path / f"log-{job}.out"
    finally:
        subprocess.run(["scancel", job], env=slurm)  # (where it came back: no later job waits for it)
    assert ended == ("CANCELLED", "0") and "slurm/train.sh: the job's step" not in log.read_text(), log.read_text()


def test_srun_killed_leaves_no_task_and_the_same_command_resumes_to_the_same_weights(slurm, tmp_path, uninterrupted):
    """kill -9 of srun (the step's launcher) mid-training: SLURM ends the step's tasks, no process is
    left within 10 s, the lock is free, every checkpoint whole; the same srun command then finishes
    where an uninterrupted run finishes, bitwise."""
    out, env = tmp_path / "run", {**slurm, "OMP_NUM_THREADS": "1"}  # as torchrun sets it for the reference
    cmd = ["srun", "--ntasks=2", "python", str(TRAIN), *PREEMPTIBLE, f"run.out_dir={out}"]
    srun = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tasks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not list((out / "checkpoints").glob("step-*.pt")):
            assert srun.poll() is None and time.monotonic() < deadline, "no checkpoint, or srun ended"
            time.sleep(0.1)
        pids = [int(p.name) for p in Path("/proc").glob("[0-9]*")]
        tasks = [pid for pid in pids if f"run.out_dir={out}".encode() in cmdline(pid).replace(b"\0", b" ")]
        srun.kill()
        gone = seconds_until_gone(tasks, time.monotonic())
    finally:
        srun.kill()
        srun.wait()
    assert tasks and srun.returncode != 0
    assert_free_and_whole(out)
    ok(subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180))
    got = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["model"]
    want = torch.load(uninterrupted / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(got[k], want[k]) for k in want)
    REPORT.append(f"kill -9 of srun mid-training: its tasks gone {gone:.1f} s later, then resumed bitwise")


def test_a_cold_start_after_the_daemons_died_begins_with_an_empty_queue(slurm, tmp_path):
    """The machine restarts (every SLURM process and munged die at once, a job running): `cluster.sh start`
    must not recover that job as RUNNING, where it would hold the node and queue every later job forever,
    and must start a munged of its own while another cluster's runs (tests/slurm_hosts.py's, in a parallel
    worker: CI's start hung on it, slurmctld waiting on a socket no one served).
    Last in this module: it restarts the cluster the tests above share."""
    job = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", "--wrap=sleep 600"],
                         env=slurm, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 60
    while job_field(slurm, job_id, "JobState") != "RUNNING":
        assert time.monotonic() < deadline, f"job {job_id} did not start within 60 s"
        time.sleep(0.5)
    state = Path(slurm["SLURM_CONF"]).parent
    listed = subprocess.run(["scontrol", "listpids", job_id], env=slurm, capture_output=True, text=True).stdout
    doomed = [int(line.split()[0]) for line in listed.splitlines()[1:] if line.split()[0].isdigit()]
    doomed += [int((state / f"{daemon}.pid").read_text()) for daemon in ("slurmctld", "slurmd")]
    doomed += [int(Path("/run/munge/munged.pid").read_text())]  # munged too: start must bring it back
    doomed += [int(pid) for pid in subprocess.run(["pgrep", "-f", f"slurmstepd: \\[{job_id}\\."],
                                                  capture_output=True, text=True).stdout.split()]  # fmt: skip
    for pid in doomed:  # all at once, as a power cut would
        os.kill(pid, 9)
    seconds_until_gone(doomed, time.monotonic())
    other = private_munged(tmp_path / "other-munge")
    try:
        started = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, timeout=120)
    finally:
        other.kill()
        other.wait()
    assert started.returncode == 0, started.stderr
    queue = subprocess.run(["squeue", "-h"], env=slurm, capture_output=True, text=True, timeout=30)
    assert queue.stdout.strip() == "", f"a dead job came back:\n{queue.stdout}"
    ok(subprocess.run(["srun", "--ntasks=1", "true"], env=slurm, capture_output=True, text=True, timeout=60))
