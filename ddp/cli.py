"""How a module becomes a command: the one command-line parser every command uses (`parse`; train's
and doctor's `[--config FILE] [section.key=value ...]` on top of it) and `command`, which runs a
main(argv) and turns how it ended into one line on stderr and an exit code of ddp.errors."""

from __future__ import annotations

import atexit
import contextlib
import errno
import io
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ddp import config, files, launchers
from ddp.errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    INTERRUPTED,
    Diverged,
    PeerLost,
    Stopped,
    UsageError,
    WriteFailed,
    exit_code,
    lost_interrupt,
    machine_failure,
    path_refused,
    to_devnull,
)


def _text(value: str | None) -> str | None:
    return value


@dataclass(frozen=True)
class Option:
    """A command-line option: a flag (no metavar: True when given), or `--name VALUE` / `--name=VALUE`,
    whose value `convert` turns into what the command gets (it gets None for a value that is missing,
    and raises UsageError for a bad one; without a `convert`, a missing or empty value is that error).
    `default` when the option is not given."""

    name: str
    metavar: str = ""
    convert: Callable[[str | None], Any] = _text
    default: Any = None

    @property
    def key(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


TORCHRUN_OPTIONS = {"nproc_per_node", "nnodes", "node_rank", "standalone", "master_addr", "master_port",
                    "rdzv_endpoint", "rdzv_backend", "rdzv_id", "max_restarts"}  # fmt: skip


def _settings_named(name: str) -> list[str]:
    """The settings (section.key) whose key is `name`: `--epochs` in a command line meant train.epochs."""
    return [f"{section}.{name.lower()}" for section, keys in config.settings().items() if name.lower() in keys]


def parse(
    argv: list[str], usage: str, options: list[Option], settings: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """({option key: value}, the other words in order). -h/--help prints `usage` and exits 0; an
    unknown option is a UsageError listing the known ones, and usage's first line (with `settings`, the command's
    words are config settings: an option named like one, --epochs 3, is shown as that setting, train.epochs=3)."""
    by_name = {o.name: o for o in options}
    values: dict[str, Any] = {o.key: False if not o.metavar else o.default for o in options}
    words, args, given = [], iter(argv), {}
    for arg in args:
        name, eq, inline = arg.partition("=")
        if arg in ("-h", "--help"):
            show(usage)
            raise SystemExit(EXIT_OK)
        if name in by_name and by_name[name].metavar:
            option = by_name[name]
            value = os.path.expanduser(inline) if eq else next(args, None)  # --out=~/x: bash left the ~
            if not value and option.convert is _text:  # `--out` last, or `--out=`: not the default, not "."
                raise UsageError(f"{name} needs a value: {name} {option.metavar}; {usage.splitlines()[0]}")
            converted = option.convert(value)  # (first: `--config a.yaml --config` is an empty one, not a second)
            if name in given:  # which one was meant? (a second --config is no merge of the two)
                raise UsageError(f"{name} is given twice ({given[name]} and {value}): give it once")
            given[name], values[option.key] = value, converted
        elif arg in by_name:
            values[by_name[arg].key] = True
        elif arg.startswith("-") and arg != "-":  # "-": stdout, a word
            known = ", ".join(f"{o.name} {o.metavar}".strip() for o in options)
            torchrun = name.lstrip("-").replace("-", "_") in TORCHRUN_OPTIONS  # given to a launch file, say
            hint = " (torchrun's option: it goes before ddp/train.py; launch files take NPROC=N)" if torchrun else ""
            if settings and not torchrun and (named := _settings_named(name.lstrip("-").replace("-", "_"))):
                value = inline if eq else next(args, None)
                value = value if value and not value.startswith("-") else "VALUE"  # (--lr= or --lr --config x)
                hint = f" (settings are section.key=value: {' or '.join(f'{key}={value}' for key in named)})"
            raise UsageError(f"unknown option {arg}{hint}; options are {known}, --help; {usage.splitlines()[0]}")
        else:
            words.append(arg)
    return values, words


@dataclass(frozen=True)
class Args:
    config: str | None  # the YAML file, or None for the defaults
    overrides: list[str]  # section.key=value, applied over the file
    print_config: bool
    preflight: int | None = None  # --preflight N: check before a launcher starts N processes, then exit


PIPED = "a pipe, as bash's <(...) makes, which the processes a launcher starts do not get: write the config to a file"


def _is_pipe(path: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def _config_file(value: str | None) -> str:
    if not value:
        raise UsageError("--config needs a file: --config configs/quick.yaml")
    if value.startswith(("/dev/fd/", "/proc/self/fd/")) and not Path(value).exists():  # a rank torchrun started
        raise UsageError(f"--config {value} is not here: {PIPED}")
    beside = Path(__file__).resolve().parent.parent / value  # the repository's, for a command run elsewhere
    if not files.existing(Path(value)) and not Path(value).is_absolute() and beside.is_file():
        raise UsageError(f"config file not found: {value} (in {Path.cwd()}); the repository's is {beside}: run "
                         "from the repository, or give that path")  # fmt: skip
    return value


def positive_int(needs: str) -> Callable[[str | None], int]:
    """An Option's converter for a whole number >= 1; `needs` is the message's start, e.g. "--preflight
    needs the number of processes to be started, e.g. 2" (", not '0'" follows it)."""

    def convert(value: str | None) -> int:
        if not (value or "").isdigit() or int(value) < 1:
            raise UsageError(f"{needs}, not {value or ''!r}")
        return int(value)

    return convert


TRAINING_OPTIONS = [
    Option("--config", "FILE", _config_file),
    Option("--print-config"),
    Option("--preflight", "N", positive_int("--preflight needs the number of processes to be started, e.g. 2")),
]


def parse_args(argv: list[str], usage: str) -> Args:
    """train's and doctor's command line; --help prints `usage` and every config key, then exits 0."""
    values, overrides = parse(argv, usage + config.reference(), TRAINING_OPTIONS, settings=True)
    if values["preflight"] and _is_pipe(values["config"] or ""):  # read here, it would be gone for the ranks
        raise UsageError(f"--config {values['config']} is {PIPED}")
    return Args(values["config"], overrides, values["print_config"], values["preflight"])


def debug_requested(argv: list[str]) -> bool:
    """run.debug from the config (file and overrides), or from the command line alone when the
    config itself is what failed to load (or the command takes other options). Never --help's answer again
    (when it was the --help that failed, its output refused)."""
    try:
        args = parse_args([a for a in argv if a not in ("-h", "--help")], "")
        return config.load(args.config, args.overrides).run.debug
    except (UsageError, OSError):  # OSError: a path refused (_paths_named)
        values = [a.partition("=")[2] for a in argv if a.replace(" ", "").startswith("run.debug=")]
        return bool(values) and config.parse_bool(values[-1]) is True


# A rank that stops with the error its machine's local rank 0 prints waits this long before it exits:
# a launcher stops every rank as soon as one fails, and a silent rank that failed first (local rank 0
# still importing, 1-2 s behind on a busy machine) would get the rank that prints stopped before it
# has printed (tests/test_cli_errors.py delays rank 0 so). The launcher ends the wait when local rank
# 0 exits; without one that does (srun without --kill-on-bad-exit), the error takes this much longer.
# 15 s, not 5: in a loaded test suite rank 0, started 2 s late, had not printed 7.3 s after the launch.
SILENT_RANK_GRACE_S = 15.0


@contextlib.contextmanager
def _stdout_taken() -> Iterator[None]:
    """Around a write to stdout: where the OS refuses it (a full disk under `> FILE`) a WriteFailed, one line on
    stderr and exit 1, not a traceback. A reader gone (`| head`) is command's."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        silence_stdout()
        raise WriteFailed(f"cannot write the output to stdout ({e.strerror})") from None


def show(text: str, end: str = "\n") -> None:
    """A command's output on stdout, flushed (_stdout_taken)."""
    with _stdout_taken():
        print(text, end=end, flush=True)


@contextlib.contextmanager
def stdout_bytes() -> Iterator[io.BytesIO]:
    """`with stdout_bytes() as f: write(f)`: what is written to f goes to stdout (a pipe) once whole (_stdout_taken),
    every byte (write_all), or a WriteFailed where its reader ended first. Under PYTHONUNBUFFERED=1 stdout's write
    took what the pipe took before its reader ended (`| ssh` lost, say): the rest was dropped without a word, and
    the export said "wrote stdout", exit 0."""
    buffer = io.BytesIO()
    yield buffer
    with _stdout_taken():
        try:
            write_all(sys.stdout, buffer.getbuffer())
        except BrokenPipeError:
            silence_stdout()
            total = len(buffer.getbuffer())
            raise WriteFailed(
                f"stdout's reader ended before it had the {total:,} bytes: they did not arrive whole"
            ) from None


def write_all(stream: Any, data: bytes | memoryview) -> None:
    """Every byte of `data` to a text stream's binary buffer, flushed: a buffered one takes it all in a write (or
    raises), the file itself (PYTHONUNBUFFERED=1) what the OS took (files.write_all)."""
    files.write_all(stream.buffer.write, data)
    stream.buffer.flush()


def silence_stdout() -> None:
    """stdout to /dev/null from here on: the exit's flush of what stdout could not take does not fail again."""
    to_devnull(sys.stdout.fileno())


def _paths_named(main: Callable[[list[str]], Any], argv: list[str]) -> Any:
    """main(argv), where a path the OS refused as named (too long, or not open to this user: errors.path_refused)
    is a UsageError naming it."""
    try:
        return main(argv)
    except OSError as e:
        if (line := path_refused(e)) is None:
            raise
        raise UsageError(line) from None
    except RuntimeError as e:  # pathlib's resolve() before Python 3.13 says a symbolic link that loops so
        if not (loop := re.fullmatch(r"Symlink loop from '(.*)'", str(e))):
            raise
        raise UsageError(path_refused(OSError(errno.ELOOP, "loop", loop[1]))) from None


def command(main: Callable[[list[str]], Any], argv: list[str] | None = None, prog: str = "") -> int:
    """Run main(argv) as a command; its exit code. main returns an int exit code (e.g. the doctor's
    1 for problems found) or anything else for done. A UsageError, a divergence, a failed write or a
    lost rank is one line, `<prog: >error: ...`, never a traceback unless run.debug asks for it; a stop prints its
    reason. Every rank stops alike on the first three: one process per machine says it
    (local rank 0), the others exit with the same code silently. Each rank names the rank it lost.
    A Ctrl-C that no stop handles (before training, or the second one in it) is one line too, exit 130."""
    argv = sys.argv[1:] if argv is None else argv
    lost_interrupt()  # a Ctrl-C in the imports that torch lost: it ends the command here, as it would have there
    try:
        code = _paths_named(main, argv)
    except Stopped as e:
        if str(e):  # rank 0 says why; the other ranks print nothing
            print(str(e), file=sys.stderr)
            launchers.record_error(str(e))
        return exit_code(e)
    except (UsageError, Diverged, WriteFailed, PeerLost) as e:
        if debug_requested(argv):
            raise  # the traceback, for a bug report
        line = f"{prog + ': ' if prog else ''}error: {e}"
        speaks = isinstance(e, PeerLost) or launchers.speaks_for_its_machine()
        if speaks:
            print(line, file=sys.stderr)
        if not speaks and launchers.has_peers():
            time.sleep(SILENT_RANK_GRACE_S)  # then its error file: the report's root cause is the earliest
        launchers.record_error(line)  # torchrun's report names it (its own box, after this line)
        return exit_code(e)
    except BrokenPipeError:  # its reader has gone (`... | head`): the rest has no one to read it
        silence_stdout()
        return EXIT_FAILURE
    except Exception as e:  # memory, disk space: one line with what to try; anything else is a bug, its traceback
        what = machine_failure(e)
        if what is None or debug_requested(argv):
            raise
        world = launchers.launched()
        who = f"rank {world.rank} of {world.world_size}: " if world and world.world_size > 1 else ""  # whose machine
        line = f"{prog + ': ' if prog else ''}error: {who}{what}"
        print(line, file=sys.stderr)
        launchers.record_error(line)
        return EXIT_FAILURE
    except KeyboardInterrupt:  # Ctrl-C where no stop is handled (preemption's and lifeline's are not installed)
        if debug_requested(argv):
            sys.excepthook = sys.__excepthook__  # where it was: the traceback (startup.quiet_startup's would not)
            raise
        if launchers.speaks_for_its_machine():
            print(f"{prog + ': ' if prog else ''}{INTERRUPTED}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code if isinstance(code, int) else EXIT_OK


_given_up: list[threading.Thread] = []


def given_up(thread: threading.Thread) -> None:
    """`thread` was left inside a call that has not returned (a torch store's client to a host that refuses or
    does not answer: lost_rank.asked). Where it is still inside it at the exit, leave() skips the interpreter's
    teardown, which would end the thread and abort the process as torch's C++ unwinds ('terminate called without
    an active exception', exit 134: 1 run in 8 of a rank that told a refusing store why it failed)."""
    _given_up.append(thread)


def leave(code: int) -> NoReturn:
    """Exit with `code` once a command is done: Python's exit handlers run and the output is flushed,
    then the process ends without the interpreter's teardown. With a CUDA build of torch that teardown
    (its libraries' destructors) takes 0.5-0.8 s of every process that imported torch, even on a CPU
    (measured on the 2-core test machine: `python -c "import torch"` 2.4-3.0 s, with os._exit 2.0-2.3 s),
    and every rank's launcher waits for it. Everything a command writes is written through file
    descriptors and closed (ddp.files, the run's lock) before this.
    A rank of several that failed exits the usual way, as every rank did before: a launcher stops the
    other ranks as soon as it sees one fail, and a rank that left early would get the rank that prints
    the one line stopped before it has, or stopped with SIGTERM while its error is the report's root
    cause (tests/test_cli_errors.py, 3 torchrun ranks: 1 run in 3 failed so). Not where a thread given_up is
    still in its call."""
    if code != EXIT_OK and launchers.has_peers() and not any(thread.is_alive() for thread in _given_up):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
