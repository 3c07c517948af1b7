"""After a collective or the rendezvous failed: which rank was lost, and how (it died, or hung past
run.timeout_s), as one PeerLost line. The ranks still alive check in at torchrun's agent store; the
ones that do not within a second are the lost ones."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from ddp.devices import World
from ddp.errors import PeerLost

# Failures of a collective that say nothing more specific than their text (gloo and nccl raise
# RuntimeError or DistError with these words).
_COMM_WORDS = ("gloo", "NCCL", "Connection reset", "Connection closed", "imed out")


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
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PeerLost(f"rank {world.rank} of {world.world_size}: {what} failed [{first}]") from e


def silent_ranks(world: World, store: dist.Store | None, wait_s: float = 1.0) -> list[int] | None:
    """The ranks that do not check in at the agent's store within `wait_s` (dead or hung), or None
    without an agent store (it would have died with rank 0)."""
    if store is None:
        return None
    # The launcher, seeing a dead worker, SIGTERMs the others; this rank is leaving anyway, and
    # takes at most `wait_s` more to say whom it lost (torchrun's SIGKILL comes 30 s later).
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        store.set_timeout(timedelta(seconds=wait_s))  # a store that died with its agent: no longer than that
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


def explain(world: World, error: BaseException, timeout_s: float, store: dist.Store | None) -> PeerLost:
    """The one line for a failed collective: this rank, the rank(s) it lost, and the first line of torch's error."""
    first = str(error).strip().splitlines()[0]
    hung = "imed out" in first or "imeout" in first
    what = f"no answer within run.timeout_s={timeout_s:g}: hung" if hung else "its connection closed: it died"
    silent = silent_ranks(world, store)
    who = f"rank {', '.join(map(str, silent))}" if silent else "another rank"
    return PeerLost(f"rank {world.rank} of {world.world_size}: lost contact with {who} ({what}) [{first}]")
