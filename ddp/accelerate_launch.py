"""`accelerate launch` as launch/accelerate.sh starts it (`python ddp/accelerate_launch.py ARGS`, accelerate launch's
arguments): accelerate's own launcher in this process, which ends without a traceback when a stop signal or a failed
rank ends it. The ranks have said why by then; the exit code says how (128 + N after signal N, else the rank's).

accelerate raises what its launcher met. With GPUs (--multi_gpu: torchrun's agent, in its process) torchrun's
SignalException at Ctrl-C, scancel or `kill`, and ChildFailedError when a rank fails; on CPUs (--cpu, through mpirun)
a KeyboardInterrupt at Ctrl-C while it waited for mpirun, and CalledProcessError when mpirun ends with a rank's failure.
Each was a 20- to 45-line traceback under the ranks' own lines (a Ctrl-C's "stopped on SIGTERM; run the same command
to resume" among them). Here each is its exit code, as under ddp/torchrun.py, whose handling of torchrun's two this
shares, with its quieting of the agent's log lines that repeat the ranks'.

Through mpirun (`_through_mpirun`), mpirun runs in a process group of its own, and this process sends the ranks the
stop signals it takes (Ctrl-C, `kill`, a hang-up): mpirun took SIGINT and SIGTERM as its end, and sent each rank
SIGTERM 1 s later and SIGKILL 1 s after that (Open MPI's odls_base_sigkill_timeout): a rank whose step took longer was
killed in it, with no checkpoint and no line. mpirun's boxes are relayed as lines where lines say more (_relay: Open
MPI's on stderr, _relay_hydra: MPICH's on stdout): a rank killed is one line, and the boxes of ranks that ended
non-zero or on the stop signal sent are left out after a stop or a rank's line of why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: import ddp from the repository, not ddp/'s modules as top-level ones
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from ddp.startup import quiet_startup  # noqa: E402

quiet_startup(__name__)  # a Ctrl-C or a missing package in the imports: one line, not a traceback

from ddp import cli, pausing, processes, torchrun  # noqa: E402
from ddp.errors import EXIT_USAGE  # noqa: E402


def main(argv: list[str]) -> int:
    try:
        from accelerate.commands import launch
        from accelerate.commands.launch import launch_command, launch_command_parser
    except ImportError as e:
        print(f"error: no accelerate in {sys.executable} ({e}): pip install 'ddp-cifar[accelerate]', or use "
              "launch/torchrun.sh", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    torchrun.quiet_agent_logs()
    args = launch_command_parser().parse_args(argv)
    # accelerate has mpirun bind each rank to a socket, and Open MPI refused more ranks than the socket's cores
    # (NPROC=4 on 2 cores: its box, exit 1); ranks may share cores, as under torchrun (its option, not an argument)
    setattr(args, "bind-to", "socket:overload-allowed")
    accelerates = launch.simple_launcher  # (launch_command calls it for --cpu: through mpirun, or one process)
    launch.simple_launcher = lambda args: (_through_mpirun if args.mpirun_hostfile else accelerates)(args)
    launch._validate_launch_command = _validated(launch._validate_launch_command)
    # (SIGUSR1/2: passed on to the ranks, which they ended; through mpirun, _through_mpirun's own forward)
    with (
        torchrun.log_dir(args.log_dir, needed=not args.mpirun_hostfile) as args.log_dir,
        pausing.passing_on(),
        pausing.finish_marks() as marks,
    ):
        try:
            launch_command(args)  # (it sets args.num_machines from --config_file's when the command line has none)
        except Refused as e:  # its arguments, before anything started
            print(f"error: accelerate launch: {e}", file=sys.stderr)
            return EXIT_USAGE
        except SentToTheRanks as e:  # a stop signal: they saved, and said so
            return 128 + e.signum
        except torchrun.SignalException as e:  # the ranks were stopped: their lines are printed
            return pausing.signalled(e.sigval, marks)
        except torchrun.ChildFailedError as e:
            return torchrun.failed(e)
        except subprocess.CalledProcessError as e:  # mpirun's exit: a rank's failure (its line said why), or a signal's
            return e.returncode if e.returncode > 0 else 128 - e.returncode
        except KeyboardInterrupt:  # a Ctrl-C before mpirun or torchrun's agent took it: what started is waited for
            _wait_for_children()
            return 128 + signal.SIGINT
        finally:  # on one machine, how it exits (torchrun.run): its flag's word, or its config file's
            torchrun.one_machine[:] = [args.num_machines == 1]
    return 0


class Refused(Exception):
    """accelerate launch's arguments refused before anything starts: its own ValueError's words (a traceback before:
    --multi_gpu with 1 process, two of --cpu, --multi_gpu, --use_fsdp), or a count below 1 (--num_processes 0 or -2
    ran one plain process, not a mistake said)."""


def _validated(validate: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """accelerate's _validate_launch_command, whose refusals are Refused (launch_command calls it first)."""

    def validated(args: Any) -> Any:
        for flag in ("num_processes", "num_machines"):
            if (count := getattr(args, flag, None)) is not None and count < 1:
                raise Refused(f"--{flag} {count}: 1 or more")
        try:
            return validate(args)
        except ValueError as e:
            raise Refused(str(e).strip()) from None

    return validated


