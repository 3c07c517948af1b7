"""After a collective or the rendezvous failed: which rank was lost, and how (it died, or hung past
run.timeout_s), as one PeerLost line. The ranks still alive check in at torchrun's agent store; the
ones that do not within a second are the lost ones."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from ddp.devices import World
from ddp.errors import PeerLost, first_line

# Failures of a collective that say nothing more specific than their text (gloo and nccl raise
# RuntimeError or DistError with these words). gloo's "Application timeout caused pair closure" comes
# from a collective inside DDP's forward (its buffer broadcast) when a peer's link is down.
_COMM_WORDS = ("gloo", "NCCL", "Connection reset", "Connection closed", "imed out", "pair closure")


def is_comm_failure(e: BaseException) -> bool:
    """Whether `e` is a collective that failed because another rank or the network went away."""
    if isinstance(e, dist.DistError):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _COMM_WORDS)


@contextmanager
def naming(world: World, what: str) -> Iterator[None]:
    """Around a wait for all the ranks that is not a collective (the rendezvous): its failure as one
    PeerLost line that names `what`."""
    try:
        yield
    except Exception as e:
        if not is_comm_failure(e):
            raise
        raise PeerLost(f"rank {world.rank} of {world.world_size}: {what} failed [{first_line(e)}]") from e


def _check_in(world: World, store: dist.Store, wait_s: float) -> dict[int, str]:
    """This rank's check-in at the store, then {rank: host} of the ranks that have not checked in
    within `wait_s` (their hosts as they registered them at the rendezvous)."""
    store.set_timeout(timedelta(seconds=wait_s))
    store.set(f"lost-contact/{world.rank}", "1")
    keys = [f"lost-contact/{r}" for r in range(world.world_size)]
    deadline = time.monotonic() + wait_s
    while not all(present := [store.check([k]) for k in keys]) and time.monotonic() < deadline:
        time.sleep(0.1)
    silent = [r for r, here in enumerate(present) if not here]
    return {r: store.get(f"host/{r}").decode() if store.check([f"host/{r}"]) else "" for r in silent}


def silent_ranks(world: World, store: dist.Store | None, wait_s: float = 1.0) -> dict[int, str] | None:
    """The ranks that do not check in at the agent's store within `wait_s` (dead or hung), with their
    hosts; None without an agent store (it would have died with rank 0), or when the store does not
    answer either (a store op on a link that is down blocks in the kernel for minutes: a thread asks)."""
    if store is None:
        return None
    # The launcher, seeing a dead worker, SIGTERMs the others; this rank is leaving anyway, and
    # takes at most a few seconds more to say whom it lost (torchrun's SIGKILL comes 30 s later).
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    found: list[dict[int, str]] = []
    try:
        asking = threading.Thread(target=lambda: found.append(_check_in(world, store, wait_s)), daemon=True)
        asking.start()
        asking.join(wait_s + 2)
        return found[0] if found else None
    finally:
        signal.signal(signal.SIGTERM, previous)


def register_host(world: World, store: dist.Store) -> None:
    """This rank's host in the store, for the others to name it if they lose it."""
    store.set(f"host/{world.rank}", socket.gethostname())


def explain(world: World, error: BaseException, timeout_s: float, store: dist.Store | None) -> PeerLost:
    """The one line for a failed collective: this rank, the rank(s) it lost and their hosts, and the
    first line of torch's error."""
    first = first_line(error)
    hung = "imed out" in first or "imeout" in first
    what = f"no answer within run.timeout_s={timeout_s:g}: hung" if hung else "its connection closed: it died"
    silent = silent_ranks(world, store)
    if silent:
        hosts = sorted({h for h in silent.values() if h and h != socket.gethostname()})  # another machine's
        who = f"rank {', '.join(map(str, silent))}" + (f" on {', '.join(hosts)}" if hosts else "")
    elif store is not None and silent is None:  # torchrun's store, on rank 0's host, is out of reach too
        who = f"the other ranks (the rendezvous store does not answer either: is {socket.gethostname()} cut off?)"
    else:
        who = "another rank"
    return PeerLost(f"rank {world.rank} of {world.world_size}: lost contact with {who} ({what}) [{first}]")
