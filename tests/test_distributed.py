"""Device and launcher resolution, as pure functions: any GPU count can be asked about on a CPU box."""

import concurrent.futures
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from launch_envs import SRUN, TORCHRUN

from ddp import checks, devices, errors, launchers, lifeline, logs, lost_rank, network, preemption
from ddp.config import RunConfig
from ddp.errors import PeerLost, UsageError


def resolve(cuda_count: int, env: dict | None = None, **run) -> devices.World:
    return devices.resolve(RunConfig(**run), env=env or {}, cuda_count=cuda_count)


@pytest.mark.parametrize(
    "cuda_count, expected",
    [(0, torch.device("cpu")), (1, torch.device("cuda", 0)), (4, torch.device("cuda", 0))],
)
def test_single_process_auto_takes_cuda0_if_any_else_cpu(cuda_count, expected):
    world = resolve(cuda_count)
    assert (world.device, world.parallel, world.world_size, world.rank) == (expected, "none", 1, 0)


def test_single_process_named_devices():
    assert resolve(0, device="cpu").device == torch.device("cpu")
    assert resolve(2, device="cuda:1").device == torch.device("cuda", 1)
    assert resolve(2, device="cpu").device == torch.device("cpu")


@pytest.mark.parametrize(
    "device, cuda_count, message",
    [
        ("cuda0", 1, "run.device='cuda0' is not a device; use auto, cpu, cuda or cuda:N"),
        ("gpu", 1, "run.device='gpu' is not a device"),
        (
            "mps",
            0,
            r"run.device=mps: Apple's GPU \(mps\) is not supported \(ddp-cifar runs and is tested on CPUs and "
            r"CUDA GPUs only\); use run.device=cpu",
        ),  # a Mac's GPU: said, not 'not a device'
        ("xpu:1", 1, r"run.device=xpu:1: Intel's GPU \(xpu\) is not supported"),
        ("cuda:7", 1, r"run.device=cuda:7 but only 1 GPU\(s\) are visible \(cuda:0..cuda:0\)"),
        ("cuda", 0, "run.device=cuda but no CUDA GPU is visible"),
        ("cuda:0", 0, "run.device=cuda:0 but no CUDA GPU is visible"),
    ],
)
def test_bad_devices(device, cuda_count, message):
    with pytest.raises(UsageError, match=message):
        resolve(cuda_count, device=device)


def test_torchrun_rank_uses_cuda_local_rank_or_gloo_on_cpu():
    world = resolve(2, TORCHRUN)
    assert (world.rank, world.local_rank, world.world_size, world.parallel) == (1, 1, 2, "ddp")
    assert world.device == torch.device("cuda", 1)
    assert resolve(0, TORCHRUN).device == torch.device("cpu")
    assert resolve(2, TORCHRUN, device="cpu").device == torch.device("cpu")
    with pytest.raises(UsageError, match="local rank 2 but only 2 GPU"):
        resolve(2, {**TORCHRUN, "LOCAL_RANK": "2", "RANK": "0", "WORLD_SIZE": "3"})
    with pytest.raises(UsageError, match="under torchrun each rank uses cuda:<local_rank>"):
        resolve(2, TORCHRUN, device="cuda:0")


