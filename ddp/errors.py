"""How a run can end: every exit code, and the exceptions that stand for the non-zero ones.

    0   EXIT_OK       done
    1   EXIT_FAILURE  a failure: a lost rank (PeerLost), a file that could not be written (WriteFailed: a
                      full disk, say), what else ran out on the machine (machine_failure: memory, /dev/shm,
                      disk space, a DataLoader worker), or a bug (any other exception, with its traceback)
    2   EXIT_USAGE    a mistake the user can fix (UsageError): a bad config, device, path, file or launch
    3   EXIT_DIVERGED the loss or the weights stopped being finite (Diverged); the finite checkpoints are kept
    75  EXIT_STOPPED  stopped on a signal after a checkpoint (Stopped): run the same command to resume
    130 EXIT_INTERRUPTED  Ctrl-C where no checkpoint is made: before training (a preflight waiting for
                      MASTER_ADDR, a download), or a second Ctrl-C in training (128 + SIGINT, as a shell says)

cli.command turns them into one line on stderr and the exit code; nothing else defines an exit code. ending()
says the same of an exception, for a rank that leaves it for the others (lost_rank).
"""

import codecs
import contextlib
import errno
import os
import pwd
import re
import shutil
import signal
import sys
import tempfile
from typing import Any, TextIO

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2  # as argparse and most Unix tools use
EXIT_DIVERGED = 3
EXIT_STOPPED = 75  # EX_TEMPFAIL (sysexits.h): try again later, and it continues
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports of a command that Ctrl-C ended


INTERRUPTED = "stopped at once on SIGINT (Ctrl-C), without a checkpoint"  # the line of an exit 130
_interrupted = False  # a Ctrl-C came while a command imported (remember_interrupts)


def remember_interrupts() -> None:
    """Before a command's imports: Python's Ctrl-C (a KeyboardInterrupt), remembered. torch 2.4 loses one raised
    inside torch._C's initialisation, and the command ran on as if none had come (lost_interrupt). A Ctrl-C that
    this process ignores (started in the background by a script) stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)


def _interrupt(signum: int, frame: Any) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether a Ctrl-C came in the command's imports (and was not raised again yet: lost_interrupt)."""
    return _interrupted


def lost_interrupt() -> None:
    """After a command's imports: the KeyboardInterrupt of a Ctrl-C that came in them and was lost there, raised
    again (it ends the command as it would have then); Python's own handler back."""
    global _interrupted
    if signal.getsignal(signal.SIGINT) is _interrupt:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _interrupted:
        _interrupted = False  # (raised once)
        raise KeyboardInterrupt


class LossyStderr:
    """A command's stderr (startup.quiet_startup puts it in sys.stderr): text the OS refuses (a terminal hung up
    under an ssh session that dropped, SLURM's output file on a full disk or quota) is lost, and fd 2 goes to
    /dev/null from then on. Before, the OSError of a stop's or a mistake's line turned its exit code (75, 2) into
    1, with a traceback nobody could read; the line is lost either way, the exit code now says what happened."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            self._lose()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self._lose()

    def _lose(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            to_devnull(self._stream.fileno())
            self._stream.flush()  # what it held goes to /dev/null: the exit's flush does not fail again

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self._stream, name)


def to_devnull(fd: int) -> None:
    """What is written to `fd` from here on goes to /dev/null (a stream the OS refuses: its disk full, its reader or
    terminal gone)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _bytes_or_escape(error: UnicodeError) -> tuple[str | bytes, int]:
    """stdout's errors: a path's bytes that are no text (surrogateescape's) as they are; text its encoding lacks (an é
    under PYTHONIOENCODING=ascii, where every path with one printed was a UnicodeEncodeError's traceback) escaped."""
    try:
        return codecs.lookup_error("surrogateescape")(error)
    except UnicodeError:
        return codecs.lookup_error("backslashreplace")(error)


codecs.register_error("ddp-bytes-or-escape", _bytes_or_escape)


