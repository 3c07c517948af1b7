"""Who started this process: the launcher's environment variables, read here and nowhere else.

Pure functions of an environment (os.environ unless one is given, so tests can ask about any launch
on any machine); nothing here touches a device or the network.

Launchers, in this order unless run.launcher names one (detect_launch):
- torchrun (and `accelerate launch --multi_gpu`, which runs torchrun): RANK, LOCAL_RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT; the rendezvous is torchrun's (env://).
- accelerate's CPU mode (`--cpu --num_processes N --mpirun_hostfile F`): mpirun's rank variables plus
  MASTER_ADDR/MASTER_PORT.
- SLURM, inside `srun` (SLURM_STEP_ID set): SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS; rank 0 is on the
  step's first node, the port is derived from the job id (slurm_port).
- otherwise one process.
Also here: SLURM's rendezvous address (for slurm/train.sh), the SLURM job (requeue, suspend), accelerate's
--cpu / --mixed_precision flags, and what ddp.doctor reports about a launch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ddp.errors import UsageError
from ddp.network import host_port

if TYPE_CHECKING:  # a type alone: importing this module imports no torch (quiet_startup runs before it)
    from ddp.config import RunConfig

Env = Mapping[str, str]
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SLURM_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
# (rank, local rank, world size, processes on this node) as mpirun sets them: Open MPI, MPICH/Intel MPI.
_MPI_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
)


def _mpi_vars(env: Env) -> tuple[str, str, str, str] | None:
    """The names of the MPI launch whose rank, local rank and size are all set; None for none. `srun --mpi=pmi2`
    (a cluster's MpiDefault=pmi2) sets PMI_RANK and PMI_SIZE alone, for SLURM's tasks: a KeyError's traceback."""
    return next((names for names in _MPI_VARS if all(name in env for name in names[:3])), None)


@dataclass(frozen=True)
class Launch:
    """What the launcher's variables say about this process, before devices are considered."""

    launcher: str  # torchrun | accelerate | slurm | none
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int = 1  # processes on this node
    init_method: str | None = None  # tcp://host:port when the rendezvous is ours (no torchrun agent store)


def _ints(env: Env, names: tuple[str, ...]) -> list[int]:
    try:
        return [int(env[v]) for v in names]
    except ValueError:
        raise UsageError(f"{', '.join(names)} must be integers, got {[env[v] for v in names]}") from None


def _checked(launcher: str, rank: int, local_rank: int, world_size: int, **rest: int | str | None) -> Launch:
    if not 0 <= rank < world_size or local_rank < 0:
        raise UsageError(f"{launcher}: rank {rank} must be in [0, world_size={world_size}) and local rank >= 0")
    return Launch(launcher, rank, local_rank, world_size, **rest)


def _counts(env: Env, names: tuple[str, str, str, str]) -> tuple[int, int, int, int]:
    """(rank, local rank, world size, processes on this node: the world size where its variable is unset)."""
    rank, local_rank, world_size, *local = _ints(env, names if names[3] in env else names[:3])
    return rank, local_rank, world_size, local[0] if local else world_size


def _torchrun(env: Env, name: str) -> Launch | None:
    """torchrun's variables (also what `accelerate launch --multi_gpu` sets), or None if none is set."""
    present = [v for v in TORCHRUN_VARS if v in env]
    if not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} & set(present):
        return None  # MASTER_ADDR/PORT alone are a rendezvous address (SLURM scripts, accelerate --cpu)
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing:
        raise UsageError(f"{', '.join(present)} set but {', '.join(missing)} not: launch with torchrun (which sets "
                         "them all), or unset them for a single process")  # fmt: skip
    rank, local_rank, world_size, local = _counts(env, ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    port = master_port(env)  # a port number, else one line (torch's own int() of it was a traceback)
    served = None if agent_store(env) else f"tcp://{host_port(env['MASTER_ADDR'], port)}"  # rank 0 serves it (env://)
    return _checked(name, rank, local_rank, world_size, local_world_size=local, init_method=served)


def _accelerate_mpi(env: Env) -> Launch | None:
    """`accelerate launch --cpu --num_processes N --mpirun_hostfile F`: mpirun starts the processes
    (MPI's rank variables) and accelerate adds MASTER_ADDR/MASTER_PORT for the process group."""
    if names := _mpi_vars(env):
        rank, local_rank, world_size, local = _counts(env, names)
        master = f"tcp://{host_port(env.get('MASTER_ADDR', '127.0.0.1'), master_port(env, 29500))}"
        return _checked("accelerate", rank, local_rank, world_size, local_world_size=local, init_method=master)
    if "MASTER_ADDR" in env:
        raise UsageError(
            "accelerate started 1 process for --num_processes > 1: with --cpu it starts several only "
            "through MPI (add --mpirun_hostfile FILE; bash launch/accelerate.sh does this for you); or drop "
            "--cpu for --multi_gpu, which starts them with torchrun and runs them on the CPU when there is no GPU"
        )
    return None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[07-09,12],cpu3' -> 'gpu07'."""
    first, depth = "", 0
    for ch in nodelist:  # the first comma-separated entry outside brackets
        if ch == "," and depth == 0:
            break
        depth += {"[": 1, "]": -1}.get(ch, 0)
        first += ch
    # In each bracket group keep the first number of the first range, zero padding included.
    return re.sub(r"\[([^],-]+)[^]]*\]", r"\1", first)


def slurm_port(job_id: str, step_id: str = "0") -> int:
    """The rendezvous port of a SLURM job's step: the same on every node, different for concurrent jobs and for
    the steps of one (two sruns at once in an allocation), below Linux's ephemeral range (32768+)."""
    return 10000 + (int(job_id) + 5003 * int(step_id if step_id.isdigit() else 0)) % 20000


def slurm_rendezvous(env: Env = os.environ) -> tuple[str, int]:
    """(address, port) of rank 0 in a SLURM job: MASTER_ADDR/MASTER_PORT if set, else the first node of the
    step (or job) and slurm_port(job id, step id). slurm/train.sh asks this for torchrun's rendezvous."""
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if "MASTER_ADDR" not in env and not nodes or "MASTER_PORT" not in env and "SLURM_JOB_ID" not in env:
        raise UsageError("not inside a SLURM job (no SLURM_JOB_NODELIST / SLURM_JOB_ID): set MASTER_ADDR and "
                         "MASTER_PORT")  # fmt: skip
    addr = env.get("MASTER_ADDR") or first_host(nodes)
    port = master_port(env) if "MASTER_PORT" in env else slurm_port(env["SLURM_JOB_ID"], env.get("SLURM_STEP_ID", ""))
    return addr, port


def _tasks_on_this_node(env: Env) -> int:
    """From SLURM_STEP_TASKS_PER_NODE ('2(x3),1': two tasks on each of 3 nodes, then one)."""
    node = _ints({"SLURM_NODEID": "0", **env}, ("SLURM_NODEID",))[0]  # counted down through the groups: '2(x99999)'
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1")).split(","):
        if (m := re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)) and (node := node - int(m.group(2) or 1)) < 0:
            return int(m.group(1))
    return 1


