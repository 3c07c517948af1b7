"""A rank lost: after a collective or the rendezvous failed, which one and how (it died, hung past
run.timeout_s, or stopped on an error it said), as one PeerLost line (the ranks still alive check in at the
store where they met; the ones that do not within a second are the lost ones); before the ranks met, why."""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch.distributed as dist

from ddp import cli, launchers, network
from ddp.devices import World
from ddp.errors import (
    EXIT_OK,
    EXIT_USAGE,
    PeerLost,
    Stopped,
    UsageError,
    ending,
    first_line,
    oom_killed,
    oom_kills_since,
)

# gloo's words after what happened, in every lost connection's error: "... remote worker crashing. Check the logs of
# the remote worker before reporting an error. GLHF! 🏖️" (a line that names the rank lost and how says more)
GLOOS_ADVICE = " This is typically caused by"
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
    """The ranks that do not check in at the store where the ranks met within `wait_s` (dead or hung), with
    their hosts; None without one, or when it does not answer either (torchrun's on a host cut off; one that
    rank 0 served, gone with it)."""
    if store is None:
        return None
    # The launcher, seeing a dead worker, SIGTERMs the others; this rank is leaving anyway, and
    # takes at most a few seconds more to say whom it lost (torchrun's SIGKILL comes 30 s later).
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        return asked(lambda: _check_in(world, store, wait_s), wait_s + 2)
    finally:
        signal.signal(signal.SIGTERM, previous)


def asked(question: Callable[[], Any], seconds: float) -> Any:
    """question()'s answer, asked in a thread of its own: None when it fails or takes over `seconds` (a store op
    on a link that is down blocks in the kernel for minutes), or when no thread can start: the interpreter is
    exiting (serve_word's fallback at the exit; Python 3.12 on refuses new threads then, and a traceback said so)."""
    found: list[Any] = []

    def ask() -> None:
        try:
            found.append(question())
        except Exception:  # a store that does not answer, or refuses: no answer
            pass

    asking = threading.Thread(target=ask, daemon=True)
    try:
        asking.start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        return None
    asking.join(seconds)
    if asking.is_alive():
        cli.given_up(asking)
    return found[0] if found else None


def meeting_store(env: launchers.Env = os.environ) -> tuple[str, int, str] | None:
    """(address, port, key prefix) of the store where this process meets the others of its run: torchrun's agent
    store, or where the rendezvous is ours (srun, mpirun) the one rank 0 serves at its tcp:// address (distributed
    makes it); None in one process, or where the launcher's variables make no sense (that error comes later)."""
    try:
        if agent := launchers.agent_store(env):
            return agent
        init_method = launchers.detect_launch(env).init_method
    except (UsageError, KeyError):
        return None
    return served_by_rank_0(init_method, env) if init_method else None


def served_by_rank_0(init_method: str, env: launchers.Env = os.environ) -> tuple[str, int, str]:
    """(address, port, key prefix) of the store rank 0 serves at `init_method` (tcp://host:port). The prefix names
    the SLURM step or MPI job where there is one: another run's ranks that come to that port (its rank 0 could not
    take it) keep to keys of their own there, where they joined this run's group and broke it."""
    url = urlsplit(init_method)  # (an IPv6 address is in brackets there: [fd00::1]:29500)
    host, port = url.hostname or "", url.port or 0
    slurm = f"{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}" if {"SLURM_JOB_ID", "SLURM_STEP_ID"} <= env.keys() else ""
    return host, port, "/".join(filter(None, ("ddp-cifar", slurm or env.get("PMIX_NAMESPACE"))))


def register_host(world: World, store: dist.Store) -> None:
    """This rank's host in the store, for the others to name it if they lose it: this rank has come to the
    meeting (wait_for_everyone); from here on a collective tells the others when it stops."""
    global _met
    store.set(f"host/{world.rank}", socket.gethostname())
    _met = True


# Before the ranks meet at their store (meeting_store), no collective can tell a rank that another has stopped: on
# one machine torchrun stops the others, but a machine whose rank stopped (its copy of the data missing, say)
# left the other machines' ranks waiting out run.timeout_s, then saying only that the rendezvous timed out.
# So a rank that stops before it came leaves its reason at the store, and those waiting there stop with it. After
# the meeting a rank that stops on an error of its own leaves it there too, for those it leaves to name (say_why).
WHY = "why-a-rank-left"  # the key of the first such word, under meeting_store's prefix
OOM = "oom-kills"  # OOM/host: the out-of-memory kills a rank on that host counted when it lost one (explain)
TELL_S = 5.0  # how long a rank that stops may take to tell (a store that does not answer: it says nothing)
HEARD = f"{WHY}/heard"  # how many ranks read it or left their own (_word): serve_word waits for them
HEAR_S = 15.0  # how long rank 0 serves its word for ranks yet to come (their store goes with it)
_met = False  # register_host done: this process came to the meeting
_serving: list[threading.Thread] = []  # serve_word's, joined at exit (until_heard)


