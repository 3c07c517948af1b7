"""Processes and devices: launcher detection, the device of each rank, the process group, wrapping.

The only module that reads RANK / LOCAL_RANK / WORLD_SIZE or calls init_process_group. It resolves
`run.device` and `run.parallel` into a frozen World *before* any CUDA or network work, so every bad
combination is a UsageError (exit 2) instead of a hang or a traceback. It does not know about data,
models or checkpoints.

Launchers, in this order unless run.launcher names one (detect_launch):
- torchrun (and `accelerate launch --multi_gpu`, which runs torchrun): RANK, LOCAL_RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT; the rendezvous is torchrun's (env://).
- accelerate's CPU mode (`--cpu --num_processes N --mpirun_hostfile F`): mpirun's rank variables plus
  MASTER_ADDR/MASTER_PORT.
- SLURM, inside `srun` (SLURM_STEP_ID set): SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS; rank 0 is on the
  step's first node, the port is derived from the job id (slurm_port).
- otherwise one process.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp.config import RunConfig
from ddp.errors import UsageError

_control: dist.ProcessGroup | None = None  # gloo group for CPU flags when the main group is nccl
_agent_store: dist.Store | None = None  # torchrun's store (outlives dead workers), this attempt's keys
_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SLURM_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
# (rank, local rank, world size, processes on this node) as mpirun sets them: Open MPI, MPICH/Intel MPI.
_MPI_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
)
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:(\d+))$")


@dataclass(frozen=True)
class Launch:
    """What the launcher's variables say about this process, before devices are considered."""

    launcher: str  # torchrun | accelerate | slurm | none
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int = 1  # processes on this node
    init_method: str | None = None  # tcp://host:port when the launcher leaves the rendezvous to us


class PeerLost(Exception):
    """A collective failed: another rank died, hung past run.timeout_s, or the network broke."""


