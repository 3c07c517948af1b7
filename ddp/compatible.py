"""Whether a checkpoint may continue in this run (`check`), from what it records of its run (RunInfo): its
settings (`check_settings`: model, dataset, batch, optimizer), its data (classes, training images) and its
optimizer's parameter groups; and what changed since (`changed`, `data_changed`: the resume line's words).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ddp import config, optim
from ddp.errors import UsageError

if TYPE_CHECKING:  # a type alone: the commands of checkpoint (inspect, export) read no data
    from ddp.datasets import Data


@dataclass(frozen=True)
class RunInfo:
    """What a checkpoint records about the run besides the weights, to refuse a wrong continuation."""

    config: dict[str, dict[str, Any]]  # config.to_dict(cfg)
    world_size: int
    train_images: int
    normalize: dict[str, list[float]]  # the training split's per-channel mean and std, as the model saw them
    classes: list[str]  # the names of the model's outputs, in order
    data_digest: str | None = None  # datasets.Data.digest's: a resume on other images or labels says so

    @classmethod
    def of(cls, config: dict[str, dict[str, Any]], world_size: int, data: Data) -> RunInfo:
        normalize = {"mean": list(data.mean), "std": list(data.std)}
        return cls(config, world_size, len(data.train.labels), normalize, data.classes, data.digest[2])


def changed(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """ "section.key old -> new" for every setting of `new` that differs from `old` (a key that `old`'s
    version did not have yet counts as its default)."""
    default = config.to_dict(config.Config())
    was = {s: {k: old.get(s, {}).get(k, default[s][k]) for k in keys} for s, keys in new.items()}
    return [f"{s}.{k} {was[s][k]!r} -> {v!r}" for s in new for k, v in new[s].items() if was[s][k] != v]


def data_changed(state: dict[str, Any], info: RunInfo) -> list[str]:
    """The resume line's word where the data differs from the checkpoint's (a checkpoint of before 2026-11-28 keeps
    no digest: nothing to compare)."""
    other = state.get("data_digest") not in (None, info.data_digest)
    return ["the data (other images or labels than the checkpoint's)"] if other else []


def check(
    state: dict[str, Any], info: RunInfo, path: str | Path, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Refuse to continue a run of another model, dataset, batch or optimizer in this one; or one whose
    optimizer groups the parameters otherwise than `optimizer` (settings changed since: a ValueError in torch)."""
    check_settings(state["config"], info.config, path)
    data = [("classes", len(state["classes"]), len(info.classes)), ("training images", state["train_images"],
            info.train_images)]  # fmt: skip
    for what, old, new in data:  # another number of training images: the data order cannot continue
        if old != new:
            raise UsageError(f"{path} was trained on {old} {what}, this data has {new}: use the same data, or start "
                             "a new run.out_dir")  # fmt: skip
    if optimizer is not None:
        optim.check_groups(state["optimizer"], optimizer, path, changed(state["config"], info.config))


def check_settings(old: dict[str, Any], new: dict[str, Any], path: str | Path) -> None:
    """Refuse to continue the run of settings `old` (a checkpoint's, at `path`) with another model, dataset, batch
    or optimizer (settings `new`)."""
    defaults = config.to_dict(config.Config())  # for keys a checkpoint of an older version lacks
    for section, key in (("model", "name"), ("model", "width"), ("data", "dataset"), ("train", "batch_size"),
                         ("optim", "name")):  # fmt: skip
        if (was := old[section].get(key, defaults[section][key])) != new[section][key]:
            raise UsageError(f"{path} was trained with {section}.{key}={was} but this run has {section}.{key}="
                             f"{new[section][key]}; set it back to continue, or start a new run.out_dir")  # fmt: skip