@contextmanager
def telling_the_waiting(env: launchers.Env = os.environ) -> Iterator[None]:
    """Around a rank's whole run: if it ends before it came to the meeting (register_host), how and why go to the
    store where the ranks meet, for those waiting there (wait_for_everyone). In one process nothing."""
    global _met
    _met, reason = False, (EXIT_OK, "it ended without training")  # (--print-config)
    try:
        yield
    except BaseException as e:
        reason = ending(e)
        raise
    finally:
        if not _met and meeting_store(env):
            tell(*reason, env)


def tell(code: int, line: str, env: launchers.Env = os.environ) -> None:
    """(`code`, `line`) at the store where the ranks meet (meeting_store), for those waiting there; the
    first rank's stays. Rank 0, where it would serve that store (srun, mpirun, a torchrun without a store of its
    own), serves it to tell (serve_word)."""
    addr, port, prefix = meeting_store(env) or ("", 0, "")
    try:  # (a word that cannot be told must not hide the error it tells: meeting_store found a launch)
        launch = launchers.detect_launch(env)
        rank, world_size = launch.rank, launch.world_size
    except UsageError:
        rank, world_size = env.get("RANK", "?"), 0
    said, key = {"rank": rank, "code": code, "line": line}, f"{prefix}/{WHY}"
    if rank == 0 and not launchers.agent_store(env):
        serve_word(addr, port, key, said, world_size)
    else:
        leave_word(addr, port, key, said)


def leave_word(addr: str, port: int, key: str, said: dict[str, Any], wait_s: float = TELL_S) -> None:
    """`said` at the TCPStore at addr:port under `key` (_word); nothing if it does not take it within `wait_s`.
    torch's client is asked only once something takes connections there (a store not up yet refuses them): its
    own retries log a stack trace each, and outlast the time given in C++ (12.7 s for 5; cli.given_up)."""
    deadline = time.monotonic() + wait_s
    if _answering(addr, port, deadline):
        wait_s = max(deadline - time.monotonic(), 1.0)
        asked(lambda: _word(dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=wait_s)), key, said),
              wait_s + 1)  # fmt: skip


def _answering(addr: str, port: int, deadline: float) -> bool:
    """Whether something takes a connection at addr:port before `deadline` (time.monotonic), asked every 0.1 s."""
    while network.connect_error(addr, port, max(deadline - time.monotonic(), 0.1)):  # refused, timed out, no name
        if (left := deadline - time.monotonic()) <= 0:
            return False
        time.sleep(min(left, 0.1))
    return True


def _word(store: dist.Store, key: str, said: dict[str, Any]) -> None:
    """`said` and this host's name as JSON at `store` under `key`, unless a word is there already (the first stays);
    this rank counted as one that no longer waits (serve_word)."""
    store.compare_set(key, "", json.dumps({**said, "host": socket.gethostname()}))
    store.add(f"{key}/heard", 1)


def serve_word(addr: str, port: int, key: str, said: dict[str, Any], of: int, who: str = "ranks") -> None:
    """Where this process would serve the store at addr:port (rank 0 under srun or mpirun, the node that hosts
    torchrun's rendezvous) and stops before the others met there: that store served with `said` under `key`, from
    a thread while this process says its error, and at its exit (until_heard) until each of the other `of` - 1 has
    read it or left its own (_word), or HEAR_S passed (a line after 2 s)."""

    def serve() -> None:
        try:
            store = dist.TCPStore(addr, port, of, True, timedelta(seconds=TELL_S), wait_for_workers=False)
            _word(store, key, said)
            start, noted = time.monotonic(), False
            while store.add(f"{key}/heard", 0) < of and time.monotonic() < start + HEAR_S:
                if not noted and time.monotonic() > start + 2:
                    print(f"(waiting up to {HEAR_S:g} s for the other {who} to hear this)", file=sys.stderr,
                          flush=True)  # fmt: skip
                    noted = True
                time.sleep(0.05)
            time.sleep(0.5)  # the last to hear may still be reading (a launcher's agent: until it has left)
        except Exception:  # the port taken (another run's store, whose ranks keep to their keys?): the word left there
            leave_word(addr, port, key, said)

    if not _serving:
        atexit.register(until_heard)
    _serving.append(threading.Thread(target=serve, name="serving-word", daemon=True))
    _serving[-1].start()


def until_heard() -> None:
    """At this process's exit: until serve_word's stores are no longer needed (at most HEAR_S and a bit), or a
    Ctrl-C ends the wait (the process then ends as it would have, with its error's exit code)."""
    try:
        for thread in _serving:
            thread.join(HEAR_S + TELL_S)
    except KeyboardInterrupt:
        pass


def word_left(store: dist.Store, key: str) -> dict[str, Any] | None:
    """The word leave_word left at `store` under `key`, or None."""
    return json.loads(store.get(key)) if store.check([key]) else None


