"""The run directory, run.out_dir, as a whole: whether this run may start there (one run at a time,
and run.resume against the checkpoints there), and making it ready on rank 0 with every rank told
whether that worked. Its contents have their own owners: checkpoints/ is checkpoint.py's;
config.yaml, metrics.jsonl and tensorboard/ are logs.py's; `.lock` is this module's.

The lock: rank 0 holds an exclusive fcntl.flock on out_dir/.lock for as long as the run lives, and
writes its host, pid and start time there. The operating system drops it when the process ends,
however it ends (a SIGKILL included), so a dead run never leaves a stale lock. A second run into
the same out_dir is refused (exit 2) before its rendezvous, naming the first. On a filesystem whose
locks do not work (NFS without lockd) taking it fails at once: a warning, never a wait.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ddp import checkpoint, distributed, logs
from ddp.distributed import World
from ddp.errors import UsageError

LOCK = ".lock"


@contextlib.contextmanager
def lock(out_dir: str, world: World) -> Iterator[None]:
    """Hold out_dir's lock (rank 0; other ranks hold nothing) while inside."""
    if not world.is_main:
        yield
        return
    path = Path(out_dir) / LOCK
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UsageError(f"cannot write to run.out_dir={out_dir} ({e})") from None
    try:
        if _take(fd, out_dir):
            holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            with contextlib.suppress(OSError):  # a full disk: the lock holds all the same, unsigned
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(holder).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _take(fd: int, out_dir: str) -> bool:
    """Whether the lock was taken; UsageError if another run holds it; False (with a warning) where
    the filesystem cannot lock."""
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
    except (OSError, ValueError, KeyError, TypeError):
        return "its lock file does not say which"


def check_resume_setting(resume: str, out_dir: str) -> None:
    """run.resume must not overwrite checkpoints the user has not asked to continue (checked before
    the process group, so every rank stops alike)."""
    if resume == "auto":
        return
    if resume != "never" and not Path(resume).is_file():
        raise UsageError(f"run.resume={resume}: no such checkpoint file (use auto, never or a path)")
    existing = checkpoint.step_files(out_dir)
    if not existing:
        return
    if resume == "never":
        raise UsageError(
            f"run.resume=never but {existing[0]} exists and would be overwritten; "
            "use another run.out_dir, run.resume=auto to continue, or delete it yourself"
        )
    if not Path(resume).samefile(existing[0]):  # last.pt is a hard link to the newest
        raise UsageError(
            f"run.resume={resume} but {checkpoint.directory(out_dir)} holds newer checkpoints that a later "
            "auto-resume would pick; use another run.out_dir"
        )


def start(out_dir: str, config_yaml: str, epochs_done: int, world: World) -> None:
    """Rank 0 writes config.yaml, cuts metrics.jsonl back to the checkpoint being resumed and removes
    a killed writer's temporary files; every rank learns whether that worked (none waits)."""

    def prepare() -> None:
        try:
            logs.start(out_dir, config_yaml, epochs_done)
            checkpoint.remove_partial_writes(out_dir)
        except OSError as e:
            raise UsageError(f"cannot write to run.out_dir={out_dir} ({e})") from None

    distributed.on_rank0(world, prepare)
