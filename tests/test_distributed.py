"""Device and launcher resolution, as pure functions: any GPU count can be asked about on a CPU box."""

import pytest
import torch
from launch_envs import SRUN, TORCHRUN

from ddp import distributed, launchers
from ddp.config import RunConfig
from ddp.errors import UsageError


def resolve(cuda_count: int, env: dict | None = None, **run) -> distributed.World:
    return distributed.resolve(RunConfig(**run), env=env or {}, cuda_count=cuda_count)


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
    world = resolve(1, SRUN)  # --gpus-per-task=1: each task sees one GPU, and it is its cuda:0
    assert (world.rank, world.world_size, world.device, world.launcher) == (3, 4, torch.device("cuda", 0), "slurm")
    assert resolve(2, SRUN).device == torch.device("cuda", 1)  # both GPUs visible: the local rank picks
    with pytest.raises(UsageError, match="local rank 2 but only 2 GPU.*at most that many processes per node"):
        resolve(2, {**SRUN, "SLURM_LOCALID": "2", "SLURM_STEP_TASKS_PER_NODE": "3(x2)"})
    with pytest.raises(UsageError, match="under slurm each rank uses cuda:<local_rank>"):
        resolve(2, SRUN, device="cuda:0")
    assert resolve(0, {**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}).init_method == "tcp://10.0.0.1:1234"


def test_one_gpu_shared_by_two_torchrun_ranks_is_refused():
    with pytest.raises(UsageError, match="2 processes on this node but 1 GPU is visible"):
        resolve(1, {**TORCHRUN, "LOCAL_WORLD_SIZE": "2"})
    world = resolve(1, {**TORCHRUN, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"})  # 2 nodes x 1 GPU
    assert world.device == torch.device("cuda", 0)


def test_global_batch_splits_evenly_or_says_what_would():
    world = resolve(0, {**TORCHRUN, "WORLD_SIZE": "3"})
    assert world.split(96, "train.batch_size") == 32
    with pytest.raises(UsageError, match="train.batch_size=100 must be a positive multiple of world_size=3.*99 or 102"):
        world.split(100, "train.batch_size")
