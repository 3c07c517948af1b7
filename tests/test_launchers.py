"""Launcher detection (ddp/launchers.py), as pure functions of an environment: torchrun, accelerate
(torchrun and MPI), SLURM (srun and the batch script), a single process, and forced launchers."""

import io
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import TINY
from launch_envs import OPEN_MPI, SRUN, TORCHRUN

from ddp import cpus, devices, launchers, processes
from ddp.config import RunConfig
from ddp.errors import UsageError


def test_half_set_launcher_variables_are_an_error():
    with pytest.raises(UsageError, match="WORLD_SIZE set but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not"):
        launchers.detect_launch({"WORLD_SIZE": "2"})
    assert launchers.detect_launch({}) == launchers.Launch("none", 0, 0, 1)


@pytest.mark.parametrize(
    "env, said",
    [
        ({**TORCHRUN, "MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not a port number (1-65535)"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT='70000' is not a port number (1-65535)"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "z"}, "RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE must be integers, got"),
        ({**OPEN_MPI, "MASTER_PORT": "x"}, "MASTER_PORT='x' is not a port number (1-65535)"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "two"}, "OMPI_COMM_WORLD_LOCAL_SIZE must be integers"),
        ({**SRUN, "SLURM_NTASKS": "four"}, "SLURM_NTASKS must be integers, got ['four']"),
        ({**SRUN, "SLURM_NODEID": "n1"}, "SLURM_NODEID must be integers, got ['n1']"),
    ],
)
def test_launcher_numbers_that_are_not_numbers_are_one_line(env, said):
    """Set by hand or by a broken script: a traceback from int() in torch's rendezvous or ours before."""
    with pytest.raises(UsageError, match=re.escape(said)):
        launchers.detect_launch(env)


@pytest.mark.parametrize("port", ["abc", "99999", "0"])
def test_the_rendezvous_the_doctor_plans_checks_master_port(port):
    """`MASTER_PORT=abc python -m ddp.doctor` was a ValueError traceback, 99999 an OverflowError from bind()."""
    with pytest.raises(UsageError, match=re.escape(f"MASTER_PORT={port!r} is not a port number (1-65535)")):
        launchers.planned_rendezvous({"MASTER_PORT": port})


def test_tasks_on_this_node_from_slurms_counts_without_spelling_them_out():
    """'2(x3),1' was made a list of its counts, one per node: '2(x99999999999)' would have filled the memory."""
    counts = {"SLURM_STEP_TASKS_PER_NODE": "2(x3),1(x99999999999),4"}
    nodes = [0, 2, 3, 99999999999 + 2, 99999999999 + 3, 99999999999 + 4]
    assert [launchers._tasks_on_this_node({**counts, "SLURM_NODEID": str(n)}) for n in nodes] == [2, 2, 1, 1, 4, 1]


@pytest.mark.parametrize(
    "nodelist, first",
    [("vm", "vm"), ("a,b", "a"), ("gpu[07-09,12],cpu3", "gpu07"), ("n[3,1]", "n3"), ("r[1-2]-n[01-04]", "r1-n01")],
)
def test_first_host_of_a_slurm_nodelist(nodelist, first):
    assert launchers.first_host(nodelist) == first


def test_the_batch_script_itself_and_one_task_are_a_single_process():
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}  # sbatch -n4 script, before srun
    assert launchers.detect_launch(batch).launcher == "none"
    assert launchers.detect_launch({**SRUN, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).launcher == "none"
    assert launchers.detect_launch(batch, "slurm").rank == 3  # unless run.launcher=slurm says so


def test_slurm_ports_differ_between_jobs_and_their_steps_and_stay_below_the_ephemeral_range():
    ports = {launchers.slurm_port(str(job), str(step)) for job in range(100_000, 100_050) for step in range(4)}
    assert len(ports) == 200 and all(10000 <= p < 32768 for p in ports)


def test_torchrun_variables_come_before_slurm():
    env = {**SRUN, **TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"}  # torchrun started by srun (slurm/train.sh)
    launch = launchers.detect_launch(env)
    assert (launch.launcher, launch.rank, launch.init_method) == ("torchrun", 1, None)  # the ranks meet at its store
    old_torchrun = {**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}  # torch 2.4's: rank 0 serves at MASTER_PORT
    assert launchers.detect_launch(old_torchrun).init_method == "tcp://127.0.0.1:29500"
    assert launchers.detect_launch(env, "slurm").rank == 3
    assert launchers.detect_launch(env, "none").world_size == 1


def test_accelerate_under_torchrun_and_under_mpi():
    launch = launchers.detect_launch({**TORCHRUN, "ACCELERATE_MIXED_PRECISION": "no"})
    assert (launch.launcher, launch.rank, launch.world_size) == ("accelerate", 1, 2)
    launch = launchers.detect_launch(OPEN_MPI)
    assert launch == launchers.Launch("accelerate", 1, 1, 2, 2, "tcp://127.0.0.1:29500")
    one = {k: v for k, v in OPEN_MPI.items() if not k.startswith("OMPI")}  # --cpu --num_processes 2, no MPI
    with pytest.raises(UsageError, match="accelerate started 1 process for --num_processes > 1.*--mpirun_hostfile"):
        launchers.detect_launch(one)
    assert launchers.detect_launch({"ACCELERATE_USE_CPU": "True"}).launcher == "none"  # --num_processes 1


@pytest.mark.parametrize(
    "launcher, env, message",
    [
        ("torchrun", {}, "run.launcher=torchrun but none of its variables are set"),
        ("accelerate", TORCHRUN, "run.launcher=accelerate but no ACCELERATE_"),
        ("slurm", {"SLURM_JOB_ID": "1"}, "run.launcher=slurm but SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS not set"),
    ],
)
def test_a_forced_launcher_must_have_its_variables(launcher, env, message):
    with pytest.raises(UsageError, match=message):
        launchers.detect_launch(env, launcher)


def test_accelerate_flags_fill_what_the_config_left_at_its_default():
    run = launchers.accelerate_flags(RunConfig(), {"ACCELERATE_USE_CPU": "True", "ACCELERATE_MIXED_PRECISION": "bf16"})
    assert (run.device, run.amp) == ("cpu", "bf16")
    assert launchers.accelerate_flags(RunConfig(amp="bf16"), {"ACCELERATE_MIXED_PRECISION": "no"}).amp == "bf16"
    with pytest.raises(UsageError, match="accelerate launch --cpu but run.device=cuda:1"):
        launchers.accelerate_flags(RunConfig(device="cuda:1"), {"ACCELERATE_USE_CPU": "True"})
    with pytest.raises(UsageError, match="--mixed_precision fp16 but run.amp=bf16"):
        launchers.accelerate_flags(RunConfig(amp="bf16"), {"ACCELERATE_MIXED_PRECISION": "fp16"})
    with pytest.raises(UsageError, match="--mixed_precision fp8: this loop trains in no, bf16 or fp16"):  # was fp32
        launchers.accelerate_flags(RunConfig(), {"ACCELERATE_MIXED_PRECISION": "fp8"})
    with pytest.raises(UsageError, match="--use_deepspeed: this loop runs DDP, or FSDP2 .--use_fsdp., not deepspeed"):
        launchers.accelerate_flags(RunConfig(), {"ACCELERATE_USE_DEEPSPEED": "true"})  # it was DDP, silently
    assert launchers.accelerate_flags(RunConfig(), {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}).compile  # was ignored


def test_an_accelerate_fp16_on_a_cpu_names_its_variable_not_a_run_amp_nobody_typed(tmp_path, monkeypatch, capsys):
    """ACCELERATE_MIXED_PRECISION=fp16 (accelerate's --mixed_precision, or left exported) on a CPU: the line said
    "run.amp=fp16 needs a CUDA device", a setting the user had not given."""
    from ddp import train

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert train.cli(["--preflight", "1", *TINY, "run.device=cpu", f"run.out_dir={tmp_path}"]) == 2
    said = "error: ACCELERATE_MIXED_PRECISION=fp16 (accelerate launch --mixed_precision fp16, or left in the shell) is "
    assert capsys.readouterr().err.startswith(said + "run.amp=fp16, which needs a CUDA device, not cpu: bf16 or no")
    assert not launchers.accelerate_flags(RunConfig(), {"ACCELERATE_DYNAMO_BACKEND": "NO"}).compile
    with pytest.raises(UsageError, match="--dynamo_backend aot_eager: this loop compiles by inductor or not"):
        launchers.accelerate_flags(RunConfig(), {"ACCELERATE_DYNAMO_BACKEND": "AOT_EAGER"})
    assert launchers.accelerate_flags(RunConfig(), {"ACCELERATE_USE_FSDP": "true"}).parallel == "fsdp"
    assert launchers.accelerate_flags(RunConfig(parallel="fsdp"), {"ACCELERATE_USE_FSDP": "true"}).parallel == "fsdp"
    with pytest.raises(UsageError, match="accelerate launch --use_fsdp but run.parallel=ddp: drop one of them"):
        launchers.accelerate_flags(RunConfig(parallel="ddp"), {"ACCELERATE_USE_FSDP": "true"})


def test_a_rank_has_peers_under_each_launcher_and_a_single_process_or_nonsense_has_none():
    """cli.leave's question: a failing rank of several exits the usual way (see tests/test_cli_errors.py)."""
    for env in (TORCHRUN, SRUN, OPEN_MPI):
        assert launchers.has_peers(env), env
    one_rank = {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    assert not launchers.has_peers({}) and not launchers.has_peers(one_rank)
    assert not launchers.has_peers({**TORCHRUN, "RANK": "x"})  # unknown (a usage error of its own): no


def test_the_cpus_a_process_may_use_are_its_cgroups_quota_at_most(tmp_path, monkeypatch):
    """cpus.cgroup_quota from /proc/self/cgroup and mountinfo (here written by hand): cgroup v2's cpu.max and v1's
    cpu.cfs_quota_us, the least of the process's cgroup and those above it; a container that sees its own cgroup at
    the mount's root (no cgroup namespace: /proc/self/cgroup names the host's path); none set, or none readable."""
    proc, fs = tmp_path / "proc", tmp_path / "fs"
    proc.mkdir()

    def write(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def mounts(*lines: str) -> None:
        write(proc / "mountinfo", "".join(f"{n} 1 0:{n} {line}\n" for n, line in enumerate(lines, 30)))

    write(proc / "cgroup", "0::/kubepods/pod1/ctr\n")  # cgroup v2: the pod's limit above the container's none
    mounts(f"/ {tmp_path}/elsewhere rw - ext4 /dev/sda rw", f"/ {fs} rw,nosuid - cgroup2 cgroup2 rw")
    write(fs / "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    write(fs / "kubepods/pod1/cpu.max", "150000 100000\n")
    write(fs / "cpu.max", "max 100000\n")
    assert cpus.cgroup_quota(proc) == 1.5
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpus.usable(proc) == 2 and cpus.threads(2, proc) == 1 and cpus.threads(4, proc) == 1  # 1.5 rounded up
    write(fs / "kubepods/pod1/ctr/cpu.max", "50000 100000\n")
    assert cpus.cgroup_quota(proc) == 0.5 and cpus.usable(proc) == 1
    write(fs / "kubepods/pod1/cpu.max", "max 100000\n")
    write(fs / "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    assert cpus.cgroup_quota(proc) is None and cpus.usable(proc) == 8  # no quota: the affinity's
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    write(fs / "kubepods/pod1/ctr/cpu.max", "400000 100000\n")
    assert cpus.usable(proc) == 2  # a quota above the affinity: the affinity's

    v1 = tmp_path / "v1"  # cgroup v1, the container's own cgroup mounted at the root, its host path in /proc
    write(proc / "cgroup", "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n0::/\n")
    memory = tmp_path / "memory"
    mounts(f"/docker/abc {v1} rw - cgroup cgroup rw,cpu,cpuacct", f"/docker/abc {memory} rw - cgroup cgroup rw,memory")
    write(v1 / "cpu.cfs_quota_us", "200000\n")
    write(v1 / "cpu.cfs_period_us", "100000\n")
    assert cpus.cgroup_quota(proc) == 2.0
    write(v1 / "cpu.cfs_quota_us", "-1\n")
    assert cpus.cgroup_quota(proc) is None
    for quota, period in (("abc", "100000"), ("100000", "0"), ("", "")):  # a file that lies: no quota is known
        write(v1 / "cpu.cfs_quota_us", quota)
        write(v1 / "cpu.cfs_period_us", period)
        assert cpus.cgroup_quota(proc) is None
    (proc / "cgroup").unlink()
    assert cpus.cgroup_quota(proc) is None  # no /proc: no quota


def test_a_process_takes_its_share_of_the_cpus_unless_omp_num_threads_says(monkeypatch):
    """devices.share_cpus: the CPUs it may use over the processes on this machine, never more than torch's default
    and never with OMP_NUM_THREADS set (torchrun sets 1 for its ranks, the launch files their share)."""
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(cpus, "usable", lambda proc=None: 3)
    try:
        torch.set_num_threads(2)
        assert devices.share_cpus(RunConfig(), {}) == 2  # 3 CPUs, 1 process: torch's 2
        assert devices.share_cpus(RunConfig(), {**TORCHRUN, "LOCAL_WORLD_SIZE": "2"}) == 1  # 3 // 2
        torch.set_num_threads(2)
        assert devices.share_cpus(RunConfig(), {"OMP_NUM_THREADS": "2"}) == 2  # said: as it is
    finally:
        torch.set_num_threads(before)
    # An OMP_NUM_THREADS exported in the shell, more threads than CPUs for this machine's processes: a note at the
    # start (2 ranks of 2 threads on 2 CPUs: 806 img/s where 1 thread each made ~2,200, seen with ddp/torchrun.py)
    cpu, two = torch.device("cpu"), {**TORCHRUN, "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "2"}
    said = "OMP_NUM_THREADS=2: 2 threads in each of 2 process(es) on this machine, which may use 3 CPUs: they take"
    assert devices.oversubscribed(RunConfig(), cpu, two, threads=2).startswith(said)
    assert devices.oversubscribed(RunConfig(), cpu, {**two, "OMP_NUM_THREADS": "1"}, threads=1) is None  # 2 on 3
    assert devices.oversubscribed(RunConfig(), cpu, {"OMP_NUM_THREADS": "3"}, threads=3) is None  # one process
    four = {**two, "LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}  # more processes than CPUs: not the threads'
    assert devices.oversubscribed(RunConfig(), cpu, four, threads=1) is None
    assert devices.oversubscribed(RunConfig(), cpu, {k: v for k, v in two.items() if k != "OMP_NUM_THREADS"}, 2) is None
    assert devices.oversubscribed(RunConfig(), torch.device("cuda", 0), two, threads=2) is None  # the GPU's work


MPIRUN_BOX = b"-" * 74 + b"\n"
EXIT_75 = MPIRUN_BOX + b"Primary job  terminated normally, but 1 process returned\na non-zero exit code.\n" + MPIRUN_BOX
KILLED = MPIRUN_BOX + b"mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9.\n" + MPIRUN_BOX
ON_SIGINT = MPIRUN_BOX + b"mpirun noticed that process rank 0 with PID 0 on node vm exited on signal 2 (Interrupt).\n"


@pytest.mark.parametrize("stops", [[], [2]])
def test_mpiruns_boxes_of_a_non_zero_exit_are_left_out_after_a_stop_signal_and_nothing_else(stops, capfdbinary):
    """ddp/accelerate_launch.py relays mpirun's stderr (the ranks' too). After a stop signal it sent the ranks,
    the boxes that say a rank ended non-zero (their exit 75) or on that signal (a rank still in its imports) are left
    out; every other line stays, in its order: a rank killed by another signal as one line of ours, a rank's line of
    dashes that opens no box that closes (kept at the end)."""
    from ddp import accelerate_launch

    rank_line = b"stopping on SIGINT: checkpoint runs/x/checkpoints/step-000000012.pt\n"
    on_sigint = ON_SIGINT + MPIRUN_BOX
    stream = io.BytesIO(rank_line + EXIT_75 + on_sigint + KILLED + b"after\n" + MPIRUN_BOX + b"a rank's own table\n")
    seen = accelerate_launch.Seen(stops=stops)
    accelerate_launch._relay(stream, seen)
    sigint = b"" if stops else b"error: rank 0 was killed by SIGINT\n"
    killed = b"error: rank 1 was killed by SIGKILL\nafter\n"
    table = MPIRUN_BOX + b"a rank's own table\n"
    assert capfdbinary.readouterr().err == rank_line + sigint + killed + table + (b"" if stops else EXIT_75)
    assert seen.killed == signal.SIGKILL


def test_mpiruns_boxes_of_a_non_zero_exit_are_left_out_where_a_ranks_line_said_why_before_or_after_them(capfdbinary):
    """A rank out of memory said why (`error: rank 1 of 2: out of memory ...`), and so did the rank it left; Open
    MPI's two boxes that ranks ended non-zero came between and after their lines. A box may come before the line of
    the rank whose exit it is (mpirun saw the exit before the line came through): each is held to the end."""
    from ddp import accelerate_launch

    lines = b"error: rank 1 of 2: out of memory\n", b"error: rank 0 of 2: lost contact with rank 1\n"
    accelerate_launch._relay(io.BytesIO(EXIT_75 + lines[0] + EXIT_75 + lines[1]), accelerate_launch.Seen())
    assert capfdbinary.readouterr().err == b"".join(lines)
    accelerate_launch._relay(io.BytesIO(b"a rank's line\n" + EXIT_75), accelerate_launch.Seen())  # no line of ours
    assert capfdbinary.readouterr().err == b"a rank's line\n" + EXIT_75


HYDRA_RULE = b"=" * 83 + b"\n"
HYDRA_BOX = (b"\n" + HYDRA_RULE + b"=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n=   PID 29169 RUNNING AT "
             b"localhost\n=   EXIT CODE: 9\n=   CLEANING UP REMAINING PROCESSES\n=   YOU CAN IGNORE THE BELOW CLEANUP "
             b"MESSAGES\n" + HYDRA_RULE + b"YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)\n"
             b"This typically refers to a problem with your application.\nPlease see the FAQ page for debugging "
             b"suggestions\n")  # fmt: skip


@pytest.mark.parametrize("stops", [[], [signal.SIGKILL]])
def test_mpichs_box_of_a_killed_rank_is_one_line_and_its_exit_code_the_signals(stops, capfdbinary):
    """MPICH's mpirun (Hydra) said that a rank was killed in a box on stdout, with its blank line before it, and exited
    with the signal's number (9), which accelerate_launch passed on: the box is now one line on stderr, as Open MPI's
    is, and the exit code 128 + 9 (seen.killed). The ranks' own blank lines and rules of '=' stay; after a stop by
    that signal the box goes without a line. The rank's number where its pid was seen (`seen.ranks`)."""
    from ddp import accelerate_launch

    ranks = (b"epoch 1/2\n\n" + HYDRA_RULE + b"a rank's table\n\n\n" + HYDRA_RULE + b"=   a rank's box\n" + HYDRA_RULE +
             b"end\n" + HYDRA_RULE + HYDRA_RULE + b"\n")  # fmt: skip
    seen = accelerate_launch.Seen(stops=stops)
    accelerate_launch._relay_hydra(io.BytesIO(ranks + HYDRA_BOX), seen)
    out, err = capfdbinary.readouterr()
    assert out == ranks
    said = b"error: a rank (pid 29169) was killed by SIGKILL, the first end MPICH's mpirun saw; it ended the others\n"
    assert err == (b"" if stops else said)
    assert seen.killed == (0 if stops else signal.SIGKILL)
    accelerate_launch._relay_hydra(io.BytesIO(b"x\n" + HYDRA_RULE), accelerate_launch.Seen())  # no box: kept
    assert capfdbinary.readouterr().out == b"x\n" + HYDRA_RULE
    accelerate_launch._relay_hydra(io.BytesIO(HYDRA_BOX), accelerate_launch.Seen(ranks={29169: 1}))  # (its PMI_RANK)
    assert capfdbinary.readouterr().err == said.replace(b"a rank (pid", b"rank 1 (pid")


def test_intel_mpis_box_of_a_killed_rank_is_one_line_naming_the_rank_and_its_exit_code_the_signals(capfdbinary):
    """Intel MPI's mpirun (its Hydra) boxes a killed rank otherwise than MPICH's (the rank, its pid, "KILLED BY
    SIGNAL") and exits 255: the box was passed on as it was, and exit 255. Now one line, and 128 + 9 (seen.killed)."""
    from ddp import accelerate_launch

    box = (b"\n" + HYDRA_RULE + b"=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n=   RANK 1 PID 17922 "
           b"RUNNING AT localhost\n=   KILLED BY SIGNAL: 9 (Killed)\n" + HYDRA_RULE)  # fmt: skip
    seen = accelerate_launch.Seen()
    accelerate_launch._relay_hydra(io.BytesIO(b"epoch 1/2\n" + box), seen)
    assert capfdbinary.readouterr() == (b"epoch 1/2\n", b"error: rank 1 (pid 17922) was killed by SIGKILL, the first "
                                        b"end Intel MPI's mpirun saw; it ended the others\n")  # fmt: skip
    assert seen.killed == signal.SIGKILL


def test_the_ranks_below_mpirun_are_found_as_its_children_or_below_a_proxy(tmp_path):
    """The ranks a stop signal is sent to: mpirun's children (Open MPI), or its proxy's (MPICH's hydra_pmi_proxy:
    the Ctrl-C sent to the proxy ended it, and the ranks trained on). A rank's own children are not ranks, nor is
    an MPI launcher whose arguments name the script: Intel MPI's mpirun (a shell script) starts mpiexec.hydra so,
    which took the Ctrl-C as its own ("Press Ctrl-C again to force abort": a second one ended the ranks unsaved)."""
    rank = "sh -c 'sleep 60; :' rank /x/train.py"  # (`; :`: sh stays, its command line naming the script)
    (tmp_path / "hydra.sh").write_text(f"{rank} &\nwait\n:\n")  # its child: the rank
    hydra = f"bash -c 'exec -a mpiexec.hydra sh {tmp_path / 'hydra.sh'} /x/train.py'"
    tree = tmp_path / "tree.sh"
    tree.write_text(f"{rank} &\nsh -c \"{rank} & wait; :\" proxy &\nsh -c 'sleep 60; :' other &\n{hydra} &\nwait\n")
    top = subprocess.Popen(["sh", str(tree)], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(found := processes.nearest_running(top.pid, "/x/train.py")) < 3:
            assert time.monotonic() < deadline, found
            time.sleep(0.05)
        time.sleep(0.2)  # (nothing more comes)
        found = processes.nearest_running(top.pid, "/x/train.py")
        words = [processes.command_line(pid) for pid in found]
        assert len(found) == 3 and all(w[-2:] == ["rank", "/x/train.py"] for w in words), words
        assert processes.nearest_running(top.pid, "/x/train.py", depth=1) == found[:1]  # (mpirun's own child)
        assert processes.nearest_running(top.pid, "/y/train.py") == []
    finally:
        os.killpg(top.pid, signal.SIGKILL)
        top.wait()


def test_a_rank_is_the_kernels_first_choice_for_its_out_of_memory_killer_up_to_the_files_limit(tmp_path, monkeypatch):
    """oom_score_adj rises by OOM_FIRST, to 1000 at most; a file that is not there (no /proc: macOS), cannot be read
    or says no number changes nothing and is no error."""
    monkeypatch.setattr(processes, "PROC", tmp_path)
    (tmp_path / "self").mkdir()
    processes.first_for_the_oom_killer()  # (no file)
    adj = tmp_path / "self" / "oom_score_adj"
    for before, after in (("0\n", "500"), ("-300\n", "200"), ("900", "1000")):
        adj.write_text(before)
        processes.first_for_the_oom_killer()
        assert adj.read_text() == after
    adj.write_text("not a number")
    processes.first_for_the_oom_killer()
    assert adj.read_text() == "not a number"
    adj.unlink()
    adj.mkdir()  # (an OSError of its own)
    processes.first_for_the_oom_killer()


PLAIN_MPI = [  # `mpirun -n 2 python ddp/train.py`, rank 1: Open MPI's, MPICH's (Hydra)
    {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
    {"PMI_RANK": "1", "MPI_LOCALRANKID": "1", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "2"},
]


@pytest.mark.parametrize("env", PLAIN_MPI)
def test_plain_mpirun_is_one_line_naming_the_launchers_that_work_said_by_its_local_rank_0(env):
    """Each process of a plain mpirun ran alone: the second found the out_dir "in use by another run" (the first).
    The same with a SLURM step's variables beside them (mpirun inside an allocation). One process is a run."""
    for extra in ({}, {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                       "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"}):  # fmt: skip
        with pytest.raises(UsageError, match=r"^mpirun started 2 processes, .*--nproc_per_node=2 .*NPROC=2 bash"):
            launchers.detect_launch({**env, **extra})
    assert not launchers.speaks_for_its_machine(env) and launchers.has_peers(env)  # it waits for local rank 0
    rank_0 = {k: "0" if "RANK" in k else v for k, v in env.items()}
    assert launchers.speaks_for_its_machine(rank_0)
    alone = {k: "1" if "SIZE" in k or "NRANKS" in k else "0" for k in env}  # mpirun -n 1
    assert launchers.detect_launch(alone) == launchers.Launch("none", 0, 0, 1) and not launchers.has_peers(alone)
    assert launchers.detect_launch(env, "none").launcher == "none"


def test_srun_with_slurms_pmi2_is_slurms_launch_not_mpiruns():
    """`srun --mpi=pmi2` (a cluster's MpiDefault=pmi2) gives each task PMI_RANK and PMI_SIZE, without MPICH's
    MPI_LOCALRANKID: every task ended in a KeyError's traceback (seen under this machine's SLURM)."""
    task = {"PMI_FD": "11", "PMI_JOBID": "168.0", "PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_JOB_ID": "168",
            "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2"}  # fmt: skip
    launch = launchers.detect_launch(task)
    assert (launch.launcher, launch.rank, launch.local_rank, launch.world_size) == ("slurm", 1, 1, 2)
    assert not launchers.speaks_for_its_machine(task)
    assert launchers.detect_launch({"PMI_RANK": "0", "PMI_SIZE": "2"}).launcher == "none"  # (no srun: one process)


def test_an_agents_ranks_are_finished_when_each_of_them_left_its_mark(tmp_path):
    """launchers.record_finished under ddp/torchrun.py's agent (its FINISHED_DIR named): all_finished once every one
    of LOCAL_WORLD_SIZE ranks has marked; never elsewhere, and a folder that is gone is no error."""
    env = {launchers.FINISHED_DIR: str(tmp_path), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    assert not launchers.all_finished(tmp_path)
    launchers.record_finished(env)
    assert not launchers.all_finished(tmp_path)  # one of two
    launchers.record_finished({**env, "LOCAL_RANK": "1"})
    assert launchers.all_finished(tmp_path)
    launchers.record_finished({**env, launchers.FINISHED_DIR: str(tmp_path / "gone")})  # (no mark, no error)
    launchers.record_finished({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})  # not under that agent: nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local-rank-0", "local-rank-1"]
