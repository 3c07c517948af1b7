"""python -m ddp.doctor: the report, and each broken setup it must catch with a non-zero exit."""

import os
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import BIN, REPO, clean_env, ok, torchrun
from launch_envs import TORCHRUN

from ddp import cpus, launchers, lost_rank, network
from ddp import doctor as ddp_doctor
from ddp.errors import UsageError

SYNTHETIC = ("data.dataset=synthetic", "data.synthetic_train=64", "data.synthetic_test=32", "train.batch_size=32")


def doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    """python -m ddp.doctor ARGS on small synthetic data unless ARGS name other data (a CIFAR download's address is
    asked, and whether it answers depends on the machine's network: tests that are not of it keep off it)."""
    return subprocess.run(
        [sys.executable, "-m", "ddp.doctor", *SYNTHETIC, *args], cwd=REPO, env=clean_env(**env), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip


def test_a_single_process_setup_is_reported_and_ok(tmp_path):
    proc = ok(doctor(f"run.out_dir={tmp_path / 'run'}"))
    assert "rank 0/1  local_rank 0" in proc.stdout and "launcher none  device cpu" in proc.stdout
    assert "versions:  python" in proc.stdout and "torch " in proc.stdout and "nccl" in proc.stdout
    assert "GPUs: none visible" in proc.stdout and "TF32: matmul" in proc.stdout and "cudnn.benchmark" in proc.stdout
    assert f"/dev/shm: {shutil.disk_usage('/dev/shm').total / 2**20:,.1f} MiB" in proc.stdout
    usable, affinity = cpus.usable(), len(os.sched_getaffinity(0))  # (the cgroup quota: a real one in test_launch.py)
    said = re.search(rf"  CPUs: {usable} to use \({affinity} in its affinity, (no cgroup quota|its cgroup's quota "
                     r"[\d.]+)\); torch threads (\d+)\n", proc.stdout)  # fmt: skip
    assert said and 1 <= int(said[2]) <= usable, proc.stdout  # its share: never more than it may use
    assert "rendezvous port 29500 (torchrun's default): " in proc.stdout
    assert f"run.out_dir {tmp_path / 'run'}: writable" in proc.stdout
    assert proc.stdout.rstrip().endswith("doctor: OK")
    assert list((tmp_path / "run").iterdir()) == []  # its probe file is gone
    assert "data: 64 training and 32 test images, 10 classes" in proc.stdout


def test_a_download_is_said_where_its_address_answers_and_a_problem_where_it_does_not(tmp_path, monkeypatch):
    """CIFAR missing with data.download=true: said, not made, where its address answers (a server on this machine
    stands in for it); a problem with the fix where it does not (refused, an HTTP error, no answer in time), as on
    a cluster's compute node without internet; none where data.root holds the whole archive (unpacked, no
    download). The same check on hosts with no route out: tests/test_hosts.py."""
    import hashlib
    import http.server
    import threading

    import torchvision

    from ddp import cifar
    from ddp import doctor as doctor_module
    from ddp.config import DataConfig
    from ddp.devices import World

    class Archive(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path.endswith(".tar.gz") else 404)
            self.end_headers()
            self.wfile.write(b"not the archive: the check reads no body")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Archive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as closed, socket.socket() as silent:  # nothing listens / listens and never answers
        closed.bind(("127.0.0.1", 0))
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        web, cls = f"http://127.0.0.1:{server.server_address[1]}", torchvision.datasets.CIFAR10
        data = DataConfig(dataset="cifar10", root=str(tmp_path / "data"), download=True)
        cpu = World(0, 0, 1, torch.device("cpu"), "none")
        try:
            monkeypatch.setattr(cls, "url", f"{web}/cifar-10-python.tar.gz")
            line, problem, _ = doctor_module.check_data(data, cpu)
            assert (line, problem) == (f"data: cifar10 is not in data.root={data.root} yet: the run downloads it", None)
            assert not (tmp_path / "data").exists()  # said, not downloaded
            for url, why in [
                (f"http://127.0.0.1:{closed.getsockname()[1]}/a.tar.gz", "ConnectionRefusedError: [Errno 111] Conn"),
                (f"{web}/moved", "HTTPError: HTTP Error 404: Not Found"),
            ]:
                monkeypatch.setattr(cls, "url", url)
                line, problem, _ = doctor_module.check_data(data, cpu)
                assert line == "data: missing, and no download" and problem.startswith(
                    f"CIFAR-10 is not in data.root={data.root}, and this machine cannot download it: {url} does not "
                    f"answer ({why}"
                ), problem
                assert "torchvision.datasets.CIFAR10(" in problem and problem.endswith("data.path=FILE.npz")
            monkeypatch.setattr(cls, "url", f"http://127.0.0.1:{silent.getsockname()[1]}/a.tar.gz")
            assert "does not answer (TimeoutError: timed out)" in cifar.download_problem(data, timeout_s=0.5)
            archive = tmp_path / "data" / cls.filename  # whole: its md5 is the one torchvision checks
            archive.parent.mkdir()
            archive.write_bytes(b"an archive")
            monkeypatch.setattr(cls, "tgz_md5", hashlib.md5(b"an archive").hexdigest())
            assert cifar.download_problem(data, timeout_s=0.5) is None  # no request: unpacked, not downloaded
        finally:
            server.shutdown()


def test_data_the_run_could_not_read_is_a_problem_and_data_it_can_is_counted(tmp_path):
    images = np.arange(6 * 32 * 32 * 3).astype(np.uint8).reshape(6, 32, 32, 3)  # any pattern: not one colour
    np.savez(tmp_path / "good.npz", x_train=images[:4], y_train=np.arange(4), x_test=images[4:], y_test=np.arange(2))
    proc = ok(
        doctor(
            f"run.out_dir={tmp_path / 'run'}",
            "data.dataset=npz",
            f"data.path={tmp_path / 'good.npz'}",
            "train.batch_size=4",
        )
    )
    assert "data: 4 training and 2 test images, 4 classes" in proc.stdout
    for args, problem in [
        (("data.dataset=npz",), "data.dataset=npz needs data.path=FILE.npz"),
        (
            ("data.dataset=cifar10", f"data.root={tmp_path}", "data.download=false"),
            f"CIFAR-10 not found in data.root={tmp_path} and data.",
        ),
    ]:
        proc = doctor(f"run.out_dir={tmp_path / 'run'}", *args)
        assert proc.returncode == 1 and f"doctor: PROBLEM: {problem}" in proc.stderr, proc.stderr
        assert "doctor: OK" not in proc.stdout


@pytest.mark.parametrize("gpus, ranks, shm_mib, problem", [(2, 0, 64.0, True), (8, 8, 1000.0, True),
    (1, 4, 64.0, True), (1, 1, 64.0, False), (2, 0, 1024.0, False), (2, 2, None, False)])  # fmt: skip
def test_a_dev_shm_smaller_than_nccls_buffers_between_a_machines_gpus_is_a_problem(gpus, ranks, shm_mib, problem):
    """A Docker container's 64 MiB /dev/shm, where NCCL between 2+ GPUs of one machine keeps its buffers (a crash
    at its start otherwise): said before a launch, with the docker option. The GPUs a rank sees, or the ranks on
    GPUs of its host where each sees one (srun --gpus-per-task=1). One GPU needs none."""
    from ddp import doctor

    report = {"host": "box", "gpus": [{}] * gpus, "shm_mib": shm_mib}
    said = doctor.shared_memory_problem(report, ranks)
    assert (said is not None) == problem
    if problem:
        n = max(gpus, ranks)
        assert said.startswith(f"on box: /dev/shm holds {shm_mib:,.0f} MiB, and NCCL between its {n} GPUs")
        assert "docker run --shm-size=1g (or --ipc=host)" in said


def test_half_set_launcher_variables_are_a_usage_error():
    proc = doctor(WORLD_SIZE="2")
    assert proc.returncode == 2
    assert "doctor: error: WORLD_SIZE set but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not" in proc.stderr


@pytest.mark.parametrize(
    "args, said",
    [(["optim.muon_lr=0.2", "optim.name=adamw"], "optim.muon_lr=0.2: Muon steps the filters beside SGD"),
     (["data.loader=torch", "data.workers=1000"], "data.workers=1000: 1,000 DataLoader worker processes a rank"),
     (["train.micro_batch_size=3"], "train.batch_size=32 is not a multiple of world_size x train.micro_batch_size"),
     (["run.resume=/no/such.pt"], "run.resume=/no/such.pt: no such checkpoint file"),
     (["run.stop_signal=SIGFOO"], "run.stop_signal: 'SIGFOO' is not a signal that can be caught")],
)  # fmt: skip
def test_settings_that_ddp_train_refuses_are_its_usage_error(args, said, tmp_path, capsys):
    """Settings that parse but do not go together (or that no machine runs), or a run.resume that is not there: the
    doctor said OK, and the run then stopped on them. Now its exit 2 with ddp/train.py's line, before any check of
    the machine. Those that the data decides (a batch beyond its images, run.profile beyond the run's steps) are
    problems of the data, exit 1."""
    from ddp.cli import command

    assert command(ddp_doctor.main, [*SYNTHETIC, f"run.out_dir={tmp_path}", *args], prog="doctor") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"doctor: error: {said}") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())  # nothing checked, nothing written
    if args[0] != "run.resume=/no/such.pt":
        return  # (the data's problems, once)
    beyond_the_data = [("train.batch_size=128", "train.batch_size=128 exceeds the 64 training images"),
                       ("run.profile=9:12", "run.profile=9:12: the run has 2 steps; profile within 1:3")]  # fmt: skip
    for beyond, problem in beyond_the_data:
        argv = [*SYNTHETIC, f"run.out_dir={tmp_path}", "train.batch_size=32", "train.epochs=1", beyond]
        assert command(ddp_doctor.main, argv, prog="doctor") == 1, beyond
        assert f"doctor: PROBLEM: {problem}\n" in capsys.readouterr().err