def _is_comm_failure(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return any(s in text for s in ("gloo", "NCCL", "Connection reset", "Connection closed", "imed out"))


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int  # processes in the job; 1 for none and dp
    device: torch.device  # this rank's device; under dp the first of the GPUs it spreads over
    parallel: str  # "none" | "dp" | "ddp", resolved from run.parallel
    launcher: str = "none"  # who started the processes: torchrun | accelerate | slurm | none
    init_method: str | None = None  # tcp://host:port for slurm and MPI; None = torchrun's env://

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints and writes files."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the one process per node that downloads."""
        return self.local_rank == 0

    def split(self, global_batch: int, key: str) -> int:
        """This rank's share of a global batch; every rank gets the same share."""
        if global_batch < 1 or global_batch % self.world_size:
            lo = max(self.world_size, global_batch // self.world_size * self.world_size)
            raise UsageError(
                f"{key}={global_batch} must be a positive multiple of world_size={self.world_size} "
                f"(it is the global batch, split evenly across ranks); try {lo} or {lo + self.world_size}"
            )
        return global_batch // self.world_size


def _ints(env: dict[str, str], names: tuple[str, ...]) -> list[int]:
    try:
        return [int(env[v]) for v in names]
    except ValueError:
        raise UsageError(f"{', '.join(names)} must be integers, got {[env[v] for v in names]}") from None


def _checked(launcher: str, rank: int, local_rank: int, world_size: int, **rest: Any) -> Launch:
    if not 0 <= rank < world_size or local_rank < 0:
        raise UsageError(f"{launcher}: rank {rank} must be in [0, world_size={world_size}) and local rank >= 0")
    return Launch(launcher, rank, local_rank, world_size, **rest)


def _torchrun(env: dict[str, str], name: str) -> Launch | None:
    """torchrun's variables (also what `accelerate launch --multi_gpu` sets), or None if none is set."""
    present = [v for v in _TORCHRUN_VARS if v in env]
    if not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} & set(present):
        return None  # MASTER_ADDR/PORT alone are a rendezvous address (SLURM scripts, accelerate --cpu)
    missing = [v for v in _TORCHRUN_VARS if v not in env]
    if missing:
        raise UsageError(
            f"{', '.join(present)} set but {', '.join(missing)} not: launch with "
            "torchrun (which sets them all), or unset them for a single process"
        )
    rank, local_rank, world_size = _ints(env, ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
    return _checked(name, rank, local_rank, world_size, local_world_size=local_world_size)


def _accelerate_mpi(env: dict[str, str]) -> Launch | None:
    """`accelerate launch --cpu --num_processes N --mpirun_hostfile F`: mpirun starts the processes
    (MPI's rank variables) and accelerate adds MASTER_ADDR/MASTER_PORT for the process group."""
    for names in _MPI_VARS:
        if names[0] in env:
            rank, local_rank, world_size = _ints(env, names[:3])
            master = f"tcp://{env.get('MASTER_ADDR', '127.0.0.1')}:{env.get('MASTER_PORT', '29500')}"
            local = int(env.get(names[3], world_size))
            return _checked("accelerate", rank, local_rank, world_size, local_world_size=local, init_method=master)
    if "MASTER_ADDR" in env:
        raise UsageError(
            "accelerate started 1 process for --num_processes > 1: with --cpu it starts several only "
            "through MPI (add --mpirun_hostfile FILE); bash launch/accelerate.sh does this for you"
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


def slurm_port(job_id: str) -> int:
    """The rendezvous port of a SLURM job: the same on every node, different for concurrent jobs,
    below Linux's ephemeral range (32768+) so no outgoing connection holds it."""
    return 10000 + int(job_id) % 20000


def slurm_rendezvous(env: dict[str, str] | None = None) -> tuple[str, int]:
    """(address, port) of rank 0 in a SLURM job: MASTER_ADDR/MASTER_PORT if set, else the first node
    of the step (or job) and slurm_port(job id). slurm/train.sh asks this for torchrun's rendezvous."""
    env = os.environ if env is None else env
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if "MASTER_ADDR" not in env and not nodes or "MASTER_PORT" not in env and "SLURM_JOB_ID" not in env:
        raise UsageError(
            "not inside a SLURM job (no SLURM_JOB_NODELIST / SLURM_JOB_ID): set MASTER_ADDR and MASTER_PORT"
        )
    addr = env.get("MASTER_ADDR") or first_host(nodes)
    port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else slurm_port(env["SLURM_JOB_ID"])
    return addr, port


def _tasks_on_this_node(env: dict[str, str]) -> int:
    """From SLURM_STEP_TASKS_PER_NODE ('2(x3),1': two tasks on each of 3 nodes, then one)."""
    counts = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1")).split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        counts += [int(m.group(1))] * int(m.group(2) or 1) if m else []
    node = int(env.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else 1


def _slurm(env: dict[str, str], forced: bool) -> Launch | None:
    """`srun python ddp/train.py`: one task per process, ranks from SLURM. Only inside a job step
    (SLURM_STEP_ID): the batch script itself also has SLURM_PROCID=0 and the job's SLURM_NTASKS."""
    if not forced and ("SLURM_STEP_ID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2):
        return None
    missing = [v for v in _SLURM_VARS if v not in env]
    if missing:
        raise UsageError(f"run.launcher=slurm but {', '.join(missing)} not set: start the processes with srun")
    rank, local_rank, world_size = _ints(env, _SLURM_VARS)
    addr, port = slurm_rendezvous(env)
    return _checked(
        "slurm",
        rank,
        local_rank,
        world_size,
        local_world_size=_tasks_on_this_node(env),
        init_method=f"tcp://{addr}:{port}",
    )


def detect_launch(env: dict[str, str] | None = None, launcher: str = "auto") -> Launch:
    """Who started this process. auto: torchrun/accelerate variables, then SLURM (inside srun),
    then a single process; run.launcher names one and reads only its variables."""
    env = os.environ if env is None else env
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
            raise UsageError(
                "run.launcher=accelerate but no ACCELERATE_* variable is set: start with accelerate launch"
            )
    if found is None and launcher in ("auto", "slurm"):
        found = _slurm(env, forced=launcher == "slurm")
    return found or Launch("none", 0, 0, 1)


def launch_variables(env: dict[str, str] | None = None) -> dict[str, str]:
    """The launcher variables that are set, for ddp.doctor's report."""
    env = os.environ if env is None else env
    names = (*_TORCHRUN_VARS, "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RESTART_COUNT")
    prefixes = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NODEID",
                "SLURM_JOB_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_GPUS", "ACCELERATE_", "OMPI_COMM_WORLD_",
                "PMI_RANK", "PMI_SIZE")  # fmt: skip
    return {k: v for k, v in sorted(env.items()) if k in names or k.startswith(prefixes)}


def planned_rendezvous(env: dict[str, str] | None = None) -> tuple[str, int, str]:
    """(address, port, where from) that a launch from here would use: MASTER_ADDR/MASTER_PORT, a
    SLURM job's derived port, else torchrun's default 29500."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" in env and (env.get("SLURM_JOB_NODELIST") or "MASTER_ADDR" in env):
        addr, port = slurm_rendezvous(env)
        return addr, port, "SLURM job" if "MASTER_PORT" not in env else "MASTER_ADDR/MASTER_PORT"
    if "MASTER_PORT" in env:
        return env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"]), "MASTER_ADDR/MASTER_PORT"
    return "127.0.0.1", 29500, "torchrun's default"


def slurm_gpu_problem(cuda_count: int, env: dict[str, str] | None = None) -> str | None:
    """Why SLURM's tasks and this node's GPUs do not pair up one to one, or None if they do (or
    there are no GPUs, or no srun step)."""
    env = os.environ if env is None else env
    if "SLURM_STEP_ID" not in env or cuda_count <= 1 or _TORCHRUN_VARS[0] in env:
        return None  # one GPU per task (or none) pairs up; torchrun under srun starts its own processes
    tasks = _tasks_on_this_node(env)
    if tasks == cuda_count:
        return None
    return (
        f"SLURM runs {tasks} task(s) on this node and each sees {cuda_count} GPUs: use --ntasks-per-node="
        f"{cuda_count}, or --gpus-per-task=1 so that each task gets its own GPU"
    )


def accelerate_flags(run: RunConfig, env: dict[str, str] | None = None) -> RunConfig:
    """run with `accelerate launch --cpu / --mixed_precision` applied: they choose what the config
    left at its default; a config that says otherwise is an error, not a silent pick."""
    env = os.environ if env is None else env
    changes = {}
    if env.get("ACCELERATE_USE_CPU", "").lower() == "true" and run.device != "cpu":
        if run.device != "auto":
            raise UsageError(f"accelerate launch --cpu but run.device={run.device}: drop one of them")
        changes["device"] = "cpu"
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if precision in ("bf16", "fp16") and run.amp != precision:
        if run.amp != "off":
            raise UsageError(f"accelerate launch --mixed_precision {precision} but run.amp={run.amp}: drop one of them")
        changes["amp"] = precision
    return replace(run, **changes)


def resolve_device(spec: str, launch: Launch | None, cuda_count: int) -> torch.device:
    """run.device as a torch.device; launch is None for a single process."""
    m = _DEVICE.match(spec)
    if not m:
        raise UsageError(f"run.device={spec!r} is not a device; use auto, cpu, cuda or cuda:N (e.g. cuda:0)")
    if spec == "cpu" or (spec == "auto" and cuda_count == 0):
        return torch.device("cpu")
    if cuda_count == 0:
        raise UsageError(
            f"run.device={spec} but no CUDA GPU is visible (torch.cuda.is_available() is False); "
            "use run.device=cpu or auto"
        )
    if m.group(2) is not None:
        index = int(m.group(2))
        if launch is not None:
            raise UsageError(
                f"run.device={spec}: under {launch.launcher} each rank uses cuda:<local_rank>; "
                "use run.device=cuda (or auto) and CUDA_VISIBLE_DEVICES to pick GPUs"
            )
    elif launch is None:
        index = 0
    elif cuda_count == 1 and (launch.launcher == "slurm" or launch.local_world_size == 1):
        index = 0  # SLURM (--gpus-per-task=1) or CUDA_VISIBLE_DEVICES gave this process its own GPU
    elif cuda_count == 1:
        raise UsageError(
            f"{launch.local_world_size} processes on this node but 1 GPU is visible to each: ranks cannot "
            "share a GPU under nccl; start one process per GPU (e.g. --nproc_per_node=1) or use run.device=cpu"
        )
    else:
        index = launch.local_rank
    if index >= cuda_count:
        what = f"run.device={spec}" if launch is None else f"local rank {index}"
        raise UsageError(
            f"{what} but only {cuda_count} GPU(s) are visible (cuda:0..cuda:{cuda_count - 1}); "
            + ("pick one of those" if launch is None else "start at most that many processes per node")
        )
    return torch.device("cuda", index)


def resolve(run: RunConfig, env: dict[str, str] | None = None, cuda_count: int | None = None) -> World:
    """The World this process will be, from run.device, run.parallel, run.launcher and the
    launcher's variables.

    Pure: no CUDA calls beyond counting devices and no network, so errors come before any work.
    """
    launch = detect_launch(env, run.launcher)
    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if launch.launcher == "none":
        device = resolve_device(run.device, None, cuda_count)
        parallel = "none" if run.parallel == "auto" else run.parallel
        if parallel == "ddp":
            raise UsageError(
                "run.parallel=ddp needs one process per device: "
                "torchrun --standalone --nproc_per_node=N ddp/train.py ..."
            )
        if parallel == "dp":
            if cuda_count < 2:
                raise UsageError(
                    f"run.parallel=dp needs at least 2 visible GPUs, found {cuda_count}; "
                    "use run.parallel=none (one device) or torchrun for DDP"
                )
            if device != torch.device("cuda", 0):
                raise UsageError(
                    f"run.parallel=dp spreads over every visible GPU from cuda:0, not {device}; "
                    "choose the GPUs with CUDA_VISIBLE_DEVICES"
                )
        return World(0, 0, 1, device, parallel)
    parallel = "ddp" if run.parallel == "auto" else run.parallel
    if parallel == "dp":
        raise UsageError(f"run.parallel=dp is a single-process mode; under {launch.launcher} use ddp (or auto)")
    if parallel == "none" and launch.world_size > 1:
        raise UsageError(
            f"run.parallel=none under {launch.launcher} with world size {launch.world_size} would train "
            f"{launch.world_size} unrelated models; use run.parallel=ddp (or auto)"
        )
    device = resolve_device(run.device, launch, cuda_count)
    if parallel != "ddp":
        return World(0, launch.local_rank, 1, device, parallel, launch.launcher)
    return World(
        launch.rank, launch.local_rank, launch.world_size, device, parallel, launch.launcher, launch.init_method
    )


def _rendezvous(world: World, timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """init_process_group arguments: world.init_method where we run the rendezvous, else
    torchrun's, with a key prefix that gives each restart attempt its own keys.

    Restarted workers (torchrun --max-restarts) join the agent's store again, where the dead
    attempt's gloo addresses still are; they connect to those and fail ("Connection refused",
    pytorch/pytorch#167288). A prefix per attempt keeps the attempts apart. Outside torchrun's
    agent store: {} (plain env:// rendezvous)."""
    if world.init_method:  # slurm or MPI: our own rendezvous at rank 0's address
        return {"init_method": world.init_method, "rank": world.rank, "world_size": world.world_size}
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    global _agent_store
    _agent_store = dist.PrefixStore(f"ddp-cifar/attempt-{attempt}", store)
    return {"store": _agent_store, "rank": world.rank, "world_size": world.world_size}


def _silent_ranks(world: World, wait_s: float = 1.0) -> list[int] | None:
    """After a failed collective: the ranks that do not check in at the agent's store within
    `wait_s` (dead or hung), or None without an agent store (it would have died with rank 0)."""
    if _agent_store is None:
        return None
    # The launcher, seeing a dead worker, SIGTERMs the others; this rank is leaving anyway, and
    # takes at most `wait_s` more to say whom it lost (torchrun's SIGKILL comes 30 s later).
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        _agent_store.set(f"lost-contact/{world.rank}", "1")
        keys = [f"lost-contact/{r}" for r in range(world.world_size)]
        deadline = time.monotonic() + wait_s
        while not all(present := [_agent_store.check([k]) for k in keys]) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [r for r, here in enumerate(present) if not here]
    except Exception:  # the store is gone too: say what we know
        return None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _lost_contact_message(world: World, error: BaseException, timeout_s: float) -> str:
    first = str(error).strip().splitlines()[0]
    hung = "imed out" in first or "imeout" in first
    what = f"no answer within run.timeout_s={timeout_s:g}: hung" if hung else "its connection closed: it died"
    silent = _silent_ranks(world)
    who = f"rank {', '.join(map(str, silent))}" if silent else "another rank"
    return f"rank {world.rank} of {world.world_size}: lost contact with {who} ({what}) [{first}]"


@contextmanager
def setup(world: World, timeout_s: float) -> Iterator[World]:
    """Pin the device and join the process group; always leave it, on errors too.

    Takes a World from resolve(), so every usage check is done before the rendezvous can wait.
    Let DDP objects die inside the block (e.g. keep them in a function called there): gloo
    objects that outlive the process group can abort the process (SIGABRT) when they are freed.
    An exception's traceback keeps the frames' locals (the DDP model) alive, so they are cleared
    before the group is destroyed."""
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)  # before any CUDA work, so nothing lands on cuda:0
    global _control, _agent_store
    try:
        if world.parallel == "ddp":
            dist.init_process_group(
                "nccl" if world.device.type == "cuda" else "gloo",
                timeout=timedelta(seconds=timeout_s),
                **_rendezvous(world, timeout_s),
            )
            if world.device.type == "cuda":  # CPU-side flags must not wait on the CUDA stream
                _control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        yield world
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)  # frames keep their names and lines, not their locals
        if world.parallel == "ddp" and isinstance(e, (dist.DistError, RuntimeError)) and _is_comm_failure(e):
            raise PeerLost(_lost_contact_message(world, e, timeout_s)) from e
        raise
    finally:
        _control = _agent_store = None
        if dist.is_initialized():
            gc.collect()  # DDP objects in reference cycles go now, while their group exists
            dist.destroy_process_group()


def wrap(model: nn.Module, world: World) -> nn.Module:
    """What forward is called on: the model itself, nn.DataParallel or DDP."""
    if world.parallel == "ddp":
        ids = [world.device.index] if world.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if world.parallel == "dp":
        return nn.DataParallel(model)
    return model


def for_eval(wrapped: nn.Module) -> nn.Module:
    """The module to evaluate with: DDP's inner module (no collectives in a forward that ranks may
    call a different number of times), DataParallel itself (it only splits the batch)."""
    return wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped


def all_reduce_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    """Sum over ranks in place (a no-op in one process); returns t."""
    if world.parallel == "ddp":
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_agree(ok: bool, world: World) -> bool:
    """True only if every rank says ok; also a barrier. Lets one rank's failure stop all ranks."""
    return not any_rank(not ok, world)


def sync_buffers(model: nn.Module, world: World) -> None:
    """Rank 0's buffers (BatchNorm running stats) to every rank, so all ranks evaluate and save one
    model: DDP syncs buffers at the start of each forward, so after the last step they differ."""
    if world.parallel == "ddp":
        for b in model.buffers():
            dist.broadcast(b, src=0)


def any_rank(flag: bool, world: World) -> bool:
    """True on every rank if it is True on any: one all-reduce of a CPU tensor (no GPU sync)."""
    if world.parallel != "ddp":
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_control)
    return bool(t.item())


def same_on_all_ranks(value: int, world: World) -> bool:
    """Whether every rank holds the same integer (e.g. the checkpoint step each one found)."""
    if world.parallel != "ddp":
        return True
    t = torch.tensor([value, -value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_control)
    return int(t[0]) == -int(t[1])


def gather_objects(obj: Any, world: World) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (pickled between our own processes)."""
    if world.parallel != "ddp":
        return [obj]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, obj, group=_control)
    return out


def requeue_command(env: dict[str, str] | None = None) -> list[str] | None:
    """`scontrol requeue JOB` for the SLURM job this process runs in (an array task as
    ARRAYJOB_TASK), or None outside SLURM."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env:
        return None
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    else:
        job = env["SLURM_JOB_ID"]
    return ["scontrol", "requeue", job]
