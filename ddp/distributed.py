"""The process group: the World each process is, its device, joining and leaving the group,
naming a lost rank, wrapping the model, and the few collectives the loop uses.

`resolve` turns `run.device`, `run.parallel` and the launch (launchers.py: who started this process)
into a frozen World *before* any CUDA or network work, so every bad combination is a UsageError
(exit 2) instead of a hang or a traceback. `setup` joins the group and always leaves it. The only
module that calls init_process_group. It knows nothing of data, models or checkpoints.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import re
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch._dynamo  # noqa: F401 (see below)
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddp import launchers
from ddp.config import DdpConfig, RunConfig
from ddp.errors import PeerLost, UsageError, WriteFailed
from ddp.launchers import Env, Launch

# torch._dynamo imported while a process group exists (the optimizer imports it on first use) keeps
# that group alive past destroy_process_group; its gloo threads then race the interpreter's exit and
# abort it (SIGABRT: 3 of 120 two-rank runs here). Imported with this module, before any group, it
# takes no reference. tests/test_ddp.py checks that no gloo thread outlives a run.
T = TypeVar("T")
# ddp.broadcast_buffers=false: torch 2.14 renamed DDP's broadcast_buffers (now a deprecation warning).
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:(\d+))$")


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int  # processes in the job; 1 for none and dp
    device: torch.device  # this rank's device; under dp the first of the GPUs it spreads over
    parallel: str  # "none" | "dp" | "ddp", resolved from run.parallel
    launcher: str = "none"  # who started the processes: torchrun | accelerate | slurm | none
    init_method: str | None = None  # tcp://host:port for slurm and MPI; None = torchrun's env://
    backend: str = "auto"  # run.backend: "gloo" on a GPU lets ranks share it; auto = nccl on CUDA, gloo on CPU
    # Set by setup() on CUDA: a gloo group for CPU-side flags, which must not wait on the CUDA stream.
    control: Any = field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints and writes files."""
        return self.rank == 0

    @property
    def process_group_backend(self) -> str:
        """nccl for CUDA devices unless run.backend=gloo; gloo for CPUs."""
        return "nccl" if self.device.type == "cuda" and self.backend != "gloo" else "gloo"

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the one process per node that downloads."""
        return self.local_rank == 0

    def split(self, global_batch: int, key: str, accum_steps: int = 1) -> int:
        """This rank's share of a global batch; every rank gets the same share, which splits again
        into `accum_steps` equal micro-batches."""
        unit = self.world_size * accum_steps
        if global_batch >= 1 and global_batch % unit == 0:
            return global_batch // self.world_size
        lo = max(unit, global_batch // unit * unit)
        if accum_steps == 1:
            raise UsageError(
                f"{key}={global_batch} must be a positive multiple of world_size={self.world_size} "
                f"(it is the global batch, split evenly across ranks); try {lo} or {lo + self.world_size}"
            )
        per_rank = global_batch // self.world_size if global_batch % self.world_size == 0 else 0
        ks = [k for k in range(1, per_rank + 1) if per_rank % k == 0]  # the K that divide this rank's share
        near = [
            k
            for k in (
                max((k for k in ks if k < accum_steps), default=0),
                min((k for k in ks if k > accum_steps), default=0),
            )
            if k
        ]
        other = f", or train.grad_accum_steps={' or '.join(map(str, near))}" if near else ""
        raise UsageError(
            f"{key}={global_batch} must be a positive multiple of world_size x train.grad_accum_steps = "
            f"{self.world_size} x {accum_steps} = {unit} (equal micro-batches on every rank); "
            f"try {lo} or {lo + unit}{other}"
        )


def resolve_device(spec: str, launch: Launch | None, cuda_count: int, backend: str = "auto") -> torch.device:
    """run.device as a torch.device; launch is None for a single process. With backend gloo, ranks
    beyond the visible GPUs share them (local rank r takes cuda:<r mod GPUs>): nccl refuses that."""
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
    elif backend == "gloo":
        index = launch.local_rank % cuda_count  # ranks share GPUs: for testing, gloo only
    elif cuda_count == 1:
        raise UsageError(
            f"{launch.local_world_size} processes on this node but 1 GPU is visible to each: ranks cannot "
            "share a GPU under nccl; start one process per GPU (e.g. --nproc_per_node=1), use run.device=cpu, "
            "or run.backend=gloo to test several ranks on one GPU"
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


def resolve(run: RunConfig, env: Env = os.environ, cuda_count: int | None = None) -> World:
    """The World this process will be, from run.device, run.parallel, run.launcher and the
    launcher's variables.

    Pure: no CUDA calls beyond counting devices and no network, so errors come before any work.
    """
    launch = launchers.detect_launch(env, run.launcher)
    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if run.backend == "nccl" and (run.device == "cpu" or cuda_count == 0):
        raise UsageError("run.backend=nccl needs CUDA GPUs (nccl has no CPU path); use run.backend=auto or gloo")
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
    device = resolve_device(run.device, launch, cuda_count, run.backend)
    if parallel != "ddp":
        return World(0, launch.local_rank, 1, device, parallel, launch.launcher, backend=run.backend)
    return World(
        launch.rank, launch.local_rank, launch.world_size, device, parallel, launch.launcher, launch.init_method,
        backend=run.backend,
    )  # fmt: skip


def _rendezvous(world: World, timeout_s: float) -> tuple[dict[str, Any], dist.Store | None]:
    """init_process_group's arguments, and torchrun's agent store when the workers join there.

    world.init_method where we run the rendezvous (slurm, MPI); else torchrun's, with a key prefix
    that gives each restart attempt its own keys: restarted workers (torchrun --max-restarts) join
    the agent's store again, where the dead attempt's gloo addresses still are; they connect to those
    and fail ("Connection refused", pytorch/pytorch#167288). Outside an agent store: env://."""
    if world.init_method:
        return {"init_method": world.init_method, "rank": world.rank, "world_size": world.world_size}, None
    agent = launchers.agent_store()
    if agent is None:
        return {}, None
    addr, port, attempt = agent
    store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    store = dist.PrefixStore(f"ddp-cifar/attempt-{attempt}", store)
    return {"store": store, "rank": world.rank, "world_size": world.world_size}, store


def _silent_ranks(world: World, store: dist.Store | None, wait_s: float = 1.0) -> list[int] | None:
    """After a failed collective: the ranks that do not check in at the agent's store within
    `wait_s` (dead or hung), or None without an agent store (it would have died with rank 0)."""
    if store is None:
        return None
    # The launcher, seeing a dead worker, SIGTERMs the others; this rank is leaving anyway, and
    # takes at most `wait_s` more to say whom it lost (torchrun's SIGKILL comes 30 s later).
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        store.set(f"lost-contact/{world.rank}", "1")
        keys = [f"lost-contact/{r}" for r in range(world.world_size)]
        deadline = time.monotonic() + wait_s
        while not all(present := [store.check([k]) for k in keys]) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [r for r, here in enumerate(present) if not here]
    except Exception:  # the store is gone too: say what we know
        return None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _is_comm_failure(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return any(s in text for s in ("gloo", "NCCL", "Connection reset", "Connection closed", "imed out"))


def _lost_contact(world: World, error: BaseException, timeout_s: float, store: dist.Store | None) -> PeerLost:
    first = str(error).strip().splitlines()[0]
    hung = "imed out" in first or "imeout" in first
    what = f"no answer within run.timeout_s={timeout_s:g}: hung" if hung else "its connection closed: it died"
    silent = _silent_ranks(world, store)
    who = f"rank {', '.join(map(str, silent))}" if silent else "another rank"
    return PeerLost(f"rank {world.rank} of {world.world_size}: lost contact with {who} ({what}) [{first}]")


@contextmanager
def setup(world: World, timeout_s: float) -> Iterator[World]:
    """Pin the device and join the process group; always leave it, on errors too. Yields the World
    to use inside (with its control group); a failed collective leaves as PeerLost, naming the rank.

    Takes a World from resolve(), so every usage check is done before the rendezvous can wait.
    Let DDP objects die inside the block (e.g. keep them in a function called there): gloo
    objects that outlive the process group can abort the process (SIGABRT) when they are freed.
    An exception's traceback keeps the frames' locals (the DDP model) alive, so they are cleared
    before the group is destroyed."""
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)  # before any CUDA work, so nothing lands on cuda:0
    store = None
    try:
        if world.parallel == "ddp":
            rendezvous, store = _rendezvous(world, timeout_s)
            backend = world.process_group_backend
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **rendezvous)
            if backend == "nccl":
                world = replace(world, control=dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))
        yield world
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)  # frames keep their names and lines, not their locals
        if world.parallel == "ddp" and isinstance(e, (dist.DistError, RuntimeError)) and _is_comm_failure(e):
            raise _lost_contact(world, e, timeout_s, store) from e
        raise
    finally:
        if dist.is_initialized():
            gc.collect()  # DDP objects in reference cycles go now, while their group exists
            dist.destroy_process_group()