def _slurm(env: Env, forced: bool) -> Launch | None:
    """`srun python ddp/train.py`: one task per process, ranks from SLURM. Only inside a job step
    (SLURM_STEP_ID): the batch script itself also has SLURM_PROCID=0 and the job's SLURM_NTASKS."""
    if not forced and ("SLURM_STEP_ID" not in env or _ints({"SLURM_NTASKS": "1", **env}, ("SLURM_NTASKS",))[0] < 2):
        return None
    missing = [v for v in _SLURM_VARS if v not in env]
    if missing:
        raise UsageError(f"run.launcher=slurm but {', '.join(missing)} not set: start the processes with srun")
    rank, local_rank, world_size = _ints(env, _SLURM_VARS)
    addr, port = slurm_rendezvous(env)
    return _checked("slurm", rank, local_rank, world_size, local_world_size=_tasks_on_this_node(env),
                    init_method=f"tcp://{host_port(addr, port)}")  # fmt: skip


def detect_launch(env: Env = os.environ, launcher: str = "auto") -> Launch:
    """Who started this process. auto: torchrun/accelerate variables, then SLURM (inside srun),
    then a single process; run.launcher names one and reads only its variables."""
    if launcher == "none":
        return Launch("none", 0, 0, 1)
    accelerate = any(k.startswith("ACCELERATE_") for k in env)
    found = None
    if launcher in ("auto", "torchrun", "accelerate"):
        found = _torchrun(env, "accelerate" if accelerate else "torchrun")
        if found is None and accelerate and launcher != "torchrun":
            found = _accelerate_mpi(env)
        if found is None and launcher != "auto":
            raise UsageError(
                f"run.launcher={launcher} but none of its variables are set: start with "
                + ("torchrun ... ddp/train.py" if launcher == "torchrun" else "accelerate launch ddp/train.py")
            )
        if found and launcher == "accelerate" and found.launcher != "accelerate":
            raise UsageError("run.launcher=accelerate but no ACCELERATE_* variable is set: start with accelerate "
                             "launch")  # fmt: skip
    if found is None and launcher == "auto":
        _not_plain_mpirun(env)
    if found is None and launcher in ("auto", "slurm"):
        found = _slurm(env, forced=launcher == "slurm")
    return found or Launch("none", 0, 0, 1)


