"""The process group: joining and leaving it (`setup`), the wrapper forward is called on (`wrap`:
DistributedDataParallel or nn.DataParallel), and the collectives the run uses, each on the group
the rule below names. In one process (no group) every collective is the identity."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import inspect
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddp import fsdp, launchers, lifeline, lost_rank, network, startup
from ddp.config import DdpConfig
from ddp.devices import World
from ddp.errors import UsageError, WriteFailed

# The rule: which group a collective uses.
# - Tensors that live on the device (gradients, BatchNorm buffers, evaluation counts, loss sums) go
#   through the default group: nccl on GPUs, gloo on CPUs.
# - Decisions made on the host (a stop, a divergence, a rank-0 error, which checkpoint) and Python
#   objects go through world.control: on GPUs a gloo group beside nccl, so that a flag never waits
#   behind the GPU's queued work and reading it never syncs the GPU; on CPUs it is the default group.
# Rank 0's side effects (printing, writing files) go under `if world.is_main:`, never a collective or a
# forward. One that can fail (a write) goes inside `with fail_together(world):` as well, because the
# other ranks would otherwise wait in their next collective for a rank 0 that has gone.

# ddp.broadcast_buffers=false: torch 2.14 renamed DDP's broadcast_buffers (now a deprecation warning).
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)

# torch before 2.8 destroys a gloo group holding the interpreter lock and waits there for its worker threads, which may
# still need that lock to free the last collective's tensors: a deadlock (2.4.1, 1 in 30 two-rank jobs three at a time:
# py-spy showed a worker in ~AsyncAllgatherWork waiting for the lock; pytorch/pytorch#154976). A pause lets them first.
GLOO_PAUSE_S = 0.2 if torch.torch_version.TorchVersion(torch.__version__) < (2, 8) else 0.0


def import_dynamo() -> None:
    """torch._dynamo, imported before any process group exists. Imported later (the optimizer imports it on first
    use) it keeps that group alive past destroy_process_group; its gloo threads then race the interpreter's exit
    and abort it (SIGABRT: 3 of 120 two-rank runs; tests/test_ddp.py). Not at the top: a usage error skips its 1 s.
    A setting of torch's in the environment that its config cannot read (TORCH_COMPILE_DEBUG=true) is a UsageError."""
    try:
        importlib.import_module("torch._dynamo")  # (an `import torch._dynamo` here would make torch local)
    except ValueError as e:
        if refused := startup.torch_variable_refused(e):
            raise UsageError(refused) from None
        raise


@contextmanager
def setup(world: World, timeout_s: float) -> Iterator[World]:
    """Pin this rank's GPU and join the process group; always leave it, on errors too. Yields the
    World to use inside (with its control group); a failed collective leaves as PeerLost naming the
    lost rank. Let DDP objects die inside (gloo objects that outlive the group abort the process)."""
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)  # before any CUDA work, so that nothing lands on cuda:0
    import_dynamo()
    store = None
    try:
        if world.grouped:
            where = f"the rendezvous ({_meeting_point(world)})"
            with lifeline.deadline(timeout_s, where), lost_rank.naming(world, where):  # a dead store: minutes
                rendezvous, store = _rendezvous(world, timeout_s, where)
                backend = world.process_group_backend
                dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **rendezvous)
                if backend == "nccl":
                    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                    world = replace(world, control=control)
        yield world
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)  # frames keep their names and lines, not their locals (DDP)
        if world.grouped and lost_rank.is_comm_failure(e):
            raise lost_rank.explain(world, e, timeout_s, store, lifeline.stopped_lately(timeout_s)) from e
        if store is not None:  # its own error (out of memory, say): why, for a rank it leaves (explain names it)
            lost_rank.say_why(world, e, store)
        raise
    finally:
        if dist.is_initialized():
            gc.collect()  # DDP objects in reference cycles go now, while their group exists
            time.sleep(GLOO_PAUSE_S)  # (the lock released: gloo's threads free what they hold)
            with lifeline.deadline(timeout_s, "leaving the process group"), backstop(timeout_s):
                dist.destroy_process_group()  # (torch 2.4's gloo hung there holding the GIL: the backstop ends it)