def standard_streams() -> None:
    """A command's fds 0-2 open and sys.stderr a LossyStderr. A closed one (`2>&-`) gets /dev/null: Python leaves
    sys.stderr None there, and the next file opened takes the number 2, so that torch's C++ warnings on fd 2 were
    written into it (a checkpoint being saved, the run's lock). stdout writes the bytes of a path that are not text
    in its encoding (a directory named in Latin-1) as they are, as Python's UTF-8 mode does: a UnicodeEncodeError
    traceback under a UTF-8 locale outside that mode (_bytes_or_escape)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
    sys.stdout = sys.stdout or open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = sys.stderr or open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="ddp-bytes-or-escape")  # a path's bytes that are no text here: as they are
    if not isinstance(sys.stderr, LossyStderr):
        sys.stderr = LossyStderr(sys.stderr)


class UsageError(Exception):
    """A user mistake; the message names what to change."""


class CorruptCheckpoint(UsageError):
    """A file that is not a whole, unaltered checkpoint (truncated, bit-flipped, or not ours)."""


class Diverged(Exception):
    """The loss or the weights became NaN or infinite; nothing was saved after that."""


class WriteFailed(Exception):
    """A file of the run could not be written (a full disk, a quota, a read-only filesystem); what
    was there before is intact."""


class PeerLost(Exception):
    """A collective failed: another rank died, hung past run.timeout_s, or the network broke.
    The launcher (torchrun --max-restarts, a SLURM requeue) may restart the job."""


class Stopped(Exception):
    """The loop stopped on a signal after writing its checkpoint; the message (rank 0's) says so."""


OUT_OF_MEMORY_FIX = (
    "try a smaller train.batch_size, or train.micro_batch_size=N (the same global batch in pieces of N per rank), "
    "run.amp=bf16, or data.loader=torch (the data off the GPU)"
)


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed: torch's CUDA (and MPS) OutOfMemoryError, its CPU
    allocator's "can't allocate memory" (a RuntimeError both), or Python's MemoryError."""
    text = str(error)
    return isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)
    )


SHARED_MEMORY_FIX = (
    "data.loader=device (the default: no worker processes), data.workers=0, or a larger /dev/shm "
    "(docker run --shm-size=1g; Kubernetes: an emptyDir of medium Memory mounted there)"
)


def out_of_shared_memory(error: BaseException) -> str | None:
    """The line of a DataLoader worker's failure for want of shared memory (/dev/shm: a Docker container's
    is 64 MB unless --shm-size): no space for a batch there, or the worker killed by SIGBUS. None for others."""
    lines = str(error).splitlines() if isinstance(error, RuntimeError) else []
    return next((line.strip() for line in reversed(lines) if "shared memory" in line), None)


def oom_kills() -> int | None:
    """How many processes of this process's memory cgroup (its job's, its container's: those the ranks share) the
    kernel's out-of-memory killer has ended, a machine's shortage or the cgroup's limit, or where no cgroup says, how
    many on this machine since it booted (/proc/vmstat); None where nothing says."""
    try:
        with open("/proc/self/cgroup") as groups:
            listed = groups.read()
    except OSError:
        listed = ""
    for path in (*_cgroup_counters(listed), "/proc/vmstat"):
        try:
            with open(path) as counters:
                found = next((int(line.split()[1]) for line in counters if line.startswith("oom_kill ")), None)
        except (OSError, ValueError):
            continue
        if found is not None:
            return found
    return None


def _cgroup_counters(listed: str) -> list[str]:
    """The files that count oom_kill for the memory cgroup /proc/self/cgroup's text `listed` names: cgroup v2's
    memory.events.local (its own processes; memory.events counts those of the cgroups below it too) and
    memory.events, or v1's memory.oom_control."""
    entries = [line.split(":", 2) for line in listed.splitlines() if line.count(":") >= 2]
    found = []
    for _, controllers, path in entries:  # v1's first: in a hybrid layout the memory controller is v1's
        if "memory" in controllers.split(","):
            found.insert(0, f"/sys/fs/cgroup/memory{path}/memory.oom_control")
        elif not controllers:
            found += [f"/sys/fs/cgroup{path}/memory.events.local", f"/sys/fs/cgroup{path}/memory.events"]
    return found


