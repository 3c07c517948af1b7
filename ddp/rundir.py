"""run.out_dir: the name of every file a run keeps there (defined here and nowhere else), the lock
that lets one run at a time use it, whether this run may start there (run.resume against its
checkpoints), and making it ready for the run."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddp import config, distributed, files
from ddp.devices import World
from ddp.errors import UsageError

# The layout of run.out_dir:
#   .lock                      held by rank 0 for as long as the run lives (lock)
#   config.yaml                the resolved config of the latest start
#   metrics.jsonl              one line per epoch (logs.record_epoch)
#   checkpoints/step-<global step, 9 digits>.pt   the newest run.keep_last (checkpoint.py), last.pt a hard link
#   tensorboard/               run.tensorboard=true
#   profile/rank<r>.json       run.profile traces
#   fault-fired.<point>.<N>    a fault of the kill-and-resume tests has fired (faults.py)
LOCK = ".lock"
_STEP_FILES = "step-" + "[0-9]" * 9 + ".pt"  # by name is by step
_TRACES = "rank[0-9]*.json"  # profile_path's names


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def step_path(out_dir: str | Path, global_step: int) -> Path:
    return checkpoint_dir(out_dir) / f"step-{global_step:09d}.pt"


def step_files(out_dir: str | Path) -> list[Path]:
    """This run's numbered checkpoints, newest first."""
    return _steps_in(checkpoint_dir(out_dir))


def _steps_in(folder: Path) -> list[Path]:
    """The numbered checkpoints in `folder`, newest first: files only (a directory or a dangling link of such a
    name stopped run.resume=auto with "is a directory", whole checkpoints beside it). A folder this user may not
    list raises (glob said it was empty: a run started afresh beside checkpoints it could not see)."""
    return _files_in(folder, _STEP_FILES)[::-1]


def _files_in(folder: Path, pattern: str) -> list[Path]:
    """The files in `folder` whose names match `pattern`, by name; none where it is missing (a folder this user may
    not list raises)."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(p for p in map(folder.joinpath, fnmatch.filter(names, pattern)) if p.is_file())


def last_path(out_dir: str | Path) -> Path:
    return checkpoint_dir(out_dir) / "last.pt"


def checkpoint_files(out_dir: str | Path) -> list[Path]:
    """The checkpoints run.resume=auto may go on from, newest first: the numbered ones, after last.pt where it is
    a file of its own, a hard link to none of them (the numbered ones removed, a copy brought in, `cp -r` of the
    run; a run never leaves one). It was passed over, the run started afresh and its first save replaced it."""
    numbered, last = step_files(out_dir), last_path(out_dir)
    try:
        own = last.is_file() and not any(last.samefile(p) for p in numbered)
    except OSError:  # removed meanwhile
        own = False
    return [last, *numbered] if own else numbered


def numbered_beside(path: Path, global_step: int, found: list[Path]) -> Path | None:
    """The newest numbered checkpoint among `found` (checkpoint_files') where `path` is last.pt of its own and holds
    another global step: which to go on from is the user's to say (the newer numbered ones removed to go back, and a
    newer copy brought in, look alike). By name is by step; `cp -r` of a run holds the same step in both."""
    numbered = [p for p in found if p.name != path.name]
    differs = path.name == "last.pt" and numbered and int(numbered[0].name[5:14]) != global_step
    return numbered[0] if differs else None


def newest_in(directory: str | Path) -> Path | None:
    """The newest checkpoint of a directory named where a checkpoint file was wanted: a run.out_dir's, or that of
    its checkpoints/ folder itself: last.pt, else (removed, say) the newest numbered one; None if it has none."""
    for folder in (checkpoint_dir(directory), Path(directory)):
        found = [folder / "last.pt"] if (folder / "last.pt").is_file() else _steps_in(folder)
        if found:
            return found[0]
    return None


def config_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / "config.yaml"


def metrics_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / "metrics.jsonl"


def tensorboard_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "tensorboard"


def profile_path(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir) / "profile" / f"rank{rank}.json"


def fault_marker(out_dir: str | Path, point: str, n: int | str) -> Path:
    return Path(out_dir) / f"fault-fired.{point}.{n}"


@contextlib.contextmanager
def lock(out_dir: str, world: World) -> Iterator[None]:
    """Hold out_dir's lock while inside (rank 0; the other ranks hold nothing): an exclusive flock on
    out_dir/.lock, with rank 0's host, pid and start time in it. The system drops it when the process
    ends, however it ends, so a dead run never leaves a stale lock. A second run is refused (exit 2), and on every
    rank, before the lock, a folder whose files no run wrote (check_own_files)."""
    check_own_files(out_dir)
    if not world.is_main:
        yield
        return
    path = Path(out_dir) / LOCK
    made = [d for d in (path.parent, *path.parent.parents) if not os.path.exists(d)]  # what a refused run takes away
    try:
        fd = _open_locked(path, out_dir)
    except OSError as e:
        raise _cannot_write(out_dir, e) from None
    try:
        if fd is not None:
            holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            with contextlib.suppress(OSError):  # a full disk: the lock holds all the same, unsigned
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(holder).encode(), 0)
        yield
    except BaseException:
        with contextlib.suppress(OSError):  # (a folder removed as the run went on: nothing to take away)
            if fd is not None and made and [p.name for p in path.parent.iterdir()] == [LOCK]:
                path.unlink()  # refused before it wrote anything: no folder of a lock alone left (under the lock: a
                for folder in made:  # run that opened it meanwhile finds it gone, _open_locked)
                    folder.rmdir()
        raise
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _open_locked(path: Path, out_dir: str) -> int | None:
    """out_dir/.lock opened and locked (UsageError if another run holds it), or None where the filesystem cannot
    lock. A lock file that a refused run removed while this one waited to open it is opened again."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _take(fd, out_dir):
                os.close(fd)
                return None
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass  # removed after our open: locked, but no longer the file of this out_dir
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _cannot_write(out_dir: str, e: OSError) -> UsageError:
    """The error for out_dir, naming the path in it that failed (its lock, metrics.jsonl, checkpoints/)."""
    target = Path(e.filename or out_dir)
    why = files.in_the_way(target, e)  # a file where target or a parent of it must be a directory: named
    where = f"{target}: " if why == e.strerror and target != Path(out_dir) else ""  # the OS's reason: say where
    return UsageError(f"cannot write to run.out_dir={out_dir} ({where}{why})")