@pytest.mark.parametrize(
    "master, said",
    [("127.0.0.1:29500", "MASTER_ADDR=127.0.0.1:29500 holds a port: MASTER_ADDR=127.0.0.1 MASTER_PORT=29500"),
     ("[::1]:29500", "MASTER_ADDR=[::1]:29500 holds a port: MASTER_ADDR=::1 MASTER_PORT=29500"),
     ("fd00::zz", "MASTER_ADDR=fd00::zz is no address or host name: give the master's IPv4 or IPv6 address, or its "),
     ("a" * 64, f"MASTER_ADDR={'a' * 64} does not resolve on ")],
)  # fmt: skip
def test_a_master_addr_with_a_port_in_it_no_address_or_a_label_too_long_is_said_as_such(master, said):
    """launch/multinode.sh's check and the doctor's said "does not resolve" for the first ones and was a UnicodeError
    traceback for the last (idna's "label too long"); the doctor called the port of each, and of a master that is
    another machine, "IN USE" here (binding that address failed)."""
    with pytest.raises(UsageError, match="^" + re.escape(said)):
        network.check_master(master, 29500, node_rank=0, timeout_s=0)
    assert ddp_doctor.port_free(master, 0) is None and ddp_doctor.port_free("192.0.2.1", 0) is None  # TEST-NET-1
    assert ddp_doctor.port_free("127.0.0.1", 0) is True


