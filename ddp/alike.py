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


def check(cfg: Config, data: datasets.Data, world: World) -> None:
    """Every rank's code, settings and data (datasets.digest) against rank 0's: a UsageError on every rank naming
    the first rank that differs and how. Another torch is only said, once per machine (by rank 0)."""
    if not world.grouped:
        return
    where = f"data.path={cfg.data.path}" if cfg.data.dataset == "npz" else f"data.root={cfg.data.root}"
    mine = (socket.gethostname(), torch.__version__, code(), settings(cfg), (*datasets.digest(data), where))
    ranks = distributed.gather_objects(mine, world)
    others = {(host, version) for host, version, *_ in ranks if version != ranks[0][1]}
    for host, version in sorted(others) if world.is_main else []:
        print(f"warning: {host} runs torch {version}, rank 0 on {ranks[0][0]} {ranks[0][1]}", file=sys.stderr)
    for rank, theirs in enumerate(ranks):
        if differ := differences(ranks[0], theirs):
            raise UsageError(f"rank {rank} on {theirs[0]} has other {'; other '.join(differ)} than rank 0 on "
                             f"{ranks[0][0]}: every machine must run the same checkout, settings and data")  # fmt: skip


def differences(first: tuple[Any, ...], other: tuple[Any, ...]) -> list[str]:
    """How `other` (check's host, torch, code, settings, data) differs from `first`, torch aside."""
    (_, _, code0, settings0, data0), (_, _, modules, values, data) = first, other
    changed = [name for name in sorted(code0.keys() | modules.keys()) if code0.get(name) != modules.get(name)]
    differ = [f"ddp-cifar code ({', '.join(f'ddp/{name}' for name in changed)})"] if changed else []
    keys = [k for k in settings0 if settings0[k] != values.get(k)]
    differ += [f"settings ({', '.join(f'{k}={values.get(k)!r} against {settings0[k]!r}' for k in keys)})"] * bool(keys)
    if data[:3] != data0[:3]:
        (train, test, _, there), (train0, test0, _, _) = data, data0
        counts = f"{train:,} training and {test:,} test images, against {train0:,} and {test0:,}"
        differ.append(f"data ({there}: {counts if (train, test) != (train0, test0) else 'other images or labels'})")
    return differ
