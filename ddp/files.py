"""Writing a run's files so that a failure (a full disk, a quota, a read-only filesystem, a kill)
never leaves a half-written one: `replace` writes a temporary file beside the target, fsyncs and
renames it over the target; `append` cuts the file back to where it was if the write fails. Either
raises WriteFailed naming the file, the bytes it needed and the space that was free. What the files
hold is their owners' (checkpoint.py, logs.py)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddp.errors import WriteFailed


def failure(path: Path, needed: int, error: OSError) -> WriteFailed:
    """WriteFailed for `path`: the OS's reason, the bytes needed, the space free where it goes."""
    try:
        free = f"{shutil.disk_usage(path.parent).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    return WriteFailed(f"cannot write {path}: {error.strerror or error} ({needed:,} bytes needed, {free})")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def replace(path: Path, data: bytes, halfway: Callable[[], None] | None = None) -> None:
    """`data` as the new content of `path`, all or nothing; `halfway` runs with half of it written
    (the kill-during-a-write tests)."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # as open() would make it, not mkstemp's 0600
            _write_all(fd, data[: len(data) // 2])
            if halfway:
                halfway()
            _write_all(fd, data[len(data) // 2 :])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
        dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        if tmp is not None:  # first, so that the free space reported is what is really free
            Path(tmp).unlink(missing_ok=True)
            tmp = None
        raise failure(path, len(data), e) from None
    finally:
        if tmp is not None:  # killed by an exception other than a failed write
            Path(tmp).unlink(missing_ok=True)


def append(path: Path, text: str) -> None:
    """Add `text` (whole lines) to the end of `path`; on failure the file is as it was."""
    data = text.encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise failure(path, len(data), e) from None
    try:
        size = os.fstat(fd).st_size
        _write_all(fd, data)
        os.fsync(fd)
    except OSError as e:
        os.ftruncate(fd, size)  # a half-written line would not parse
        raise failure(path, len(data), e) from None
    finally:
        os.close(fd)


def digest(obj: Any) -> str:
    """sha256 over a checkpoint's content (tensors by dtype, shape and bytes), independent of how
    torch.save lays it out, so it can be stored inside the file it checks."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            h.update(f"D{len(x)}".encode())
            for k in sorted(x, key=repr):
                walk(k)
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"S{type(x).__name__}:{x!r}".encode())

    walk(obj)
    return h.hexdigest()
