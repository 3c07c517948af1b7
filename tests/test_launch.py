"""Every launch path, run for real on CPU (gloo): the scripts in launch/ and slurm/, torchrun across
two "nodes" on loopback, accelerate launch (torchrun and MPI modes). SLURM itself: test_slurm.py."""

import concurrent.futures
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    BIN,
    REPO,
    TINY,
    TRAIN,
    clean_env,
    cmdline,
    cpu_cgroup,
    descendants,
    kill_orphans,
    memory_cgroup,
    metrics,
    needs_fsdp2,
    pending,
    require,
    seconds_until_gone,
    session,
    state,
)

from ddp import checkpoint, cpus, errors, lost_rank, processes, torchrun_args
from ddp import torchrun as launcher

SCRIPTS = sorted([*(REPO / "launch").glob("*.sh"), *(REPO / "slurm").glob("*.sh")])
ONE_EPOCH = [*TINY, "train.epochs=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(script: str, *args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / script), *args],
        cwd=cwd,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse_and_every_path_they_name_exists(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    named = set(re.findall(r"\b((?:launch|slurm|ddp|configs)/[\w./-]*\w)", script.read_text()))
    missing = [n for n in named if not (REPO / n).exists() and not n.startswith("slurm/train.sh ")]
    assert not missing, f"{script.name} names {missing}, which do not exist"


def test_torchrun_launcher_defaults_to_2_cpu_processes_each_with_its_share_of_the_cores(tmp_path):
    """From another directory, NPROC unset: 2 processes, the arguments passed on, and OMP_NUM_THREADS =
    cores / processes set by the script (torchrun has nothing to warn about). Rank 0's notes come once: the
    script's preflight said run.cuda_graph=auto's too, before the ranks said it again."""
    env = clean_env()
    env.pop("NPROC", None)
    noted = ["optim.muon_momentum=0.9", "run.cuda_graph=auto"]  # notes, rank 0's alone: once, not the preflight's too
    proc = run_script("launch/torchrun.sh", *ONE_EPOCH, *noted, f"run.out_dir={tmp_path}", env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ddp/torchrun.py --standalone --nproc_per_node=2" in proc.stderr
    for note in ("note: optim.muon_momentum=0.9 does nothing here", "run.cuda_graph=auto: the step runs eager"):
        assert (proc.stdout + proc.stderr).count(note) == 1, proc.stdout
    assert metrics(tmp_path)[0]["world_size"] == 2
    assert "Setting OMP_NUM_THREADS" not in proc.stderr
    assert f"threads={cpus.threads(2)}" in proc.stdout  # (the CPUs this process may use: a quota's too)


def test_a_cpu_quota_below_the_machines_cores_is_the_threads_a_process_takes(tmp_path):
    """In a cgroup of 1 CPU's time a second (Docker's --cpus=1) on a machine of 2 or more: the launch files' share
    (omp_threads) was the machine's cores / processes, and a plain `python ddp/train.py` took torch's default, a
    thread per core; the threads beyond the quota are throttled and wait for each other (bench figures: README). Now
    both take 1, as the quota allows."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("this machine has 1 CPU: a quota of 1 is no fewer than its cores")
    shell = (f'echo $$ > "$1" && root={REPO} && source launch/common.sh && omp_threads 1 && '
             f'echo "omp_threads: $OMP_NUM_THREADS" && unset OMP_NUM_THREADS && shift && exec {sys.executable} '
             'ddp/train.py "$@"')  # fmt: skip
    with cpu_cgroup(1) as procs:
        proc = subprocess.run(["bash", "-c", shell, "bash", str(procs), *ONE_EPOCH, f"run.out_dir={tmp_path}"],
                              cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("omp_threads: 1\n") and " threads=1 " in proc.stdout, proc.stdout


def test_ctrl_c_on_the_torchrun_script_ends_with_our_lines_and_130_and_a_killed_rank_is_named(tmp_path):
    """Ctrl-C: SIGINT to the script's whole process group, as a terminal sends it. The ranks save and
    say so; torchrun's SignalException traceback no longer follows, nor its agent's "Received 2 death signal,
    shutting down workers" above them; the exit code is 128 + SIGINT. Before it, as they train: each rank's
    oom_score_adj is its agent's + OOM_FIRST (the kernel, out of memory, ends a rank, which the agent then names).
    Then a rank killed with -9: the survivor's line, one line for the dead rank, 128 + SIGKILL. Neither leaves torch's
    log dir (with the ranks' error files) in TMPDIR."""
    job = [*TINY, "data.synthetic_train=2048", "train.epochs=20", f"run.out_dir={tmp_path}"]
    (tmp := tmp_path / "tmp").mkdir()  # TMPDIR: torch's log dir, /tmp/torchelastic_*, was left there by every run
    proc = subprocess.Popen(["bash", "launch/torchrun.sh", *job], cwd=REPO, env=clean_env(TMPDIR=str(tmp)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (tmp_path / "metrics.jsonl").is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    adj = [int(Path(f"/proc/{pid}/oom_score_adj").read_text()) for pid in [proc.pid, *processes.children(proc.pid)]]
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert adj == [adj[0], *[min(1000, adj[0] + processes.OOM_FIRST)] * 2], (adj, out)  # the agent, its 2 ranks
    lines = [line for line in out.splitlines() if not line.startswith(("W1", "*****"))]  # torchrun's log lines
    assert proc.returncode == 130 and "Traceback" not in out and "death signal" not in out, out  # (torchrun's echo)
    assert lines[-2].startswith("stopping on SIGINT: checkpoint ") and lines[-1] == (
        "stopped on SIGINT; run the same command to resume"
    ), out
    fault = clean_env(DDP_CIFAR_FAULT="step:3:r1", TMPDIR=str(tmp))
    killed = run_script("launch/torchrun.sh", *TINY, f"run.out_dir={tmp_path / 'killed'}", env=fault)
    assert killed.returncode == 128 + signal.SIGKILL and "Traceback" not in killed.stderr, killed.stderr
    assert re.search(r"^error: rank 1 \(pid \d+\) was killed by SIGKILL$", killed.stderr, re.M), killed.stderr
    assert not list(tmp.glob("torchelastic_*")), list(tmp.iterdir())


def test_sigusr1_to_torchruns_agent_alone_stops_its_ranks_with_their_checkpoint(tmp_path):
    """`kill -USR1 PID` of a launch file (its pid: torchrun's agent). torch leaves SIGUSR1 to its default action:
    the agent ended (exit 138), and its ranks, their launcher gone, stopped on its end. ddp/torchrun.py sends it on
    to its ranks: they stop on SIGUSR1 (a stop signal by default) with their checkpoint, exit 75, and under rank 0's
    line no other says "error: rank 1 (pid ...) exited 75"."""
    job = [*TINY, "data.synthetic_train=2048", "train.epochs=20", f"run.out_dir={tmp_path}"]
    proc = subprocess.Popen(["bash", "launch/torchrun.sh", *job], cwd=REPO, env=clean_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "metrics.jsonl").is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)  # the agent alone (the script's exec): its ranks run in sessions of their own
        out = proc.communicate(timeout=120)[0]
    finally:
        kill_orphans(session(proc.pid))
    lines = [line for line in out.splitlines() if not line.startswith(("W1", "*****", "+ "))]  # torchrun's, ours
    assert proc.returncode == 75 and "Traceback" not in out and "error" not in out, out
    saved = re.fullmatch(r"stopping on SIGUSR1: checkpoint (\S+)", lines[-2])
    assert saved and Path(saved[1]).is_file() and lines[-1] == "stopped on SIGUSR1; run the same command to resume", out


def test_a_sigterm_after_the_last_epoch_leaves_a_complete_run_exit_0_and_says_so(tmp_path):
    """SIGTERM for torchrun's agent as the last epoch's line comes (a SLURM preemption's or time limit's signal in a
    job's last seconds): the ranks, trained to their last epoch, save it and end as they would, and the agent exits 0
    with a note, where it exited 143 silently (a complete job FAILED, never requeued). The marks' folder is gone."""
    (tmp := tmp_path / "tmp").mkdir()
    job = ["ddp/torchrun.py", "--standalone", "--nproc_per_node=2", "ddp/train.py", *TINY, f"run.out_dir={tmp_path}"]
    proc = subprocess.Popen([sys.executable, *job], cwd=REPO, env=clean_env(TMPDIR=str(tmp)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    said = []
    try:
        for line in iter(proc.stdout.readline, ""):
            said.append(line)
            if line.startswith("epoch 2/2"):
                proc.send_signal(signal.SIGTERM)  # the agent alone (its ranks: sessions of their own), as SLURM's
                break
        out = "".join(said) + proc.communicate(timeout=120)[0]
    finally:
        kill_orphans(session(proc.pid))
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert re.search(r"^note: SIGTERM came after every rank on \S+ had trained to its last epoch: the run is complete",
                     out, re.M), out  # fmt: skip
    saved = checkpoint.load(tmp_path / "checkpoints" / "last.pt")
    assert (saved["epoch"], saved["step"], saved["global_step"]) == (2, 0, 16), out
    assert not list(tmp.glob("ddp-cifar-finished-*")), list(tmp.iterdir())


def test_sigusr1_before_the_agents_ranks_run_ends_it_as_sigterm_does(monkeypatch):
    """With no rank to send it on to (before they start), SIGUSR1 ends the agent as SIGTERM does: torch's
    SignalException, which ddp/torchrun.py ends as 128 + N, its log dir removed. The handlers are the launcher's
    only while it runs (its main in a test's process leaves none behind), and one ignored at the start stays so."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ddp import pausing

    monkeypatch.setattr(processes, "children", lambda parent=None: [])
    with pytest.raises(SignalException) as raised:
        pausing.pass_on(signal.SIGUSR1, None)
    assert raised.value.sigval == signal.SIGUSR1
    before = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        with pausing.passing_on():
            assert signal.getsignal(signal.SIGUSR1) is pausing.pass_on
            assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_a_rank_the_kernels_out_of_memory_killer_ends_is_said_to_be_out_of_memory_by_torchrun_and_its_peer(tmp_path):
    """Rank 1 takes memory in step 3 until the kernel kills it (DDP_CIFAR_FAULT=memory; the job in a memory cgroup
    of 2.5 GB, about twice what it needs): a SIGKILL leaves no word, and torchrun's line was only "rank 1 (pid N)
    was killed by SIGKILL", rank 0's "its connection closed: it died". Both now say what the kernel's count of
    out-of-memory kills (/proc/vmstat) says: that it ended a process on this machine meanwhile."""
    job = [*TINY, f"run.out_dir={tmp_path}"]
    with memory_cgroup(5 << 29) as procs:
        move = f'echo $$ > {procs} && exec bash launch/torchrun.sh "$@"'
        env = clean_env(DDP_CIFAR_FAULT="memory:3:r1")
        proc = subprocess.run(["bash", "-c", move, "bash", *job], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    said = (
        r"the kernel's out-of-memory killer ended \d+ process(es)? on this machine meanwhile \(dmesg names (it|them)\)"
    )
    assert proc.returncode == 128 + signal.SIGKILL and "Traceback" not in proc.stderr, proc.stderr
    fix = "give it more memory, or use less: fewer ranks on this machine"
    assert re.search(rf"^error: rank 1 \(pid \d+\) was killed by SIGKILL: out of memory, most likely \({said}\); {fix}",
                     proc.stderr, re.M), proc.stderr  # fmt: skip
    assert re.search(rf"^error: rank 0 of 2: lost contact with rank 1 \(its connection closed: it died; {said}\)",
                     proc.stderr, re.M), proc.stderr  # fmt: skip


def test_more_ranks_than_memory_end_with_torchruns_line_for_those_killed_not_torchrun_killed_silently(tmp_path):
    """NPROC=32 smoke ranks in a 2 GiB memory cgroup: the kernel ended torchrun's agent first (as large as a rank as
    they start: torch imported, the preflight run), and the job ended as the shell's "Killed", with no line of ours.
    Each rank now raises its oom_score_adj as it starts: the kernel ends ranks, and the agent names them in one line."""
    job = ["--config", "configs/smoke.yaml", "train.epochs=1", f"run.out_dir={tmp_path}"]
    with memory_cgroup(2 << 30) as procs:
        move = f'echo $$ > {procs} && exec bash launch/torchrun.sh "$@"'
        proc = subprocess.run(["bash", "-c", move, "bash", *job], cwd=REPO, env=clean_env(NPROC="32"),
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    said = r"the kernel's out-of-memory killer ended \d+ process(es)? on this machine meanwhile"
    assert proc.returncode == 128 + signal.SIGKILL and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(rf"^error: ranks? [\d, ]+ \(pids? [\d, ]+\) (was|were) killed by SIGKILL: out of memory, most "
                     rf"likely \({said}", proc.stderr, re.M), proc.stderr  # fmt: skip


def test_the_ranks_torchrun_stops_after_one_failed_get_no_line_of_their_own(tmp_path, capsys, monkeypatch):
    """Rank 0's usage error (its own line, in its error file) and rank 1 stopped by torchrun's closing SIGTERM:
    "error: rank 1 (pid ...) was killed by SIGTERM" was the last line, under the cause; and where the error file's
    time (whole seconds) was not before the stopped rank's, the exit code was 143, not the cause's. A rank killed
    by another signal, or by SIGTERM with no other failure (before its stop handler), still gets its line; a SIGKILL
    with the kernel's out-of-memory kills counted since torchrun began says so. Ranks that ended the same way: one
    line (7 of 32 ranks killed for memory were 7 lines, the same but for the rank). Ranks that stopped to be resumed
    (exit 75; rank 0's line in its file) get none: "error: rank 1 (pid ...) exited 75" followed rank 0's "stopped on
    SIGTERM; run the same command to resume" where the ranks alone had the signal."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    monkeypatch.setattr(errors, "OOM_KILLS_AT_START", 5)  # as this process began
    monkeypatch.setattr(errors, "oom_kills", lambda: 5)  # none since (an earlier test's would be counted)
    later = int(time.time()) + 100  # rank 0's file says it failed after rank 1 was stopped: not so
    for rank, stamp in ((0, 1), (1, later)):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"message": {"message": "x", "extraInfo": {
            "timestamp": str(stamp)}}}))  # fmt: skip

    def failure(rank, code, said=False):
        return ProcessFailure(rank, 100 + rank, code, str(tmp_path / (f"rank{rank}.json" if said else "none")))

    assert launcher.failed(ChildFailedError("train.py", {0: failure(0, 2, said=True), 1: failure(1, -15)})) == 2
    assert capsys.readouterr().err == ""
    assert launcher.failed(ChildFailedError("train.py", {0: failure(0, 75, said=True), 1: failure(1, 75)})) == 75
    assert capsys.readouterr().err == ""
    assert launcher.failed(ChildFailedError("train.py", {2: failure(2, 75), 3: failure(3, 75)})) == 75  # node 1's
    assert capsys.readouterr().err == ""
    assert launcher.failed(ChildFailedError("train.py", {0: failure(0, 2, said=True), 1: failure(1, -9)})) == 2
    assert capsys.readouterr().err == "error: rank 1 (pid 101) was killed by SIGKILL\n"
    assert launcher.failed(ChildFailedError("train.py", {0: failure(0, -15), 1: failure(1, 2, said=True)})) == 2
    assert capsys.readouterr().err == ""
    assert launcher.failed(ChildFailedError("train.py", {1: failure(1, -15)})) == 128 + 15
    assert capsys.readouterr().err == "error: rank 1 (pid 101) was killed by SIGTERM\n"
    monkeypatch.setattr(errors, "oom_kills", lambda: 7)  # two since
    assert launcher.failed(ChildFailedError("train.py", {0: failure(0, -15), 1: failure(1, -9)})) == 128 + 9
    assert capsys.readouterr().err == ("error: rank 1 (pid 101) was killed by SIGKILL: out of memory, most likely (the "
                                       "kernel's out-of-memory killer ended 2 processes on this machine meanwhile "
                                       f"(dmesg names them)); {errors.MACHINE_MEMORY_FIX}\n")  # fmt: skip
    many = {0: failure(0, -9), 1: failure(1, 2, said=True), 2: failure(2, -9), 3: failure(3, 1), 4: failure(4, -15)}
    assert launcher.failed(ChildFailedError("train.py", many)) == 128 + 9
    assert capsys.readouterr().err == ("error: ranks 0, 2 (pids 100, 102) were killed by SIGKILL: out of memory, most "
                                       "likely (the kernel's out-of-memory killer ended 2 processes on this machine "
                                       f"meanwhile (dmesg names them)); {errors.MACHINE_MEMORY_FIX}\n"
                                       "error: rank 3 (pid 103) exited 1\n")  # fmt: skip
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "detail")  # torch 2.14.1's DDP crashed as it started (SIGSEGV)
    assert launcher.failed(ChildFailedError("train.py", {0: failure(0, -11), 1: failure(1, -11)})) == 128 + 11
    detail = f"(TORCH_DISTRIBUTED_DEBUG=DETAIL is set: {launcher.DETAIL_CRASH}; unset it, or set INFO)"
    assert capsys.readouterr().err == f"error: ranks 0, 1 (pids 100, 101) were killed by SIGSEGV {detail}\n"


def test_the_out_of_memory_kills_are_counted_in_the_processs_memory_cgroup_else_on_the_machine():
    """/proc/self/cgroup's lines name the counters: v1's memory controller (a hybrid layout's too), else v2's
    cgroup, its own processes' count first; none, and /proc/vmstat's count of the machine is the one."""
    v1 = "4:memory:/slurm/job_7\n1:cpu,cpuacct:/slurm/job_7\n0::/user.slice\n"
    assert errors._cgroup_counters(v1) == ["/sys/fs/cgroup/memory/slurm/job_7/memory.oom_control",
                                           "/sys/fs/cgroup/user.slice/memory.events.local",
                                           "/sys/fs/cgroup/user.slice/memory.events"]  # fmt: skip
    assert errors._cgroup_counters("0::/system.slice/job.service\n") == [
        "/sys/fs/cgroup/system.slice/job.service/memory.events.local",
        "/sys/fs/cgroup/system.slice/job.service/memory.events",
    ]
    assert errors._cgroup_counters("") == []
    assert isinstance(errors.oom_kills(), int)  # this machine says, one way or the other (Linux 4.13 on)


def test_a_mistake_every_rank_would_make_is_one_line_before_torchrun_starts(tmp_path):
    """`make train` offline: launch/torchrun.sh checks the data (and the config, the batch, out_dir)
    once, before torchrun: the message once, last, no traceback, and torchrun never starts."""
    proc = run_script("launch/torchrun.sh", "--config", "configs/quick.yaml", f"data.root={tmp_path}",
                      "data.download=false", f"run.out_dir={tmp_path / 'run'}")  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: CIFAR-10 not found in data.root={tmp_path} and data.download=false")
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr and "+ python" not in proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preflight=0", "--standalone", str(TRAIN)], "--preflight=N needs the number of processes to be started"),
        (["--preflight=two", "--standalone", str(TRAIN)], "not 'two'"),
        (["--preflight=", "--standalone", str(TRAIN)], "not ''"),
        (["--preflight=2", "--standalone", "other.py"], "--preflight checks ddp/train.py's arguments, not other.py's"),
        (["--preflight=3", "--standalone", str(TRAIN), *TINY], "=32 must be a positive multiple of world_size=3"),
    ],
)  # fmt: skip
def test_the_launchers_preflight_in_torchruns_process_refuses_in_one_line(argv, message, capsys):
    """ddp/torchrun.py --preflight=N (the launch files'): a bad N, another script, a mistake every rank would
    make: exit 2, one line, and torchrun never starts (no "+ python" line, no rank)."""
    assert launcher.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err and "+ python" not in err, err


def test_a_node_rank_left_in_the_shell_does_not_make_one_machine_a_machine_of_several(tmp_path, monkeypatch, capsys):
    """NODE_RANK=1 and MASTER_ADDR left exported by an earlier launch/multinode.sh: launch/torchrun.sh (one machine,
    torchrun --standalone, which ignores them) had its preflight wait run.timeout_s for MASTER_ADDR to answer, then
    fail; without MASTER_ADDR it said "MASTER_ADDR= does not resolve". launch/multinode.sh's NODE_RANK counts, with
    NNODES=1 too."""
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nothing answers there
    ranks = [str(TRAIN), *TINY, f"run.out_dir={tmp_path / 'run'}", "run.timeout_s=2"]
    assert launcher.preflight("2", ["--standalone", *ranks]) is None, capsys.readouterr().err
    assert os.environ["NODE_RANK"] == "1"  # as it was, after
    monkeypatch.delenv("MASTER_ADDR")
    assert launcher.preflight("2", ["--nnodes=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1", *ranks]) == 2
    said = "error: NODE_RANK=1 is set, and MASTER_ADDR is not: on each of several machines, set it to node 0's"
    assert capsys.readouterr().err.startswith(said)
    with socket.socket() as held:  # launch/multinode.sh with NNODES=1: its NODE_RANK=0 counts (the port checked)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("NODE_RANK", "0")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        node_0 = ["--nnodes=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
        assert launcher.preflight("2", [*node_0, *ranks]) == 2
    assert f"MASTER_PORT={port} is taken" in capsys.readouterr().err


def test_help_and_print_config_through_a_launch_file_are_answered_once_and_start_no_rank(capsys):
    """`bash launch/torchrun.sh --print-config` (or --help): printed once, by ddp/torchrun.py's preflight, not by
    every rank, and torchrun never starts; the launch files' shared preflight (accelerate, SLURM) does the same."""
    assert launcher.main(["--preflight=2", "--standalone", str(TRAIN), "optim.lr=0.25", "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert out.count("optim:\n") == 1 and "  lr: 0.25\n" in out and err == "", (out, err)
    with pytest.raises(SystemExit) as done:
        launcher.main(["--preflight=2", "--standalone", str(TRAIN), "--help"])
    out, err = capsys.readouterr()
    assert done.value.code == 0 and out.count("usage: ") == 1 and err == "", (out, err)
    shell = f'root={REPO}; source launch/common.sh; preflight 2 optim.lr=0.25 --print-config; echo "a rank starts"'
    proc = subprocess.run(["bash", "-c", shell], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("optim:\n") == 1 and "a rank starts" not in proc.stdout, proc


def test_the_rendezvous_store_is_where_torchrun_finds_it_an_ipv6_address_too():
    """The store a node whose preflight stopped it tells (and an agent watches) is read from --rdzv_endpoint as
    torchrun reads it. [fd00::1]:29401 was ('[fd00::1]', 29401), which no client can reach; the launch files and
    slurm/train.sh put an IPv6 MASTER_ADDR in brackets (torchrun read fd00::1 alone as host 'fd00:', port 1)."""

    def store(*flags: str) -> tuple[str, int] | None:
        return launcher.fixed_nodes_store(launcher.parse_args(["--rdzv_backend=c10d", *flags, str(TRAIN)]))

    assert store("--nnodes=2", "--rdzv_endpoint=[fd00::1]:29401") == ("fd00::1", 29401)
    assert store("--nnodes=2", "--rdzv_endpoint=[fd00::1]") == ("fd00::1", 29400)  # torch's c10d default port
    assert store("--nnodes=2", "--rdzv_endpoint=h0:29401") == ("h0", 29401)
    assert store("--nnodes=2") == ("localhost", 29400)  # as torchrun: was ("", 29400)
    assert store("--nnodes=2", "--rdzv_endpoint=h0:port") is None  # torchrun refuses it, in its own words
    assert store("--nnodes=1:2", "--rdzv_endpoint=h0:29401") is None  # elastic: it begins without a node
    for addr, endpoint in (("fd00::1", "[fd00::1]:29400"), ("[fd00::1]", "[fd00::1]:29400"), ("h0", "h0:29400")):
        shell = f"root={REPO}; source launch/common.sh; endpoint '{addr}' 29400"
        assert subprocess.run(["bash", "-c", shell], capture_output=True, text=True).stdout == endpoint + "\n"


def test_the_command_a_launch_file_shows_is_one_a_shell_runs_as_it_ran():
    """launch/*.sh and slurm/train.sh show their command ("+ python ..."): a user copies it to run it again. A word
    with a space or a quote (run.out_dir=runs/my run) was shown bare, and the copy ran another command."""
    words = ["python", "run.out_dir=/tmp/my run", "it's", "", "$HOME", "*", "optim.lr=0.1"]
    shell = f'root={REPO}; source launch/common.sh; shown "$@"'
    for compat in ("", "32"):  # and as bash 3.2 (a Mac's) quotes in ${word//...}: it kept a backslash there
        env = {**os.environ, "BASH_COMPAT": compat} if compat else None
        line = subprocess.run(["bash", "-c", shell, "-", *words], capture_output=True, text=True, env=env).stdout
        assert line == "+ python 'run.out_dir=/tmp/my run' 'it'\\''s' '' '$HOME' '*' optim.lr=0.1\n", compat
        assert shlex.split(line[2:]) == words


def test_an_endpoint_torchrun_refuses_is_one_line_before_it_starts(capsys):
    """torchrun refused a link-local address with its interface ([fe80::1%eth0]:29400) and a port that is no number
    after the ranks' preflight, with a ValueError's traceback; now one line, exit 2. MASTER_ADDR=fe80::1%eth0 of
    the launch files is said by their preflight, in those words (tests/test_doctor.py)."""
    flags = ["--nnodes=2", "--rdzv_backend=c10d", "--nproc_per_node=1"]
    for endpoint, line in (
        ("[fe80::1%eth0]:29400", r"--rdzv_endpoint=\[fe80::1%eth0\]:29400 is an IPv6 address with its interface "
                                 r"\(%eth0\), a link-local one, .*: give the master's global or unique-local address"),
        ("h0:port", r"--rdzv_endpoint=h0:port: The port number of the rendezvous endpoint 'h0:port' must be an "
                    r"integer"),
    ):  # fmt: skip
        assert launcher.main([*flags, f"--rdzv_endpoint={endpoint}", str(TRAIN)]) == 2
        assert re.fullmatch(f"error: {line}.*\n", capsys.readouterr().err)
    for endpoint in ("[fd00::1]:29400", "h0:29400", "h0"):  # taken: torchrun would go on with them
        args = launcher.parse_args([*flags, f"--rdzv_endpoint={endpoint}", str(TRAIN)])
        assert torchrun_args.endpoint_refused(args) is None


def test_torchrun_arguments_it_would_refuse_in_a_traceback_are_one_line_before_it_starts(capsys, monkeypatch):
    """`python ddp/torchrun.py` run by hand: --nproc_per_node=gpu on a machine without one, 0, -1 or a word torchrun
    does not know, --nnodes=0, 3:2 or abc, --max-restarts=-1: torchrun's ValueError's or AssertionError's traceback;
    a static rendezvous's --node_rank past --nnodes: a wait for good. Now one line each, exit 2."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (torchrun asks it: a machine without GPUs)
    nnodes = "a number of machines (1 or more), or MIN:MAX with 1 <= MIN <= MAX"
    static = ["--rdzv_backend=static", "--master_addr=127.0.0.1", "--master_port=29555"]
    for flags, line in (
        (["--nproc_per_node=gpu"], "--nproc_per_node=gpu: Cuda is not available; give a number of processes (e.g. "
                                   "2), or auto or cpu"),
        (["--nproc_per_node=0"], "--nproc_per_node=0: 1 or more processes on each machine"),
        (["--nproc_per_node=-1"], "--nproc_per_node=-1: 1 or more processes on each machine"),
        (["--nproc_per_node=two"], "--nproc_per_node=two is no number of processes, nor auto, cpu or gpu"),
        (["--nnodes=0"], f"--nnodes=0: {nnodes}"),
        (["--nnodes=3:2"], f"--nnodes=3:2: {nnodes}"),
        (["--nnodes=abc"], f"--nnodes=abc: {nnodes}"),
        (["--max-restarts=-1", "--standalone"], "--max-restarts=-1: 0 or more restarts"),
        (["--nnodes=2", "--node_rank=5", *static], "--node_rank=5: the machines of --nnodes=2 are 0 to 1"),
    ):  # fmt: skip
        assert launcher.main([*flags, str(TRAIN)]) == 2, flags
        assert capsys.readouterr().err == f"error: {line}\n"
    for count in ("1", "cpu", "auto"):  # taken: torchrun would go on with them
        assert torchrun_args.nproc_refused(count) is None
    for flags in (["--nnodes=1:4", "--standalone"], ["--nnodes=2", "--node_rank=1", *static]):
        assert torchrun_args.launch_refused(launcher.parse_args([*flags, str(TRAIN)])) is None


@pytest.mark.parametrize("mode, flags", [("ddp", ["--multi_gpu"]), ("fsdp", ["--use_fsdp", "--fsdp_version", "2"])])
def test_accelerate_multi_gpu_runs_2_processes_on_a_machine_without_gpus(tmp_path, mode, flags):
    """--multi_gpu (or --use_fsdp: run.parallel=fsdp) starts torchrun, which needs no GPU and no MPI: the
    ranks use the CPU and gloo."""
    if mode == "fsdp":
        needs_fsdp2()
    cmd = [str(BIN / "accelerate"), "launch", *flags, "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), str(TRAIN),
           *ONE_EPOCH, f"run.out_dir={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"launcher=accelerate parallel={mode} world_size=2 device=cpu" in proc.stdout
    assert metrics(tmp_path)[0]["world_size"] == 2


def test_a_master_port_held_by_another_program_is_one_line_on_node_0_and_on_the_others(tmp_path):
    """Node 0: the port is taken (the holder named, a free one offered). Another node: the port accepts
    connections but is no rendezvous store (torchrun's client would wait without end): said within
    run.timeout_s + 10 s. Both before torchrun starts, exit 2."""
    with socket.socket() as held:  # another program listening on the port (here this test; it never answers)
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        env = clean_env(NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        node_0 = run_script("launch/multinode.sh", *ONE_EPOCH, f"run.out_dir={tmp_path}", env=env)
        started = time.monotonic()
        node_1 = run_script("launch/multinode.sh", *ONE_EPOCH, "run.timeout_s=2", env={**env, "NODE_RANK": "1"})
        seconds = time.monotonic() - started
    for proc in (node_0, node_1):
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "+ python" not in proc.stderr, proc.stderr
    assert f"error: MASTER_PORT={port} is taken on" in node_0.stderr and f"pid {os.getpid()} (" in node_0.stderr
    assert re.search(r"set another free port on every node, e.g. MASTER_PORT=\d+$", node_0.stderr.strip())
    assert "accepts connections from" in node_1.stderr and "does not answer as torchrun's rendezvous store" in (
        node_1.stderr
    )
    # the probe's bound, and the preflight's own start: its imports cost 2.5-4.5 s of CPU, 22.5 s in all once
    # with another job beside the suite on this 2-core machine; bounded is the property, not fast
    assert seconds < 2 + 10 + 20, seconds


def test_ctrl_c_while_a_node_waits_for_its_master_is_one_line_and_130():
    """Node 1's preflight (in torchrun's process) waits for MASTER_ADDR's store up to run.timeout_s; Ctrl-C
    there, as a terminal sends it to the whole group: one line, no traceback, 128 + SIGINT, no rank started."""
    with socket.socket() as held:  # the master's port: it accepts, so the test knows when node 1 is waiting
        held.bind(("127.0.0.1", 0))
        held.listen()
        held.settimeout(120)
        env = clean_env(NNODES="2", NODE_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(held.getsockname()[1]))
        proc = subprocess.Popen(["bash", "launch/multinode.sh", *ONE_EPOCH, "run.timeout_s=120"], cwd=REPO, env=env,
                                text=True, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        held.accept()[0].close()
        os.killpg(proc.pid, signal.SIGINT)
        err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130 and err == "stopped at once on SIGINT (Ctrl-C), without a checkpoint\n", err


def two_nodes_one_without_the_data(tmp_path: Path) -> tuple[list[str], str]:
    """ONE_EPOCH on an .npz, as node 0 runs it, and node 1's data.path, where its (node-local) copy is missing."""
    x = np.random.default_rng(0).integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    np.savez(tmp_path / "data.npz", x_train=x, y_train=np.arange(64) % 10, x_test=x[:20], y_test=np.arange(20) % 10)
    return [*ONE_EPOCH, "data.dataset=npz", f"data.path={tmp_path / 'data.npz'}"], str(tmp_path / "missing.npz")


@pytest.mark.parametrize("program", ["ddp/train.py", "ddp.doctor"])
def test_a_rank_that_stops_before_the_ranks_meet_ends_the_other_machines_ranks_with_its_line_at_once(program, tmp_path):
    """Plain torchrun on two machines (two agents here), the second's copy of the data missing (the doctor: a key
    mistyped there): its rank stops with its line; the first machine's rank, waiting for it at the rendezvous, stops
    with the same line within seconds, exit 2 (it waited out run.timeout_s, then said only that the rendezvous
    timed out)."""
    args, missing = two_nodes_one_without_the_data(tmp_path)
    port = free_port()
    rdzv = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
    run = [str(TRAIN)] if program == "ddp/train.py" else ["-m", program]
    node = lambda conf, *more: subprocess.Popen(  # noqa: E731
        [str(BIN / "torchrun"), *rdzv, f"--rdzv_conf=is_host={conf}", *run, *args, "run.timeout_s=300", *more],
        cwd=REPO, env=clean_env(), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    mistake = f"data.path={missing}" if program == "ddp/train.py" else "optim.lrr=1"
    nodes = [node("true", f"run.out_dir={tmp_path / 'run'}"), node("false", mistake)]
    try:  # bounded well inside run.timeout_s, not fast: two torch starts on 2 cores
        errors = [proc.communicate(timeout=90)[1] for proc in nodes]
    finally:
        kill_orphans([proc.pid for proc in nodes])  # a failed test's launchers (their ranks leave with them)
    said = re.search(r"^(doctor: )?error: (.*)$", errors[1], flags=re.M)
    assert said and (f"data.path={missing}: no such file" if mistake.startswith("data") else "'optim.lrr'") in said[2]
    host = re.escape(socket.gethostname())  # the rendezvous numbers the machines: node 1's rank may be 0
    line = f"{re.escape(said[1] or '')}error: rank [01] on {host} stopped before the ranks met: {re.escape(said[2])}"
    assert re.search(line, errors[0]) and nodes[0].returncode != 0 and nodes[1].returncode != 0, errors[0]
    assert "exitcode  : 2" in errors[0] and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("store", ["torchrun's", "rank 0's"])
def test_a_rank_that_runs_out_of_memory_is_named_with_why_by_the_rank_on_another_machine_it_leaves(tmp_path, store):
    """Two machines (two torchrun agents here), one rank each; rank 1 runs out of memory in step 3 (an error of its
    own: DDP_CIFAR_FAULT=oom). Rank 0, waiting for it in a collective, names it and why: it said so at the store
    where the ranks met before it left, where rank 0 said only that its connection closed. That store is torchrun's,
    or one rank 0 serves (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: as under torch 2.4's torchrun, srun and mpirun)."""
    port = free_port()
    rdzv = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
    run = [str(TRAIN), *ONE_EPOCH, "train.batch_size=16", f"run.out_dir={tmp_path}"]
    env = clean_env(DDP_CIFAR_FAULT="oom:3:r1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE=str(int(store == "rank 0's")))
    nodes = [subprocess.Popen([str(BIN / "torchrun"), *rdzv, f"--rdzv_conf=is_host={host}", *run], cwd=REPO, env=env,
                              stderr=subprocess.PIPE, text=True) for host in ("true", "false")]  # fmt: skip
    try:
        errors = "".join(proc.communicate(timeout=120)[1] for proc in nodes)
    finally:
        kill_orphans([proc.pid for proc in nodes])
    said = "out of memory (CUDA out of memory. Tried to allocate 2.00 GiB (DDP_CIFAR_FAULT=oom:3:r1)); try a smaller"
    assert f"error: rank 1 of 2: {said}" in errors, errors
    assert f"error: rank 0 of 2: lost contact with rank 1 (it stopped: {said}" in errors, errors
    (lost,) = [line for line in errors.splitlines() if line.startswith("error: rank 0 of 2: lost contact")]
    assert lost.endswith("(the data off the GPU))"), lost  # without torch's words after it (gloo's, 'GLHF!')


@pytest.mark.parametrize("fails", [1, 0])
def test_a_node_that_its_preflight_stops_ends_the_node_waiting_for_it_with_its_line_and_exit_2(tmp_path, fails):
    """launch/multinode.sh on two machines, one's copy of the data missing: its preflight says so before torchrun
    starts, exit 2, and the other node's torchrun, waiting for it at the rendezvous (600 s in silence, torch's join
    timeout), ends with that line and exit 2 within seconds, no rank started. Node 1 leaves its word at node 0's
    store, once it is up; node 0, whose store it is, serves one to tell node 1 (lost_rank.serve_word)."""
    args, missing = two_nodes_one_without_the_data(tmp_path)
    env = clean_env(NNODES="2", NPROC="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with open(tmp_path / "waits.err", "w+") as err:
        waits = subprocess.Popen(["bash", "launch/multinode.sh", *args, f"run.out_dir={tmp_path / 'run'}"], cwd=REPO,
                                 env={**env, "NODE_RANK": str(1 - fails)}, stderr=err, text=True)  # fmt: skip
        waits_ended = concurrent.futures.ThreadPoolExecutor(1).submit(lambda: (waits.wait(), time.monotonic())[1])
        try:
            deadline = time.monotonic() + 120
            while fails and launcher.network.connect_error("127.0.0.1", int(env["MASTER_PORT"]), 1.0):
                assert time.monotonic() < deadline
                time.sleep(0.2)  # node 0's store is up: node 0 waits at its rendezvous
            node = {**env, "NODE_RANK": str(fails)}
            stops = run_script("launch/multinode.sh", *args, f"data.path={missing}", env=node)
            stops_ended, waits_end = time.monotonic(), waits_ended.result(timeout=60)  # bounded, not fast
        finally:
            kill_orphans([waits.pid])
        err.seek(0)
        said = err.read()
    line = f"data.path={missing}: no such file"
    note = f"(waiting up to {lost_rank.HEAR_S:g} s for the other machines to hear this)\n"  # node 0, as node 1 starts
    assert stops.returncode == 2 and stops.stderr.removesuffix(note) == f"error: {line}\n", stops.stderr
    assert waits.returncode == 2, said
    assert said.endswith(f"error: {socket.gethostname()}, a machine of this job, stopped before it began: {line}\n")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert stops_ended - waits_end < lost_rank.HEAR_S / 2  # node 0 ends as node 1 has heard it, not after HEAR_S


def test_a_node_that_its_preflight_stops_before_node_0_is_up_waits_for_its_store_to_tell_it(tmp_path):
    """launch/multinode.sh: node 1's copy of the data missing, node 0 started 6 s after node 1's preflight stopped it.
    Node 1 says it waits for node 0's store, and leaves its line there once it is up; node 0 ends with it, exit 2.
    Node 1 gave up after 5 s, and node 0 waited out torch's join timeout (600 s) in silence."""
    args, missing = two_nodes_one_without_the_data(tmp_path)
    env = clean_env(NNODES="2", NPROC="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    stops = subprocess.Popen(["bash", "launch/multinode.sh", *args, f"data.path={missing}"], cwd=REPO,
                             env={**env, "NODE_RANK": "1"}, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        said = [stops.stderr.readline(), stops.stderr.readline()]  # its error, then that it waits
        time.sleep(6)
        waits = subprocess.run(["bash", "launch/multinode.sh", *args, f"run.out_dir={tmp_path / 'run'}"], cwd=REPO,
                               env={**env, "NODE_RANK": "0"}, capture_output=True, text=True, timeout=60)  # fmt: skip
        said += stops.communicate(timeout=30)[1].splitlines(keepends=True)
    finally:
        kill_orphans([stops.pid])
    line = f"data.path={missing}: no such file"
    assert stops.returncode == 2 and said == [f"error: {line}\n", f"(waiting up to {lost_rank.HEAR_S:g} s for the "
                                              f"rendezvous store at 127.0.0.1:{env['MASTER_PORT']} to tell the other "
                                              "machines)\n"], said  # fmt: skip
    assert waits.returncode == 2, waits.stderr
    assert waits.stderr.endswith(f"error: {socket.gethostname()}, a machine of this job, stopped before it began: "
                                 f"{line}\n")  # fmt: skip


def test_accelerate_launch_on_cpu_runs_2_processes_through_mpi(tmp_path):
    require("mpirun", "apt-get install openmpi-bin")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    env = clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [str(BIN / "accelerate"), "launch", "--cpu", "--num_processes", "2", "--mpirun_hostfile", str(hostfile),
           "--main_process_port", str(free_port()), str(TRAIN), *ONE_EPOCH, f"run.out_dir={tmp_path}/run"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "launcher=accelerate parallel=ddp world_size=2 device=cpu" in proc.stdout
    assert metrics(tmp_path / "run")[0]["world_size"] == 2


def paused_rank(proc: subprocess.Popen, timeout: float = 120) -> int:
    """The rank of `proc`'s job that DDP_CIFAR_FAULT=pause has stopped (SIGSTOP: state T)."""
    deadline = time.monotonic() + timeout
    while not (paused := [pid for pid in descendants(proc.pid) if state(pid) == "T" and b"train.py" in cmdline(pid)]):
        assert proc.poll() is None and time.monotonic() < deadline, "the job ended or no rank paused"
        time.sleep(0.02)
    return paused[0]


def test_plain_mpirun_of_two_ranks_is_one_line_and_no_run(tmp_path):
    """`mpirun -n 2 python ddp/train.py`: each process trained alone, and the second failed as the first held the
    out_dir ("in use by another run"). Now one line names the launchers that work, said once; nothing is written.
    Rank 0, which says it, starts 3 s late (mpirun's MPMD form): rank 1 ended first, and mpirun killed rank 0 before
    it had said it (no line; 1 run in 4 inside sbatch). Now rank 1 waits for it."""
    require("mpirun", "apt-get install openmpi-bin")
    env = clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    train = [sys.executable, str(TRAIN), *ONE_EPOCH, f"run.out_dir={tmp_path / 'run'}"]
    cmd = ["mpirun", "-n", "1", "bash", "-c", 'sleep 3; exec "$@"', "late", *train, ":", "-n", "1", *train]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("error: mpirun started 2 processes, and ddp-cifar takes its ranks from") == 1, proc.stderr
    assert not (tmp_path / "run").exists()


def accelerate_launch(mode: str) -> list[str]:
    """launch/accelerate.sh's on a machine without GPUs (mpirun); its launch with GPUs (multi_gpu), on the CPU."""
    if mode in ("mpirun", "mpich", "intel-mpi"):
        return ["bash", "launch/accelerate.sh"]  # (it takes a free port)
    flags = "--multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no".split()
    return [sys.executable, "ddp/accelerate_launch.py", *flags, "--main_process_port", str(free_port()), str(TRAIN)]


# Steps longer than mpirun's 2 s from a Ctrl-C to its SIGKILL (the fast net, 256 images a rank: 1.5-3 s a step here)
SLOW_STEPS = [*TINY, "model.name=fast", "train.batch_size=512", "data.synthetic_train=2048", "train.epochs=20"]


MPICH = "apt-get install mpich"


def mpich(tmp_path: Path) -> str:
    """A PATH whose mpirun is MPICH's (Hydra), beside Open MPI's, the system's mpirun here; Hydra runs the proxy it
    finds beside the mpirun it was started as."""
    tools = tmp_path / "mpich"
    tools.mkdir()
    (tools / "mpirun").symlink_to(require("mpirun.mpich", MPICH))
    (tools / "hydra_pmi_proxy").symlink_to(require("hydra_pmi_proxy", MPICH))
    return f"{tools}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}"  # (then this environment's, as clean_env)


INTEL_MPI = Path("/opt/ddp-cifar/intel-mpi")  # PyPI's impi-rt, as tests/system_packages.sh installs it


def intel_mpi() -> str:
    """A PATH whose mpirun is Intel MPI's (a shell script that starts its mpiexec.hydra), before Open MPI's."""
    mpirun = require(str(INTEL_MPI / "bin" / "mpirun"), f"pip install --target {INTEL_MPI} impi-rt==2021.13.1")
    return f"{Path(mpirun).parent}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.parametrize("mode", ["mpirun", "mpich", "intel-mpi", "multi_gpu"])
def test_ctrl_c_of_an_accelerate_launch_ends_with_our_lines_and_130_and_a_killed_rank_with_137(tmp_path, mode):
    """Ctrl-C (SIGINT to the whole process group) of accelerate launch: the ranks saved and said so, and
    accelerate's traceback followed, 20 lines (mpirun's: a KeyboardInterrupt, printed before the ranks' lines, exit
    -2) or 45 (--multi_gpu: torchrun's SignalException, exit 1). Launched by launch/accelerate.sh now (through
    ddp/accelerate_launch.py), it ends after them with 128 + SIGINT. Through mpirun the ranks saved only where a
    step was short: mpirun took the Ctrl-C as its end, and sent each rank SIGTERM 1 s later and SIGKILL 1 s after
    that, which killed a rank in a longer step (no checkpoint, no line). Now the Ctrl-C is sent to the ranks and not
    to mpirun. Rank 1 pauses after step 1 (DDP_CIFAR_FAULT) until the Ctrl-C (or torchrun's SIGTERM) has reached it:
    the stop comes with step 2, which takes longer than 2 s here. A rank killed with -9: CalledProcessError's or
    ChildFailedError's traceback before; now the lines of the ranks, a line naming the one killed (Open MPI's box of
    it was 4 lines, beside two boxes that ranks ended non-zero), and 128 + SIGKILL.
    MPICH's mpirun: launch/accelerate.sh gave it Open MPI's hostfile (Hydra: "token slots not supported", exit 255),
    and the Ctrl-C sent to its children reached its proxy, not the ranks, which trained on. A rank killed there: Hydra
    ends the others at once, and exited 9 with an 11-line box on stdout ("EXIT STRING: Killed (signal 9)"): now one
    line and 128 + SIGKILL. No run leaves torchrun's log dir in TMPDIR (--multi_gpu left one each). Intel MPI's
    mpirun (PyPI's impi-rt): the Ctrl-C went to its mpiexec.hydra, which said "Press Ctrl-C again to force abort"
    (a second one ended the ranks unsaved); its box of a killed rank was passed on as it was, and exit 255."""
    if mode == "mpirun":
        require("mpirun", "apt-get install openmpi-bin")
    (tmp := tmp_path / "tmp").mkdir()  # TMPDIR: --multi_gpu left torchrun's log dir (torchelastic_*) there each run
    env = clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", DDP_CIFAR_FAULT="pause:1:r1",
                    TMPDIR=str(tmp))  # fmt: skip
    if mode in ("mpich", "intel-mpi"):
        env.update(PATH=mpich(tmp_path) if mode == "mpich" else intel_mpi())
    short = [*TINY, "data.synthetic_train=2048", "train.epochs=20"]  # (any step)
    steps = short if mode in ("mpich", "intel-mpi") else SLOW_STEPS
    cmd = [*accelerate_launch(mode), *steps, f"run.out_dir={tmp_path}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        paused = paused_rank(proc)
        os.killpg(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        while state(paused) == "T" and not pending(paused, signal.SIGINT) and not pending(paused, signal.SIGTERM):
            assert time.monotonic() < deadline, "the Ctrl-C never reached the paused rank"
            time.sleep(0.01)
        os.kill(paused, signal.SIGCONT)
        out = proc.communicate(timeout=120)[0]
    finally:
        kill_orphans(session(proc.pid))
    assert proc.returncode == 130 and "Traceback" not in out and "non-zero" not in out, out
    assert "Press Ctrl-C again to force abort" not in out, out  # (Intel MPI's mpiexec.hydra, given the Ctrl-C)
    assert re.search(r"^stopped on SIG(INT|TERM); run the same command to resume$", out, re.M), out  # (torchrun: TERM)
    saved = re.search(r"^stopping on SIG(INT|TERM): checkpoint (\S+)$", out, re.M)
    assert saved and Path(saved[2]).is_file(), out
    env.update(DDP_CIFAR_FAULT="step:3:r1")
    killed = subprocess.run([*accelerate_launch(mode), *TINY, f"run.out_dir={tmp_path / 'killed'}"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert not list(tmp.glob("torchelastic_*")), list(tmp.iterdir())
    assert killed.returncode == 128 + signal.SIGKILL and "Traceback" not in killed.stderr, killed.stderr
    assert "BAD TERMINATION" not in killed.stdout and "non-zero" not in killed.stderr, killed.stdout + killed.stderr
    if mode in ("mpich", "intel-mpi"):  # (Hydra ended rank 0 at once; MPICH's rank 1: its PMI_RANK, as it ran)
        mpi = "MPICH's" if mode == "mpich" else "Intel MPI's"  # (Intel's box: a rank's number; it exited 255)
        # (rank 0 at times, under load: 2 runs in 4 with two test workers; Hydra's box names the first end it saw,
        # which may be rank 0's, killed by Hydra itself as rank 1 died)
        assert re.search(rf"^error: rank [01] \(pid \d+\) was killed by SIGKILL, the first end {mpi} mpirun saw; it "
                         "ended the others$", killed.stderr, re.M), killed.stderr  # fmt: skip
        return
    assert "error: rank 0 of 2: lost contact with rank 1" in killed.stderr, killed.stderr
    assert re.search(r"^error: rank 1( \(pid \d+\))? was killed by SIGKILL$", killed.stderr, re.M), killed.stderr


@pytest.mark.parametrize("mode, sent", [("config", signal.SIGUSR1), ("mpirun", signal.SIGTERM)])
def test_a_kill_of_the_accelerate_scripts_pid_stops_the_run_with_a_checkpoint(tmp_path, mode, sent):
    """`kill PID` of `bash launch/accelerate.sh` killed the shell alone: accelerate and its ranks trained on to the
    end (20 of 20 epochs), and no one could stop them but by their own pids. The script now runs accelerate in its
    own process (exec; mpirun's hostfile is a file of the repository, not one the shell removed at its end). Through
    mpirun (no GPU) accelerate sends the ranks the SIGTERM: they stop with a checkpoint, exit 128 + SIGTERM. Its
    config's path (one machine of NUM_MACHINES=1; on GPUs the one-machine path is the same) runs torchrun's agent,
    whose SIGTERM the Ctrl-C test's SIGINT shares; `kill -USR1` ended it there (exit 138, its ranks stopping on
    the launcher's end): it sends SIGUSR1 on to its ranks, which stop on it with a checkpoint, exit 75."""
    env = clean_env(NPROC="2", MASTER_PORT=str(free_port()), OMPI_ALLOW_RUN_AS_ROOT="1",
                    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # fmt: skip
    if mode == "config":
        env.update(ACCELERATE_CONFIG=str(REPO / "launch/accelerate/multi-machine.yaml"), NUM_MACHINES="1",
                   MACHINE_RANK="0", MASTER_ADDR="127.0.0.1")  # fmt: skip
    else:
        require("mpirun", "apt-get install openmpi-bin")
    job = [*TINY, "data.synthetic_train=2048", "train.epochs=20", f"run.out_dir={tmp_path}"]
    proc = subprocess.Popen(["bash", "launch/accelerate.sh", *job], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "metrics.jsonl").is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(sent)
        out = proc.communicate(timeout=120)[0]
        seconds_until_gone(session(proc.pid), time.monotonic())  # (mpirun may close its output a moment before)
    finally:
        kill_orphans(session(proc.pid))
    code = 128 + sent if sent == signal.SIGTERM else errors.EXIT_STOPPED
    assert proc.returncode == code and "Traceback" not in out and "non-zero" not in out and "error" not in out, out
    saved = re.search(rf"^stopping on {sent.name}: checkpoint (\S+)$", out, re.M)
    assert saved and Path(saved[1]).is_file() and "epoch 20/20" not in out, out


def test_accelerate_launch_cpu_without_mpi_says_why_it_got_one_process(tmp_path):
    cmd = [str(BIN / "accelerate"), "launch", "--cpu", "--num_processes", "2", str(TRAIN), *ONE_EPOCH,
           f"run.out_dir={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "error: accelerate started 1 process for --num_processes > 1" in proc.stderr
    assert "--mpirun_hostfile" in proc.stderr and not (tmp_path / "metrics.jsonl").exists()
    assert "--multi_gpu, which starts them with torchrun and runs them on the CPU" in proc.stderr


def test_accelerate_script_on_cpu_twice_at_once(tmp_path):
    """Two runs at once on one machine, MASTER_PORT unset: the second's ranks found the first's port (29500) taken
    and failed (exit 2). Each takes a free port now, as torchrun --standalone does. The second has 3 ranks, more
    than the cores of a 2-core machine: accelerate has mpirun bind the ranks to a socket, and Open MPI refused to
    bind more than its cores (`binding more processes than cpus on a resource`, exit 1). The second's shell has a
    NODE_RANK too, which is not accelerate's."""
    require("mpirun", "apt-get install openmpi-bin")
    nprocs = (2, 3)
    stale = {3: {"NODE_RANK": "1"}}  # the second's shell: left by launch/multinode.sh ("MASTER_ADDR= does not resolve")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_script, "launch/accelerate.sh", *ONE_EPOCH, "train.batch_size=30",
                            f"run.out_dir={tmp_path / str(n)}", env=clean_env(NPROC=str(n), **stale.get(n, {})))
                for n in nprocs]  # fmt: skip
    for n, run in zip(nprocs, runs):
        proc = run.result()
        assert proc.returncode == 0, proc.stderr
        assert f"ddp/accelerate_launch.py --cpu --num_processes {n}" in proc.stderr
        assert metrics(tmp_path / str(n))[0]["world_size"] == n


@pytest.mark.parametrize(
    "setting, message",
    [
        ("MIN_NODES=x", "MIN_NODES=x must be a whole number (1 to NNODES=2)"),
        ("MIN_NODES=3", "MIN_NODES=3 must be 1 to NNODES=2"),
        ("MIN_NODES=0", "MIN_NODES=0 must be 1 to NNODES=2"),
        ("MAX_RESTARTS=-1", "MAX_RESTARTS=-1 must be a whole number"),
        ("NODE_RANK=2", "NODE_RANK=2 must be 0 to NNODES-1=1"),
        ("NNODES=two", "NNODES=two must be a whole number"),
        ("NNODES=0", "NNODES=0 must be 1 or more (how many machines)"),  # was "NODE_RANK=0 must be 0 to NNODES-1=-1"
        ("RDZV_CONF=zzz", "RDZV_CONF=zzz must be key=value pairs joined by commas, e.g. last_call_timeout=5"),
        ("RDZV_CONF=a=1,", "RDZV_CONF=a=1, must be key=value pairs joined by commas, e.g. last_call_timeout=5"),
        ("RDZV_CONF=join_timeout=9,is_host=false", "RDZV_CONF may not set is_host: this script does (node 0, "),
        ("RDZV_CONF=last_call_timeout=abc", "RDZV_CONF's last_call_timeout=abc must be a whole number (seconds, or"),
        ("RDZV_CONF=keep_alive_max_attempt=1.5", "RDZV_CONF's keep_alive_max_attempt=1.5 must be a whole number"),
    ],
)
def test_multinode_settings_that_cannot_work_are_one_line_and_exit_2(setting, message):
    """launch/multinode.sh's elastic settings (MIN_NODES, MAX_RESTARTS) and node numbers, checked before
    anything starts."""
    name, value = setting.split("=", 1)
    env = clean_env(**{"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "h0", name: value})
    proc = run_script("launch/multinode.sh", *TINY, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {message}") and proc.stderr.count("\n") == 1, (
        proc.stderr
    )


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"NPROC": "two"}, "NPROC=two must be a whole number, 1 or more (processes on this machine)"),  # "unbound"
        ({"NUM_MACHINES": "x"}, "NUM_MACHINES=x must be a whole number"),  # was "x: unbound variable"
        ({"MACHINE_RANK": "2"}, "MACHINE_RANK=2 must be 0 to NUM_MACHINES-1=1"),  # accelerate waited for ever
        ({"ACCELERATE_CONFIG": "/no/such.yaml"}, "ACCELERATE_CONFIG=/no/such.yaml: no such file"),  # a traceback
        ({"MASTER_PORT": "x"}, "MASTER_PORT=x is not a port number (1-65535)"),  # accelerate's 60-line usage
        ({"MASTER_PORT": "65536"}, "MASTER_PORT=65536 is not a port number (1-65535)"),
        ({"PATH": "{bin}:/usr/bin:/bin"}, "no accelerate in this python ({bin}/python): pip install 'ddp-cifar["),
    ],
)
def test_accelerate_settings_that_cannot_work_are_one_line_and_exit_2(settings, message, tmp_path):
    """launch/accelerate.sh's machines, ranks, port and config file, checked before accelerate starts; and a
    machine without accelerate (a PATH with python alone)."""
    (tmp_path / "python").symlink_to(sys.executable)
    env = clean_env(NPROC="1", ACCELERATE_CONFIG=str(REPO / "launch/accelerate/multi-machine.yaml"),
                    NUM_MACHINES="2", MACHINE_RANK="0", MASTER_ADDR="127.0.0.1")  # fmt: skip
    env.update({k: v.format(bin=tmp_path) for k, v in settings.items()})
    proc = run_script("launch/accelerate.sh", *TINY, env=env)
    said = f"error: {message.format(bin=tmp_path)}"
    assert proc.returncode == 2 and proc.stderr.startswith(said) and proc.stderr.count("\n") == 1, proc.stderr


def test_slurm_scripts_rendezvous_from_a_master_port_that_is_no_port_is_one_line():
    """slurm/train.sh asks ddp.launchers for the rendezvous in a python -c before anything: MASTER_PORT=abc was a
    ValueError traceback, and the script went on to the preflight with no address. (No cluster needed: the
    job's variables are all the script reads before it.)"""
    env = clean_env(SLURM_JOB_ID="5", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="localhost", MASTER_PORT="abc")
    proc = run_script("slurm/train.sh", *TINY, env=env)
    assert (proc.returncode, proc.stderr) == (2, "error: MASTER_PORT='abc' is not a port number (1-65535)\n")


@pytest.mark.parametrize("script", ["launch/torchrun.sh", "launch/multinode.sh"])
@pytest.mark.parametrize("nproc", ["0", "two", "-1", "08"])
def test_a_process_count_that_cannot_work_is_one_line_and_exit_2(script, nproc):
    """NPROC, every launch file's (launch/common.sh checks it): one line naming it, before any Python starts
    (bash's arithmetic said "division by 0" or "two: unbound variable", or the preflight named --preflight=N).
    OMP_NUM_THREADS set to what OpenMP refuses: libgomp's "Invalid value" from every rank, which then took all the
    CPUs each. (Empty is unset, as before: the launch file gives it the process's share.)"""
    env = clean_env(NPROC=nproc, NNODES="2", NODE_RANK="0", MASTER_ADDR="h0")
    proc = run_script(script, *TINY, env=env)
    message = f"error: NPROC={nproc} must be a whole number, 1 or more (processes on this machine)"
    assert proc.returncode == 2 and proc.stderr.strip() == message, proc.stderr
    threads = {"0": "abc", "two": "0", "-1": "-1", "08": "2,x"}[nproc]
    proc = run_script(script, *TINY, env={**env, "NPROC": "1", "OMP_NUM_THREADS": threads})
    message = f"error: OMP_NUM_THREADS={threads} must be a whole number, 1 or more (threads per process), or unset"
    assert proc.returncode == 2 and proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr


def test_torchruns_exit_barrier_race_is_one_line_and_a_barrier_timeout_is_left_as_it_was(caplog, capsys):
    """Seen at the end of a 2-node sbatch job that succeeded: the agent hosting the store left first,
    the other logged a traceback and C++ stack traces (pytorch/pytorch#69520). A connection closed at
    the exit barrier is one line, and the rendezvous's connection warnings after it go; a barrier that
    timed out (a node that never came) is torch's own report still."""
    race = launcher.ExitBarrierRace()
    loggers = [logging.getLogger(name) for name in launcher.RACE_LOGGERS]
    for logger in loggers:
        logger.addFilter(race)
    try:
        closed, timeout = torch.distributed.DistNetworkError, torch.distributed.DistStoreError
        for error in (closed("Failed to recv, got 0 bytes"), closed("again"), timeout("timed out")):
            try:
                raise error
            except RuntimeError:
                loggers[0].exception("Error waiting on exit barrier. Elapsed: %s seconds", 0.03)
        loggers[1].warning("The node 'h1_1_0' has failed to shutdown the rendezvous '2' due to an error of type "
                           "RendezvousConnectionError.")  # fmt: skip
    finally:
        for logger in loggers:
            logger.removeFilter(race)
    assert [str(r.exc_info[1]) for r in caplog.records] == ["timed out"]
    note = "note: every rank finished; the rendezvous store's host ended before this agent on"
    assert capsys.readouterr().err.count(note) == 1


HUNG_AGENT = """
import subprocess, sys, threading, time
from ddp import torchrun
torchrun.STORE_LOST_S, torchrun.GRACE_S = 0.0, 1.0
subprocess.Popen([sys.executable, "-c", "pass"]).wait()  # (reaped at once: as the agent's ranks ended)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])  # (ends, left a zombie: not running)
threading.Thread(target=torchrun.leave_after_the_ranks, args=(None, False, None), daemon=True).start()
def close_the_ranks():
    time.sleep(60)
close_the_ranks()
"""


def test_an_agent_that_outlives_its_ranks_on_one_machine_says_where_it_hangs_and_leaves():
    """Seen once in ~190 Ctrl-Cs as ranks started, under load, --standalone: the agent still ran 20 s after its
    ranks ended, and its line guessed at a rendezvous store on another host, which that job had none of. The
    line now says where the agent's main thread was, with no such guess."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HUNG_AGENT], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1 and time.monotonic() - started < 30, proc.stderr
    line = f"error: torchrun's agent on {socket.gethostname()} still ran 1 s after its ranks ended; it was at "
    assert proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr
    assert "it was at <string>:9 in close_the_ranks < <string>:10 in <module>: left" in proc.stderr, proc.stderr


@pytest.mark.parametrize("flags, skips_teardown", [(["--standalone"], True), (["--nnodes=1"], True),
                                                   (["--nnodes=2", "--rdzv_endpoint=h:29400"], False)])  # fmt: skip
def test_the_agent_of_a_job_on_one_machine_exits_without_the_interpreters_teardown(flags, skips_teardown, monkeypatch):
    """Torch's teardown took the agent 0.4-0.5 s after every run here (1.5-2.8 s beside a test suite, where a Ctrl-C
    took up to 7.4 s to end): on one machine it leaves as the ranks do (cli.leave). An agent of a job of several
    machines exits the usual way: it may serve the rendezvous store that the other agents still read."""

    def leave(code: int) -> None:
        raise RuntimeError(f"left {code} without the teardown")

    monkeypatch.setattr(launcher, "one_machine", [])
    monkeypatch.setattr(launcher, "torchrun", lambda argv: None)  # (every rank done)
    monkeypatch.setattr(launcher.cli, "leave", leave)
    monkeypatch.setattr(launcher, "leave_after_the_ranks", lambda *args: None)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTSTP, signal.SIGCONT)}  # (main sets Ctrl-Z's)
    try:
        with pytest.raises(RuntimeError if skips_teardown else SystemExit) as ended:
            launcher.run([*flags, "--nproc_per_node=2", str(TRAIN)])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if skips_teardown:
        assert str(ended.value) == "left 0 without the teardown"
    else:
        assert ended.value.code == 0


def test_accelerate_launch_arguments_it_refuses_are_one_line_before_anything_starts(monkeypatch, capsys):
    """`python ddp/accelerate_launch.py` run by hand: --multi_gpu with 1 process, or --cpu and --multi_gpu together,
    were accelerate's ValueError's traceback; --num_processes 0 or -2 ran one plain process, no mistake said. Now one
    line each, exit 2, and no launcher of ranks is called."""
    from accelerate.commands import launch

    from ddp import accelerate_launch

    for name in ("simple_launcher", "_validate_launch_command"):  # (main wraps them: put back after)
        monkeypatch.setattr(launch, name, getattr(launch, name))
    started = []
    monkeypatch.setattr(launcher, "one_machine", [])  # (main sets it)
    monkeypatch.setattr(launch, "multi_gpu_launcher", started.append)
    monkeypatch.setattr(accelerate_launch, "_through_mpirun", started.append)
    for flags, line in (
        (["--num_processes", "0"], "--num_processes 0: 1 or more"),
        (["--cpu", "--num_processes", "-2"], "--num_processes -2: 1 or more"),
        (["--multi_gpu", "--num_processes", "2", "--num_machines", "0"], "--num_machines 0: 1 or more"),
        (["--multi_gpu", "--num_processes", "1"], "You need to use at least 2 processes to use `--multi_gpu`."),
        (["--cpu", "--multi_gpu"], "You can only use one of `--cpu`, `--multi_gpu`, `--tpu`, `--use_deepspeed`, "
                                   "`--use_fsdp` at a time."),
    ):  # fmt: skip
        assert accelerate_launch.main([*flags, str(TRAIN)]) == 2, flags
        assert capsys.readouterr().err.endswith(f"error: accelerate launch: {line}\n"), flags
    assert accelerate_launch.main(["--multi_gpu", "--num_processes", "2", str(TRAIN)]) == 0 and len(started) == 1


@pytest.mark.parametrize("config, skips_teardown", [("one-machine.yaml", True), ("multi-machine.yaml", False)])
def test_accelerate_launch_on_one_machine_by_its_config_file_exits_without_the_teardown(config, skips_teardown,
                                                                                        monkeypatch):  # fmt: skip
    """ddp/accelerate_launch.py took `--num_machines` from its command line alone: with launch/accelerate.sh's GPU
    config (num_machines: 1 in the file, not a flag) it exited through the teardown. It asks accelerate's own reading
    of the file. Accelerate's launcher of the ranks (torchrun's agent) is left out here: every rank done."""
    from accelerate.commands import launch

    from ddp import accelerate_launch

    def leave(code: int) -> None:
        raise RuntimeError(f"left {code} without the teardown")

    monkeypatch.setattr(launcher, "one_machine", [])
    monkeypatch.setattr(launch, "multi_gpu_launcher", lambda args: None)
    for name in ("simple_launcher", "_validate_launch_command"):  # (main wraps them: put back after)
        monkeypatch.setattr(launch, name, getattr(launch, name))
    monkeypatch.setattr(launcher.cli, "leave", leave)
    argv = ["--config_file", str(REPO / "launch" / "accelerate" / config), "--num_processes", "2", str(TRAIN)]
    with pytest.raises(RuntimeError if skips_teardown else SystemExit) as ended:
        launcher.run(argv, accelerate_launch.main)
    assert str(ended.value) == "left 0 without the teardown" if skips_teardown else ended.value.code == 0
