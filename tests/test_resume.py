"""Killed, stopped, corrupted, restarted, resized: a resumed run ends with the weights of the run
that never stopped, bit for bit (same world size) — on CPU with gloo and 2 real torchrun ranks.

Kill points are drawn at random each run; KILL_SEED=N draws the same points again for the same
selection of tests in the same order. The seed and every
kill point tried are printed in pytest's summary ("kill / resume report").
"""

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    REPORT,
    TORCHRUN,
    TRAIN,
    assert_free_and_whole,
    children,
    clean_env,
    cmdline,
    descendants,
    kill_orphans,
    metrics,
    ok,
    pending,
    require,
    running,
    seconds_until_gone,
    state,
    torchrun,
    wait_for_checkpoint,
)

from ddp import checkpoint, lifeline, processes, rundir

# A job with BatchNorm and random crops/flips on (both must resume exactly): 512 synthetic train
# images, global batch 32 -> 16 steps per epoch, 3 epochs = 48 steps; a checkpoint every 5 steps.
SAVE_EVERY = 5
JOB = [
    "data.dataset=synthetic", "data.synthetic_train=512", "data.synthetic_test=101", "data.workers=0",
    "model.name=small", "train.batch_size=32", "train.epochs=3", "optim.lr=0.05", f"run.save_every_steps={SAVE_EVERY}",
]  # fmt: skip
STEPS = 48
SEED = int(os.environ["KILL_SEED"])  # drawn by conftest.py, shown at the end of the run
RNG = random.Random(SEED)


def train_cmd(out: Path, *extra: str, nproc: int = 2, script: Path = TRAIN) -> list[str]:
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(script), f"run.out_dir={out}", *JOB, *extra]


def final_state(out: Path) -> dict:
    return torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)