def test_one_launched_process_runs_without_ddp_unless_asked():
    """run.parallel=auto under a launcher that started one process (torchrun --nproc_per_node=1 on a
    1-GPU VM): nothing to all-reduce, so no process group and no DDP wrapper (DDP's per-step cost at
    world size 1: README "Speed"); run.parallel=ddp still asks for DDP there. The checks before a
    launch (--preflight N) stand for the same."""
    one = {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    world = resolve(1, one)
    assert (world.parallel, world.world_size, world.launcher, world.device) == (
        "none",
        1,
        "torchrun",
        torch.device("cuda", 0),
    )
    assert not world.grouped and resolve(1, one, parallel="ddp").parallel == "ddp"
    assert resolve(0, one, parallel="fsdp").parallel == "fsdp"
    planned = {
        (n, mode): devices.planned(RunConfig(parallel=mode), n, None).parallel
        for n in (1, 2)
        for mode in ("auto", "ddp")
    }
    assert planned == {(1, "auto"): "none", (2, "auto"): "ddp", (1, "ddp"): "ddp", (2, "ddp"): "ddp"}


def test_parallel_modes_need_the_right_launch():
    world = resolve(2, parallel="dp")
    assert (world.parallel, world.device, world.world_size) == ("dp", torch.device("cuda", 0), 1)
    for gpus in (0, 1):
        with pytest.raises(UsageError, match=f"run.parallel=dp needs at least 2 visible GPUs, found {gpus}"):
            resolve(gpus, parallel="dp")
    with pytest.raises(UsageError, match="run.parallel=ddp needs one process per device: torchrun"):
        resolve(0, parallel="ddp")
    with pytest.raises(UsageError, match="dp is a single-process mode"):
        resolve(2, TORCHRUN, parallel="dp")
    with pytest.raises(UsageError, match="would train 2 unrelated models"):
        resolve(0, TORCHRUN, parallel="none")


def test_srun_tasks_are_ranks_with_a_rendezvous_on_the_first_node():
    launch = launchers.detect_launch(SRUN)
    assert launch == launchers.Launch("slurm", 3, 1, 4, 2, f"tcp://gpu07:{launchers.slurm_port('4242')}")
    assert lost_rank.meeting_store(SRUN) == ("gpu07", launchers.slurm_port("4242"), "ddp-cifar/4242.0")  # rank 0's
    # A second srun in the same allocation at once (step 1): a port and keys of its own.
    assert lost_rank.meeting_store({**SRUN, "SLURM_STEP_ID": "1"}) == ("gpu07", launchers.slurm_port("4242", "1"),
                                                                       "ddp-cifar/4242.1")  # fmt: skip
    assert launchers.slurm_port("4242", "1") != launchers.slurm_port("4242") == launchers.slurm_port("4242", "0")
    assert lost_rank.served_by_rank_0("tcp://h0:1", {"PMIX_NAMESPACE": "2720"})[2] == "ddp-cifar/2720"  # mpirun's job
    assert lost_rank.meeting_store({**SRUN, "SLURM_PROCID": "x"}) is None  # (the variables' error comes later)
    world = resolve(1, SRUN)  # --gpus-per-task=1: each task sees one GPU, and it is its cuda:0
    assert (world.rank, world.world_size, world.device, world.launcher) == (3, 4, torch.device("cuda", 0), "slurm")
    assert resolve(2, SRUN).device == torch.device("cuda", 1)  # both GPUs visible: the local rank picks
    with pytest.raises(UsageError, match="local rank 2 but only 2 GPU.*at most that many processes per node"):
        resolve(2, {**SRUN, "SLURM_LOCALID": "2", "SLURM_STEP_TASKS_PER_NODE": "3(x2)"})
    with pytest.raises(UsageError, match="under slurm each rank uses cuda:<local_rank>"):
        resolve(2, SRUN, device="cuda:0")
    assert resolve(0, {**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}).init_method == "tcp://10.0.0.1:1234"


def test_one_gpu_shared_by_two_torchrun_ranks_is_refused():
    with pytest.raises(UsageError, match="2 processes on this node but 1 GPU is visible.*or run.backend=gloo"):
        resolve(1, {**TORCHRUN, "LOCAL_WORLD_SIZE": "2"})
    world = resolve(1, {**TORCHRUN, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"})  # 2 nodes x 1 GPU
    assert world.device == torch.device("cuda", 0)


@pytest.mark.parametrize("gpus, expected", [(1, [0, 0, 0]), (2, [0, 1, 0])])
def test_with_gloo_ranks_share_the_gpus(gpus, expected):
    """run.backend=gloo: 3 local ranks on 1 or 2 GPUs, local rank r on cuda:<r mod GPUs>, and the
    process group is gloo (nccl refuses two ranks on one GPU)."""
    env = {**TORCHRUN, "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}
    worlds = [resolve(gpus, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}, backend="gloo") for r in range(3)]
    assert [w.device for w in worlds] == [torch.device("cuda", i) for i in expected]
    assert {w.process_group_backend for w in worlds} == {"gloo"}
    assert "backend=gloo (gloo on GPUs: ranks may share a GPU; for testing" in logs.backend(worlds[0])


def test_the_backend_follows_the_device_unless_named():
    assert resolve(2, TORCHRUN).process_group_backend == "nccl"
    assert resolve(0, TORCHRUN).process_group_backend == "gloo"
    assert resolve(2, TORCHRUN, backend="gloo").process_group_backend == "gloo"
    assert resolve(0, TORCHRUN, backend="gloo").process_group_backend == "gloo"
    assert logs.backend(resolve(0, TORCHRUN)) == " backend=gloo" and logs.backend(resolve(0)) == ""
    for gpus, device in ((0, "auto"), (2, "cpu")):
        with pytest.raises(UsageError, match="run.backend=nccl needs CUDA GPUs"):
            resolve(gpus, TORCHRUN, backend="nccl", device=device)


def test_sync_bn_under_gloo_on_a_gpu_is_the_gloo_implementation():
    """torch's SyncBatchNorm needs nccl's all_gather_into_tensor; with run.backend=gloo on a GPU the
    BatchNorms become GlooSyncBatchNorm (conversion touches no CUDA memory, so this runs anywhere)."""
    from ddp import models, sync_bn

    cuda = torch.device("cuda", 0)
    assert isinstance(sync_bn.convert(models.build("small", 10), cuda, "gloo")[0][1], sync_bn.GlooSyncBatchNorm)
    assert isinstance(sync_bn.convert(models.build("small", 10), cuda, "nccl")[0][1], torch.nn.SyncBatchNorm)


def test_global_batch_splits_evenly_or_says_what_would():
    world = resolve(0, {**TORCHRUN, "WORLD_SIZE": "3"})
    assert checks.split_batch(96, world.world_size, "train.batch_size") == 32
    with pytest.raises(UsageError, match="train.batch_size=100 must be a positive multiple of world_size=3.*99 or 102"):
        checks.split_batch(100, world.world_size, "train.batch_size")


@pytest.mark.parametrize(
    "error, comm",
    [
        (RuntimeError("Application timeout caused pair closure"), True),  # gloo, a peer's link down (DDP's forward)
        (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.250.0.2]:5432"), True),
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 8000ms"), True),
        (RuntimeError("NCCL communicator was aborted on rank 0"), True),
        (dist.DistNetworkError("failed to recv, got 0 bytes"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), False),
        (ValueError("Connection closed"), False),  # not what a collective raises
    ],
)
def test_a_collective_that_lost_a_peer_is_told_from_other_errors(error, comm):
    assert lost_rank.is_comm_failure(error) is comm


def test_the_stop_agreement_of_a_group_of_one_calls_no_collective(monkeypatch):
    """DDP at world size 1 (run.parallel=ddp, one process): its own flag is the group's, every step."""
    from ddp import distributed

    def all_reduce(*args, **kwargs):
        raise AssertionError("an all-reduce in a group of one")

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    world = devices.World(0, 0, 1, torch.device("cpu"), "ddp")
    assert world.grouped and distributed.any_rank(True, world) and not distributed.any_rank(False, world)
    agreement = distributed.StopAgreement(world)  # the training loop's: at once, not a step late
    assert [agreement.after_step(flag) for flag in (False, True)] == [False, True] and not agreement.wait()
    assert agreement.after_step(preemption.PAUSE) == preemption.PAUSE  # (a level: the highest of the ranks' wins)


def test_the_stop_agreement_takes_a_flag_of_any_rank_one_step_late_on_every_rank_and_leaves_nothing_unread():
    """Two gloo ranks (threads, each its own group object over one store). Rank 1's flag after step 3:
    both stop after step 4, and send nothing on. Rank 0's after an epoch's last step (2): wait() has it.
    A pause (Ctrl-Z: preemption.PAUSE) and a stop in the same step: the stop wins."""
    from ddp import distributed

    store, seen = dist.HashStore(), {}

    def rank(r: int) -> None:
        group = dist.ProcessGroupGloo(dist.PrefixStore("agree", store), r, 2, timedelta(seconds=30))
        world = replace(devices.World(r, r, 2, torch.device("cpu"), "ddp"), control=group)
        agreement = distributed.StopAgreement(world)
        stops = [agreement.after_step(step == 3 and r == 1) for step in range(1, 5)]
        unread = agreement.pending
        epoch = distributed.StopAgreement(world)
        late = [epoch.after_step(step == 2 and r == 0) for step in (1, 2)]
        levels = distributed.StopAgreement(world)
        both = [levels.after_step((preemption.PAUSE, preemption.STOP)[r] if step == 1 else 0) for step in (1, 2)]
        seen[r] = stops, unread, late, epoch.wait(), epoch.pending, both

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert seen == {
        r: ([False, False, False, True], None, [False, False], True, None, [0, preemption.STOP]) for r in (0, 1)
    }


def test_held_ranks_agree_every_hold_s_until_no_launcher_is_stopped_and_a_stop_asked_meanwhile_ends_it_everywhere(
    monkeypatch, capsys
):
    """An agreed hold (preemption.HOLD: a rank's launcher is stopped, plain torchrun's Ctrl-Z) on 2 gloo ranks
    (threads): rank 1's launcher is stopped for its first 3 looks. Both agree again every HOLD_S and go on together
    after the 4th look (no stop); rank 0 says so at each hold. In a second hold rank 0 is asked to stop: both leave
    it with the stop, at once."""
    from ddp import distributed

    store, seen, looks = dist.HashStore(), {}, {0: 0, 1: 0}

    def launcher_held() -> bool:
        r = int(threading.current_thread().name)
        looks[r] += 1
        return r == 1 and looks[r] <= 3

    monkeypatch.setattr(lifeline, "launcher_held", launcher_held)
    monkeypatch.setattr(preemption, "HOLD_S", 0.01)

    def rank(r: int) -> None:
        group = dist.ProcessGroupGloo(dist.PrefixStore("hold", store), r, 2, timedelta(seconds=30))
        world = replace(devices.World(r, r, 2, torch.device("cpu"), "ddp"), control=group)
        agreement, stop = distributed.StopAgreement(world), preemption.StopRequest([])
        first = stop.take(preemption.HOLD, agreement), looks[r]
        if r == 0:
            stop.request("SIGTERM")
        seen[r] = first, stop.take(preemption.HOLD, agreement), looks[r]

    threads = [threading.Thread(target=rank, args=(r,), name=str(r)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert seen == {0: ((False, 4), True, 4), 1: ((False, 4), True, 5)}
    assert capsys.readouterr().out.count("note: holding: a launcher of this job is stopped") == 2  # (rank 0, twice)


def test_a_rank_that_stops_before_the_ranks_meet_is_heard_there_the_first_one_only_and_a_silent_one_named(monkeypatch):
    """torchrun's agent store (a TCPStore here), 3 ranks. Rank 0 and 2 come; rank 1 stops on a usage error before it
    came: rank 0 stops with its line, a UsageError. A second rank's crash after it leaves the first word. The next
    restart attempt has keys of its own: rank 1 crashes there, and that is a PeerLost naming the crash. A rank that
    never comes and says nothing: after run.timeout_s, a PeerLost naming it."""
    monkeypatch.setattr(lost_rank, "_met", False)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port),
           "LOCAL_RANK": "0", "WORLD_SIZE": "3"}  # fmt: skip
    ranks = [devices.World(r, r, 3, torch.device("cpu"), "ddp", "torchrun") for r in range(3)]

    def attempt(n: int, stops: BaseException | None) -> dist.Store:
        attempt_env = {**env, "TORCHELASTIC_RESTART_COUNT": str(n)}
        store = dist.PrefixStore(launchers.agent_store(attempt_env)[2], server)
        for world in (ranks[0], ranks[2]):
            lost_rank.register_host(world, store)
        monkeypatch.setattr(lost_rank, "_met", False)  # rank 1's process: it has not come
        with pytest.raises(type(stops)), lost_rank.telling_the_waiting({**attempt_env, "RANK": "1"}):
            raise stops
        return store

    store = attempt(0, UsageError("data.path=/data/cifar.npz: no such file"))
    with pytest.raises(UsageError) as said:
        lost_rank.wait_for_everyone(ranks[0], store, 30, "the rendezvous")
    host = socket.gethostname()
    assert str(said.value) == f"rank 1 on {host} stopped before the ranks met: data.path=/data/cifar.npz: no such file"
    with pytest.raises(ZeroDivisionError), lost_rank.telling_the_waiting({**env, "RANK": "2"}):
        raise ZeroDivisionError("a bug")
    with pytest.raises(UsageError, match="no such file"):
        lost_rank.wait_for_everyone(ranks[2], store, 30, "the rendezvous")
    store = attempt(1, ZeroDivisionError("division by zero"))
    with pytest.raises(PeerLost) as said:
        lost_rank.wait_for_everyone(ranks[0], store, 30, "the rendezvous")
    assert str(said.value) == (f"rank 0 of 3: rank 1 on {host} ended before the ranks met (exit 1): "
                               "ZeroDivisionError: division by zero")  # fmt: skip
    store = dist.PrefixStore(launchers.agent_store({**env, "TORCHELASTIC_RESTART_COUNT": "2"})[2], server)
    for world in (ranks[0], ranks[2]):
        lost_rank.register_host(world, store)
    with pytest.raises(PeerLost) as said:
        lost_rank.wait_for_everyone(ranks[2], store, 0.3, "the rendezvous (here)")
    assert str(said.value).startswith("rank 2 of 3: rank 1 did not come to the rendezvous (here) within "
                                      "run.timeout_s=0.3 s, and did not say why")  # fmt: skip
    lost_rank.register_host(ranks[1], store)
    lost_rank.wait_for_everyone(ranks[2], store, 0.3, "the rendezvous")  # all came: it returns


def test_a_word_left_at_a_store_not_up_yet_arrives_and_at_none_costs_its_time_and_nothing_printed(capfd):
    """leave_word (a rank of srun or mpirun that stops before the ranks met, telling rank 0's store): a store that
    comes up 0.5 s later gets the word. Where none ever comes, it gives up after its wait, with nothing printed:
    before, torch's client retried the refused port itself, logged a stack trace each time, and stayed in C++ past
    the wait (12.7 s for 5), which aborted the process as it exited 1 run in 8."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    late = concurrent.futures.ThreadPoolExecutor(1).submit(
        lambda: time.sleep(0.5) or dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=5),
                                                 wait_for_workers=False))  # fmt: skip
    said = {"rank": 1, "code": 2, "line": "data.path=/d.npz: no such file"}
    lost_rank.leave_word("127.0.0.1", port, "ddp-cifar/why", said, wait_s=3)
    assert lost_rank.word_left(late.result(), "ddp-cifar/why") == {**said, "host": socket.gethostname()}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    capfd.readouterr()
    assert 0.5 <= timed(lambda: lost_rank.leave_word("127.0.0.1", port, "ddp-cifar/why", said, wait_s=0.5)) < 1.0
    time.sleep(1.0)  # (torch's client, where one was asked, logs when its own wait ends)
    assert capfd.readouterr() == ("", "")


def test_rank_0_that_stops_before_the_ranks_meet_serves_its_word_until_the_others_heard_or_told(monkeypatch):
    """srun, 3 tasks: rank 0, which would serve the ranks' store, stops on a usage error before it came. It goes on
    at once (to say its error), serving that store with its line; at its exit (until_heard) it waits until rank 1
    has read it (a UsageError naming rank 0) and rank 2 has left its own, then ends at once. A rank that never
    comes: rank 0 ends after HEAR_S."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**SRUN, "SLURM_NTASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "3", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "SLURM_PROCID": "0"}  # fmt: skip
    monkeypatch.setattr(lost_rank, "_serving", [])
    monkeypatch.setattr(lost_rank, "_met", False)
    with pytest.raises(UsageError), lost_rank.telling_the_waiting(env):
        raise UsageError("data.path=/data/cifar.npz: no such file")
    rank_0_exits = concurrent.futures.ThreadPoolExecutor(1).submit(timed, lost_rank.until_heard)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    store = dist.PrefixStore(lost_rank.meeting_store({**env, "SLURM_PROCID": "1"})[2], client)
    world_1 = devices.World(1, 1, 3, torch.device("cpu"), "ddp", "slurm")
    lost_rank.register_host(world_1, store)
    with pytest.raises(UsageError) as said:
        lost_rank.wait_for_everyone(world_1, store, 30, "the rendezvous")
    assert str(said.value) == f"rank 0 on {socket.gethostname()} stopped before the ranks met: data.path=" \
                              "/data/cifar.npz: no such file"  # fmt: skip
    assert not rank_0_exits.done()  # rank 2 has neither heard nor told
    with pytest.raises(ValueError), lost_rank.telling_the_waiting({**env, "SLURM_PROCID": "2"}):
        raise ValueError("a bug")
    assert rank_0_exits.result(timeout=3) < 3  # it ended at once, not after HEAR_S
    monkeypatch.setattr(lost_rank, "HEAR_S", 0.5)
    monkeypatch.setattr(lost_rank, "_met", False)
    with pytest.raises(UsageError), lost_rank.telling_the_waiting(env):
        raise UsageError("data.path=/data/cifar.npz: no such file")
    assert 0.5 <= timed(lost_rank.until_heard) < 3  # nobody came: it served its word for HEAR_S, then ended


def timed(call: Callable[[], object]) -> float:
    """The seconds call() took."""
    start = time.monotonic()
    call()
    return time.monotonic() - start


def test_a_lost_rank_without_a_store_to_ask_is_the_other_one_in_a_world_of_2_else_another_rank():
    """Where the ranks met in a store rank 0 served (srun, mpirun, torch 2.4's torchrun) and rank 0 is gone with it,
    no store tells which rank is lost: in a world of 2 it is the other one; in a larger one, another rank. torch's
    words follow, without gloo's source file and its advice after them (three sentences, "GLHF!" the last)."""
    advice = " This is typically caused by a remote worker crashing. Check the logs of the remote worker ... GLHF!"
    closed = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed "
                          f"by peer [10.0.0.1]:1234.{advice}")  # fmt: skip
    said = [str(lost_rank.explain(devices.World(1, 0, n, torch.device("cpu"), "ddp", "slurm", "tcp://h0:1"), closed,
                                  60, None)) for n in (2, 3)]  # fmt: skip
    torchs = "Connection closed by peer [10.0.0.1]:1234."  # without gloo's source file and its advice (as torch 2.14)
    assert said == [f"rank 1 of {n}: lost contact with {who} (its connection closed: it died) [{torchs}]"
                    for n, who in ((2, "rank 0"), (3, "another rank"))]  # fmt: skip


def test_the_out_of_memory_kills_a_rank_on_another_machine_told_are_said_with_that_machines_name(monkeypatch):
    """explain: a rank that loses one and whose machine's count of out-of-memory kills rose leaves that count at the
    store under its host's name; a rank on another machine that lost a rank there says it (tests/test_hosts.py runs
    it). This machine's own count, and hosts with none told, add nothing."""
    store = dist.HashStore()
    store.set(f"{lost_rank.OOM}/h1", "2")
    assert lost_rank._oom_told(store, {3: "h1", 5: "h2", 6: ""}) == (
        "the kernel's out-of-memory killer ended 2 processes on h1 meanwhile (dmesg on h1 names them)"
    )
    assert lost_rank._oom_told(store, {5: "h2"}) is None
    monkeypatch.setattr(errors, "OOM_KILLS_AT_START", 5)
    monkeypatch.setattr(errors, "oom_kills", lambda: 6)  # one since, here
    monkeypatch.setattr(lost_rank, "silent_ranks", lambda world, store: {1: "h1"})
    monkeypatch.setattr(socket, "gethostname", lambda: "h0")
    closed = RuntimeError("Connection closed by peer")
    said = lost_rank.explain(devices.World(0, 0, 2, torch.device("cpu"), "ddp", "torchrun"), closed, 60, store)
    assert store.get(f"{lost_rank.OOM}/h0") == b"1"  # told, for the other machines' ranks
    assert "(its connection closed: it died; the kernel's out-of-memory killer ended 2 processes on h1" in str(said)


def test_a_ctrl_c_while_rank_0_serves_its_word_at_exit_ends_that_wait_without_a_traceback(monkeypatch):
    """until_heard runs among the exit handlers, after the error's line: a Ctrl-C there ends the wait (the process
    then ends with its error's exit code), where it was `Exception ignored in atexit callback` and a traceback."""
    serving = threading.Thread(target=time.sleep, args=(10,), daemon=True)
    serving.start()
    monkeypatch.setattr(lost_rank, "_serving", [serving])
    threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()  # Ctrl-C
    assert timed(lost_rank.until_heard) < 5


def test_rank_0_whose_port_another_runs_store_holds_leaves_its_word_there_under_its_own_keys(monkeypatch):
    """Two sruns in one allocation on one MASTER_PORT: the second's rank 0 finds the first's store there (it said why:
    network.check_port_free). It cannot serve its word, and leaves it in that store under its step's keys, where its
    own ranks wait; the first run's keys are untouched."""
    first = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    env = {**SRUN, "SLURM_STEP_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(first.port)}  # fmt: skip
    monkeypatch.setattr(lost_rank, "_serving", [])
    monkeypatch.setattr(lost_rank, "_met", False)
    with pytest.raises(UsageError), lost_rank.telling_the_waiting(env):
        raise UsageError(f"MASTER_PORT={first.port} is taken on {socket.gethostname()}")
    lost_rank.until_heard()
    assert lost_rank.word_left(dist.PrefixStore("ddp-cifar/4242.1", first), lost_rank.WHY)["line"].startswith(
        f"MASTER_PORT={first.port} is taken")  # fmt: skip
    assert lost_rank.word_left(dist.PrefixStore("ddp-cifar/4242.0", first), lost_rank.WHY) is None


def test_a_gloo_interface_named_that_this_machine_lacks_is_refused_with_the_ones_it_has():
    """GLOO_SOCKET_IFNAME names one interface or several, comma-separated, as gloo takes them; each must be here with an
    address (a space is part of a name to gloo: ' lo' is none of this machine's)."""
    for named in ("lo", "lo,lo", "lo,"):
        assert network.pick_interface("127.0.0.1", True, {"GLOO_SOCKET_IFNAME": named}) is None
    for named, lacking in (("nonesuch0", "nonesuch0"), ("lo,nonesuch0", "nonesuch0"), ("lo, lo", " lo")):
        with pytest.raises(UsageError) as refused:
            network.pick_interface("127.0.0.1", True, {"GLOO_SOCKET_IFNAME": named})
        said = f"GLOO_SOCKET_IFNAME={named}: this machine ({socket.gethostname()}) has no interface {lacking!r} with"
        assert str(refused.value).startswith(f"{said} an address (its interfaces: lo (127.0.0.1)")
        assert str(refused.value).endswith("); name one of them, or unset it")
