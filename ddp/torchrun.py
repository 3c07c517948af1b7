"""torchrun as the launch files start it (`python ddp/torchrun.py ARGS`, torchrun's arguments): torch's own
launcher in this process, which ends without its traceback when a stop signal or a failed rank ends
it. The ranks have said why by then; the exit code says how (128 + N after signal N, else the rank's).

Ctrl-C (SIGINT to the foreground group), scancel and `kill` reach torchrun's agent, which stops the ranks
(each saves its checkpoint and says "run the same command to resume") and then raises SignalException, printed
by torchrun as a 25-line traceback with exit 1. A rank that fails (a usage error, a lost peer) prints its own
line; torchrun then repeats it in a failure box and a traceback. Here both end as the exit code alone, after
the ranks' lines, and so do torchrun's log lines that repeat them (which rank failed, the SIGTERM it then
sends the rest); a rank that ended without a line of its own (killed by a signal, but not by that SIGTERM)
gets one. And an agent that outlives its last rank (on a host cut off, torchrun's agent waits on the
rendezvous store on another host for minutes) leaves, saying so: STORE_LOST_S after its ranks ended when its
rendezvous store does not answer (the host cut off, or the store's host gone); else GRACE_S after them (its
exit barrier waits on the other hosts), or never while the store answers in an elastic job, which may start
new ranks.

At the end of a job of several nodes, the agent that hosts the rendezvous store may leave before
another agent has read the exit barrier's result (pytorch/pytorch#69520): that agent logged a traceback
and C++ stack traces although every rank had finished. Here it is one line. The agent's own C++
warnings (about its store connection, never about training) are hidden unless TORCH_CPP_LOG_LEVEL is
set; the ranks get the environment as it was.

The launch files put `--preflight=N` first: ddp/train.py --preflight N with the ranks' arguments, here, before
torchrun starts a rank (one Python and torch start fewer than a process of its own: 2.2 s on the 2-core test
machine); a mistake ends it with that one line and exit 2, else it prints the command it goes on with. --help and
--print-config are answered there, once, and no rank starts. In a job on a fixed number of machines, a node that
its preflight stops (its copy of the data missing, say) leaves its line at the rendezvous store (node 0, its host,
serves it to do so; another node waits a while for it to be up); the agents waiting there for it end with that line
and its exit code, where torchrun waited out its join timeout (600 s) in silence.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

if __package__ in (None, ""):  # run as a file: import ddp from the repository, not ddp/'s modules as top-level ones
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from ddp.startup import quiet_startup  # noqa: E402

quiet_startup(__name__)  # a Ctrl-C or a missing package in torch's import: one line, not its traceback
_QUIET_CPP = "TORCH_CPP_LOG_LEVEL" not in os.environ
if _QUIET_CPP:
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # read once, as torch's libraries load
import torch.distributed  # noqa: E402

if _QUIET_CPP:
    del os.environ["TORCH_CPP_LOG_LEVEL"]  # the ranks start with the user's environment

from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint  # noqa: E402
from torch.distributed.run import main as torchrun  # noqa: E402
from torch.distributed.run import parse_args  # noqa: E402

from ddp import cli, launchers, lost_rank, network, pausing, processes  # noqa: E402
from ddp.errors import EXIT_FAILURE, EXIT_STOPPED, EXIT_USAGE, MACHINE_MEMORY_FIX, lost_interrupt, oom_killed  # noqa: E402
from ddp.torchrun_args import launch_refused  # noqa: E402

GRACE_S = 20.0  # how long the agent may outlive its ranks (its own exit barrier waits on the other hosts)
STORE_LOST_S = 5.0  # ... when its rendezvous store does not answer: what it waits for cannot come
NODE_LEFT = "ddp-cifar/node-left"  # at the rendezvous store: the word of a node whose preflight stopped it
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # where a rank's line goes (launchers.record_error), the preflight's too
one_machine: list[bool] = []  # main's word, for the exit (run): whether the job runs on this machine alone


class ExitBarrierRace(logging.Filter):
    """torchrun's "Error waiting on exit barrier" traceback when the store's host left first (its
    connection closed), and the rendezvous's connection warnings after it: one line instead."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        closed = isinstance(error, getattr(torch.distributed, "DistNetworkError", ()))  # not a timeout
        if str(record.msg).startswith("Error waiting on exit barrier") and closed:
            if not self.seen:
                print(f"note: every rank finished; the rendezvous store's host ended before this agent on "
                      f"{socket.gethostname()} left torchrun's exit barrier ({error.__class__.__name__}: harmless, "
                      f"pytorch/pytorch#69520)", file=sys.stderr, flush=True)  # fmt: skip
            self.seen = True
            return False
        return not (self.seen and "RendezvousConnectionError" in record.getMessage())


