"""Writing a run's files all or nothing, the one place that does: a new content goes to a temporary
file beside its target, fsynced, then renamed over it (`replace`, `atomic`, `link`); `append` cuts a
failed addition off. A failure is one WriteFailed: the file, the bytes it needed, the space free.

`digest` is the checksum a checkpoint holds of its own content; `torch_file_problem` tells
torch.save's whole files from others; `seekable` is what torch.load can read of a pipe."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import stat
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from ddp.errors import UsageError, WriteFailed, link_on_the_way

TEMPORARY = ".*.tmp"  # what a writer killed before its rename leaves beside the target (never a final name)


def failure(path: Path, needed: int, error: OSError, found: bool = True) -> WriteFailed:
    """WriteFailed for `path`: the OS's reason, and for a full disk or quota the bytes needed and the space
    free where it goes (for any other reason, "0 bytes free" of a read-only or missing place would mislead). A folder
    gone (ENOENT) where the writer had `found` its folders, or made them, is named: "No such file or directory" of a
    run's metrics.jsonl did not say that the run's folder had been removed as it trained."""
    why = in_the_way(path.parent, error)  # (a link to nothing on the way: named there)
    if error.errno == errno.ENOENT and why == error.strerror and found:
        gone = next((p for p in reversed(path.parents) if not os.path.lexists(p)), None)  # the topmost
        why = f"{gone} is gone (removed or moved meanwhile?)" if gone else why
    reason = f"cannot write {path}: {why}"
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return WriteFailed(reason)
    try:
        free = f"{shutil.disk_usage(path.parent).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    return WriteFailed(f"{reason} ({needed:,} bytes needed, {free})")


def in_the_way(directory: Path, error: OSError) -> str:
    """Why a directory (to be) could not be made or written to: the OS's reason, or for the two a file gives
    (EEXIST, ENOTDIR) the file standing where it or a parent of it must be. os.path's tests: they say False
    where a parent cannot be searched (a user not root under /root), where Path.exists raises. A symbolic link
    on the way that loops (mkdir says EEXIST of it, ELOOP below it) raises OSError ELOOP naming it, which every
    command says in errors.path_refused's line: "File exists" of it misled, from Python 3.13 in every command
    (pathlib's resolve() had said the loop before). A link to nothing on the way (runs/ linked to a scratch
    folder not made yet, or on a filesystem not mounted) is named with where it points: "File exists" misled too;
    the folder it names is not made here (on a filesystem not mounted, it would fill the one beneath)."""
    on_the_way = (errno.EEXIST, errno.ENOTDIR, errno.ELOOP, errno.ENOENT)
    if error.errno in on_the_way and (found := link_on_the_way(str(directory))):
        if found[1]:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), found[0])
        if error.errno != errno.ELOOP:
            return f"{_to_nothing(found[0])}: make that directory, mount its filesystem, or point the link at one"
    paths = (directory, *directory.parents) if error.errno in (errno.EEXIST, errno.ENOTDIR) else ()
    file = next((p for p in paths if os.path.exists(p) and not os.path.isdir(p)), None)
    return f"{file} is a file, not a directory" if file else error.strerror or str(error)


def link_to_nothing(path: Path) -> str | None:
    """The first of `path` and the folders above it, from the top down, that is a link to nothing (a scratch folder
    not made yet, a filesystem not mounted), said as "L is a symbolic link to T, which is not there"; None if none."""
    found = link_on_the_way(str(path))
    return _to_nothing(found[0]) if found and not found[1] else None


def _to_nothing(link: str) -> str:
    return f"{link} is a symbolic link to {os.readlink(link)}, which is not there"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_all(write: Callable[[memoryview], int], data: bytes | memoryview) -> None:
    """Every byte of `data` through `write` (os.write on a file descriptor, an unbuffered stream's write), which
    may take a part of it: a signal in the write, a pipe whose reader ended (the next write raises)."""
    view = memoryview(data)
    while view:
        view = view[write(view) :]


def _fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` itself durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(path: Path, data: bytes | memoryview, exclusive: bool = False, parents: bool = True) -> None:
    """`data` as the new content of `path` (its folder made if missing, and the folders above it unless not
    `parents`), all or nothing. `exclusive`: a file that is there by then stays (an OSError, File exists), as one made
    meanwhile by a second writer."""
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=parents, exist_ok=True)
    except OSError as e:  # (made here, not gone: where one cannot be made, as in /proc, the OS's reason)
        raise failure(path, len(data), e, found=not parents) from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # as open() would make it, not mkstemp's 0600
            write_all(lambda view: os.write(fd, view), data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            _link_new(tmp, path)
        else:
            os.replace(tmp, path)
        tmp = None
        _fsync_dir(path.parent)
    except OSError as e:
        if tmp is not None:  # first, so that the free space reported is what is really free
            Path(tmp).unlink(missing_ok=True)
            tmp = None
        raise failure(path, len(data), e) from None
    finally:
        if tmp is not None:  # left by an exception other than a failed write
            Path(tmp).unlink(missing_ok=True)


def _link_new(tmp: str, path: Path) -> None:
    """`tmp` renamed to `path` unless `path` exists, in one step: a hard link never replaces a file."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links (FAT): the caller's look before is all there is
        if path.exists():
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
        os.replace(tmp, path)
    else:
        os.unlink(tmp)


@contextmanager
def atomic(path: Path, exclusive: bool = False, parents: bool = True) -> Iterator[io.BytesIO]:
    """`with atomic(path) as f: write(f)`: what is written to f becomes `path`'s content
    when the `with` ends without an error, whole (replace; with `exclusive` never over a file that is there);
    an error inside leaves `path` as it was. The bytes go to memory first, so a full disk is an OSError here,
    never a half-written zip."""
    buffer = io.BytesIO()
    yield buffer
    replace(path, buffer.getbuffer(), exclusive, parents)


def link(target: Path, name: Path) -> None:
    """`name` made another name of `target`, atomically (a hard link: no second copy of the bytes; a
    copy on a filesystem without hard links)."""
    tmp = name.parent / f".{name.name}.{os.getpid()}.tmp"
    try:
        tmp.unlink(missing_ok=True)
        try:
            os.link(target, tmp)
        except OSError:
            shutil.copyfile(target, tmp)
        os.replace(tmp, name)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise failure(name, 0, e) from None


def append(path: Path, text: str) -> None:
    """Add `text` (whole lines) to the end of `path`; on failure the file is as it was."""
    data = text.encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise failure(path, len(data), e) from None
    try:
        size = os.fstat(fd).st_size
        write_all(lambda view: os.write(fd, view), data)
        os.fsync(fd)
    except OSError as e:
        os.ftruncate(fd, size)  # a half-written line would not parse
        raise failure(path, len(data), e) from None
    finally:
        os.close(fd)


def remove_temporary(directory: Path, pattern: str = TEMPORARY) -> None:
    """The temporary files that writers killed before their rename left in `directory` (those `pattern` names)."""
    for tmp in Path(directory).glob(pattern):
        tmp.unlink(missing_ok=True)


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


def seekable(path: Path) -> Path | io.BytesIO:
    """`path`, or a pipe's bytes in memory (`--checkpoint <(ssh host cat last.pt)`, `... | --checkpoint -`, "-"
    being stdin): torch.load and zipfile seek, which a pipe cannot, and it can be read only once."""
    if str(path) == "-":
        if sys.stdin.isatty():
            raise UsageError("PATH - reads the checkpoint from stdin, a terminal here: pipe it, e.g. cat last.pt |")
        return io.BytesIO(sys.stdin.buffer.read())
    try:
        return io.BytesIO(path.read_bytes()) if stat.S_ISFIFO(path.stat().st_mode) else path
    except OSError:
        return path  # missing, unreadable: torch.load's error says which


def existing(path: Path) -> bool:
    """Path.exists(), but where this user may not look (a folder on the way not open to it) or the name is too long
    it raises, as pathlib did before Python 3.14, whose exists() says False: "no such file" for a file that is there."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EBADF):  # pathlib's before 3.14, but a loop: said as one
            return False
        raise
    return True


def read_small(path: Path, most: int) -> bytes | None:
    """A file's bytes, or None where it holds more than `most`, of which no more is read (/dev/zero, a data
    file named by mistake: reading it whole filled the memory)."""
    with open(path, "rb") as f:
        data = f.read(most + 1)
    return data if len(data) <= most else None


def size_of(source: Path | io.BytesIO) -> int:
    return source.getbuffer().nbytes if isinstance(source, io.BytesIO) else source.stat().st_size


def torch_file_problem(source: Path | io.BytesIO) -> str | None:
    """What makes `source` no whole file of torch.save's, from its bytes: another kind of file, or its zip cut
    short; None when it looks whole (a zip, its format, or a pickle, its legacy one) or cannot be read (then
    torch.load's error says why)."""
    try:
        with open(source, "rb") if isinstance(source, Path) else nullcontext(source) as f:
            f.seek(0)
            head = f.read(4)
            if not head:
                return "an empty file"
            if head == b"PK\x03\x04":
                whole = zipfile.is_zipfile(f)  # it finds the zip's end record, the last bytes torch.save writes
                return None if whole else "cut short: a zip without its end, as an interrupted copy leaves"
    except OSError:
        return None
    return None if head[:1] == b"\x80" else "not a file that torch.save wrote"
