"""What each launcher sets in one process, for the tests of the launcher and device resolution."""

TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}

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