def not_an_echo(record: logging.LogRecord) -> bool:
    """Drops the agent's log lines that repeat what the ranks' lines (or failed()'s) said: which rank failed,
    the closing signal sent to the rest, its own error file's copy, the stop signal it took. They were the last lines
    under a usage error."""
    return not str(record.msg).startswith(ECHOES)


TRAIN = Path(__file__).resolve().parent / "train.py"
RACE_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.rendezvous.dynamic_rendezvous")
ECHO_LOGGERS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.multiprocessing.errors.error_handler",
)
# (and a stop signal's "Received 2 death signal, shutting down workers", above the ranks' `stopping on SIGINT`)
ECHOES = (
    "failed (exitcode: ",
    "Sending process %s closing signal",
    "no error file defined for parent",
    "Received %s death",
)


def main(argv: list[str]) -> int:
    lost_interrupt()  # a Ctrl-C in torch's import that torch lost (2.4): as if it had ended the import
    if argv and argv[0].startswith("--preflight="):  # (MASTER_ADDR's mistakes of the launch files: said there)
        code = preflight(argv[0].partition("=")[2], argv[1:])
        if code is not None:
            return code
        argv = argv[1:]
        print(f"+ {shlex.join(['python', str(Path(__file__).resolve()), *argv])}", file=sys.stderr, flush=True)
    quiet_agent_logs()
    args = parse_args(argv)
    one_machine[:] = [args.standalone or str(args.nnodes) in ("1", "1:1")]
    if refused := launch_refused(args):
        print(f"error: {refused}", file=sys.stderr)
        return EXIT_USAGE
    store = rendezvous_store(args) if ":" in args.rdzv_endpoint else None  # (its port given: on another host)
    elastic = args.max_restarts > 0
    if signal.getsignal(signal.SIGTSTP) == signal.SIG_DFL:  # (one ignored where this started stays ignored)
        pause = pausing.Pause(one_machine[0], by_slurm=pausing.by_slurm())
        signal.signal(signal.SIGTSTP, pause)
        signal.signal(signal.SIGCONT, pause.resumed)
    if store or not elastic:  # (an elastic job without an endpoint of its own: not watched)
        watched = (store, elastic, fixed_nodes_store(args))
        watch = threading.Thread(target=leave_after_the_ranks, args=watched, name="ddp-agent-watch", daemon=True)
        watch.start()
    with (
        log_dir(args.log_dir) as logs,
        pausing.passing_on(),  # SIGUSR1/2 to the ranks: by default they ended it
        pausing.finish_marks() as marks,  # where the ranks say they trained to the last epoch
    ):
        try:
            torchrun(argv if logs == args.log_dir else ["--log-dir", logs, *argv])
        except SignalException as e:  # the ranks were stopped: their lines are printed
            return pausing.signalled(e.sigval, marks)
        except ChildFailedError as e:
            return failed(e)
    return 0