def _take(fd: int, out_dir: str) -> bool:
    """Whether the lock was taken; UsageError if another run holds it; False (with a warning) where
    the filesystem cannot lock (NFS without lockd): never a wait."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # never waits
        return True
    except BlockingIOError:
        raise UsageError(
            f"run.out_dir={out_dir} is in use by another run ({_holder(fd)}); wait for it to end, stop it, "
            "or choose another run.out_dir"
        ) from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        why = f"{e.strerror}: no working file locks on this filesystem, e.g. NFS without lockd"
        print(
            f"warning: cannot lock run.out_dir={out_dir} ({why}); a second run into it would not be refused",
            file=sys.stderr,
        )
        return False


def _holder(fd: int) -> str:
    try:
        held = json.loads(os.pread(fd, 4096, 0))
        return f"pid {held['pid']} on {held['host']}, started {held['started']}"
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return "its lock file does not say which"


def check_resume_setting(resume: str, out_dir: str) -> None:
    """run.resume must not overwrite checkpoints the user has not asked to continue (checked before
    the process group, so every rank stops alike)."""
    if resumes_its_own(resume, out_dir):
        return
    if resume != "never" and not Path(resume).is_file():
        if files.existing(Path(resume)) and not Path(resume).is_dir():  # <(ssh host cat last.pt): every rank reads it
            raise UsageError(f"run.resume={resume} is a pipe or device, not a file: copy the checkpoint to a file")
        newest = f"; its newest checkpoint is {newest_in(resume)}" if newest_in(resume) else ""
        raise UsageError(f"run.resume={resume}: no such checkpoint file (use auto, never or a path){newest}")
    existing = checkpoint_files(out_dir)
    if not existing:
        return
    if resume == "never":
        raise UsageError(
            f"run.resume=never but {existing[0]} exists and would be overwritten; "
            "use another run.out_dir, run.resume=auto to continue, or delete it yourself"
        )
    if not Path(resume).samefile(existing[0]):  # last.pt is a hard link to the newest
        raise UsageError(
            f"run.resume={resume} but {checkpoint_dir(out_dir)} holds newer checkpoints that a later "
            "auto-resume would pick; use another run.out_dir"
        )


def resumes_its_own(resume: str, out_dir: str) -> bool:
    """Whether the run goes on from out_dir's own newest checkpoint: run.resume=auto, or PATH restarting the run
    that started from PATH there (its config.yaml has this run.resume, and checkpoints of its own are there: a
    requeue, torchrun --max-restarts, the same command again; it was refused, as if PATH were an older file)."""
    if resume == "auto":
        return True
    if resume == "never" or not checkpoint_files(out_dir):
        return False
    try:
        return config.load(str(config_path(out_dir)), []).run.resume == resume
    except UsageError:  # no config.yaml, or not one of ours
        return False


def check_own_files(out_dir: str) -> None:
    """A UsageError where run.out_dir holds files of the names a run writes that no run wrote: a project's own
    config.yaml, metrics.jsonl, checkpoints/last.pt or step-*.pt, profile/rank*.json (run.out_dir=. in it, say),
    which the run replaced (the step files it pruned). A run's directory has its config.yaml (this config's
    sections), written before any of the others and after checkpoints/: one of this config's sections alone is a
    user's (`--config runs/a/config.yaml run.out_dir=runs/a`: replaced)."""
    settings = config_path(out_dir)  # files only: a folder of one of these names is in the way, said as such
    names = (settings, metrics_path(out_dir), last_path(out_dir))
    try:
        found = [p for p in names if p.is_file()]
        odd = [p for p in names if p.exists() and not p.is_file() and not p.is_dir()]
    except OSError:  # out_dir or checkpoints/ not open to this user, a name too long: said where they are used
        return
    if odd:  # metrics.jsonl as /dev/zero was read whole (MemoryError, the OOM killer), as a pipe waited for good
        raise UsageError(f"run.out_dir={out_dir}: {odd[0]} is a pipe or a device (or a link to one) where a run keeps "
                         "a file of its own: remove it, or choose another run.out_dir")  # fmt: skip
    ours = settings in found and config.is_a_runs(settings)
    if ours and checkpoint_dir(out_dir).is_dir():
        return
    if settings in found:
        why = "no checkpoints/ beside it, which a run makes first" if ours else "not ddp-cifar's settings"
        raise UsageError(
            f"run.out_dir={out_dir} holds a config.yaml that is not a run's ({why}; a run writes its "
            f"settings there, replacing it): choose another run.out_dir, or move {settings} away"
        )
    try:  # a user's step-*.pt were passed over and then pruned (train.keep_last), their rank0.json replaced
        found += _files_in(checkpoint_dir(out_dir), _STEP_FILES) + _files_in(profile_path(out_dir, 0).parent, _TRACES)
    except OSError:  # checkpoints/ not open to this user: check_checkpoints says it
        pass
    if found:
        shown, more = [str(p.relative_to(out_dir)) for p in found[:2]], len(found) - 2
        names = f"{', '.join(shown)} and {more} more" if more > 0 else " and ".join(shown)
        raise UsageError(f"run.out_dir={out_dir} holds {names} but no run's config.yaml, which a run "
                         "writes before them: they are not a run's, and this run would replace or prune them; choose "
                         "another run.out_dir, or move them away")  # fmt: skip