@contextmanager
def backstop(seconds: float) -> Iterator[None]:
    """Around a call into torch that may hang holding the interpreter's lock: lifeline's watcher, a Python thread, never
    runs again (torch 2.4's gloo in destroy_process_group, once in a loaded suite: a rank outlived its launcher by an
    hour). Past `seconds` + SLACK_S + BACKSTOP_S faulthandler's thread, which needs no lock, writes each thread's
    stack to stderr (where it hangs) and ends the process, exit 1."""
    faulthandler.dump_traceback_later(seconds + lifeline.SLACK_S + lifeline.BACKSTOP_S, exit=True, file=2)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _meeting_point(world: World) -> str:
    """Where the ranks meet, for a line about a rendezvous that does not end."""
    agent = launchers.agent_store()
    if world.init_method:
        return world.init_method
    return f"torchrun's store at {network.host_port(*agent[:2])}" if agent else "env://MASTER_ADDR:MASTER_PORT"


def _rendezvous(world: World, timeout_s: float, where: str) -> tuple[dict[str, Any], dist.Store | None]:
    """init_process_group's arguments, and the store where the ranks met.

    Where we run the rendezvous (slurm, MPI, a torchrun that shares no store of its own, as torch 2.4's:
    world.init_method), a store rank 0 serves there, as init_method=tcp:// and env:// would; else torchrun's, with
    a key prefix that gives each restart attempt its own keys: restarted workers (torchrun --max-restarts) join
    the agent's store again, where the dead attempt's gloo addresses still are; they connect to those
    and fail ("Connection refused", pytorch/pytorch#167288). In either each rank first waits for all the
    others, or for the reason one that stopped before it came left (lost_rank.wait_for_everyone).
    Outside both (a World made without a launcher's variables): env://.
    Picks the network interface first where this host's name resolves to a loopback address."""
    master = urlsplit(world.init_method).hostname if world.init_method else launchers.master_address()
    note = network.pick_interface(master, launchers.spans_machines()) if master else None
    if note and world.is_local_main:  # each machine says it once
        print(f"rank {world.rank}: {note} (GLOO_SOCKET_IFNAME chooses)", flush=True)
    meeting = lost_rank.served_by_rank_0(world.init_method) if world.init_method else launchers.agent_store()
    if meeting is None:
        return {}, None
    addr, port, prefix = meeting
    ours = world.init_method is not None  # rank 0 serves it, as init_method=tcp:// would: it goes when rank 0 does
    if ours and world.is_main:
        network.check_port_free(port)  # else one line naming who holds it (another run's rank 0?), not EADDRINUSE
    timeout = timedelta(seconds=timeout_s)
    served = dist.TCPStore(addr, port, world.world_size, world.is_main, timeout, wait_for_workers=False) if ours \
        else dist.TCPStore(addr, port, is_master=False, timeout=timeout)  # fmt: skip
    store = dist.PrefixStore(prefix, served)
    lost_rank.register_host(world, store)
    lost_rank.wait_for_everyone(world, store, timeout_s, where, clock=lifeline.awake)
    group = {"store": store, "rank": world.rank, "world_size": world.world_size}
    return group, store  # (lost_rank.explain asks it which ranks are lost; one rank 0 serves goes with rank 0)


def shard(model: nn.Module, world: World, amp: torch.dtype | None) -> nn.Module:
    """Under run.parallel=fsdp, FSDP2's fully_shard on each block and the root, in place (fsdp.shard):
    before the optimizer is made, which must hold the sharded parameters. Else the model as it is."""
    return fsdp.shard(model, amp) if world.parallel == "fsdp" else model


