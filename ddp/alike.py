"""What every rank must have alike though each machine has its own: ddp-cifar's code, the settings and the data,
compared once the ranks have met. A machine that differs stops every rank before the first step; it trained its
own way without a word (or hung a collective, where its steps per epoch differed)."""

from __future__ import annotations

import hashlib
import socket
import sys
from pathlib import Path
from typing import Any

import torch

from ddp import config, datasets, distributed
from ddp.config import Config
from ddp.devices import World
from ddp.errors import UsageError

# Settings that may differ between machines: paths (a node-local disk mounted elsewhere), what only shows, and
# data.workers (a machine's own cores; the data's order and augmentation do not depend on it).
MAY_DIFFER = config.PATHS | {"data.download", "data.workers", "run.progress", "run.debug"}


def code() -> dict[str, str]:
    """Each module of ddp/ by name, with a digest of its source."""
    folder = Path(__file__).resolve().parent
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.py"))}


def settings(cfg: Config) -> dict[str, Any]:
    values = config.to_dict(cfg)
    return {f"{s}.{k}": v for s, keys in values.items() for k, v in keys.items() if f"{s}.{k}" not in MAY_DIFFER}


def described(cfg: Config, data: datasets.Data | None = None) -> dict[str, Any]:
    """This rank's host, torch, code, settings and (given) data, as differences compares them."""
    mine = {"host": socket.gethostname(), "torch": torch.__version__, "code": code(), "settings": settings(cfg)}
    return mine | data_of(cfg.data, data) if data is not None else mine


def data_of(d: config.DataConfig, data: datasets.Data) -> dict[str, Any]:
    """The data part of described's: the data's digest (datasets.Data.digest) and where this machine read it."""
    where = f"data.path={d.path}" if d.dataset == "npz" else f"data.root={d.root}"
    return {"data": (*data.digest, where)}


def check(cfg: Config, data: datasets.Data, world: World) -> None:
    """Every rank's code, settings and data (Data.digest) against rank 0's: a UsageError on every rank naming
    the first rank that differs and how. Another torch is only said, once per machine (by rank 0)."""
    if not world.grouped:
        return
    ranks = distributed.gather_objects(described(cfg, data), world)
    first = ranks[0]
    others = {(r["host"], r["torch"]) for r in ranks if r["torch"] != first["torch"]}
    for host, version in sorted(others) if world.is_main else []:
        print(f"warning: {host} runs torch {version}, rank 0 on {first['host']} {first['torch']}", file=sys.stderr)
    for rank, theirs in enumerate(ranks):
        if differ := differences(first, theirs):
            raise UsageError(f"rank {rank} on {theirs['host']} {differ} than rank 0 on {first['host']}: every "
                             "machine must run the same checkout, settings and data")  # fmt: skip


def differences(first: dict[str, Any], other: dict[str, Any]) -> str:
    """How `other` (described's) differs from `first`, torch aside: "has other ..., other ...", or "" if alike.
    Data only where both have it (the doctor's: the ranks that read it, one a machine)."""
    code0, modules, settings0, values = first["code"], other["code"], first["settings"], other["settings"]
    changed = [name for name in sorted(code0.keys() | modules.keys()) if code0.get(name) != modules.get(name)]
    differ = [f"ddp-cifar code ({', '.join(f'ddp/{name}' for name in changed)})"] if changed else []
    keys = [k for k in settings0 if settings0[k] != values.get(k)]
    differ += [f"settings ({', '.join(f'{k}={values.get(k)!r} against {settings0[k]!r}' for k in keys)})"] * bool(keys)
    if "data" in first and "data" in other and other["data"][:3] != first["data"][:3]:
        (train, test, _, there), (train0, test0, _, _) = other["data"], first["data"]
        counts = f"{train:,} training and {test:,} test images, against {train0:,} and {test0:,}"
        differ.append(f"data ({there}: {counts if (train, test) != (train0, test0) else 'other images or labels'})")
    return "has other " + "; other ".join(differ) if differ else ""