def check_checkpoints(out_dir: str) -> None:
    """A UsageError where checkpoints/ is not open to this user: to list (glob said it was empty, and a run started
    afresh beside checkpoints it could not see) or to write (the first save said so, after an epoch's training)."""
    folder = checkpoint_dir(out_dir)
    probe = folder / f".writable-{os.getpid()}.tmp"  # a kill's leftover goes with the writers' (files.TEMPORARY)
    try:
        step_files(out_dir)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise _cannot_write(out_dir, OSError(e.errno, e.strerror, str(folder))) from None


def prepare(out_dir: str, config_yaml: str, epochs_done: int, world: World, tensorboard: bool = False) -> None:
    """Rank 0 makes checkpoints/ (and tensorboard/), writes config.yaml, cuts metrics.jsonl back to the
    epochs of the checkpoint being resumed (a killed run may have logged an epoch it never saved) and
    removes what killed writers left; every rank learns whether that worked, before the first step."""
    with distributed.fail_together(world):
        if world.is_main:
            try:
                checkpoint_dir(out_dir).mkdir(parents=True, exist_ok=True)  # a file in its place: said now, not later
                if tensorboard:
                    tensorboard_dir(out_dir).mkdir(exist_ok=True)
                files.replace(config_path(out_dir), config_yaml.encode())  # a full disk: WriteFailed, exit 1
                metrics = metrics_path(out_dir)
                if metrics.exists():
                    lines = metrics.read_text(errors="replace").splitlines()  # bytes that are no text: no record
                    kept = [line for line in lines if _epoch(line) <= epochs_done]
                    files.replace(metrics, "".join(line + "\n" for line in kept).encode())
                files.remove_temporary(checkpoint_dir(out_dir))
                check_checkpoints(out_dir)
            except OSError as e:
                raise _cannot_write(out_dir, e) from None


def _epoch(line: str) -> float:
    """A metrics line's epoch; infinity for a line a kill left half-written (so it is dropped)."""
    record = metrics_record(line)
    return float("inf") if record is None else record["epoch"]


def metrics_record(line: str) -> dict[str, Any] | None:
    """One line of metrics.jsonl as its epoch's record; None for a line that is not one (a kill left it
    half-written, or an edit)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # the second: [[[[... nested deeper than the parser's recursion
        return None
    return record if isinstance(record, dict) and isinstance(record.get("epoch"), int) else None
