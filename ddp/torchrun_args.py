"""torchrun's arguments checked before it starts: what it would refuse only in a traceback (an AssertionError's, a
ValueError's, after the ranks' preflight) or wait on for good, said as one line by ddp/torchrun.py (exit 2)."""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

from ddp import network


def launch_refused(args: Any) -> str | None:
    """Why torchrun will refuse its arguments, which it said in a traceback (an AssertionError's, a ValueError's), or
    wait on for good (a node rank past --nnodes, a static rendezvous): that line; None where it takes them."""
    try:
        low, high = parse_min_max_nnodes(str(args.nnodes))
    except (ValueError, RuntimeError):  # (RuntimeError: not MIN:MAX)
        low = high = 0
    if not 0 < low <= high:
        return f"--nnodes={args.nnodes}: a number of machines (1 or more), or MIN:MAX with 1 <= MIN <= MAX"
    if args.max_restarts < 0:
        return f"--max-restarts={args.max_restarts}: 0 or more restarts"
    if args.rdzv_backend == "static" and not 0 <= args.node_rank < high:
        return f"--node_rank={args.node_rank}: the machines of --nnodes={args.nnodes} are 0 to {high - 1}"
    return nproc_refused(args.nproc_per_node) or endpoint_refused(args)


def nproc_refused(value: str) -> str | None:
    """Why torchrun will refuse --nproc_per_node (gpu on a machine without one, a word it does not know: its
    ValueError's traceback; 0 or fewer: an AssertionError's, with no words): that line; None where it takes it."""
    try:
        count = determine_local_world_size(str(value))
    except ValueError as e:
        if str(e).startswith("Unsupported"):
            return f"--nproc_per_node={value} is no number of processes, nor auto, cpu or gpu"
        return f"--nproc_per_node={value}: {str(e).rstrip('.')}; give a number of processes (e.g. 2), or auto or cpu"
    return None if count >= 1 else f"--nproc_per_node={value}: 1 or more processes on each machine"


def endpoint_refused(args: Any) -> str | None:
    """Why torchrun will refuse --rdzv_endpoint, which it said only after the ranks' preflight, in a ValueError's
    traceback: that line; None where it takes it."""
    if args.standalone or args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return None
    try:
        parse_rendezvous_endpoint(args.rdzv_endpoint, 29400)
    except ValueError as e:
        endpoint = f"--rdzv_endpoint={args.rdzv_endpoint}"
        return network.scoped(endpoint) if "%" in args.rdzv_endpoint else f"{endpoint}: {e}"
    return None