def _not_plain_mpirun(env: Env) -> None:
    """`mpirun -n 2 python ddp/train.py` (no accelerate): each process ran alone, and the second found the run's
    out_dir "in use by another run" (the first). Before SLURM's variables: mpirun inside an allocation has them too."""
    if (size := _mpi_size(env)) > 1:
        raise UsageError(
            f"mpirun started {size} processes, and ddp-cifar takes its ranks from torchrun, srun or accelerate "
            f"(which runs mpirun for you): torchrun --standalone --nproc_per_node={size} ddp/train.py ..., or "
            f"NPROC={size} bash launch/accelerate.sh ..."
        )


def speaks_for_its_machine(env: Env = os.environ) -> bool:
    """Whether this process is local rank 0 (or alone): the one that prints an error every rank
    shares. Launcher variables that do not make sense leave every process speaking (plain mpirun's make sense: its
    local rank 0 speaks)."""
    if launch := launched(env):
        return launch.local_rank == 0
    return env[names[1]] == "0" if (names := _mpi_vars(env)) else True


def has_peers(env: Env = os.environ) -> bool:
    """Whether a launcher started this process as one rank of several. Launcher variables that do not
    make sense: not known, so no; but a plain mpirun's processes have peers (its local rank 0 says why they end: the
    others wait for it, or mpirun, ending all at the first exit, killed it before it had, 1 run in 4 inside sbatch)."""
    if launch := launched(env):
        return launch.world_size > 1
    with contextlib.suppress(UsageError):  # (its variables make no sense: not known, so no)
        return _mpi_size(env) > 1
    return False


def _mpi_size(env: Env) -> int:
    """The processes MPI's variables (Open MPI's, MPICH's) say it started; 0 where there are none."""
    return _counts(env, names)[2] if (names := _mpi_vars(env)) else 0


def launched(env: Env = os.environ) -> Launch | None:
    """What the launcher's variables say, or None where they do not make sense (a mistake said elsewhere)."""
    try:
        return detect_launch(env)
    except UsageError:
        return None


def master_address(env: Env = os.environ) -> str | None:
    """MASTER_ADDR: the host where the ranks meet (rank 0's, or torchrun's rendezvous store)."""
    return env.get("MASTER_ADDR")


def node_rank(env: Env = os.environ) -> int | None:
    """NODE_RANK, as launch/multinode.sh is given it on each machine; None when it is not set."""
    value = env.get("NODE_RANK")
    if value is not None and not value.isdigit():
        raise UsageError(f"NODE_RANK={value!r} must be a whole number: 0 on the machine at MASTER_ADDR, 1, 2, ...")
    return None if value is None else int(value)


