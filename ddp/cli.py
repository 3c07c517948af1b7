"""How a module becomes a command: the command line that train and doctor share
(`[--config FILE] [section.key=value ...] [--print-config]`), and `command`, the one wrapper that runs
a main(argv) and turns how it ended into one line on stderr and an exit code of ddp.errors.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddp import config, launchers
from ddp.errors import EXIT_OK, Diverged, PeerLost, Stopped, UsageError, WriteFailed, exit_code


@dataclass(frozen=True)
class Args:
    config: str | None  # the YAML file, or None for the defaults
    overrides: list[str]  # section.key=value, applied over the file
    print_config: bool
    preflight: int | None = None  # --preflight N: check before a launcher starts N processes, then exit


def parse_args(argv: list[str], usage: str) -> Args:
    """The shared command line; --help prints `usage` and every config key, then exits 0."""
    path, overrides, print_config, preflight = None, [], False, None
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            print(usage + config.reference())
            raise SystemExit(EXIT_OK)
        if arg == "--config":
            path = next(args, None)
            if path is None:
                raise UsageError("--config needs a file: --config configs/quick.yaml")
        elif arg.startswith("--config="):
            path = arg.partition("=")[2]
        elif arg == "--print-config":
            print_config = True
        elif arg == "--preflight":
            count = next(args, "")
            if not count.isdigit() or int(count) < 1:
                raise UsageError(f"--preflight needs the number of processes to be started, e.g. 2, not {count!r}")
            preflight = int(count)
        elif arg.startswith("-"):
            raise UsageError(f"unknown option {arg}; options are --config FILE, --print-config, --preflight N, --help")
        else:
            overrides.append(arg)
    return Args(path, overrides, print_config, preflight)


def debug_requested(argv: list[str]) -> bool:
    """run.debug from the config (file and overrides), or from the command line alone when the
    config itself is what failed to load (or the command takes other options)."""
    try:
        args = parse_args(argv, "")
        return config.load(args.config, args.overrides).run.debug
    except UsageError:
        values = [a.partition("=")[2] for a in argv if a.replace(" ", "").startswith("run.debug=")]
        return bool(values) and config.parse_bool(values[-1]) is True


def command(main: Callable[[list[str]], Any], argv: list[str] | None = None, prog: str = "") -> int:
    """Run main(argv) as a command; its exit code. main returns an int exit code (e.g. the doctor's
    1 for problems found) or anything else for done. A UsageError, a divergence, a failed write or a
    lost rank is one line, `<prog: >error: ...`, never a traceback unless run.debug asks for it; a stop prints its
    reason. Every rank stops alike on the first three: one process per machine says it
    (local rank 0), the others exit with the same code silently. Each rank names the rank it lost."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        code = main(argv)
    except Stopped as e:
        if str(e):  # rank 0 says why; the other ranks print nothing
            print(str(e), file=sys.stderr)
        return exit_code(e)
    except (UsageError, Diverged, WriteFailed, PeerLost) as e:
        if debug_requested(argv):
            raise  # the traceback, for a bug report
        if isinstance(e, PeerLost) or launchers.speaks_for_its_machine():
            print(f"{prog + ': ' if prog else ''}error: {e}", file=sys.stderr)
        return exit_code(e)
    return code if isinstance(code, int) else EXIT_OK