OOM_KILLS_AT_START = oom_kills()  # of this process: more since, and a process killed by SIGKILL was most likely one


def oom_kills_since() -> int:
    """How many processes the kernel's out-of-memory killer ended here since this process began (0: none, or no
    count)."""
    now, then = oom_kills(), OOM_KILLS_AT_START
    return max(0, now - then) if now is not None and then is not None else 0


def oom_killed(kills: int | None = None, host: str | None = None) -> str | None:
    """What the kernel's out-of-memory killer did on this machine since this process began, if anything: the
    words for a SIGKILL (a rank's, a DataLoader worker's) that has no word of its own. `kills` and `host`: the
    count a rank on another host told (lost_rank)."""
    kills = oom_kills_since() if kills is None else kills
    if kills <= 0:
        return None
    many, there = kills > 1, f" on {host}" if host else ""
    return (f"the kernel's out-of-memory killer ended {kills} process{'es' if many else ''} on "
            f"{host or 'this machine'} meanwhile (dmesg{there} names {'them' if many else 'it'})")  # fmt: skip


MACHINE_MEMORY_FIX = "give it more memory, or use less: fewer ranks on this machine, data.workers or train.batch_size"


LOST_WORKER_FIX = "run the same command to resume; data.loader=device (the default) or data.workers=0 uses no workers"


def lost_worker(error: BaseException) -> str | None:
    """torch's line for a DataLoader worker process that a signal ended or that vanished (SIGKILL: the kernel's
    out-of-memory killer, say); None for others (a worker whose code raised is "Caught ... in DataLoader worker")."""
    line = first_line(error) if isinstance(error, RuntimeError) else ""
    return line if line.startswith("DataLoader worker (pid") else None


