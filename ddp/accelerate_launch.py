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
killed in it, with no checkpoint and no line. After such a stop mpirun's boxes that say a rank ended non-zero, or
ended on that signal (a rank still starting), are left out: the ranks' lines say why.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

if __package__ in (None, ""):  # run as a file: import ddp from the repository, not ddp/'s modules as top-level ones
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from ddp.launchers import quiet_startup  # noqa: E402

quiet_startup(__name__)  # a Ctrl-C or a missing package in the imports: one line, not a traceback

from ddp import processes, torchrun  # noqa: E402
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
    with torchrun.log_dir(args.log_dir, needed=not args.mpirun_hostfile) as args.log_dir:  # (--multi_gpu's agent)
        try:
            launch_command(args)
        except SentToTheRanks as e:  # a stop signal: they saved, and said so
            return 128 + e.signum
        except torchrun.SignalException as e:  # the ranks were stopped: their lines are printed
            return 128 + int(e.sigval)
        except torchrun.ChildFailedError as e:
            return torchrun.failed(e)
        except subprocess.CalledProcessError as e:  # mpirun's exit: a rank's failure (its line said why), or a signal's
            return e.returncode if e.returncode > 0 else 128 - e.returncode
        except KeyboardInterrupt:  # a Ctrl-C before mpirun or torchrun's agent took it: what started is waited for
            _wait_for_children()
            return 128 + signal.SIGINT
    return 0


# The signals the ranks stop on by default (run.stop_signal), and SIGUSR2, which mpirun passed on
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
BOX = b"-" * 74 + b"\n"  # the first and last line of each of mpirun's boxes


class SentToTheRanks(Exception):
    """mpirun ended after a stop signal this process sent its ranks (ddp.cli's Stopped is a rank's own stop)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum


def _through_mpirun(args: object) -> None:
    """accelerate's simple_launcher through mpirun, with mpirun's stop signals sent to the ranks instead."""
    from accelerate.commands.launch import prepare_simple_launcher_cmd_env

    cmd, env = prepare_simple_launcher_cmd_env(args)
    forwarded = [s for s in FORWARDED if signal.getsignal(s) is not signal.SIG_IGN]  # (`&` in a script, nohup: left)
    stops: list[int] = []

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
        mpirun = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=own_group)
        for signum in forwarded:
            signal.signal(signum, forward)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
    relay = threading.Thread(target=_relay, args=(mpirun.stderr, stops), daemon=True)
    relay.start()
    mpirun.wait()
    relay.join(timeout=5)
    if stops:
        raise SentToTheRanks(stops[0])
    if mpirun.returncode:
        raise subprocess.CalledProcessError(mpirun.returncode, cmd)


def _relay(stream, stops: list[int]) -> None:
    """mpirun's stderr (the ranks' too) to this process's, but its boxes of ranks that ended non-zero or on the signal
    sent to them, after a stop: a rank still in its imports ends on a Ctrl-C (after its line), and mpirun said
    "exited on signal 2 (Interrupt)" (6 of 11 Ctrl-Cs 1.5-8 s into launch/accelerate.sh, each at 3.5-5.5 s). Read to
    its end, whatever this one's stderr does (mpirun would block on a full pipe, and its ranks with it)."""
    box: list[bytes] = []
    for line in iter(stream.readline, b""):
        if box or line == BOX:
            box.append(line)
            if len(box) == 1 or line != BOX:
                continue
            line, box = b"".join(box), []
            if stops and (b"non-zero" in line or any(b"exited on signal %d " % s in line for s in stops)):
                continue
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.buffer.write(b"".join(box))  # (a box not closed)
        sys.stderr.buffer.flush()


def _wait_for_children() -> None:
    """Until this process's children (mpirun) have ended, or a second Ctrl-C."""
    with contextlib.suppress(KeyboardInterrupt, ChildProcessError):
        for pid in processes.children():
            os.waitpid(pid, 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
