"""Device and launcher resolution, as pure functions: any GPU count can be asked about on a CPU box."""

import pytest
import torch

from ddp import distributed
from ddp.config import RunConfig
from ddp.errors import UsageError

TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


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


def test_half_set_launcher_variables_are_an_error():
    with pytest.raises(UsageError, match="WORLD_SIZE set but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not"):
        distributed.detect_launch({"WORLD_SIZE": "2"})
    assert distributed.detect_launch({}) == distributed.Launch("none", 0, 0, 1)


SRUN = {  # what srun sets in task 3 of `srun -N2 --ntasks-per-node=2` (job 4242, nodes gpu[07-08])
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
    "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}  # fmt: skip
OPEN_MPI = {  # accelerate launch --cpu --num_processes 2 --mpirun_hostfile F, rank 1
    "ACCELERATE_USE_CPU": "True", "ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}  # fmt: skip


@pytest.mark.parametrize(
    "nodelist, first",
    [("vm", "vm"), ("a,b", "a"), ("gpu[07-09,12],cpu3", "gpu07"), ("n[3,1]", "n3"), ("r[1-2]-n[01-04]", "r1-n01")],
)
def test_first_host_of_a_slurm_nodelist(nodelist, first):
    assert distributed.first_host(nodelist) == first


def test_srun_tasks_are_ranks_with_a_rendezvous_on_the_first_node():
    launch = distributed.detect_launch(SRUN)
    assert launch == distributed.Launch("slurm", 3, 1, 4, 2, f"tcp://gpu07:{distributed.slurm_port('4242')}")
    world = resolve(1, SRUN)  # --gpus-per-task=1: each task sees one GPU, and it is its cuda:0
    assert (world.rank, world.world_size, world.device, world.launcher) == (3, 4, torch.device("cuda", 0), "slurm")
    assert resolve(2, SRUN).device == torch.device("cuda", 1)  # both GPUs visible: the local rank picks
    with pytest.raises(UsageError, match="local rank 2 but only 2 GPU.*at most that many processes per node"):
        resolve(2, {**SRUN, "SLURM_LOCALID": "2", "SLURM_STEP_TASKS_PER_NODE": "3(x2)"})
    with pytest.raises(UsageError, match="under slurm each rank uses cuda:<local_rank>"):
        resolve(2, SRUN, device="cuda:0")
    assert resolve(0, {**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}).init_method == "tcp://10.0.0.1:1234"


def test_the_batch_script_itself_and_one_task_are_a_single_process():
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}  # sbatch -n4 script, before srun
    assert distributed.detect_launch(batch).launcher == "none"
    assert distributed.detect_launch({**SRUN, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).launcher == "none"
    assert distributed.detect_launch(batch, "slurm").rank == 3  # unless run.launcher=slurm says so


def test_slurm_ports_differ_between_jobs_and_stay_below_the_ephemeral_range():
    ports = {distributed.slurm_port(str(job)) for job in range(100_000, 100_050)}
    assert len(ports) == 50 and all(10000 <= p < 32768 for p in ports)


def test_torchrun_variables_come_before_slurm():
    env = {**SRUN, **TORCHRUN}  # torchrun started by srun, one per node (slurm/train.sh)
    launch = distributed.detect_launch(env)
    assert (launch.launcher, launch.rank, launch.init_method) == ("torchrun", 1, None)
    assert distributed.detect_launch(env, "slurm").rank == 3
    assert distributed.detect_launch(env, "none").world_size == 1


def test_accelerate_under_torchrun_and_under_mpi():
    launch = distributed.detect_launch({**TORCHRUN, "ACCELERATE_MIXED_PRECISION": "no"})
    assert (launch.launcher, launch.rank, launch.world_size) == ("accelerate", 1, 2)
    launch = distributed.detect_launch(OPEN_MPI)
    assert launch == distributed.Launch("accelerate", 1, 1, 2, 2, "tcp://127.0.0.1:29500")
    one = {k: v for k, v in OPEN_MPI.items() if not k.startswith("OMPI")}  # --cpu --num_processes 2, no MPI
    with pytest.raises(UsageError, match="accelerate started 1 process for --num_processes > 1.*--mpirun_hostfile"):
        distributed.detect_launch(one)
    assert distributed.detect_launch({"ACCELERATE_USE_CPU": "True"}).launcher == "none"  # --num_processes 1


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
        distributed.detect_launch(env, launcher)


def test_one_gpu_shared_by_two_torchrun_ranks_is_refused():
    with pytest.raises(UsageError, match="2 processes on this node but 1 GPU is visible"):
        resolve(1, {**TORCHRUN, "LOCAL_WORLD_SIZE": "2"})
    world = resolve(1, {**TORCHRUN, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"})  # 2 nodes x 1 GPU
    assert world.device == torch.device("cuda", 0)


def test_accelerate_flags_fill_what_the_config_left_at_its_default():
    run = distributed.accelerate_flags(
        RunConfig(), {"ACCELERATE_USE_CPU": "True", "ACCELERATE_MIXED_PRECISION": "bf16"}
    )
    assert (run.device, run.amp) == ("cpu", "bf16")
    assert distributed.accelerate_flags(RunConfig(amp="bf16"), {"ACCELERATE_MIXED_PRECISION": "no"}).amp == "bf16"
    with pytest.raises(UsageError, match="accelerate launch --cpu but run.device=cuda:1"):
        distributed.accelerate_flags(RunConfig(device="cuda:1"), {"ACCELERATE_USE_CPU": "True"})
    with pytest.raises(UsageError, match="--mixed_precision fp16 but run.amp=bf16"):
        distributed.accelerate_flags(RunConfig(amp="bf16"), {"ACCELERATE_MIXED_PRECISION": "fp16"})


def test_global_batch_splits_evenly_or_says_what_would():
    world = resolve(0, {**TORCHRUN, "WORLD_SIZE": "3"})
    assert world.split(96, "train.batch_size") == 32
    with pytest.raises(UsageError, match="train.batch_size=100 must be a positive multiple of world_size=3.*99 or 102"):
        world.split(100, "train.batch_size")