def no_space(error: BaseException) -> str | None:
    """The line of a full disk or quota met outside the run's own writes (those are WriteFailed): torch.compile's
    cache in TMPDIR, say. The OSError among the error's causes, or the line of its message that quotes one."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return first_line(seen, typed=True)
        seen = seen.__cause__ or seen.__context__
    quoted = (f"[Errno {errno.ENOSPC}]", f"[Errno {errno.EDQUOT}]")
    return next((line.strip() for line in str(error).splitlines() if any(q in line for q in quoted)), None)


def machine_failure(error: BaseException) -> str | None:
    """What ran out on this machine, as "what (the error's line); what to try", for cli.command's one line:
    memory, /dev/shm, a DataLoader worker, disk space. None for any other error (a bug: its traceback)."""
    if shared := out_of_shared_memory(error):
        return f"out of shared memory ({shared}; /dev/shm: {_mib('/dev/shm', 'total')}); {SHARED_MEMORY_FIX}"
    if lost := lost_worker(error):
        killer = "; SIGKILL: " + (oom_killed() or "the kernel's out-of-memory killer, most often (dmesg says)")
        killer = killer if "Killed" in lost else ""
        return f"a DataLoader worker was lost ({lost.rstrip('. ')}{killer}); {LOST_WORKER_FIX}"
    if out_of_memory(error):
        return f"out of memory ({first_line(error)}); {OUT_OF_MEMORY_FIX}"
    if full := no_space(error):
        temporary = tempfile.gettempdir()
        return (f"no space left ({full}); free some, or set TMPDIR to a disk with room: torch.compile's cache is "
                f"in TMPDIR={temporary} ({_mib(temporary, 'free')} free)")  # fmt: skip
    return None


def path_refused(error: OSError) -> str | None:
    """The line for a path the OS refused as named: too long for the filesystem, not open to this user (it, or
    a folder above it: pathlib's exists() and is_file() raise on both, where they say False for a missing path), or
    through a symbolic link that loops; None for any other error, or one that names no path."""
    if error.filename is None:
        return None
    if error.errno == errno.ENAMETOOLONG:
        return (f"{error.filename}: a path too long for this filesystem (a name in it is at most 255 bytes on "
                "most, a whole path 4096); choose a shorter one")  # fmt: skip
    if error.errno in (errno.EACCES, errno.EPERM):
        return (f"{error.filename}: permission denied to user {_user()}: it, or a folder above it, is not open to "
                "this user (ls -ld each folder on the way); ask its owner to open it, or name another")  # fmt: skip
    if error.errno == errno.ELOOP:  # the link itself, wherever on the way the OS met the loop (a folder below it)
        found = link_on_the_way(str(error.filename))
        where = found[0] if found and found[1] else error.filename
        return f"{where}: a symbolic link on the way loops (ls -l each link on the way); name the file itself"
    return None


def link_on_the_way(path: str) -> tuple[str, bool] | None:
    """The first of `path` and the folders above it, from the root (or the working directory) down, that is a
    symbolic link that loops (True) or that points at nothing (False), as `path` spells it; None if none is."""
    parts = path.split(os.sep)
    for place in [os.sep.join(parts[: i + 1]) or os.sep for i in range(len(parts))]:
        try:
            os.stat(place)
        except OSError as e:  # (below a missing one, none is there)
            return (place, True) if e.errno == errno.ELOOP else (place, False) if os.path.islink(place) else None
    return None


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a container's uid without a name
        return str(os.geteuid())


def _mib(path: str, which: str) -> str:
    """The `which` (total, free) of the filesystem at `path` in MiB."""
    try:
        return f"{getattr(shutil.disk_usage(path), which) / 2**20:,.1f} MiB"
    except OSError as e:
        return e.strerror or "unknown size"


def first_line(error: BaseException, typed: bool = False) -> str:
    """An exception's message as one line for ours: its first line, without terminal colour codes
    (torch.load's has some); its type's name when it has no message, and before the line if `typed`."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    line, kind = text.splitlines()[0] if text else "", type(error).__name__
    return (f"{kind}: {line}" if typed else line) if line else kind


# globals a pickle calls to run code as it loads (a checkpoint made to do harm), not classes a model pickles
RUNS_CODE = ("os.", "posix.", "nt.", "sys.", "subprocess.", "runpy.", "importlib.", "pty.", "shutil.", "socket.",
             "builtins.eval", "builtins.exec", "builtins.compile", "builtins.__import__")  # fmt: skip


def refused_pickle(error: BaseException) -> str | None:
    """What torch.load's weights-only unpickler refused, said plainly: a class (torch.save of a whole model pickles
    one), or a call that runs code (posix.system: a file made to do so; torch blocks its module since 2.6, and named it
    as any other global before); None for another error. Torch's own line advises loading with weights_only=False,
    which would run that code."""
    text = str(error)
    if code := re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+?)(?: |$)", text, re.M):
        if re.search(r"whose module \S+ is blocked", text) or code[1].startswith(RUNS_CODE):
            return f"it would call {code[1]} as it loads, which torch.load refuses: no checkpoint does; do not trust it"
        return f"it holds Python objects ({code[1]}), as torch.save of a whole model writes, not only tensors"
    if text.startswith("Weights only load failed"):  # (torch's advice first, then its reason)
        said = re.search(r"^\s*(?:WeightsUnpickler error: )?((?:Unsupported|Trying to load) .*)$", text, re.M)
        return "torch.load's weights-only unpickler refused it" + (f": {said[1]}" if said else "")
    return None


def exit_code(error: BaseException) -> int:
    """The exit code of a run that ended with `error`."""
    if isinstance(error, UsageError):
        return EXIT_USAGE
    if isinstance(error, Stopped):
        return EXIT_STOPPED
    if isinstance(error, Diverged):
        return EXIT_DIVERGED
    return EXIT_FAILURE


def ending(error: BaseException) -> tuple[int, str]:
    """(exit code, line) of a process that ends with `error`, as its own line says it (cli.command; a bug: the
    first line of the traceback it prints)."""
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED, INTERRUPTED
    if isinstance(error, SystemExit):
        return (error.code if isinstance(error.code, int) else EXIT_FAILURE), f"it exited with {error.code}"
    if isinstance(error, OSError) and (refused := path_refused(error)):
        return EXIT_USAGE, refused
    if isinstance(error, (UsageError, Diverged, WriteFailed, PeerLost, Stopped)):
        return exit_code(error), str(error)
    return EXIT_FAILURE, machine_failure(error) or first_line(error, typed=True)