def wrap(model: nn.Module, world: World, knobs: DdpConfig) -> nn.Module:
    """What forward is called on: DistributedDataParallel (one rank per device: its gradients are all-reduced in
    the backward), nn.DataParallel (one process over every visible GPU), or the model itself (under fsdp, sharded
    already: shard). The raw `model` is what is saved, never this wrapper."""
    if world.parallel == "ddp":
        device_ids = [world.device.index] if world.device.type == "cuda" else None  # cuda:<local_rank>
        _graph_cut(knobs.split_graph)  # run.compile's, before DDP is built (DDP reads the mode too)
        wrapped = DistributedDataParallel(
            model, device_ids=device_ids, bucket_cap_mb=knobs.bucket_cap_mb, static_graph=knobs.static_graph,
            find_unused_parameters=knobs.find_unused_parameters, gradient_as_bucket_view=knobs.gradient_as_bucket_view,
            **({} if knobs.broadcast_buffers else _NO_FORWARD_BUFFER_SYNC),
        )  # fmt: skip
        if knobs.comm_hook == "allreduce":  # each bucket divided once; torch's own divides each gradient (host_cost)
            wrapped._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        elif knobs.comm_hook != "none":
            wrapped.register_comm_hook(None, _compress_hook(knobs.comm_hook, world))
        return wrapped
    if world.parallel == "dp":
        return nn.DataParallel(model)
    return model


def _graph_cut(split: bool) -> None:
    """ddp.split_graph=false: dynamo compiles the step as one graph, DDP's all-reduces after its backward (torch's
    way cuts it at DDP's buckets); read as run.compile's graph is compiled, at the first step: one model a process."""
    if not split:
        torch._dynamo.config.optimize_ddp = False  # (the bench's whole_graph rows: bench/harness.py COMPILED_DDP)


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
    last backward (pytorch/pytorch#43201: no_sync around the backward alone, or one too many, is wrong);
    under FSDP2 the same with set_requires_gradient_sync (reduce-scattered once, in the last)."""
    ddp = isinstance(wrapped, DistributedDataParallel)
    sharded = getattr(wrapped, "_orig_mod", wrapped)  # compiled: the model inside
    sharded = sharded if count > 1 and fsdp.is_sharded(sharded) else None  # one micro-batch: syncs as it is
    for i in range(count):
        if sharded is not None:
            sharded.set_requires_gradient_sync(i == count - 1)
        yield wrapped.no_sync() if ddp and i < count - 1 else contextlib.nullcontext()


def forward(wrapped: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """wrapped(x), with DDP's error for a model that left parameters unused as a usage error."""
    try:
        return wrapped(x)
    except RuntimeError as e:
        if "Expected to have finished reduction in the prior iteration" not in str(e):
            raise
        raise UsageError(
            "the model left some parameters without a gradient in the last step, and DDP waits for every "
            "one: set ddp.find_unused_parameters=true (or ddp.static_graph=true if the same ones are unused "
            "in every step)"
        ) from None


def for_eval(wrapped: nn.Module) -> nn.Module:
    """The module to evaluate with: DDP's inner module (no collectives in a forward that ranks may
    call a different number of times), DataParallel itself (it only splits the batch)."""
    return wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and optimizer's state dicts as one process holds them (DDP's form), on rank 0 at
    least: a sharded model's gathered to rank 0's CPU (a collective: every rank calls this)."""
    if fsdp.is_sharded(model):
        return fsdp.full_state(model, optimizer)
    return model.state_dict(), optimizer.state_dict()


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict[str, Any], state: dict[str, Any] | None
) -> None:
    """full_state's dicts into the model and optimizer, on every rank (a sharded model keeps its slice)."""
    if fsdp.is_sharded(model):
        fsdp.load_full_state(model, optimizer, weights, state)
        return
    model.load_state_dict(weights)
    if optimizer is not None and state is not None:
        optimizer.load_state_dict(state)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its slice of a sharded (DTensor) one, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


# On the device, through the default group:


def all_reduce_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    """Sum over ranks in place (a no-op in one process); returns t."""
    if world.grouped:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def sync_buffers(model: nn.Module, world: World, how: str = "broadcast") -> None:
    """Make every rank's buffers (BatchNorm running stats) one, so all ranks evaluate and save one
    model: DDP syncs buffers at the start of each forward, so after the last step they differ.
    broadcast = rank 0's; reduce = the mean over ranks of the float ones (train.dist_bn)."""
    if not world.grouped:
        return
    for b in model.buffers():
        if how == "reduce" and b.is_floating_point():
            dist.all_reduce(b, op=dist.ReduceOp.SUM)
            b.div_(world.world_size)
        else:
            dist.broadcast(b, src=0)


# On the host, through world.control:


def any_rank(flag: bool, world: World) -> bool:
    """True on every rank if it is True on any: one all-reduce of a CPU tensor (no GPU sync); none for a
    group of one (DDP at world size 1), whose flag is already everyone's."""
    return bool(highest(flag, world))


def highest(flag: int, world: World) -> int:
    """The highest of the ranks' `flag` (a bool, or a level), waited for: any_rank's all-reduce."""
    return int(flag) if _alone(world) else int(_send_flag(flag, world, async_op=False)[0].item())


def _alone(world: World) -> bool:
    """No other rank to agree with: no process group, or a group of one."""
    return not world.grouped or world.world_size == 1


def _send_flag(flag: int, world: World, async_op: bool) -> tuple[torch.Tensor, dist.Work | None]:
    """The all-reduce (max) of `flag` (a bool, or a level) over the control group, in place in the tensor returned."""
    t = torch.tensor([int(flag)])
    return t, dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.control, async_op=async_op)


class StopAgreement:
    """The highest of each step's flags over the ranks (0: go on; preemption's levels: pause, stop), without waiting
    for it: after step n, the flags of step n - 1, whose all-reduce (started after that step, asynchronous) has
    long arrived, and this step's sent on. Every rank stops (or pauses) after the same step, one after the flag's.
    A blocking all-reduce would cost the control group's round trip every step, a network's between hosts, and
    hold every rank to the slowest each step (bench/stop_agreement.py). At an epoch's end wait() takes the last
    step's (the epoch's stop check repeats it)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.pending: tuple[torch.Tensor, dist.Work | None] | None = None

    def after_step(self, flag: int) -> int:
        """What every rank does now: the step before's highest flag over the ranks (this one's, in a group of one)."""
        if _alone(self.world):
            return int(flag)
        agreed = self.wait()
        if not agreed:  # a stop or a pause sends nothing on: no all-reduce is left unread (or under way)
            self.pending = _send_flag(flag, self.world, async_op=True)
        return agreed

    def wait(self) -> int:
        """The flags sent last, agreed (0 when none are on their way)."""
        if self.pending is None:
            return 0
        t, work = self.pending
        self.pending = None
        work.wait()
        return int(t.item())


def same_on_all_ranks(value: int, world: World) -> bool:
    """Whether every rank holds the same integer (e.g. the checkpoint step each one found)."""
    if not world.grouped:
        return True
    t = torch.tensor([value, -value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.control)
    return int(t[0]) == -int(t[1])


def gather_objects(obj: Any, world: World) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (pickled between our own processes)."""
    if not world.grouped:
        return [obj]
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, obj, group=world.control)
    return out


def barrier(world: World) -> None:
    """Every rank waits here until all have arrived."""
    if world.grouped:
        dist.barrier(group=world.control)


@contextmanager
def fail_together(world: World) -> Iterator[None]:
    """Around a side effect of rank 0 (`if world.is_main:` inside) that can fail, a write above all:
    if it fails, every rank raises rank 0's error, so that none is left waiting in a later collective
    for a rank that has gone. One all-reduce; side effects that cannot fail (printing) need none."""
    error = None
    try:
        yield
    except (UsageError, WriteFailed) as e:
        error = e
    if any_rank(error is not None, world):
        kind, message = next(e for e in gather_objects(error and (type(error).__name__, str(error)), world) if e)
        raise error or (WriteFailed if kind == "WriteFailed" else UsageError)(message)