def test_an_ipv6_master_addr_is_an_address():
    """An IPv6 address, bare or in brackets, and a name whose only address is IPv6 (an IPv6-only cluster) were
    refused: "no IPv4 address or host name (IPv6?)", and "does not resolve" for the name. torch's rendezvous takes
    them (tests/test_hosts.py runs a job on IPv6-only hosts). A link-local one with its interface is not taken."""
    with pytest.raises(UsageError, match=r"^MASTER_ADDR=fe80::1%lo is an IPv6 address with its interface \(%lo\), a "
                                         r"link-local one, which torch's rendezvous does not take: give"):  # fmt: skip
        network.check_master("fe80::1%lo", 0, node_rank=1, timeout_s=0)
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as e:
        pytest.skip(f"this machine has no IPv6 loopback (::1): {e}")
    assert network.resolve("::1") == network.resolve("[::1]") == "::1" and network.resolve("[]") is None
    assert network.host_port("::1", 29500) == "[::1]:29500" and network.host_port("h0", 1) == "h0:1"
    for master in ("::1", "[::1]"):
        network.check_master(master, 0, node_rank=0, timeout_s=0)  # resolves; port 0: any is free
        assert ddp_doctor.port_free(master, 0) is True
    assert network.route_to("::1") == ("lo", "::1") and network.interface_with("::1") == "lo"
    launch = launchers.detect_launch({**TORCHRUN, "MASTER_ADDR": "fd00::1", "MASTER_PORT": "1"})  # rank 0 serves it
    assert launch.init_method == "tcp://[fd00::1]:1"
    assert lost_rank.served_by_rank_0("tcp://[fd00::1]:1", {}) == ("fd00::1", 1, "ddp-cifar")