@contextlib.contextmanager
def log_dir(given: str | None, needed: bool = True) -> Iterator[str | None]:
    """torchrun's log dir (its ranks' error files): `given`, else (where `needed`) one of ours, removed at the end.
    torch's own, a /tmp/torchelastic_* where none is given, was left behind by every run."""
    if given or not needed:
        yield given
        return
    ours = tempfile.mkdtemp(prefix="torchelastic_")
    try:
        yield ours
    finally:
        shutil.rmtree(ours, ignore_errors=True)


def quiet_agent_logs() -> None:
    """The agent's log lines that repeat the ranks' dropped (not_an_echo), and its exit barrier's race one line."""
    race = ExitBarrierRace()
    for name in RACE_LOGGERS:
        logging.getLogger(name).addFilter(race)
    for name in ECHO_LOGGERS:
        logging.getLogger(name).addFilter(not_an_echo)


def preflight(count: str, argv: list[str]) -> int | None:
    """--preflight=`count`: ddp/train.py --preflight with the ranks' arguments from torchrun's `argv`, in
    this process. None when the ranks may start; else the exit code to end with: a mistake's, or that of
    --help or --print-config, answered here once (every rank would print it) without starting a rank."""
    if not count.isdigit() or int(count) < 1:
        print(f"error: --preflight=N needs the number of processes to be started, e.g. 2, not {count!r}",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    args = parse_args(argv)
    if Path(args.training_script).resolve() != TRAIN:
        print(f"error: --preflight checks ddp/train.py's arguments, not {args.training_script}'s", file=sys.stderr)
        return EXIT_USAGE
    from ddp import train  # only here: a plain torchrun does not pay for its imports

    if {"--help", "-h", "--print-config"} & set(args.training_script_args):
        return train.cli(args.training_script_args)
    # --standalone (launch/torchrun.sh): a NODE_RANK left in the shell (by launch/multinode.sh, say) is not this
    # launch's; the preflight took it for a machine of several, and waited for MASTER_ADDR to answer. (multinode.sh's
    # own, NNODES=1 too, is: node 0 serves the rendezvous on MASTER_PORT, which the preflight checks is free.)
    alone = {"NODE_RANK": None} if args.standalone else {}
    with tempfile.NamedTemporaryFile(suffix=".json") as said:  # its line, where a rank's goes (launchers.record_error)
        with launchers.environment_changed({ERROR_FILE: said.name, **alone}):
            code = train.cli(["--preflight", count, *args.training_script_args])
        if code and (store := fixed_nodes_store(args)):  # the other machines wait for this one
            line = json.loads(Path(said.name).read_text() or '{"message": {}}')["message"].get("message", "")
            word = {"code": code, "line": line.removeprefix("error: ")}
            if "is_host=true" in args.rdzv_conf.lower().split(","):  # its store is not up: it serves one to tell
                lost_rank.serve_word(*store, NODE_LEFT, word, int(str(args.nnodes).partition(":")[0]), "machines")
            else:  # a mistake of this node's: node 0's store may not be up yet (started later), it waits a while
                refused = network.connect_error(*store, 1.0)  # nothing listens there (yet), or nothing answers
                later = code == EXIT_USAGE and refused
                if later:
                    print(
                        f"(waiting up to {lost_rank.HEAR_S:g} s for the rendezvous store at "
                        f"{network.host_port(*store)} to tell the other machines)",
                        file=sys.stderr,
                        flush=True,
                    )
                # A store that refuses after this node's check waited for it: no one to tell, no TELL_S spent.
                if later or not refused:
                    lost_rank.leave_word(*store, NODE_LEFT, word, lost_rank.HEAR_S if later else lost_rank.TELL_S)
    return code or None  # 0: the ranks may start


def failed(error: ChildFailedError) -> int:
    """A line for the ranks that ended without writing their own (killed by a signal: no error file), one for each
    way they ended (32 ranks in 2 GiB: 7 lines for 7 the kernel killed, the same but for the rank), but none for
    those torchrun itself stopped with SIGTERM once another had failed ("rank 1 was killed by SIGTERM" was the last
    line under rank 0's usage error), nor for those that stopped to be resumed (exit 75: rank 0 said why, and the
    others, silent, were each "exited 75" under it); the exit code of the first rank that failed otherwise (128 +
    N for signal N): an error file's time is in whole seconds, and a rank stopped the same second could pass
    for the first."""
    failures = error.failures
    causes = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    first = min(causes, key=lambda rank: causes[rank].timestamp)
    unsaid: dict[int, list[int]] = {}  # exit code: the ranks that ended so without a line (one line for them all)
    for rank, failure in sorted(failures.items()):
        stopped = rank != first and failure.exitcode == -signal.SIGTERM  # torchrun's "closing signal SIGTERM"
        if not os.path.isfile(failure.error_file) and not stopped and failure.exitcode != EXIT_STOPPED:
            unsaid.setdefault(failure.exitcode, []).append(rank)
    for code, ranks in unsaid.items():
        pids, many = ", ".join(str(failures[rank].pid) for rank in ranks), len(ranks) > 1
        who = f"rank{'s' * many} {', '.join(map(str, ranks))} (pid{'s' * many} {pids})"
        print(f"error: {killed(who, -code, many) if code < 0 else f'{who} exited {code}'}", file=sys.stderr, flush=True)
    code = failures[first].exitcode
    return code if code > 0 else 128 - code if code < 0 else EXIT_FAILURE


def killed(who: str, signum: int, many: bool = False) -> str:
    """`who` (a rank, or `many` ranks) killed by signal `signum`, which left no line of its own: by the kernel for
    memory, most likely, where SIGKILL came as this machine's out-of-memory kills rose."""
    try:
        name = signal.Signals(signum).name
    except ValueError:  # (a real-time signal)
        name = f"signal {signum}"
    oom = oom_killed() if signum == signal.SIGKILL else None
    why = f": out of memory, most likely ({oom}); {MACHINE_MEMORY_FIX}" if oom else ""
    if signum == signal.SIGSEGV and os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        why = f" (TORCH_DISTRIBUTED_DEBUG=DETAIL is set: {DETAIL_CRASH}; unset it, or set INFO)"
    return f"{who} {'were' if many else 'was'} killed by {name}{why}"


DETAIL_CRASH = "under torch 2.14.1 DDP crashed with it as it started, in its DETAIL logging (seen with gloo)"


def leave_after_the_ranks(store: tuple[str, int] | None, elastic: bool, nodes: tuple[str, int] | None) -> None:
    """Once every rank this agent started has ended, this process leaves (exit 1) with one line when
    `store` ((host, port): the rendezvous store on another host) does not answer STORE_LOST_S later, or
    GRACE_S later in any case, unless `elastic` and the store answers: the agent may be waiting there for
    its next ranks. The agent ends before that on its own in every other case. Before its ranks start,
    it leaves with the word of a node whose preflight stopped it, if one is left at `nodes` (node_left)."""
    seen, ended_at, asking = False, None, {}
    while True:
        time.sleep(0.5)
        if _ranks_running():
            seen, ended_at = True, None
            continue
        if not seen:
            if nodes:
                node_left(nodes, asking)
            continue
        ended_at = ended_at or time.monotonic()
        waited, host = time.monotonic() - ended_at, socket.gethostname()
        if waited < STORE_LOST_S:
            continue
        answers = store is not None and network.connect_error(*store, 3.0) is None
        if answers and elastic:
            continue  # the agent may be waiting at its store for its next ranks
        if store and not answers:
            _leave(f"torchrun's agent on {host}: its rendezvous store {network.host_port(*store)} does not answer "
                   f"{STORE_LOST_S:.0f} s after its ranks ended (is {host} cut off?)")  # fmt: skip
        if waited > GRACE_S:
            guess = " (its exit barrier waits on another host?)" if store else ""  # (one machine: a hang of its own)
            _leave(f"torchrun's agent on {host} still ran {GRACE_S:.0f} s after its ranks ended{guess}; it was at "
                   f"{main_thread_at()}")  # fmt: skip


def fixed_nodes_store(args: Any) -> tuple[str, int] | None:
    """(host, port) of the c10d rendezvous store of a job on a fixed number of machines, where the agents wait for
    every one to begin; None on one machine, or in an elastic job (--nnodes=MIN:MAX: it begins without one)."""
    low, _, high = str(args.nnodes).partition(":")
    if args.rdzv_backend != "c10d" or high not in ("", low) or low == "1":
        return None
    return rendezvous_store(args)


def rendezvous_store(args: Any) -> tuple[str, int] | None:
    """(host, port) of --rdzv_endpoint as torchrun reads it (host:port, [IPv6 address]:port; port 29400 if none is
    given); None for --standalone, or an endpoint torchrun will refuse."""
    try:
        return None if args.standalone else parse_rendezvous_endpoint(args.rdzv_endpoint, 29400)
    except ValueError:
        return None


def node_left(store: tuple[str, int], asking: dict[str, Any]) -> None:
    """While this agent waits for the other machines at the rendezvous: if one's preflight stopped it and it left
    its word at `store` (preflight), its line here, and this agent leaves with its exit code; the job cannot begin
    without it (torchrun waits out its join timeout, 600 s, in silence). `asking` keeps the store's client."""
    try:
        if "client" not in asking:  # the store may not be up yet (its host starts after this one)
            asking["client"] = torch.distributed.TCPStore(*store, is_master=False, timeout=timedelta(seconds=3))
        word = lost_rank.word_left(asking["client"], NODE_LEFT)
    except (RuntimeError, ValueError):  # torch's DistError is a RuntimeError
        asking.pop("client", None)
        return
    if word:
        print(f"error: {word['host']}, a machine of this job, stopped before it began: {word['line']}", file=sys.stderr,
              flush=True)  # fmt: skip
        time.sleep(1.0)  # the other machines' agents, if more wait, read the word before this one's store goes
        asking["client"].add(f"{NODE_LEFT}/heard", 1)  # (a store served to tell it waits for this: serve_word)
        os._exit(word["code"])


def _leave(why: str) -> None:
    print(f"error: {why}: left", file=sys.stderr, flush=True)
    os._exit(EXIT_FAILURE)


def main_thread_at(frames: int = 3) -> str:
    """Where this process's main thread is: its innermost `frames` frames (dir/file.py:line in function, the
    innermost first), for the line of an agent that hangs (seen once in ~190 Ctrl-Cs as ranks started, on one
    machine, cause not found)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "an unknown place (its main thread has ended)"
    stack = reversed(traceback.extract_stack(frame)[-frames:])
    return " < ".join(f"{Path(Path(f.filename).parent.name, Path(f.filename).name)}:{f.lineno} in {f.name}"
                      for f in stack)  # fmt: skip


def _ranks_running() -> bool:
    """Whether a child of this process runs (not a zombie): the ranks, started by the agent."""
    return bool(processes.children())


def run(argv: list[str], launch: Callable[[list[str]], int] | None = None) -> NoReturn:
    """`launch` (main; accelerate_launch's), then the exit: on one machine without the interpreter's teardown, as
    the ranks leave (cli.leave): torch's took 0.4-0.5 s after every run, 1.5-2.8 s beside a test suite (a Ctrl-C there
    took up to 7.4 s to end). A job of several machines exits the usual way: the agent that serves the rendezvous
    store, leaving sooner, would end it sooner under the agents still reading its exit barrier (pytorch#69520)."""
    code = (launch or main)(argv)
    if one_machine == [True]:
        cli.leave(code)
    sys.exit(code)


if __name__ == "__main__":
    run(sys.argv[1:])