def wrap(model: nn.Module, world: World, knobs: DdpConfig) -> nn.Module:
    """What forward is called on: the model itself, nn.DataParallel or DDP with the `ddp:` settings."""
    if world.parallel == "ddp":
        ids = [world.device.index] if world.device.type == "cuda" else None
        wrapped = DistributedDataParallel(
            model, device_ids=ids, bucket_cap_mb=knobs.bucket_cap_mb, static_graph=knobs.static_graph,
            find_unused_parameters=knobs.find_unused_parameters, gradient_as_bucket_view=knobs.gradient_as_bucket_view,
            **({} if knobs.broadcast_buffers else _NO_FORWARD_BUFFER_SYNC),
        )  # fmt: skip
        if knobs.comm_hook != "none":
            wrapped.register_comm_hook(None, _compress_hook(knobs.comm_hook, world))
        return wrapped
    if world.parallel == "dp":
        return nn.DataParallel(model)
    return model


def _compress_hook(name: str, world: World) -> Callable[..., Any]:
    """ddp.comm_hook's hook: gradients cast to fp16/bf16 for the all-reduce, then back (torch's
    default_hooks); bf16 only where the backend can all-reduce it."""
    if name == "fp16":
        return default_hooks.fp16_compress_hook
    try:  # ask the backend, on this device (nccl needs 2.10+ and a bf16 GPU; gloo builds differ)
        dist.all_reduce(torch.zeros(1, dtype=torch.bfloat16, device=world.device))
    except RuntimeError:
        raise UsageError(
            f"ddp.comm_hook=bf16: the {dist.get_backend()} backend here cannot all-reduce bfloat16; "
            "use ddp.comm_hook=fp16"
        ) from None
    return default_hooks.bf16_compress_hook