def assert_bitwise(a: Path, b: Path) -> None:
    x, y = final_state(a), final_state(b)
    assert x["epoch"] == y["epoch"] == 3
    for key in x["model"]:
        assert torch.equal(x["model"][key], y["model"][key]), f"model {key} differs"
    assert (x["ema"] is None) == (y["ema"] is None)
    if x["ema"] is not None:
        assert x["ema"]["updates"] == y["ema"]["updates"] == STEPS
        for key in x["ema"]["weights"]:
            assert torch.equal(x["ema"]["weights"][key], y["ema"]["weights"][key]), f"moving average {key} differs"
    for i, params in x["optimizer"]["state"].items():
        for name, value in params.items():
            assert torch.equal(value, y["optimizer"]["state"][i][name]), f"optimizer {i}.{name} differs"
    for key in ("train_loss", "grad_norm_mean", "grad_norm_max"):
        assert [m[key] for m in metrics(a)] == [m[key] for m in metrics(b)], key


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The run that never stops."""
    out = tmp_path_factory.mktemp("reference")
    ok(subprocess.run(train_cmd(out), cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300))
    return out


# The recipe toolbox all on: the moving average (its BatchNorm statistics averaged over the ranks),
# MixUp and CutMix (off for the last epoch), clipping, 2 micro-batches per step.
TOOLBOX = [
    "train.ema_decay=0.9", "train.ema_warmup=5", "data.mixup_alpha=0.4", "data.cutmix_alpha=1.0",
    "data.mix_prob=0.8", "data.mix_off_epoch=3", "optim.clip_grad_norm=0.5", "train.grad_accum_steps=2",
    "train.dist_bn=reduce",
]  # fmt: skip


@pytest.fixture(scope="module")
def toolbox_reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toolbox-reference")
    ok(subprocess.run(train_cmd(out, *TOOLBOX), cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300))
    return out


def test_killed_with_the_toolbox_on_then_resumes_bitwise(toolbox_reference, tmp_path):
    """EMA + MixUp/CutMix + clipping + accumulation: the weights, their moving average, the optimizer
    state and the logged gradient norms of a run killed at a random step and resumed are the
    uninterrupted run's, bit for bit."""
    step, rank = RNG.randint(1, STEPS - 1), RNG.randint(0, 1)
    env = clean_env(DDP_CIFAR_FAULT=f"step:{step}:r{rank}")
    first = subprocess.run(
        train_cmd(tmp_path, *TOOLBOX), cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert first.returncode != 0 and list(tmp_path.glob("fault-fired.*"))
    ok(subprocess.run(train_cmd(tmp_path, *TOOLBOX), cwd=REPO, env=env, capture_output=True, text=True, timeout=300))
    assert_bitwise(toolbox_reference, tmp_path)
    assert all(0 < m["grad_norm_mean"] <= m["grad_norm_max"] for m in metrics(tmp_path))
    REPORT.append(f"toolbox on, kill -9 of rank {rank} after global step {step}/{STEPS}: resumed bitwise identical")


def rank_of(pid: int) -> int | None:
    """The RANK a worker was started with; None while it has none (torchrun's fork before the exec) or is gone."""
    rank = processes.environment(pid).get("RANK")
    return None if rank is None else int(rank)


def kill_job(proc: subprocess.Popen) -> None:
    """kill -9 the whole job at once: the torchrun agent and every worker."""
    for pid in [*children(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def popen(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """A job in its own session (so killing it cannot reach pytest), output captured."""
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env or clean_env(),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_kills_at_random_points_one_after_another_each_resumed_by_the_same_command_end_bitwise(reference, tmp_path):
    """One run directory killed again and again, the same command resuming it each time (one chain:
    each resume is the next kill's run), the last run ends bitwise where the run that never stopped ends:
    - kill -9 of rank 0 and of rank 1 (in random order) each in a random global step: the survivor
      names the dead rank;
    - kill -9 of rank 0 halfway through writing a random step's checkpoint: that file is not under its
      final name, every file that is passes its checksum, and the next run removes the half-written one;
    - kill -9 of the whole job (torchrun and every worker at once) at a random time after a new checkpoint."""
    points = []
    for step, rank in zip(sorted(RNG.sample(range(1, 20), 2)), RNG.sample([0, 1], 2)):
        killed = subprocess.run(train_cmd(tmp_path), cwd=REPO, env=clean_env(DDP_CIFAR_FAULT=f"step:{step}:r{rank}"),
                                capture_output=True, text=True, timeout=300)  # fmt: skip
        assert killed.returncode != 0 and rundir.fault_marker(tmp_path, "step", step).exists(), killed.stderr[-2000:]
        survivor = f"rank {1 - rank} of 2: lost contact with rank {rank} (its connection closed: it died)"
        assert survivor in killed.stderr  # the survivor names the dead rank
        points.append(f"rank {rank} after global step {step}")

    write = RNG.choice(range(20, 35, SAVE_EVERY))  # a save after the last kill's step
    killed = subprocess.run(train_cmd(tmp_path), cwd=REPO, env=clean_env(DDP_CIFAR_FAULT=f"write:{write}"),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert killed.returncode != 0
    directory = rundir.checkpoint_dir(tmp_path)
    half_written = list(directory.glob(f".step-{write:09d}.pt.*.tmp"))
    assert half_written, "killed halfway through the write"
    assert not (directory / f"step-{write:09d}.pt").exists()
    for path in rundir.step_files(tmp_path):
        checkpoint.load(path)  # every file under a final name is whole and passes its checksum
    points.append(f"rank 0 halfway through writing step {write}")

    delay, before = RNG.uniform(0, 0.3), rundir.step_files(tmp_path)[0]  # in the >= 18 steps left (~0.4 s here)
    proc = popen(train_cmd(tmp_path))
    wait_for_checkpoint(tmp_path, proc, newer_than=before)
    assert not any(path.exists() for path in half_written)  # the resume removed it
    time.sleep(delay)
    kill_job(proc)
    newest = rundir.step_files(tmp_path)[0].name
    points.append(f"the whole job {delay:.2f} s after a new checkpoint (newest then: {newest})")

    ok(subprocess.run(train_cmd(tmp_path), cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300))
    assert not list(directory.glob(".*.tmp"))
    assert_bitwise(reference, tmp_path)
    REPORT.append(f"kill -9 of {'; '.join(points)} (of {STEPS} steps), resumed each time: bitwise identical")


def test_torchrun_max_restarts_recovers_a_dead_rank_by_itself(reference, tmp_path):
    step = RNG.randint(1, STEPS - 1)
    env = clean_env(DDP_CIFAR_FAULT=f"step:{step}:r1")
    cmd = [TORCHRUN, "--max-restarts=1", *train_cmd(tmp_path)[1:]]
    proc = ok(subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300))
    assert list(tmp_path.glob("fault-fired.*"))
    # The kill comes before that step's save: a checkpoint exists only when the kill is past the first one.
    saved_before_kill = step > SAVE_EVERY
    assert ("resumed from" in proc.stdout) == saved_before_kill, proc.stdout
    assert_bitwise(reference, tmp_path)
    how = "resumed from its checkpoint" if saved_before_kill else "no checkpoint yet, restarted from scratch"
    REPORT.append(f"kill -9 of rank 1 after step {step} under torchrun --max-restarts=1: {how}, bitwise")


def paused_worker(proc: subprocess.Popen, rank: int, timeout: float = 120) -> int:
    """The pid of the job's rank `rank` once DDP_CIFAR_FAULT=pause has stopped it (SIGSTOP: state T)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the job ended or no rank paused"
        pid = next((pid for pid in children(proc.pid) if rank_of(pid) == rank), None)
        if pid is not None and state(pid) == "T":
            return pid
        time.sleep(0.02)


def test_stop_signals_save_at_the_next_step_and_exit_75_and_the_run_resumes_bitwise(reference, tmp_path):
    """SIGTERM to torchrun (it forwards it to its workers) in the first half of epoch 2, then, in the
    resumed run, SIGUSR1 to every worker (as SLURM's --signal does) in the first quarter of epoch 3, the
    last: each time every rank stops at the same step boundary, rank 0 saves, the workers exit 75. The
    same command resumes each time and ends bitwise. Where the signal lands is drawn in steps, not seconds
    (a loaded machine's scheduling moved a timed one past its epoch's end): one rank, drawn too, pauses
    (DDP_CIFAR_FAULT=pause) after the drawn step, the other runs on into the next one's gradient
    all-reduce; the signal is sent then, and once it waits in the paused rank, that one goes on. It has the
    signal at that step's boundary, the other within the next step, so both stop after the next step."""
    args, stops, per_epoch = ("run.save_every_steps=0",), [], STEPS // 3
    for sig, epoch, most in ((signal.SIGTERM, 2, 0.5), (signal.SIGUSR1, 3, 0.25)):
        step = (epoch - 1) * per_epoch + RNG.randint(1, int(most * per_epoch) - 1)  # a stop at step + 1, in epoch
        rank = RNG.randrange(2)
        proc = popen(train_cmd(tmp_path, *args), env=clean_env(DDP_CIFAR_FAULT=f"pause:{step}:r{rank}"))
        paused = paused_worker(proc, rank)
        for pid in [proc.pid] if sig == signal.SIGTERM else children(proc.pid):
            os.kill(pid, sig)
        deadline = time.monotonic() + 30
        while not pending(paused, sig):  # torchrun forwards a SIGTERM from its own thread
            assert time.monotonic() < deadline, f"{sig.name} never reached the paused rank"
            time.sleep(0.01)
        os.kill(paused, signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
        assert f"stopped on {sig.name}; run the same command to resume" in err
        assert len(metrics(tmp_path)) == epoch - 1, f"{sig.name} came after epoch {epoch}"
        if sig == signal.SIGUSR1:
            # torchrun's report lists the workers that had exited when it saw the first one go; each is 75
            codes = [line.split(":")[1].split()[0] for line in err.splitlines() if line.strip().startswith("exitcode")]
            assert codes and set(codes) == {"75"}, codes
        saved = [line for line in out.splitlines() if line.startswith(f"stopping on {sig.name}")]
        assert len(saved) == 1
        assert saved[0].endswith(rundir.step_path(tmp_path, step + 1).name), saved[0]
        stops.append(f"{sig.name} to rank {rank} paused after step {step} of epoch {epoch} ({saved[0].split('/')[-1]})")
    ok(subprocess.run(train_cmd(tmp_path, *args), cwd=REPO, env=clean_env(), capture_output=True, text=True,
                      timeout=300))  # fmt: skip
    assert_bitwise(reference, tmp_path)
    REPORT.append(f"{'; '.join(stops)}: exit 75 each time, resumed bitwise")


def test_a_hung_rank_ends_the_others_at_the_timeout_and_a_stop_signal_ends_that_wait_within_seconds(tmp_path):
    """Two jobs side by side (their waits overlap), rank 1 of each frozen (SIGSTOP: alive, no connection
    closed) once both have a checkpoint, rank 0 waiting for it in its next collective:
    - run.timeout_s=5: rank 0 leaves at the timeout naming rank 1 as hung; rank 1, woken (SIGCONT), does
      not wait for the others and leaves too;
    - run.timeout_s=60, SIGTERM to rank 0 a second later: it cannot reach Python until torch returns, but
      the watcher sees it: rank 0 leaves within the grace (5 s and 3 times its slowest step), exit 1, one
      line; the checkpoints before are whole. (A wait for it in a checkpoint's save had no grace: CI, 2026-11-30.)"""
    timed, signalled = tmp_path / "timeout", tmp_path / "signal"
    jobs = {
        timed: popen(train_cmd(timed, "run.timeout_s=5", "train.epochs=50")),
        signalled: popen(train_cmd(signalled, "run.timeout_s=60", "train.epochs=50")),
    }
    frozen: dict[Path, dict[int, int]] = {}  # each job's {rank: pid}
    limit, left = {timed: 5 + 20, signalled: 50}, {}  # seconds until rank 0 must be / was gone (60: the timeout)
    try:
        for out, proc in jobs.items():
            wait_for_checkpoint(out, proc)  # the other job trains on meanwhile
        for out, proc in jobs.items():
            frozen[out] = {rank_of(pid): pid for pid in children(proc.pid)}
            os.kill(frozen[out][1], signal.SIGSTOP)
        since = {timed: time.monotonic()}
        time.sleep(1)  # the signalled job's rank 0 is in its next collective, waiting
        os.kill(frozen[signalled][0], signal.SIGTERM)
        since[signalled] = time.monotonic()
        while len(left) < 2:
            for out in jobs.keys() - left.keys():
                seconds = time.monotonic() - since[out]
                if not running(frozen[out][0]):
                    left[out] = seconds
                assert out in left or seconds < limit[out], f"rank 0 of the {out.name} job still runs"
            time.sleep(0.05)
        for pids in frozen.values():
            os.kill(pids[1], signal.SIGCONT)  # woken: the others are gone, and it must not wait for them
        woken = seconds_until_gone([frozen[timed][1]], time.monotonic())
        jobs[signalled].wait(timeout=30)  # its torchrun ends now and reports
    finally:
        for out, proc in jobs.items():
            kill_orphans(list(frozen.get(out, {}).values()))
            kill_job(proc)
    err = jobs[timed].stderr.read()
    assert "error: rank 0 of 2: lost contact with rank 1 (no answer within run.timeout_s=5: hung)" in err, err
    err = jobs[signalled].stderr.read()
    left_within_the_grace(err, left[signalled])
    assert "exitcode  : 1" in err
    assert_free_and_whole(signalled)
    REPORT.append(f"rank 1 hung (SIGSTOP): rank 0 exited after {left[timed]:.1f} s with run.timeout_s=5; rank 1, "
                  f"woken (SIGCONT), left {woken:.1f} s later; with run.timeout_s=60, SIGTERM to rank 0 waiting for "
                  f"it: it left {left[signalled]:.1f} s later")  # fmt: skip


FROZEN_IN_A_SAVE = """
import os, signal, sys
from ddp import checkpoint, distributed, train
where = {"the gathering": "gather_objects", "rank 0's write": "full_state"}[os.environ["FREEZE_AT"]]
original_save, original = checkpoint.Checkpoints.save, getattr(distributed, where)
saves = []
def save(*args, **kwargs):
    saves.append(True)
    return original_save(*args, **kwargs)
def frozen(*args, **kwargs):
    if len(saves) == 2 and os.environ["RANK"] == "1" and not frozen.done:  # (DDP: full_state is rank 1's own)
        frozen.done = True
        os.kill(os.getpid(), signal.SIGSTOP)  # the test continues it
    return original(*args, **kwargs)
frozen.done = False
checkpoint.Checkpoints.save = save
setattr(distributed, where, frozen)
sys.exit(train.cli(sys.argv[1:]))
"""


def rank_0_once_rank_1_is_stopped(proc: subprocess.Popen, timeout: float = 120) -> int:
    """rank 0's pid, once rank 1 of `proc`'s job is stopped (SIGSTOP: /proc's T)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, f"rank 1 never stopped: {proc.communicate()}"
        ranks = {rank_of(pid): pid for pid in children(proc.pid)}
        if 0 in ranks and 1 in ranks and state(ranks[1]) == "T":
            return ranks[0]
        time.sleep(0.05)


def left_within_the_grace(err: str, seconds: float) -> None:
    """rank 0's line for a stop that no step boundary took; its `seconds` (from the signal until it was gone) within
    the grace that the line gives: GRACE_S past the signal and 3 times the slowest step, a look and its exit more."""
    line = next((line for line in err.splitlines() if "no step boundary came within" in line), None)
    assert line and line.startswith("error: rank 0 of 2: stopping on SIGTERM, but"), err
    slowest = float(line.split("the slowest step took ")[1].split(" s")[0])
    assert seconds < lifeline.GRACE_S + 3 * slowest + 3, f"left {seconds:.1f} s after the signal: {line}"


def test_a_stop_signal_ends_rank_0s_wait_for_a_rank_hung_in_a_checkpoints_save_within_the_grace(tmp_path):
    """Rank 1 frozen (SIGSTOP) in the second checkpoint's save, before the gathering of every rank's state or as
    rank 0 writes the file; rank 0 waits for it, then SIGTERM to rank 0 (run.timeout_s=60). A save's wait for a
    hung rank had no grace (all of save was busy work): rank 0 stayed until the timeout, past the 30 s that
    SLURM gives after its SIGTERM (KillWait's default). It leaves within the grace now (exit 1, one line), the
    checkpoints before it whole; rank 1, continued, leaves too. The two jobs side by side (their waits overlap)."""
    script = tmp_path / "frozen_in_a_save.py"
    script.write_text(FROZEN_IN_A_SAVE)
    outs = {where: tmp_path / where.split()[-1] for where in ("the gathering", "rank 0's write")}
    jobs = {where: popen(train_cmd(out, "run.timeout_s=60", script=script), env=clean_env(FREEZE_AT=where))
            for where, out in outs.items()}  # fmt: skip
    rank0: dict[str, int] = {}
    try:
        for where, proc in jobs.items():  # the other job trains on meanwhile
            rank0[where] = rank_0_once_rank_1_is_stopped(proc)
        time.sleep(1)  # rank 0 in its wait
        since = time.monotonic()
        for pid in rank0.values():
            os.kill(pid, signal.SIGTERM)
        left = {where: seconds_until_gone([pid], since, limit=50) for where, pid in rank0.items()}  # (< the timeout)
        for proc in jobs.values():
            for pid in children(proc.pid):
                os.kill(pid, signal.SIGCONT)  # rank 1: the other is gone, and it must not wait for it
            proc.wait(timeout=30)
    finally:
        for proc in jobs.values():
            kill_job(proc)
    for where, proc in jobs.items():
        err = proc.stderr.read()
        left_within_the_grace(err, left[where])
        assert "exitcode  : 1" in err, err
        assert_free_and_whole(outs[where])
        newest = {"the gathering": 5, "rank 0's write": 10}[where]  # (rank 1 was stopped before step 10's or after)
        assert rundir.step_files(outs[where])[0] == rundir.step_path(outs[where], newest), where
    REPORT.append("rank 1 frozen in a checkpoint's save; SIGTERM to rank 0 waiting for it (run.timeout_s=60): rank 0 "
                  + ", ".join(f"{s:.1f} s later in {where}" for where, s in left.items()))  # fmt: skip


def test_the_launcher_killed_leaves_no_worker_and_the_same_command_resumes_bitwise(reference, tmp_path):
    """kill -9 of torchrun alone (its workers run in sessions of their own, so it does not reach them),
    three times in one run directory: in start-up, as rank 0 writes a checkpoint in the first half of
    the run (the workers need steps left to see it), and mid-epoch. Each time within 10 s no worker is
    left, the lock is free, every checkpoint whole; killed in training, the workers stop at the next
    step boundary with a checkpoint. The same command resumes each time, and the last run ends bitwise
    equal to the run that never stopped."""
    kills = []
    for when in ("start-up", "checkpoint write", "mid-epoch"):
        newest = rundir.step_files(tmp_path)[:1]  # none after start-up: "nothing to save"
        step = RNG.choice(range(SAVE_EVERY, STEPS // 2, SAVE_EVERY))
        fault = {"DDP_CIFAR_FAULT": f"launcher:{step}"} if when == "checkpoint write" else {}
        proc = popen(train_cmd(tmp_path), env=clean_env(**fault))  # rank 0 kills torchrun as it writes step N
        workers: list[int] = []
        try:
            while len(workers) < 2:
                assert proc.poll() is None, "torchrun ended before its workers started"
                workers = children(proc.pid)
            if when == "start-up":
                time.sleep(RNG.uniform(0.1, 1.0))  # importing torch, reading the data, in the rendezvous
            elif when == "mid-epoch":
                wait_for_checkpoint(tmp_path, proc, newer_than=newest[0])  # >= 23 steps left, ~0.5 s here
                time.sleep(RNG.uniform(0, 0.25))
            if when == "checkpoint write":
                while proc.poll() is None:
                    time.sleep(0.01)
            else:
                os.kill(proc.pid, signal.SIGKILL)
            gone = seconds_until_gone(workers, time.monotonic())
        finally:
            kill_orphans(workers)
            kill_job(proc)
        out, err = proc.stdout.read(), proc.stderr.read()
        assert_free_and_whole(tmp_path)
        if when == "start-up":
            assert "stopped on the launcher's end" in err and "nothing to save" in err, err
        else:
            assert "stopping on the launcher's end (its process" in out, out
        kills.append(f"{when}{f', step {step}' if fault else ''}: its workers gone {gone:.1f} s later")
    ok(subprocess.run(train_cmd(tmp_path), cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300))
    assert_bitwise(reference, tmp_path)
    REPORT.append(f"kill -9 of torchrun alone ({'; '.join(kills)}), resumed each time: bitwise")


def test_resume_in_other_world_sizes_keeps_batch_and_data_order(tmp_path):
    """1 -> 2 -> 4 -> 2 -> 1 ranks: every change up and down between neighbours. A run on 1 process is
    killed at a random step. At each change of world size a copy of its directory, cut back to the
    checkpoint 4 steps before its newest, continues on the new number of ranks, and after those 4 steps
    its weights must agree with the old number's own checkpoint there; it is killed 4 steps further on
    (its newest checkpoint is then the next change's comparison), and the last runs to the end. Five
    runs: each run is both one change's new world size and the next change's old one. One rank runs
    without DDP (run.parallel=auto: nothing to all-reduce), so DDP's runs are checked against it too.

    Why 4 steps and not the final weights: float reordering across world sizes (~1e-8 after a few
    steps, or ~4e-6 when it tips a max-pool/ReLU decision) grows exponentially along some trajectories
    of this net: measured here, up to 4e-3 after 80 steps. One wrong batch moves the weights by ~1e-2
    at once, so after 4 steps 1e-4 separates the two by orders of magnitude. No BatchNorm: per-rank
    batch statistics would legitimately differ."""
    args = [*JOB, "model.name=tutorial", "optim.lr=0.01", "run.save_every_steps=4", "run.keep_last=100"]

    def train_on(size: int, out: Path, kill_in: int | None) -> subprocess.CompletedProcess:
        env = clean_env(DDP_CIFAR_FAULT=f"step:{kill_in}") if kill_in else clean_env()
        run = torchrun(size, str(TRAIN), f"run.out_dir={out}", *args, env=env)
        assert (run.returncode != 0) == (kill_in is not None), run.stderr[-2000:]
        return run

    def weights(out: Path, step: int) -> dict:
        return torch.load(rundir.step_path(out, step), weights_only=True)

    sizes = (1, 2, 4, 2, 1)
    first_kill = RNG.randint(9, STEPS - 20)  # a checkpoint 4 steps before the newest; room for 4 changes
    out = tmp_path / f"0-on-{sizes[0]}"
    train_on(sizes[0], out, first_kill)  # killed in that step, before its checkpoint: the newest is older
    resume_at = int(rundir.step_files(out)[0].name[5:-3]) - 4
    diffs = []
    for i, (before, after) in enumerate(zip(sizes, sizes[1:])):
        new = tmp_path / f"{i + 1}-on-{after}"
        shutil.copytree(out, new)
        for path in rundir.step_files(new):  # auto-resume takes the newest: the files after resume_at go
            if int(path.name[5:-3]) > resume_at:
                path.unlink()
        rundir.last_path(new).unlink()  # a link to one that went: else it is the newest, and the run asks which
        last = i == len(sizes) - 2
        run = train_on(after, new, None if last else resume_at + 9)  # saves at +4 and +8, killed in +9
        assert f"saved at world_size {before}, now {after}; same global batch 32 and data order" in run.stdout
        assert f"parallel={'ddp' if after > 1 else 'none'} world_size={after}" in run.stdout  # 1: no DDP (auto)
        a, b = weights(out, resume_at + 4), weights(new, resume_at + 4)
        assert (a["world_size"], b["world_size"]) == (before, after)
        diffs.append(max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"]))
        out, resume_at = new, resume_at + 4
    assert final_state(out)["epoch"] == 3 and final_state(out)["world_size"] == sizes[-1]
    assert max(diffs) < 1e-4, f"first kill in step {first_kill}: {diffs}"
    REPORT.append(f"world sizes {sizes} from step {first_kill}: 4 steps after each change, weights agree "
                  f"within {max(diffs):.0e} with the unchanged world size")  # fmt: skip


def test_fault_injection_installs_nothing_unless_asked(monkeypatch, tmp_path):
    """DDP_CIFAR_FAULT unset (every real run): faults.arm reads it once and installs no hook."""
    from ddp import faults

    def installed(*_):
        raise AssertionError("a fault hook was installed")

    monkeypatch.setattr(faults, "register_optimizer_step_post_hook", installed)
    monkeypatch.setattr(faults.sys, "addaudithook", installed)
    monkeypatch.delenv(faults.VAR, raising=False)
    faults.arm(str(tmp_path), 0, 0)
    monkeypatch.setenv(faults.VAR, "step:5:r1")  # another rank's fault
    faults.arm(str(tmp_path), 0, 0)
    rundir.fault_marker(tmp_path, "write", 5).write_text("write:5")  # a fault that has fired already
    monkeypatch.setenv(faults.VAR, "write:5")
    faults.arm(str(tmp_path), 0, 0)
    with pytest.raises(AssertionError, match="installed"):  # and one that is due is installed
        monkeypatch.setenv(faults.VAR, "write:10")
        faults.arm(str(tmp_path), 0, 0)


def test_accelerate_killed_leaves_no_process_and_the_same_command_resumes_bitwise(reference, tmp_path):
    """kill -9 of `accelerate launch` (launch/accelerate.sh on a CPU: accelerate starts mpirun, which
    starts the ranks): the ranks see their launcher's launcher go, stop with a checkpoint, and mpirun
    ends with them; within 10 s no process is left. The same command then ends bitwise equal."""
    require("mpirun", "apt-get install openmpi-bin")
    cmd = ["bash", str(REPO / "launch" / "accelerate.sh"), *JOB, f"run.out_dir={tmp_path}"]
    proc = popen(cmd)
    left: list[int] = []
    try:
        wait_for_checkpoint(tmp_path, proc)
        time.sleep(RNG.uniform(0, 0.25))  # 43 steps left
        accelerate = proc.pid  # (the script runs accelerate in its own process: exec)
        assert b"accelerate_launch.py" in cmdline(accelerate), cmdline(accelerate)
        left = descendants(accelerate)  # mpirun and the ranks
        os.kill(accelerate, signal.SIGKILL)
        gone = seconds_until_gone(left, time.monotonic())
    finally:
        kill_orphans(left)
        kill_job(proc)
    out = proc.stdout.read()
    assert "stopping on the launcher's end (its process" in out, out
    assert_free_and_whole(tmp_path)
    ok(subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300))
    assert_bitwise(reference, tmp_path)
    REPORT.append(f"kill -9 of accelerate launch (mpirun below it): every process gone {gone:.1f} s later, "
                  "then resumed bitwise")  # fmt: skip


def test_a_store_that_never_answers_ends_at_its_deadline_and_a_signal_ends_the_wait_at_once(tmp_path):
    """A worker of a torchrun whose store accepts the connection and then says nothing (torch's own
    timeout does not end that wait): one line naming it, exit 1, at run.timeout_s + 5 s. SIGTERM in
    that wait: exit 1 within seconds, not at the deadline. SIGINT there (Ctrl-C, or torchrun's on it):
    the one line of a Ctrl-C before training, from local rank 0, and 128 + SIGINT."""

    def worker(store: socket.socket, *args: str, local_rank: str = "1") -> tuple[subprocess.Popen, str]:
        """Rank 1 of a torchrun whose store is `store`; and the store's address."""
        port = str(store.getsockname()[1])
        env = clean_env(RANK="1", LOCAL_RANK=local_rank, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True")  # fmt: skip
        cmd = [sys.executable, str(TRAIN), *JOB, f"run.out_dir={tmp_path / port}", *args]
        return subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True), f"127.0.0.1:{port}"

    # Three stores that listen and never answer; the worker of each waits, side by side.
    with (
        socket.create_server(("127.0.0.1", 0)) as store,
        socket.create_server(("127.0.0.1", 0)) as other,
        socket.create_server(("127.0.0.1", 0)) as third,
    ):
        started = time.monotonic()
        timed, where = worker(store, "run.timeout_s=2")
        waiting, _ = worker(other)  # its wait ended by SIGTERM
        interrupted, _ = worker(third, local_rank="0")  # by SIGINT
        held = []  # the connections, open and silent (torch 2.4's client fails on one closed, later ones connect again)
        try:
            for server, proc, sig in ((other, waiting, signal.SIGTERM), (third, interrupted, signal.SIGINT)):
                server.settimeout(60)
                held.append(server.accept()[0])  # it is in the wait for an answer
                time.sleep(0.5)
                proc.send_signal(sig)
            signalled = time.monotonic()
            assert waiting.wait(timeout=10) == 1
            ended = time.monotonic() - signalled
            assert interrupted.wait(timeout=10) == 130
            said = interrupted.stderr.read()
            assert said.splitlines()[-1] == "stopped at once on SIGINT (Ctrl-C), without a checkpoint", said
            err = timed.communicate(timeout=60)[1]
            waited = time.monotonic() - started
        finally:
            for proc in (waiting, timed, interrupted):
                proc.kill()
            for connection in held:
                connection.close()
    assert timed.returncode == 1
    line = f"error: rank 1 of 2: the rendezvous (torchrun's store at {where}): no answer within run.timeout_s=2 s (+5)"
    assert line in err, err
    REPORT.append(f"a store that never answers: exit 1 {waited:.1f} s after start (run.timeout_s=2); "
                  f"SIGTERM in that wait: exit 1 {ended:.1f} s later")  # fmt: skip