def master_port(env: Env = os.environ, default: int = 29400) -> int:
    """MASTER_PORT, or launch/multinode.sh's default for torchrun's rendezvous."""
    value = env.get("MASTER_PORT", str(default))
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise UsageError(f"MASTER_PORT={value!r} is not a port number (1-65535)")
    return int(value)


def spans_machines(env: Env = os.environ) -> bool:
    """Whether this process's job has ranks on other machines (more ranks than this node starts)."""
    launch = launched(env)
    return launch is not None and launch.world_size > launch.local_world_size


def agent_store(env: Env = os.environ) -> tuple[str, int, str] | None:
    """(address, port, key prefix) of torchrun's agent store when its workers are meant to use it
    (TORCHELASTIC_USE_AGENT_STORE), else None. The prefix gives each restart attempt keys of its own."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return env["MASTER_ADDR"], master_port(env), f"ddp-cifar/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def record_error(line: str, env: Env = os.environ) -> None:
    """Under torchrun: `line` where its agent looks for a worker's error (TORCHELASTIC_ERROR_FILE, in
    the form torch.distributed.elastic's @record writes), so that its failure report shows this line
    as the root cause instead of error_file: <N/A>. Elsewhere nothing."""
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    error = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
    with contextlib.suppress(OSError):  # the report is a courtesy: the line is on stderr already
        Path(path).write_text(json.dumps({"message": error}))


@contextlib.contextmanager
def environment_changed(changes: dict[str, str | None]) -> Iterator[None]:
    """os.environ with `changes` while inside (None: the variable unset), as it was after."""
    before = {name: os.environ.get(name) for name in changes}

    def put(values: dict[str, str | None]) -> None:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    put(changes)
    try:
        yield
    finally:
        put(before)


# A folder of the agent's (pausing.finish_marks: ddp/torchrun.py's, ddp/accelerate_launch.py's) where each of its
# ranks leaves a mark as its training ends.
FINISHED_DIR = "DDP_CIFAR_FINISHED_DIR"


def record_finished(env: Env = os.environ) -> None:
    """Under pausing.finish_marks' agent: this rank has trained to its last epoch (its checkpoint written), marked
    where the agent looks after a stop signal that came later: the run is complete, not stopped. Elsewhere nothing."""
    folder = env.get(FINISHED_DIR)
    if folder and "LOCAL_RANK" in env:
        with contextlib.suppress(OSError):  # (no mark: the agent's exit code says the signal, as without one)
            Path(folder, f"local-rank-{env['LOCAL_RANK']}").write_text(env.get("LOCAL_WORLD_SIZE", "1"))


def all_finished(folder: str | Path) -> bool:
    """Whether every rank of an agent (LOCAL_WORLD_SIZE of them) left its mark in `folder` (record_finished)."""
    marks = [mark.read_text() for mark in Path(folder).glob("local-rank-*")]
    return bool(marks) and all(mark == str(len(marks)) for mark in marks)


def accelerate_flags(run: RunConfig, env: Env = os.environ) -> RunConfig:
    """run with `accelerate launch --cpu / --mixed_precision / --use_fsdp / --dynamo_backend inductor` applied: they
    choose what the config left at its default; a config that says otherwise, or a choice this loop lacks, is an error,
    not a silent pick. (--use_fsdp means run.parallel=fsdp, our FSDP2: its --fsdp_* settings do not apply to it.)"""
    changes = {}
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true" and run.parallel != "fsdp":
        if run.parallel != "auto":
            raise UsageError(f"accelerate launch --use_fsdp but run.parallel={run.parallel}: drop one of them")
        changes["parallel"] = "fsdp"
    if env.get("ACCELERATE_USE_CPU", "").lower() == "true" and run.device != "cpu":
        if run.device != "auto":
            raise UsageError(f"accelerate launch --cpu but run.device={run.device}: drop one of them")
        changes["device"] = "cpu"
    for flag in ("deepspeed", "megatron_lm"):  # ZeRO, Megatron's model parallelism: the run was DDP without a word
        if env.get(f"ACCELERATE_USE_{flag.upper()}", "").lower() == "true":
            raise UsageError(f"accelerate launch --use_{flag}: this loop runs DDP, or FSDP2 (--use_fsdp), not {flag}")
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper()  # --dynamo_backend: torch.compile's, was ignored
    if backend not in ("NO", "INDUCTOR"):
        raise UsageError(f"accelerate launch --dynamo_backend {backend.lower()}: this loop compiles by inductor or not")
    if backend == "INDUCTOR":
        changes["compile"] = True
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if precision not in ("no", "bf16", "fp16"):  # fp8 (accelerate's, through TransformerEngine): trained in fp32
        raise UsageError(f"accelerate launch --mixed_precision {precision}: this loop trains in no, bf16 or fp16")
    if precision in ("bf16", "fp16") and run.amp != precision:
        if run.amp != "off":
            raise UsageError(f"accelerate launch --mixed_precision {precision} but run.amp={run.amp}: drop one of them")
        changes["amp"] = precision
    return replace(run, **changes)


def slurm_job(env: Env = os.environ) -> str | None:
    """The SLURM job this process runs in, as scontrol names it (an array task as ARRAYJOB_TASK); None outside SLURM.
    Its suspend (scontrol suspend: PreemptMode=SUSPEND, gang scheduling) sends each process of the job, on every
    machine, SIGTSTP, then SIGSTOP 2 s later; its resume, SIGCONT (seen with slurm-wlm 22.05)."""
    if "SLURM_JOB_ID" not in env:
        return None
    array = ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")
    return "_".join(env[v] for v in array) if all(v in env for v in array) else env["SLURM_JOB_ID"]


# What ddp.doctor reports about a launch, before and during one.


def launch_variables(env: Env = os.environ) -> dict[str, str]:
    """The launcher variables that are set."""
    names = (*TORCHRUN_VARS, "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RESTART_COUNT")
    prefixes = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NODEID",
                "SLURM_JOB_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_GPUS", "ACCELERATE_", "OMPI_COMM_WORLD_",
                "PMI_RANK", "PMI_SIZE")  # fmt: skip
    return {k: v for k, v in sorted(env.items()) if k in names or k.startswith(prefixes)}


def planned_rendezvous(env: Env = os.environ) -> tuple[str, int, str]:
    """(address, port, where from) a launch from here would use: MASTER_ADDR/PORT, a SLURM job's, else torchrun's."""
    if "SLURM_JOB_ID" in env and (env.get("SLURM_JOB_NODELIST") or "MASTER_ADDR" in env):
        addr, port = slurm_rendezvous(env)
        return addr, port, "SLURM job" if "MASTER_PORT" not in env else "MASTER_ADDR/MASTER_PORT"
    if "MASTER_PORT" in env:
        return env.get("MASTER_ADDR", "127.0.0.1"), master_port(env), "MASTER_ADDR/MASTER_PORT"  # checked: the doctor's
    return "127.0.0.1", 29500, "torchrun's default"


def slurm_gpu_problem(cuda_count: int, env: Env = os.environ) -> str | None:
    """Why SLURM's tasks and this node's GPUs do not pair up one to one, or None if they do (or
    there are no GPUs, or no srun step)."""
    if "SLURM_STEP_ID" not in env or cuda_count <= 1 or "RANK" in env:
        return None  # one GPU per task (or none) pairs up; torchrun under srun starts its own processes
    tasks = _tasks_on_this_node(env)
    if tasks == cuda_count:
        return None
    return (
        f"SLURM runs {tasks} task(s) on this node and each sees {cuda_count} GPUs: use --ntasks-per-node="
        f"{cuda_count}, or --gpus-per-task=1 so that each task gets its own GPU"
    )