def micro_batches(wrapped: nn.Module, count: int) -> Iterator[contextlib.AbstractContextManager[Any]]:
    """One context per micro-batch of an optimizer step, for its forward *and* backward: DDP's
    no_sync() for all but the last, so gradients accumulate locally and are all-reduced once, in the
    last backward (pytorch/pytorch#43201: no_sync around the backward alone, or one too many, is wrong)."""
    ddp = isinstance(wrapped, DistributedDataParallel)
    for i in range(count):
        yield wrapped.no_sync() if ddp and i < count - 1 else contextlib.nullcontext()


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


def sync_buffers(model: nn.Module, world: World, how: str = "broadcast") -> None:
    """Make every rank's buffers (BatchNorm running stats) one, so all ranks evaluate and save one
    model: DDP syncs buffers at the start of each forward, so after the last step they differ.
    broadcast = rank 0's; reduce = the mean over ranks of the float ones (train.dist_bn)."""
    if world.parallel != "ddp":
        return
    for b in model.buffers():
        if how == "reduce" and b.is_floating_point():
            dist.all_reduce(b, op=dist.ReduceOp.SUM)
            b.div_(world.world_size)
        else:
            dist.broadcast(b, src=0)


def any_rank(flag: bool, world: World) -> bool:
    """True on every rank if it is True on any: one all-reduce of a CPU tensor (no GPU sync)."""
    if world.parallel != "ddp":
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.control)
    return bool(t.item())


def same_on_all_ranks(value: int, world: World) -> bool:
    """Whether every rank holds the same integer (e.g. the checkpoint step each one found)."""
    if world.parallel != "ddp":
        return True
    t = torch.tensor([value, -value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.control)
    return int(t[0]) == -int(t[1])


def on_rank0(world: World, action: Callable[..., T], *args: Any) -> T | None:
    """Rank 0 does `action(*args)` (a write); then every rank learns whether it failed and raises the same
    error (rank 0's message), so that none waits in a collective for a rank that has left. Returns
    action's result on rank 0, None on the others."""
    result, error = None, None
    if world.is_main:
        try:
            result = action(*args)
        except (UsageError, WriteFailed) as e:
            error = e
    if any_rank(error is not None, world):
        kind, message = gather_objects((type(error).__name__, str(error)) if error else None, world)[0]
        raise error or (WriteFailed if kind == "WriteFailed" else UsageError)(message)
    return result


def gather_objects(obj: Any, world: World) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (pickled between our own processes)."""
    if world.parallel != "ddp":
        return [obj]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, obj, group=world.control)
    return out
