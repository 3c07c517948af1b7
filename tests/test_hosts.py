"""Several machines for real: hosts made of network namespaces (tests/hosts.py), each with its own
address, hostname and /etc/hosts, no route out; launch/multinode.sh on each, as a user runs it.
The failures of real clusters end with one line, in bounded time, and the run resumes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
import yaml
from conftest import (
    BIN,
    REPO,
    REPORT,
    TINY,
    TORCHRUN,
    TRAIN,
    assert_free_and_whole,
    clean_env,
    cmdline,
    kill_orphans,
    max_diff,
    memory_cgroup,
    metrics,
    require,
    running,
    torchrun_shares_its_store,
    wait_for_checkpoint,
)
from hosts import Host, hosts
from slurm_hosts import slurm_cluster

from ddp import checkpoint, rundir

PORT = "29400"
# 1024 images, global batch 32: 32 steps an epoch; a checkpoint every 8.
JOB = [*TINY, "data.synthetic_train=1024", "train.epochs=3", "run.save_every_steps=8"]


def multinode(host: Host, node_rank: int, master: Host | str, *args: str, nnodes: int = 2, nproc: int = 1):
    """launch/multinode.sh on `host` as node `node_rank`, MASTER_ADDR by name."""
    name = master.name if isinstance(master, Host) else master
    env = clean_env(NNODES=str(nnodes), NODE_RANK=str(node_rank), MASTER_ADDR=name, MASTER_PORT=PORT,
                    NPROC=str(nproc))  # fmt: skip
    return host.popen(["bash", "launch/multinode.sh", *args], REPO, env)


def store_up(master: Host, node0: subprocess.Popen, port: str = PORT, timeout: float = 120) -> subprocess.Popen:
    """`node0` (the launcher on `master`) once its rendezvous store listens. A node started beside it waits
    only run.timeout_s for the store (launch/multinode.sh's preflight), and the tests' short run.timeout_s
    is less than node 0 can take to start torchrun on a loaded machine (seen: over 8 s at 3 test workers)."""
    deadline = time.monotonic() + timeout
    while not master.listens(int(port)):
        if node0.poll() is not None or time.monotonic() > deadline:
            node0.kill()
            raise AssertionError(f"no store on {master.name}:{port} within {timeout:.0f} s: {node0.communicate()}")
        time.sleep(0.05)
    return node0


def finish(*procs: subprocess.Popen, timeout: float = 180) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each, in order. One that runs past `timeout`: every one's processes
    (each in a session of its own) as they ran, then killed, and every one's output in the failure: a job
    that hung on one host showed only the first host's launcher's output, which said nothing."""
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            running = subprocess.run(
                ["ps", "-o", "pid,sid,stat,etime,args", "--sort", "sid", "-s", ",".join(str(p.pid) for p in procs)],
                capture_output=True,
                text=True,
            ).stdout
            for other in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(other.pid, signal.SIGKILL)
            said = [(p.communicate(), p.returncode) for p in procs]
            said = [f"--- {i} (exit {code}): stdout\n{out[-1500:]}--- stderr\n{err[-3000:]}" for i, ((out, err), code)
                    in enumerate(said)]  # fmt: skip
            raise AssertionError(f"{timeout:.0f} s passed; running then:\n{running}" + "\n".join(said)) from None
        results.append((proc.returncode, out, err))
    return results


def ok_all(results: list[tuple[int, str, str]]) -> None:
    for code, out, err in results:
        assert code == 0, f"exit {code}\n--- stdout\n{out[-2000:]}\n--- stderr\n{err[-3000:]}"


def test_two_hosts_two_ranks_each_by_name_then_resumed_on_one(tmp_path):
    """World size 4 across 2 hosts (rendezvous at h0 by name): each test image counted once, the
    checkpoint whole; the same run then continues on h0 alone (2 ranks, same global batch).
    Each host has its own name on 127.0.1.1, as Debian and Ubuntu write /etc/hosts: gloo would
    advertise that address and the other host could not reach it. Each says which interface it uses.
    First h1 is given a data.path it has not: its preflight stops it, and h0, waiting for it at the rendezvous,
    ends with h1's line (torchrun waited out its 600 s join timeout in silence)."""
    out = tmp_path / "run"
    with hosts(2, loopback_names=(0, 1)) as (h0, h1):
        args = [*TINY, f"run.out_dir={out}"]
        node0 = store_up(h0, multinode(h0, 0, h0, *args))
        missing = ["data.dataset=npz", f"data.path={tmp_path / 'not-on-h1.npz'}"]
        (code1, _, err1), (code0, _, err0) = finish(multinode(h1, 1, h0, *args, *missing), node0, timeout=60)
        line = f"data.path={tmp_path / 'not-on-h1.npz'}: no such file"
        assert code1 == code0 == 2 and err1 == f"error: {line}\n", (err0, err1)
        assert err0.endswith(f"error: {h1.name}, a machine of this job, stopped before it began: {line}\n"), err0
        results = finish(multinode(h0, 0, h0, *args, nproc=2), multinode(h1, 1, h0, *args, nproc=2))
        ok_all(results)
        for (_, stdout, _), host in zip(results, (h0, h1)):
            assert f"{host.name} resolves to 127.0.1.1: gloo/nccl use eth0 ({host.address})" in stdout
        assert "--nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d" in results[1][2]
        assert "launcher=torchrun parallel=ddp world_size=4" in results[0][1]
        assert [(m["world_size"], m["test_images"]) for m in metrics(out)] == [(4, 101), (4, 101)]
        checkpoint.load(rundir.last_path(out))
        (code, stdout, err), = finish(multinode(h0, 0, h0, *args, "train.epochs=3", nnodes=1, nproc=2))  # fmt: skip
        assert code == 0, err[-3000:]
    assert "saved at world_size 4, now 2; same global batch 32" in stdout
    assert [m["world_size"] for m in metrics(out)] == [4, 4, 2]


def test_an_ipv6_only_cluster_by_address_and_by_name(tmp_path):
    """Hosts whose only addresses are IPv6 (each name on 127.0.1.1 too, as Debian writes it): launch/multinode.sh
    with MASTER_ADDR an IPv6 address, bare or in brackets, or a name that resolves to one. Before, the preflight
    refused each ("does not resolve", "no IPv4 address"), though torchrun and gloo take them. A mistake of h1's
    reaches h0 through the store at that address; then a run across them, each test image counted once."""
    out = tmp_path / "run"
    with hosts(2, loopback_names=(0, 1), ipv6=True) as (h0, h1):
        args = [*TINY, f"run.out_dir={out}", "train.epochs=1"]
        node0 = store_up(h0, multinode(h0, 0, h0.address, *args))
        missing = ["data.dataset=npz", f"data.path={tmp_path / 'not-on-h1.npz'}"]
        (code1, _, err1), (code0, _, err0) = finish(multinode(h1, 1, f"[{h0.address}]", *args, *missing), node0)
        line = f"data.path={tmp_path / 'not-on-h1.npz'}: no such file"
        assert code1 == code0 == 2 and err1 == f"error: {line}\n", (err0, err1)
        assert err0.endswith(f"error: {h1.name}, a machine of this job, stopped before it began: {line}\n"), err0
        results = finish(multinode(h0, 0, h0.name, *args), multinode(h1, 1, h0.address, *args))
    ok_all(results)
    for (_, stdout, _), host in zip(results, (h0, h1)):
        assert f"{host.name} resolves to 127.0.1.1: gloo/nccl use eth0 ({host.address})" in stdout
    assert f"--rdzv_endpoint=[{h0.address}]:{PORT}" in results[1][2]
    assert [(m["world_size"], m["test_images"]) for m in metrics(out)] == [(2, 101)]


def test_a_rank_the_kernel_kills_for_memory_on_another_host_is_said_to_be_so_there(tmp_path):
    """Rank 3 on h1 takes memory until the kernel kills it (h1's job in a memory cgroup of 2.5 GB). The ranks on h0
    said only "its connection closed: it died": the count of out-of-memory kills is h1's. Rank 2, beside it on h1,
    now leaves that count at the store as it loses it, and the ranks on h0 say it."""
    args = [*TINY, f"run.out_dir={tmp_path}", "run.timeout_s=20"]
    with hosts(2) as (h0, h1), memory_cgroup(5 << 29) as procs:
        node0 = store_up(h0, multinode(h0, 0, h0, *args, nproc=2))
        env = clean_env(NNODES="2", NODE_RANK="1", MASTER_ADDR=h0.name, MASTER_PORT=PORT, NPROC="2",
                        DDP_CIFAR_FAULT="memory:3:r3")  # fmt: skip
        node1 = h1.popen(["bash", "launch/multinode.sh", *args], REPO, env, cgroup=procs)
        (code0, _, err0), (code1, _, err1) = finish(node0, node1, timeout=120)
    assert code0 != 0 and code1 == 128 + 9, (err0[-3000:], err1[-3000:])
    assert re.search(r"rank 3 \(pid \d+\) was killed by SIGKILL: out of memory, most likely", err1), err1[-3000:]
    said = (
        rf"the kernel's out-of-memory killer ended \d+ process(es)? on {h1.name} meanwhile \(dmesg on {h1.name} names"
    )
    lines = [line for line in err0.splitlines() if re.search(rf"lost contact with rank .*3 on {h1.name} ", line)]
    assert lines and all(re.search(rf"\(its connection closed: it died; (.*; )?{said}", ln) for ln in lines), err0


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_a_master_that_does_not_resolve_answer_or_let_through_is_one_line_in_bounded_time(tmp_path):
    """torchrun waits without end in each of these (seen: over a minute); launch/multinode.sh's
    check before it ends each with one line naming the cause and the fix."""
    args = [*TINY, f"run.out_dir={tmp_path}", "run.timeout_s=4"]
    seen = []
    with hosts(2) as (h0, h1):
        for case in ("a name that does not resolve", "nobody listens", "a firewall drops the port"):
            node0 = None
            if case == "a firewall drops the port":
                require("iptables", "apt-get install iptables")
                h0.run(["iptables", "-A", "INPUT", "-p", "tcp", "--dport", PORT, "-j", "DROP"], REPO, clean_env())
                node0 = multinode(h0, 0, h0, *args)
            started = time.monotonic()
            master = "nosuchhost" if case.startswith("a name") else h0
            (code, _, err), = finish(multinode(h1, 1, master, *args), timeout=60)  # fmt: skip
            seconds = time.monotonic() - started
            if node0:
                node0.kill()
            line = one_error_line(err)
            seen.append(f"{case}: exit {code} after {seconds:.1f} s")
            if case.startswith("a name"):
                assert code == 2 and "MASTER_ADDR=nosuchhost does not resolve on" in line
            else:
                assert code == 1 and f"MASTER_ADDR={h0.name}:{PORT} (10.250.0.1) did not answer" in line
                assert ("Connection refused" if case == "nobody listens" else "a firewall") in line, line
                assert seconds < 4 + 15
    REPORT.append("before torchrun, from node 1: " + "; ".join(seen))


def lose_h1(h0: Host, h1: Host, procs: list[subprocess.Popen], out, timeout_s: int, cut: bool):
    """Once training is under way, h1 is lost: its link goes down (`cut`) or every process on it is
    killed. The rank on each host must leave within run.timeout_s + 20 s and each host's launcher
    (torchrun's agent included) within run.timeout_s + 30 s, non-zero; every checkpoint is whole. Then
    h1 comes back, with nothing of the job left on it. Returns (seconds until each host's rank left,
    (exit code, seconds) of each launcher, each launcher's stderr)."""
    wait_for_checkpoint(out, procs)
    ranks = {
        h.name: [p for p in h.pids() if b"ddp/train.py" in cmdline(p) and b"torchrun" not in cmdline(p)]
        for h in (h0, h1)
    }  # fmt: skip (not torchrun's agents: a cut-off one waits on its store in the kernel)
    if cut:
        h1.link(False)
    else:
        kill_orphans(h1.pids())
    lost, left = time.monotonic(), {}
    while len(left) < 2:
        for name, pids in ranks.items():
            if name not in left and not any(running(pid) for pid in pids):
                left[name] = time.monotonic() - lost
        assert time.monotonic() - lost < timeout_s + 20, f"still running {timeout_s + 20} s after: {left}"
        time.sleep(0.1)
    launchers_left = []  # each host's launch, torchrun's agent included: gone on its own (a cut-off one
    for proc in procs:  # waited minutes on the store on h0, ddp/torchrun.py ends it after its ranks)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, lost + timeout_s + 30 - time.monotonic()))
        launchers_left.append((proc.returncode, time.monotonic() - lost))
        proc.kill()
    errors = [proc.communicate(timeout=30)[1] for proc in procs]
    assert all(code not in (None, 0) for code, _ in launchers_left), (launchers_left, errors[1][-3000:])
    for path in rundir.step_files(out):
        checkpoint.load(path)
    h1.link(True)
    back = time.monotonic()
    while any(running(pid) for pid in h1.pids()):  # h1's torchrun agent: its store connection breaks now
        assert time.monotonic() - back < 60, "h1's torchrun still waits a minute after its link came back"
        time.sleep(0.1)
    return left, launchers_left, errors


def test_a_host_cut_off_mid_training_every_rank_and_launcher_leaves_and_leaves_a_run_to_resume(tmp_path):
    """h1's link goes down: the rank on h0 leaves within run.timeout_s naming rank 1 and its host; the
    rank on h1 leaves too, saying it is cut off, and its launcher after it; with h1 back, nothing of
    the run is left on either host, the run's lock is free and every checkpoint whole: what the same
    command needs to resume (the Kubernetes test below resumes after h1's processes are killed)."""
    out, timeout_s = tmp_path / "run", 8
    args = [*JOB, f"run.out_dir={out}", f"run.timeout_s={timeout_s}"]
    with hosts(2) as (h0, h1):
        procs = [store_up(h0, multinode(h0, 0, h0, *args)), multinode(h1, 1, h0, *args)]
        left, launchers_left, errors = lose_h1(h0, h1, procs, out, timeout_s, cut=True)
        assert not [pid for pid in h0.pids() if running(pid)]
    assert_free_and_whole(out)
    assert f"error: rank 0 of 2: lost contact with rank 1 on {h1.name} (no answer within run.timeout_s=8" \
           in errors[0], errors[0][-4000:]  # fmt: skip
    cut_off = (f"the other ranks (the rendezvous store does not answer either: is {h1.name} cut off?)" if
               torchrun_shares_its_store() else "rank 0 (no answer within run.timeout_s=8: hung)")  # fmt: skip
    assert f"error: rank 1 of 2: lost contact with {cut_off}" in errors[1], errors[1]
    assert f"error: torchrun's agent on {h1.name}: its rendezvous store {h0.name}:" in errors[1]
    assert f"does not answer 5 s after its ranks ended (is {h1.name} cut off?): left" in errors[1]
    REPORT.append(f"h1's link down mid-training (run.timeout_s={timeout_s}): the rank on h0 left after "
                  f"{left[h0.name]:.1f} s, the rank on h1 after {left[h1.name]:.1f} s; the launchers after "
                  f"{launchers_left[0][1]:.1f} and {launchers_left[1][1]:.1f} s")  # fmt: skip


def test_the_doctor_before_a_launch_finds_a_master_that_does_not_resolve(tmp_path):
    with hosts(1) as (h0,):
        proc = h0.run([sys.executable, "-m", "ddp.doctor", f"run.out_dir={tmp_path}", f"data.root={tmp_path}/d"], REPO,
                      clean_env(MASTER_ADDR="nosuchhost", MASTER_PORT=PORT))  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert f"doctor: PROBLEM: MASTER_ADDR=nosuchhost does not resolve on {h0.name}" in proc.stderr
    # a host with no route out, as a cluster's compute node without internet: CIFAR's download would fail there
    assert (f"doctor: PROBLEM: CIFAR-10 is not in data.root={tmp_path}/d, and this machine cannot download it: "
            "https://") in proc.stderr  # fmt: skip
    assert "network: eth0 (10.250.0.1, this host's name)" in proc.stdout


def test_the_doctor_across_two_hosts_shows_each_ranks_host_and_interface(tmp_path):
    """`torchrun -m ddp.doctor` on 2 hosts, one of them with its own name on 127.0.1.1: rank 0 reports
    every rank's host and the interface and address gloo uses there, and the all_reduce across them."""
    with hosts(2, loopback_names=(1,)) as (h0, h1):
        procs = []
        for host in (h0, h1):
            cmd = [str(BIN / "torchrun"), "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint={h0.name}:{PORT}", "--rdzv_id=doctor", f"--rdzv_conf=is_host={host is h0}",
                   "-m", "ddp.doctor", f"run.out_dir={tmp_path}", "data.dataset=synthetic"]  # fmt: skip
            procs.append(host.popen(cmd, REPO, clean_env()))
        results = finish(*procs, timeout=120)
    ok_all(results)
    report = results[0][1]
    assert f"rank 0/2  local_rank 0  host {h0.name}" in report and f"rank 1/2  local_rank 0  host {h1.name}" in report
    assert f"network: eth0 ({h0.address}, this host's name)" in report
    assert f"network: eth0 ({h1.address}, GLOO_SOCKET_IFNAME)" in report  # picked: its name is loopback
    assert "all_reduce over 2 ranks (gloo): 1 (expected 1)" in report and "doctor: OK" in report


def test_accelerate_multi_machine_config_on_two_hosts(tmp_path):
    """launch/accelerate/multi-machine.yaml through launch/accelerate.sh on each host, MASTER_ADDR by name."""
    config = "launch/accelerate/multi-machine.yaml"
    with hosts(2) as (h0, h1):
        procs = []
        for rank, host in enumerate((h0, h1)):
            env = clean_env(ACCELERATE_CONFIG=config, NUM_MACHINES="2", MACHINE_RANK=str(rank), MASTER_ADDR=h0.name,
                            MASTER_PORT=PORT, NPROC="1")  # fmt: skip
            args = [*TINY, "train.epochs=1", f"run.out_dir={tmp_path}"]
            procs.append(host.popen(["bash", "launch/accelerate.sh", *args], REPO, env))
        results = finish(*procs)
    ok_all(results)
    assert f"--config_file {config} --num_machines 2" in results[1][2]
    assert f"--main_process_ip {h0.name}" in results[1][2]
    assert "launcher=accelerate parallel=ddp world_size=2" in results[0][1]
    assert metrics(tmp_path)[-1]["world_size"] == 2


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> Iterator[tuple[list[Host], dict[str, str]]]:
    """Two hosts and a SLURM cluster over them (slurmctld on the first, a slurmd on each)."""
    with hosts(2) as made, slurm_cluster(made, tmp_path_factory.mktemp("slurm")) as env:
        yield made, env


def slurm_job_state(host: Host, env: dict[str, str], job: str, name: str) -> str:
    shown = subprocess.run(host.command(["scontrol", "show", "job", job]), env=env, capture_output=True, text=True)
    return next((w.split("=", 1)[1] for w in shown.stdout.split() if w.startswith(f"{name}=")), "")


def test_srun_on_two_nodes_two_tasks_each_is_one_job_of_4_ranks(two_nodes, tmp_path):
    (h0, _), env = two_nodes
    cmd = ["srun", "--nodes=2", "--ntasks-per-node=2", "python", str(TRAIN), *TINY, f"run.out_dir={tmp_path}"]
    proc = subprocess.run(h0.command(cmd), cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "launcher=slurm parallel=ddp world_size=4" in proc.stdout
    assert [(m["world_size"], m["test_images"]) for m in metrics(tmp_path)] == [(4, 101), (4, 101)]


def test_sbatch_on_two_nodes_stopped_requeued_ends_with_the_weights_of_an_uninterrupted_run(two_nodes, tmp_path):
    """sbatch --nodes=2 slurm/train.sh: one torchrun per node, the rendezvous on the first node by
    name. A stop signal (what --signal=TERM@120 does before the time limit, and SLURM on preemption:
    SIGTERM to every process of the job) checkpoints and requeues the job, with no traceback; it
    resumes, runs each epoch once, and ends bitwise where an uninterrupted run on this machine ends."""
    (h0, _), env = two_nodes
    args = [*TINY, "data.synthetic_train=1024", "train.epochs=4", "run.save_every_steps=10"]  # 128 steps
    submitted = subprocess.run(h0.command(["sbatch", "--parsable", "--nodes=2", f"--output={tmp_path}/log-%j.out",
                                           "slurm/train.sh", *args]),
                               cwd=REPO, env={**env, "OUT_ROOT": str(tmp_path), "NPROC": "1"}, capture_output=True,
                               text=True, timeout=60)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    out, deadline = tmp_path / f"slurm-{job}", time.monotonic() + 120
    while not list((out / "checkpoints").glob("step-*.pt")):
        assert time.monotonic() < deadline, f"no checkpoint after 120 s: {slurm_job_state(h0, env, job, 'JobState')}"
        time.sleep(0.2)
    subprocess.run(h0.command(["scancel", "--signal=TERM", job]), env=env, check=True, capture_output=True)
    reference = tmp_path / "uninterrupted"  # trained here while SLURM holds the requeued job back (10 s)
    uninterrupted = subprocess.Popen([TORCHRUN, "--standalone", "--nproc_per_node=2", str(TRAIN), *args,
                                      f"run.out_dir={reference}"], cwd=REPO, env=clean_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    while (state := slurm_job_state(h0, env, job, "JobState")) not in ("COMPLETED", "FAILED", "CANCELLED"):
        assert time.monotonic() < deadline + 180, f"job {job} still {state}"
        time.sleep(1)
    assert uninterrupted.wait(timeout=120) == 0, uninterrupted.stderr.read()[-3000:]
    log = (tmp_path / f"log-{job}.out").read_text()
    assert state == "COMPLETED" and slurm_job_state(h0, env, job, "Restarts") == "1", log[-3000:]
    assert "on 2 node(s)" in log and "stopping on SIGTERM: checkpoint" in log
    # Restarts 1 above is the requeue. scontrol was once (1 suite in 3) ended by it before it said so: it now
    # ignores SIGTERM, and a SIGKILL would be said
    assert f"scontrol requeue {job}: requeued" in log or f"scontrol requeue {job}: scontrol ended by SIG" in log, log
    assert "Traceback" not in log, log  # torchrun's SignalException ends as an exit code (ddp/torchrun.py)
    assert "resumed from" in log and f"job {job} (restart 1)" in log
    assert [m["epoch"] for m in metrics(out)] == [1, 2, 3, 4]  # each epoch once, the right number
    got = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["model"]
    want = torch.load(reference / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(got[k], want[k]) for k in want)
    resumed = next(line for line in log.splitlines() if line.startswith("resumed from"))
    REPORT.append(f"sbatch --nodes=2 on 2 hosts: stopped by SIGTERM, requeued, {resumed.split(':')[1].strip()}; "
                  "finished bitwise equal to an uninterrupted run")  # fmt: skip


# The tutorial net of tests/test_equivalence.py (no BatchNorm, no augmentation: world sizes agree to
# 1e-6), the global batch of 16 as micro-batches of 8: 2 ranks x 1, then 1 rank x 2 micro-batches.
ELASTIC = [
    "data.dataset=synthetic", "data.synthetic_train=128", "data.synthetic_test=32", "data.workers=0",
    "data.augment=false", "model.name=tutorial", "train.batch_size=16", "train.micro_batch_size=8", "train.epochs=2",
    "optim.lr=0.02", "optim.warmup_epochs=0.5", "run.save_every_steps=2", "run.timeout_s=10",
]  # fmt: skip


def test_elastic_jobs_that_lose_a_node_finish_on_the_other_and_a_cut_off_node_ends_its_launcher(tmp_path):
    """Two elastic jobs side by side (their waits overlap), each on two hosts of its own: MIN_NODES=1
    NNODES=2 (torchrun --nnodes=1:2, restarts on).
    - h1 is lost in global step 11 (its torchrun and its rank killed): the rank on h0 restarts alone from
      step 10's checkpoint with 2 micro-batches of 8 instead of 1 (train.micro_batch_size), and ends where
      one uninterrupted process ends, within the invariance bound of tests/test_equivalence.py (1e-6).
    - The same job, longer: h3's link goes down after the first checkpoint. h2 goes on alone and
      finishes. h3 cannot go on (its rendezvous store is on h2): its rank leaves naming the cut, and its
      launcher, torchrun's agent included, is gone within run.timeout_s + 30 s, non-zero."""
    lost, cut, alone, timeout_s = tmp_path / "elastic", tmp_path / "elastic-cut", tmp_path / "alone", 10
    # Node 1 starts its torchrun only once node 0's store answers (launch/multinode.sh's preflight), so it
    # joins a torchrun start-up later: 20 s for it on a loaded 2-core machine; a lost node drops in 2 s.
    rdzv = "last_call_timeout=20,keep_alive_interval=1,keep_alive_max_attempt=2"

    def node(host: Host, rank: int, master: Host, job: list[str], **fault: str) -> subprocess.Popen:
        env = clean_env(NNODES="2", MIN_NODES="1", NODE_RANK=str(rank), MASTER_ADDR=master.name, MASTER_PORT=PORT,
                        NPROC="1", RDZV_CONF=rdzv, **fault)  # fmt: skip
        return host.popen(["bash", "launch/multinode.sh", *job], REPO, env)

    longer = [*ELASTIC, "data.synthetic_train=2048", "run.save_every_steps=8", f"run.out_dir={cut}"]
    with hosts(2) as (h0, h1), hosts(2) as (h2, h3):
        started = time.monotonic()
        procs = [store_up(h0, node(h0, 0, h0, [*ELASTIC, f"run.out_dir={lost}"])),
                 node(h1, 1, h0, [*ELASTIC, f"run.out_dir={lost}"], DDP_CIFAR_FAULT="node:11:r1")]  # fmt: skip
        wait_for_checkpoint(lost, procs)  # the second job starts only then: the load of its start cannot delay h1
        procs += [store_up(h2, node(h2, 0, h2, longer)), node(h3, 1, h2, longer)]
        wait_for_checkpoint(cut, procs[2:])
        h3.link(False)
        cut_at = time.monotonic()
        cmd = [sys.executable, str(TRAIN), *ELASTIC, f"run.out_dir={alone}"]  # one process, uninterrupted
        one = subprocess.Popen(
            cmd, cwd=REPO, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[3].wait(timeout=timeout_s + 30)
        h3_left = time.monotonic() - cut_at
        procs[3].kill()
        (code, stdout, err), _, (cut_code, _, cut_err), (h3_code, _, h3_err) = finish(*procs, timeout=240)
        seconds = time.monotonic() - started
        h3.link(True)
    assert code == 0, err[-3000:]
    assert "resumed from" in stdout and "saved at world_size 2, now 1 (grad_accum_steps 1, now 2)" in stdout
    assert "global batch 16 (16 per rank = 2 micro-batches of 8 (train.micro_batch_size))" in stdout
    assert [(m["epoch"], m["world_size"]) for m in metrics(lost)] == [(1, 2), (2, 1)]
    assert one.wait(timeout=120) == 0, one.stderr.read()[-3000:]
    final = [torch.load(d / "checkpoints" / "last.pt", weights_only=True)["model"] for d in (lost, alone)]
    diff = max_diff(*final)
    assert diff < 1e-6
    assert cut_code == 0, cut_err[-3000:]
    assert h3_code not in (None, 0) and h3_left < timeout_s + 30, (h3_code, h3_left, h3_err[-3000:])
    assert f"error: torchrun's agent on {h3.name}: its rendezvous store {h2.name}:{PORT} does not answer" in h3_err
    assert metrics(cut)[-1]["epoch"] == 2 and metrics(cut)[-1]["world_size"] == 1
    REPORT.append(f"elastic job on 2 hosts, h1 lost at step 11: finished on h0 alone ({seconds:.0f} s for both jobs), "
                  f"{diff:.1e} from one uninterrupted process; the other, h3's link down: h2 finished alone, h3's "
                  f"launcher gone {h3_left:.1f} s after the cut")  # fmt: skip


def test_the_skypilot_tasks_run_section_on_two_hosts_as_skypilot_starts_it(tmp_path):
    """launch/skypilot.yaml's `run` on each host with the variables SkyPilot sets (the first line of
    SKYPILOT_NODE_IPS is the head node): one job of 2 ranks, rendezvous at the head's address."""
    task = yaml.safe_load((REPO / "launch" / "skypilot.yaml").read_text())
    assert task["num_nodes"] >= 2 and "setup" in task and task["resources"]
    with hosts(2) as (h0, h1):
        ips = f"{h0.address}\n{h1.address}\n"
        procs = []
        for rank, host in enumerate((h0, h1)):
            env = clean_env(SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NODE_IPS=ips, SKYPILOT_NUM_NODES="2",
                            SKYPILOT_NUM_GPUS_PER_NODE="0", NPROC="1", MASTER_PORT=PORT,
                            ARGS=" ".join([*TINY, "train.epochs=1", f"run.out_dir={tmp_path}"]))  # fmt: skip
            procs.append(host.popen(["bash", "-c", task["run"]], REPO, env))
        results = finish(*procs)
    ok_all(results)
    assert f"--rdzv_endpoint={h0.address}:{PORT}" in results[1][2]
    assert metrics(tmp_path)[-1]["world_size"] == 2


MANIFEST = REPO / "launch" / "kubernetes" / "pytorchjob.yaml"


def test_the_kubernetes_manifest_trains_on_two_hosts_and_a_pod_lost_mid_run_resumes(tmp_path):
    """launch/kubernetes/pytorchjob.yaml's own command, read from it, on two hosts with the environment
    the training operator gives each pod: MASTER_ADDR (the master pod's name), MASTER_PORT (its port),
    WORLD_SIZE and RANK by pod, torchrun's PET_* from nprocPerNode, and the container's own env. It
    trains; the worker pod lost mid-run (every process on its host killed) ends the master pod's rank
    and command non-zero in bounded time (lose_h1), naming the dead rank, every checkpoint whole; both
    started again (restartPolicy OnFailure) resume, into one run.out_dir."""
    job = yaml.safe_load(MANIFEST.read_text())
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Worker"]["template"] == specs["Master"]["template"]  # one pod template
    container = specs["Master"]["template"]["spec"]["containers"][0]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port")
    own = {e["name"]: e["value"] for e in container["env"]}
    out, timeout_s = tmp_path / "run", 8
    own["TRAIN_ARGS"] = " ".join([*JOB, f"run.out_dir={out}", f"run.timeout_s={timeout_s}"])  # the test's sizes

    def pod(host: Host, rank: int) -> subprocess.Popen:
        operator = {"MASTER_ADDR": h0.name, "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank),
                    "PET_NNODES": "2", "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
                    "PET_MASTER_ADDR": h0.name, "PET_MASTER_PORT": str(port), "PYTHONUNBUFFERED": "0"}  # fmt: skip
        return host.popen([*container["command"], *container["args"]], REPO, clean_env(**operator, **own))

    with hosts(2) as (h0, h1):
        pods = [store_up(h0, pod(h0, 0), str(port)), pod(h1, 1)]
        left, launchers_left, errors = lose_h1(h0, h1, pods, out, timeout_s, cut=False)  # the worker's node gone
        restarted = finish(store_up(h0, pod(h0, 0), str(port)), pod(h1, 1))
    assert f"error: rank 0 of 2: lost contact with rank 1 on {h1.name} (its connection closed: it died)" in errors[0]
    ok_all(restarted)
    assert "resumed from" in restarted[0][1] and "launcher=torchrun parallel=ddp world_size=2" in restarted[0][1]
    assert [m["epoch"] for m in metrics(out)] == [1, 2, 3] and (out / "checkpoints" / "last.pt").is_file()
    REPORT.append(f"h1's processes killed mid-training (the Kubernetes worker pod, run.timeout_s={timeout_s}): the "
                  f"rank on h0 left after {left[h0.name]:.1f} s, its launcher after {launchers_left[0][1]:.1f} s; "
                  f"both pods started again resumed to the end")  # fmt: skip


def test_the_kubernetes_manifest_names_only_fields_of_the_pytorchjob_api():
    """Every key of the manifest is a field of kubeflow.org/v1 PyTorchJob (and of the Kubernetes pod
    template inside): a typo would be dropped or refused by the cluster, unseen here."""
    fields = {
        "": {"apiVersion", "kind", "metadata", "spec"},
        "metadata": {"name", "namespace", "labels", "annotations"},
        "spec": {"runPolicy", "elasticPolicy", "pytorchReplicaSpecs", "nprocPerNode"},
        "spec.runPolicy": {"cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit",
                           "schedulingPolicy", "suspend", "managedBy"},
        "spec.pytorchReplicaSpecs": {"Master", "Worker"},
        "replica": {"replicas", "template", "restartPolicy"},
        "replica.template": {"metadata", "spec"},
        "pod": {"containers", "volumes", "nodeSelector", "tolerations", "affinity", "serviceAccountName",
                "priorityClassName", "initContainers", "securityContext", "imagePullSecrets"},
        "container": {"name", "image", "imagePullPolicy", "workingDir", "command", "args", "env", "envFrom", "ports",
                      "resources", "volumeMounts", "securityContext"},
        "port": {"name", "containerPort", "protocol"},
        "resources": {"limits", "requests"},
        "volumeMount": {"name", "mountPath", "readOnly", "subPath"},
        "volume": {"name", "persistentVolumeClaim", "emptyDir", "hostPath", "nfs", "configMap", "secret"},
    }  # fmt: skip
    job = yaml.safe_load(MANIFEST.read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    spec = job["spec"]
    checked = [("", job), ("metadata", job["metadata"]), ("spec", spec), ("spec.runPolicy", spec["runPolicy"]),
               ("spec.pytorchReplicaSpecs", spec["pytorchReplicaSpecs"])]  # fmt: skip
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        checked += [("replica", replica), ("replica.template", replica["template"]), ("pod", pod)]
        assert replica["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        for container in pod["containers"]:
            checked += [("container", container), ("resources", container.get("resources", {}))]
            checked += [("port", p) for p in container.get("ports", [])]
            checked += [("volumeMount", m) for m in container.get("volumeMounts", [])]
        checked += [("volume", v) for v in pod.get("volumes", [])]
        assert [c["name"] for c in pod["containers"]][:1] == ["pytorch"]  # the operator's container name
    for where, mapping in checked:
        assert set(mapping) <= fields[where], f"{where}: {set(mapping) - fields[where]} not in the API"