# The signals the ranks stop on by default (run.stop_signal), and SIGUSR2, which mpirun passed on
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
BOX = b"-" * 74 + b"\n"  # the first and last line of each of Open MPI's boxes
# "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).", the launcher's name first
OPEN_MPI_KILLED = re.compile(rb"noticed that process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
HYDRA_RULE = b"=" * 83 + b"\n"  # MPICH's (Hydra's): around its box, on stdout
HYDRA_KILLED = re.compile(rb"=   PID (\d+) RUNNING AT .*EXIT STRING: .*\(signal (\d+)\)", re.S)
INTEL_KILLED = re.compile(rb"=   RANK (\d+) PID (\d+) RUNNING AT .*KILLED BY SIGNAL: (\d+)", re.S)  # its Hydra's


class SentToTheRanks(Exception):
    """mpirun ended after a stop signal this process sent its ranks (ddp.cli's Stopped is a rank's own stop)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum


def _through_mpirun(args: object) -> None:
    """accelerate's simple_launcher through mpirun, with mpirun's stop signals sent to the ranks instead."""
    from accelerate.commands.launch import prepare_simple_launcher_cmd_env

    cmd, env = prepare_simple_launcher_cmd_env(args)
    forwarded = [s for s in FORWARDED if signal.getsignal(s) is not signal.SIG_IGN]  # (`&` in a script, nohup: left)
    seen = Seen()
    stops = seen.stops
    hydra = "--hostfile" not in cmd  # accelerate's arguments for an mpirun that is not Open MPI's (MPICH's: Hydra)

    def forward(signum: int, frame: object) -> None:
        stops.append(signum)  # to the ranks (below mpirun), or to mpirun while it starts them
        for pid in processes.nearest_running(mpirun.pid, args.training_script) or [mpirun.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def own_group() -> None:  # mpirun's, as it starts: the terminal's signals and a kill of this group miss it
        os.setpgrp()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)

    signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)  # a stop signal until mpirun has a pid waits, then is sent
    try:
        # (no stdin: mpirun reads it for rank 0, and a process group not in the terminal's foreground is stopped there)
        out = subprocess.PIPE if hydra else None  # (relayed: _relay, and _relay_hydra under MPICH only: see there)
        mpirun = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE,
                                  preexec_fn=own_group)  # fmt: skip
        for signum in forwarded:
            signal.signal(signum, forward)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
    relays = [threading.Thread(target=_relay, args=(mpirun.stderr, seen), daemon=True)]
    if hydra:
        relays.append(threading.Thread(target=_relay_hydra, args=(mpirun.stdout, seen), daemon=True))
        threading.Thread(target=_note_ranks, args=(mpirun, args.training_script, seen), daemon=True).start()
    for relay in relays:
        relay.start()
    mpirun.wait()
    for relay in relays:
        relay.join(timeout=5)
    if stops:
        raise SentToTheRanks(stops[0])
    if mpirun.returncode:  # a rank killed by a signal: 128 + it, as elsewhere (MPICH's mpirun exits with its number,
        code = -seen.killed if seen.killed else mpirun.returncode  # Intel MPI's with 255)
        raise subprocess.CalledProcessError(code, cmd)


@dataclasses.dataclass
class Seen:
    """What the relays of mpirun's output have seen: the stop signals sent to the ranks, whether a line of ours (a
    rank's `error: ...`) passed, and the signal that killed a rank, as mpirun's box said."""

    stops: list[int] = dataclasses.field(default_factory=list)
    said: bool = False
    killed: int = 0
    ranks: dict[int, int] = dataclasses.field(default_factory=dict)  # pid: rank, of MPICH's ranks while they ran


def _relay(stream, seen: Seen) -> None:
    """mpirun's stderr (the ranks' too) to this process's, but Open MPI's boxes where a line says more: those of
    ranks that ended non-zero (held to the end) where a rank's line said why (`error: ...`: an out-of-memory rank's
    line had two boxes beside it) or after a stop, of ranks ended by the signal sent to them (a rank still in its
    imports ends on a Ctrl-C: "exited on signal 2 (Interrupt)" in 6 of 11 Ctrl-Cs 1.5-8 s into
    launch/accelerate.sh, each at 3.5-5.5 s); a rank killed by another signal is one line, as ddp/torchrun.py says
    it. Read to its end, whatever this one's stderr does (mpirun would block on a full pipe, and its ranks with
    it)."""
    box: list[bytes] = []
    non_zero: list[bytes] = []  # held to the end: a rank's line may come after mpirun's box of its exit
    for line in iter(stream.readline, b""):
        seen.said = seen.said or line.startswith(b"error: ")
        if box or line == BOX:
            box.append(line)
            if len(box) == 1 or line != BOX:
                continue
            line, box = b"".join(box), []
            if b"non-zero" in line:
                non_zero.append(line)
                continue
            if killed := OPEN_MPI_KILLED.search(line):
                rank, signum = map(int, killed.groups())
                if signum in seen.stops:
                    continue
                seen.killed, line = signum, f"error: {torchrun.killed(f'rank {rank}', signum)}\n".encode()
        _write(sys.stderr, line)
    _write(sys.stderr, b"".join(box + ([] if seen.stops or seen.said else non_zero)))  # (and a box not closed)


def _relay_hydra(stream, seen: Seen) -> None:
    """mpirun's stdout (the ranks' too) to this process's, but MPICH's box (Hydra's, on stdout, with the blank line
    before it) of a rank killed by a signal: one line on stderr, as under Open MPI; none where it is the stop signal
    sent to the ranks (a rank still in its imports). Read to its end, as _relay is. Under MPICH only: a kill -9 of
    this process leaves no reader, and the ranks' lines after it are lost (their stop line, under Open MPI: tests/
    test_resume.py), as their stderr's are under either."""
    held: list[bytes] = []  # a blank line, then a box between two rules; once that is Hydra's, all to mpirun's end
    for line in iter(stream.readline, b""):
        rules = held.count(HYDRA_RULE)
        hydras = rules == 2 and any(b"BAD TERMINATION" in h for h in held)
        if hydras or (line == HYDRA_RULE and rules < 2) or (rules == 1 and line.startswith(b"=   ")):
            held.append(line)
            continue
        _write(sys.stdout, b"".join(held))  # (no box of Hydra's: a rank's blank line, or its own lines of '=')
        held = [line] if line in (b"\n", HYDRA_RULE) else []
        _write(sys.stdout, b"" if held else line)
    if intel := INTEL_KILLED.search(b"".join(held)):  # (its box names the rank)
        rank, pid, signum, mpi = int(intel[1]), int(intel[2]), int(intel[3]), "Intel MPI's"
    elif mpich := HYDRA_KILLED.search(b"".join(held)):
        pid, signum, mpi = int(mpich[1]), int(mpich[2]), "MPICH's"
        rank = seen.ranks.get(pid)
    else:
        _write(sys.stdout, b"".join(held))
        return
    if signum not in seen.stops:
        seen.killed = signum
        who = f"a rank (pid {pid})" if rank is None else f"rank {rank} (pid {pid})"
        said = f"error: {torchrun.killed(who, signum)}, the first end {mpi} mpirun saw; it ended the others\n"
        _write(sys.stderr, said.encode())  # (at times one it ended so: MPICH's, under load)


def _note_ranks(mpirun: subprocess.Popen, script: str, seen: Seen) -> None:
    """Each rank's number by its pid in `seen.ranks` (its PMI_RANK) while mpirun runs, every 0.5 s: MPICH's box of a
    rank killed names its pid alone (on Linux; elsewhere the line says `a rank (pid N)`)."""
    while mpirun.poll() is None:
        for pid in processes.nearest_running(mpirun.pid, script):
            if pid not in seen.ranks and (rank := processes.environment(pid).get("PMI_RANK", "")).isdigit():
                seen.ranks[pid] = int(rank)
        time.sleep(0.5)


def _write(stream, data: bytes) -> None:
    with contextlib.suppress(OSError, ValueError):
        cli.write_all(stream, data)  # (a stop signal in the write: the rest of the ranks' lines too)


def _wait_for_children() -> None:
    """Until this process's children (mpirun) have ended, or a second Ctrl-C."""
    with contextlib.suppress(KeyboardInterrupt, ChildProcessError):
        for pid in processes.children():
            os.waitpid(pid, 0)


if __name__ == "__main__":
    torchrun.run(sys.argv[1:], main)
