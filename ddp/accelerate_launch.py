"""`accelerate launch` as launch/accelerate.sh starts it (`python ddp/accelerate_launch.py ARGS`, accelerate launch's
arguments): accelerate's own launcher in this process, which ends without a traceback when a stop signal or a failed
rank ends it. The ranks have said why by then; the exit code says how (128 + N after signal N, else the rank's).

accelerate raises what its launcher met. With GPUs (--multi_gpu: torchrun's agent, in its process) torchrun's
SignalException at Ctrl-C, scancel or `kill`, and ChildFailedError when a rank fails; on CPUs (--cpu, through mpirun)
a KeyboardInterrupt at Ctrl-C while it waits for mpirun, and CalledProcessError when mpirun ends with a rank's failure.
Each was a 20- to 45-line traceback under the ranks' own lines (a Ctrl-C's "stopped on SIGTERM; run the same command
to resume" among them). Here each is its exit code, as under ddp/torchrun.py, whose handling of torchrun's two this
shares, with its quieting of the agent's log lines that repeat the ranks'.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: import ddp from the repository, not ddp/'s modules as top-level ones
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from ddp.launchers import quiet_startup  # noqa: E402

quiet_startup(__name__)  # a Ctrl-C or a missing package in the imports: one line, not a traceback

from ddp import pausing, torchrun  # noqa: E402
from ddp.errors import EXIT_USAGE  # noqa: E402


def main(argv: list[str]) -> int:
    try:
        from accelerate.commands.launch import launch_command, launch_command_parser
    except ImportError as e:
        print(f"error: no accelerate in {sys.executable} ({e}): pip install 'ddp-cifar[accelerate]', or use "
              "launch/torchrun.sh", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    torchrun.quiet_agent_logs()
    args = launch_command_parser().parse_args(argv)
    try:
        launch_command(args)
    except torchrun.SignalException as e:  # the ranks were stopped: their lines are printed
        return 128 + int(e.sigval)
    except torchrun.ChildFailedError as e:
        return torchrun.failed(e)
    except subprocess.CalledProcessError as e:  # mpirun's exit: a rank's failure (its line said why), or a signal's
        return e.returncode if e.returncode > 0 else 128 - e.returncode
    except KeyboardInterrupt:  # mpirun has it too, and stops the ranks, which save and say so: they are waited for
        _wait_for_children()
        return 128 + signal.SIGINT
    return 0


def _wait_for_children() -> None:
    """Until this process's children (mpirun) have ended, or a second Ctrl-C."""
    with contextlib.suppress(KeyboardInterrupt, ChildProcessError):
        for pid in pausing.children():
            os.waitpid(pid, 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