def test_a_busy_rendezvous_port_is_a_problem(tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = doctor(f"run.out_dir={tmp_path}", MASTER_PORT=str(port))
    assert proc.returncode == 1
    assert f"rendezvous port {port} (MASTER_ADDR/MASTER_PORT): IN USE" in proc.stdout
    assert f"doctor: PROBLEM: port {port} (MASTER_ADDR/MASTER_PORT) is in use" in proc.stderr


def test_an_out_dir_that_cannot_be_written_is_a_problem(tmp_path):
    (tmp_path / "file").write_text("")
    proc = doctor(f"run.out_dir={tmp_path / 'file' / 'run'}")
    assert proc.returncode == 1
    why = f"is not writable ({tmp_path / 'file'} is a file, not a directory)"  # as the run would say it
    assert f"doctor: PROBLEM: run.out_dir={tmp_path / 'file' / 'run'} {why}" in proc.stderr


def test_under_torchrun_every_rank_reports_and_an_all_reduce_runs(tmp_path):
    proc = ok(torchrun(2, "-m", "ddp.doctor", f"run.out_dir={tmp_path}", *SYNTHETIC, "train.lookahead_decay=0.5"))
    assert "rank 0/2  local_rank 0" in proc.stdout and "rank 1/2  local_rank 1" in proc.stdout
    said = "note: train.lookahead_decay=0.5 does nothing here: lookahead is off (train.lookahead_every=0)\n"
    assert proc.stdout.count(said) == 1  # a setting the run would not read: rank 0's note, as ddp/train.py's
    assert proc.stdout.count("  data: 64 training and 32 test images, 10 classes") == 1  # one machine: once
    assert "RANK=1" in proc.stdout and "launcher torchrun" in proc.stdout
    assert "all_reduce over 2 ranks (gloo): 1 (expected 1)" in proc.stdout
    assert "writable, the same directory on every rank" in proc.stdout and proc.stdout.count("doctor: OK") == 1


def test_an_out_dir_that_differs_between_nodes_is_a_problem(tmp_path):
    """Two torchrun agents as two nodes; the second sees its own (tmpfs) out_dir, as a node-local
    disk would be: the doctor must say the directory is not shared. The second was also given another
    optim.lr on its command line, and finds other images at the same data.path (its own copy, one pixel off), both of
    which the run would stop on (ddp/alike.py): problems too."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "true"]).returncode != 0:
        pytest.skip("needs `unshare --mount` (root, util-linux) to give one 'node' its own filesystem")
    local = tmp_path / "run"
    local.mkdir()
    images = np.random.default_rng(0).integers(0, 256, (20, 32, 32, 3), dtype=np.uint8)
    for name, pixel in (("here.npz", 0), ("there.npz", 1)):  # the second node's copy: one pixel off
        images[0, 0, 0, 0] = pixel
        np.savez(tmp_path / name, x_train=images, y_train=np.arange(20) % 10, x_test=images[:10], y_test=np.arange(10))
    shutil.copy(tmp_path / "here.npz", local / "data.npz")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    rdzv = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
    node = [str(BIN / "torchrun"), *rdzv, "-m", "ddp.doctor", f"run.out_dir={local}", "data.dataset=npz",
            f"data.path={local / 'data.npz'}"]  # fmt: skip
    host = subprocess.Popen([*node[:1], *node[1:5], "--rdzv_conf=is_host=true", *node[5:]], cwd=REPO,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    other = subprocess.run(
        ["unshare", "--mount", "bash", "-c",
         f'mount -t tmpfs none "{local}" && cp "{tmp_path / "there.npz"}" "{local}/data.npz" && exec "$@"', "node1",
         *node[:5], "--rdzv_conf=is_host=false", *node[5:], "optim.lr=0.2"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out, err = host.communicate(timeout=120)
    both = out + err + other.stdout + other.stderr
    assert host.returncode != 0 or other.returncode != 0, both
    assert "do not see rank 0's files in run.out_dir" in both and "a filesystem every node shares" in both
    name = socket.gethostname()
    assert (f"doctor: PROBLEM: rank 1 on {name} has other settings (optim.lr=0.2 against 0.1); other data "
            f"(data.path={local / 'data.npz'}: other images or labels) than rank 0 on {name}: every machine must run "
            "the same checkout, settings and data") in both  # fmt: skip


@pytest.mark.parametrize(
    "tasks_per_node, gpus, problem",
    [("2", 2, None), ("4", 1, None), ("2(x2)", 4, "SLURM runs 2 task(s) on this node and each sees 4 GPUs")],
)
def test_slurm_tasks_must_match_the_gpus(tasks_per_node, gpus, problem):
    env = {"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_NODEID": "0"}
    got = launchers.slurm_gpu_problem(gpus, env)
    assert got == problem if problem is None else problem in got
