"""torchvision's CIFAR-10/100 in data.root: found there, or downloaded by local rank 0 (one run at a time into a
data.root, a stalled connection bounded) while the others of its node wait; why a copy is missing or not whole,
and whether this machine could download it (ddp.doctor). ddp/datasets.py puts what it reads in its form.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import http.client
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ddp import files, models
from ddp.config import DataConfig
from ddp.devices import World
from ddp.errors import UsageError, first_line

Arrays = tuple[np.ndarray, np.ndarray]  # a split's images (N, 32, 32, 3) uint8 and labels (N,)


class DataMissing(UsageError):
    """CIFAR is not in data.root and data.download=false: a download would bring it."""


CLASS_COUNTS = {"cifar10": 10, "cifar100": 100}  # known before a download: a model of other classes is refused first
DOWNLOAD_WAIT_S = 3600  # how long the other ranks of a node wait for local rank 0's download
DOWNLOAD_STALL_S = 60.0  # a download that receives nothing for this long fails (torchvision's has no limit)


@contextlib.contextmanager
def _stall_limit(seconds: float) -> Iterator[None]:
    """Sockets opened inside wait at most `seconds` for each connect and read: torchvision's urlopen has no timeout,
    so a connection that stalls (a firewall that drops, a proxy that hangs) held local rank 0, and the ranks
    waiting on it, for good. Set process-wide while inside: the data is read before any process group or thread."""
    before = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(before)


@contextlib.contextmanager
def _download_lock(root: Path, name: str) -> Iterator[None]:
    """data.root locked (flock) while this process downloads into it: torchvision writes the archive in place,
    so two runs downloading at once (the jobs of one sweep) wrote over each other's. The second waits, then
    finds the data. Where no lock can be had (read-only, NFS without lockd) it goes on without one."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / ".download.lock", "a")  # closed below, after the yield
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another run's download of {name} into data.root={root}", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            pass  # no locks on this filesystem
        yield
    finally:
        lock.close()


def dataset_class(cfg: DataConfig) -> tuple[type, str]:
    """torchvision's dataset class of data.dataset (cifar10 or cifar100), and its name."""
    torchvision_datasets = models.torchvision(f"data.dataset={cfg.dataset}").datasets
    if cfg.dataset == "cifar10":
        return torchvision_datasets.CIFAR10, "CIFAR-10"
    return torchvision_datasets.CIFAR100, "CIFAR-100"


DOWNLOAD_ANSWER_S = 10.0  # how long ddp.doctor waits for CIFAR's address to answer


def download_problem(cfg: DataConfig, timeout_s: float = DOWNLOAD_ANSWER_S) -> str | None:
    """Why data.download=true could not fetch CIFAR from this machine (its address does not answer within
    timeout_s: a cluster's compute node without internet, a proxy not set), or None; None too where data.root
    holds the whole archive, which the run unpacks without a download. ddp.doctor says it before a run fails."""
    from torchvision.datasets.utils import USER_AGENT, check_integrity  # torchvision's own request and check

    cls, name = dataset_class(cfg)
    if check_integrity(Path(cfg.root) / cls.filename, cls.tgz_md5):
        return None
    try:  # the response's head only: closed before its body
        with urllib.request.urlopen(urllib.request.Request(cls.url, headers={"User-Agent": USER_AGENT}),
                                    timeout=timeout_s):  # fmt: skip
            return None
    except (OSError, ValueError, http.client.HTTPException) as e:  # URLError, HTTPError and timeouts are OSErrors
        cause = e.reason if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException) else e
        why = first_line(cause, typed=True)  # the socket's own error, not urllib's wrapper of it
    root = cfg.root
    return (f"{name} is not in data.root={root}, and this machine cannot download it: {cls.url} does not answer "
            f"({why}); download it where there is internet (python -c \"import torchvision; torchvision.datasets."
            f"{cls.__name__}('{root}', download=True)\") into a data.root this machine sees, set https_proxy if "
            "this network has a proxy, or use data.dataset=npz data.path=FILE.npz")  # fmt: skip


