"""Processes and devices: launcher detection, the device of each rank, the process group, wrapping.

The only module that reads RANK / LOCAL_RANK / WORLD_SIZE or calls init_process_group. It resolves
`run.device` and `run.parallel` into a frozen World *before* any CUDA or network work, so every bad
combination is a UsageError (exit 2) instead of a hang or a traceback. It does not know about data,
models or checkpoints.

Launchers: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; anything else is
one process. (SLURM and accelerate detection come with the launch issue.)
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
from dataclasses import dataclass
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
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:(\d+))$")


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


def launch_env(env: dict[str, str] | None = None) -> tuple[int, int, int] | None:
    """(rank, local_rank, world_size) set by torchrun, or None for a plain single process."""
    env = os.environ if env is None else env
    present = [v for v in _LAUNCH_VARS if v in env]
    if not present:
        return None
    missing = [v for v in _LAUNCH_VARS if v not in env]
    if missing:
        raise UsageError(
            f"{', '.join(present)} set but {', '.join(missing)} not: launch with "
            "torchrun (which sets them all), or unset them for a single process"
        )
    try:
        rank, local_rank, world_size = (int(env[v]) for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    except ValueError:
        raise UsageError("RANK, LOCAL_RANK and WORLD_SIZE must be integers") from None
    if not 0 <= rank < world_size or local_rank < 0:
        raise UsageError(f"RANK={rank} must be in [0, WORLD_SIZE={world_size}) and LOCAL_RANK >= 0")
    return rank, local_rank, world_size


def resolve_device(spec: str, local_rank: int | None, cuda_count: int) -> torch.device:
    """run.device as a torch.device; local_rank is None for a single process."""
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
        if local_rank is not None:
            raise UsageError(
                f"run.device={spec}: under torchrun each rank uses cuda:<local_rank>; "
                "use run.device=cuda (or auto) and CUDA_VISIBLE_DEVICES to pick GPUs"
            )
    else:
        index = 0 if local_rank is None else local_rank
    if index >= cuda_count:
        what = f"run.device={spec}" if local_rank is None else f"LOCAL_RANK={local_rank}"
        raise UsageError(
            f"{what} but only {cuda_count} GPU(s) are visible (cuda:0..cuda:{cuda_count - 1}); "
            + ("pick one of those" if local_rank is None else "start at most that many processes per node")
        )
    return torch.device("cuda", index)


def resolve(run: RunConfig, env: dict[str, str] | None = None, cuda_count: int | None = None) -> World:
    """The World this process will be, from run.device, run.parallel and the launcher's variables.

    Pure: no CUDA calls beyond counting devices and no network, so errors come before any work.
    """
    launched = launch_env(env)
    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if launched is None:
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
    rank, local_rank, world_size = launched
    parallel = "ddp" if run.parallel == "auto" else run.parallel
    if parallel == "dp":
        raise UsageError("run.parallel=dp is a single-process mode; under torchrun use ddp (or auto)")
    if parallel == "none" and world_size > 1:
        raise UsageError(
            f"run.parallel=none under torchrun with WORLD_SIZE={world_size} would train "
            f"{world_size} unrelated models; use run.parallel=ddp (or auto)"
        )
    device = resolve_device(run.device, local_rank, cuda_count)
    world_size = world_size if parallel == "ddp" else 1
    return World(rank if parallel == "ddp" else 0, local_rank, world_size, device, parallel)


def _attempt_store(world: World, timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """init_process_group arguments that give each torchrun restart attempt its own keys.

    Restarted workers (torchrun --max-restarts) join the agent's store again, where the dead
    attempt's gloo addresses still are; they connect to those and fail ("Connection refused",
    pytorch/pytorch#167288). A prefix per attempt keeps the attempts apart. Outside torchrun's
    agent store: {} (plain env:// rendezvous)."""
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
                **_attempt_store(world, timeout_s),
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