def _oom_told(store: dist.Store, silent: dict[int, str]) -> str | None:
    """The out-of-memory kills a rank on the host of a silent rank told at `store` (explain), in words; None if none."""
    hosts = sorted({h for h in silent.values() if h and h != socket.gethostname()})
    told = {h: int(store.get(f"{OOM}/{h}")) for h in hosts if store.check([f"{OOM}/{h}"])}
    return "; ".join(filter(None, (oom_killed(n, h) for h, n in told.items()))) or None


def say_why(world: World, error: BaseException, store: dist.Store) -> None:
    """After the meeting: why this rank stops, at the store where the ranks met, on an error of its own (out of memory,
    a bug), for a rank that it leaves waiting in a collective to name (explain); not a stop, a Ctrl-C, a lost rank."""
    if isinstance(error, (PeerLost, Stopped, KeyboardInterrupt, SystemExit)):
        return
    code, line = ending(error)
    asked(lambda: _word(store, WHY, {"rank": world.rank, "code": code, "line": line}), TELL_S)


def wait_for_everyone(
    world: World, store: dist.Store, timeout_s: float, where: str, clock: Callable[[], float] = time.monotonic
) -> None:
    """After register_host, until every rank has come (then distributed.setup makes the group at once). A rank that
    stopped before it came and told why (tell): its line, a UsageError where it was one, else PeerLost. None
    within `timeout_s` on `clock` (lifeline.awake: not the time the job was stopped): PeerLost naming the ranks
    that did not come."""
    keys = [f"host/{r}" for r in range(world.world_size)]
    deadline, pause = clock() + timeout_s, 0.005
    while not store.check(keys):
        if left := word_left(store, WHY):
            store.add(HEARD, 1)
            who = f"rank {left['rank']} on {left['host']}"
            if left["code"] == EXIT_USAGE:
                raise UsageError(f"{who} stopped before the ranks met: {left['line']}")
            raise PeerLost(f"rank {world.rank} of {world.world_size}: {who} ended before the ranks met "
                           f"(exit {left['code']}): {left['line']}")  # fmt: skip
        if clock() > deadline:
            missing = ", ".join(str(r) for r, key in enumerate(keys) if not store.check([key]))
            raise PeerLost(f"rank {world.rank} of {world.world_size}: rank {missing} did not come to {where} within "
                           f"run.timeout_s={timeout_s:g} s, and did not say why (killed, or hung? its machine's log "
                           "says more)")  # fmt: skip
        time.sleep(pause)
        pause = min(0.2, 2 * pause)


def explain(
    world: World, error: BaseException, timeout_s: float, store: dist.Store | None, stopped_s: float = 0.0
) -> PeerLost:
    """The one line for a failed collective: this rank, the rank(s) it lost and their hosts, and the first line of
    torch's error (but where the rank it lost said why); `stopped_s`, how long this process was stopped just before
    (lifeline), if it was."""
    first = first_line(error)
    hung = "imed out" in first or "imeout" in first
    first = re.sub(r"^\[\S+:\d+\] ", "", first).split(GLOOS_ADVICE)[0]  # (its source file and line: torch's build's)
    what = f"no answer within run.timeout_s={timeout_s:g}: hung" if hung else "its connection closed: it died"
    kills = 0 if hung or store is None else oom_kills_since()
    if kills:  # for the ranks of other machines, which see only a closed connection: before the check-in's wait
        asked(lambda: store.set(f"{OOM}/{socket.gethostname()}", str(kills)), 1.0)
    silent = silent_ranks(world, store)
    word = asked(lambda: word_left(store, WHY), 2.0) if silent and store is not None else None
    if word and str(word["rank"]) in map(str, silent):  # it said why (say_why): torch's words add nothing to it
        what, first = f"it stopped: {word['line']}", ""
    elif not hung and silent:  # killed without a word: this machine's out-of-memory kills (counted above), and
        here = oom_killed(kills) if socket.gethostname() in silent.values() else None  # those told from others
        told = asked(lambda: _oom_told(store, silent), 2.0) if store is not None else None
        what += "".join(f"; {oom}" for oom in (here, told) if oom)
    if stopped_s:  # a wait in a collective outlived its deadline on torch's clocks, which ran on while it was stopped
        what += (f"; this process was stopped for {stopped_s:.0f} s just before (SLURM's suspend? a SIGSTOP?), "
                 "and torch's timeouts count that time: a longer run.timeout_s outlasts such stops")  # fmt: skip
    if silent:
        hosts = sorted({h for h in silent.values() if h and h != socket.gethostname()})  # another machine's
        who = f"rank {', '.join(map(str, silent))}" + (f" on {', '.join(hosts)}" if hosts else "")
    elif store is not None and silent is None and not world.init_method:  # torchrun's store, out of reach too
        who = f"the other ranks (the rendezvous store does not answer either: is {socket.gethostname()} cut off?)"
    else:  # no store to ask (one rank 0 served is gone with it, or left with it)
        who = f"rank {1 - world.rank}" if world.world_size == 2 else "another rank"
    torchs = f" [{first}]" if first else ""
    return PeerLost(f"rank {world.rank} of {world.world_size}: lost contact with {who} ({what}){torchs}")