def read(cfg: DataConfig, world: World) -> tuple[Arrays, Arrays, list[str]]:
    """CIFAR-10/100 from data.root: (train, test) as (images (N, 32, 32, 3) uint8, labels), and the class names;
    local rank 0 downloads if allowed, the others of its node wait for the files to appear (no process group is
    needed: the data is read before joining one)."""
    cls, name = dataset_class(cfg)
    folder = cls.base_folder
    offline_fix = f"put the torchvision copy ({folder}/) in data.root, or use data.dataset=npz data.path=FILE.npz"
    if Path(cfg.root).name == cls.filename and Path(cfg.root).is_file():  # make train DATA=the archive
        raise UsageError(f"data.root={cfg.root} is {cls.filename} itself: name the directory that holds it, data."
                         f"root={Path(cfg.root).parent}, and set data.download=true to unpack it there")  # fmt: skip
    if Path(cfg.root).is_file():  # make train DATA=file that does not end in .npz, say
        raise UsageError(f"data.root={cfg.root} is a file, not a directory; {offline_fix}")
    if to_nothing := files.link_to_nothing(Path(cfg.root)):  # "not found", or a download's "File exists"
        raise UsageError(f"data.root={cfg.root}: {to_nothing}: mount its filesystem, make that directory, or point "
                         "the link at the data")  # fmt: skip
    for place in (Path(cfg.root), Path(cfg.root) / folder):  # torchvision says "not found" of a folder not open
        if place.is_dir() and not os.access(place, os.R_OK | os.X_OK):  # to this user, and a download followed
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(place))  # cli's line for it

    def opened() -> tuple[Arrays, Arrays, list[str]] | None:
        try:
            parts = [cls(cfg.root, train=train, download=False) for train in (True, False)]
        except RuntimeError:  # torchvision: "Dataset not found or corrupted"
            return None
        except OSError as e:  # a file of it this user may not read, say
            raise UsageError(f"cannot read {name} in data.root={cfg.root}: {e.filename} ({e.strerror})") from None
        return (parts[0].data, np.asarray(parts[0].targets)), (parts[1].data, np.asarray(parts[1].targets)), list(
            parts[0].classes)  # fmt: skip

    found = opened()
    if found is None and not cfg.download:
        raise DataMissing(_not_here(cls, Path(cfg.root), name, offline_fix))
    if found is None and world.is_local_main:
        with _download_lock(Path(cfg.root), name):
            found = opened()  # another run's download may have brought it meanwhile
            if found is None:
                try:
                    with _stall_limit(DOWNLOAD_STALL_S):
                        for train in (True, False):
                            cls(cfg.root, train=train, download=True)
                except Exception as e:  # offline, proxy, disk full: all mean "no data here"
                    why = first_line(e, typed=True)
                    found_here = _not_here(cls, Path(cfg.root), name, offline_fix, download=True)  # what is there
                    raise UsageError(f"could not download {name} into data.root={cfg.root} ({why}); offline? "
                                     f"{found_here}") from None  # fmt: skip
                found = opened()
        if found is None:
            raise UsageError(f"{name} not found in data.root={cfg.root} after its download")
    deadline = time.monotonic() + DOWNLOAD_WAIT_S
    while found is None:  # the others wait for local rank 0's download (its failure ends the job)
        if time.monotonic() > deadline:
            raise UsageError(
                f"{name} did not appear in data.root={cfg.root} within {DOWNLOAD_WAIT_S} s of waiting for local "
                "rank 0 to download it: is data.root on a filesystem this node's processes share?"
            )
        time.sleep(2)
        found = opened()
    return found


def _not_here(cls: type, root: Path, name: str, offline_fix: str, download: bool = False) -> str:
    """Why torchvision found no whole copy of CIFAR in data.root, and what brings one: for data.download=false, or
    (`download`) where its download failed (offline: a damaged copy there was said to be missing)."""
    from torchvision.datasets.utils import check_integrity  # its own check: False for a missing file too

    folder, archive = root / cls.base_folder, root / cls.filename
    checked = [*cls.train_list, *cls.test_list, (cls.meta["filename"], cls.meta["md5"])]
    if folder.is_dir() and (bad := [f for f, md5 in checked if not check_integrity(folder / f, md5)]):  # altered
        return (
            f"{name} in data.root={root} is incomplete or damaged: in {folder.name}/, {', '.join(bad)} missing or not "
            "the files torchvision knows (by their md5); copy it again"
            + ("" if download else ", or set data.download=true to fetch it")
        )
    if root.name == cls.base_folder:
        return (
            f"data.root={root} is {cls.base_folder}/ itself: name the directory that holds it, data.root={root.parent}"
        )
    if check_integrity(archive, cls.tgz_md5):
        return (f"data.root={root} holds {archive.name}, not unpacked: tar xzf {archive} -C {root}, or set "
                "data.download=true (it unpacks it, without a download)")  # fmt: skip
    if archive.is_file():  # torchvision's download writes it in place: a kill leaves it cut short
        fix = "copy it again, or fetch it where there is internet" if download else (
            "Set data.download=true to fetch it again, or copy it again")  # fmt: skip
        return (f"data.root={root} holds {archive.name}, but not the whole archive (not the md5 torchvision knows): "
                f"a download cut short? {fix}")  # fmt: skip
    if download:
        return offline_fix
    return f"{name} not found in data.root={root} and data.download=false; {offline_fix}"
