"""A checkpoint's weights as a model takes them: which ones (the moving average's or the trained), their keys
without a wrapper's prefix, and load_state_dict's refusal of ones that do not fit as one line. Reading the
file and what else it holds are checkpoint.py's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from ddp import __version__, models
from ddp.errors import UsageError

EXPORT_FORMAT = "ddp-cifar-weights/1"  # what `python -m ddp.checkpoint export` writes (without --state-dict)
EXPORT_ENTRIES = {"model_name": str, "width": (int, float), "dropout": (int, float), "classes": list,
                  "normalize": dict, "model": dict}  # fmt: skip


def exported(state: Any, path: str | Path) -> dict[str, Any] | None:
    """`state` (what checkpoint.loaded read at `path`) if `export` wrote it, or None for another file; one whose
    entries are not of their kinds (another program wrote it) is a UsageError naming them."""
    if not (isinstance(state, dict) and state.get("format") == EXPORT_FORMAT):
        return None
    if bad := [k for k, kind in EXPORT_ENTRIES.items() if not isinstance(state.get(k), kind)]:
        raise UsageError(f"{path} is an export ({EXPORT_FORMAT}) whose {', '.join(bad)} are missing or malformed")
    return state


def pick(state: dict[str, Any], raw: bool = False) -> dict[str, torch.Tensor]:
    """The weights to evaluate or export: the moving average's when the run kept one, unless `raw`."""
    return state["model"] if raw or not state.get("ema") else state["ema"]["weights"]


def load(state: dict[str, Any], model: nn.Module, path: str | Path, raw: bool = True) -> None:
    """A checkpoint's weights (the trained ones, or with raw=False those pick() picks) into a plain model on
    any device, also when saved from a DataParallel/DDP ("module.") or compiled ("_orig_mod.") wrapper."""
    with fitting(state, path):
        model.load_state_dict(unprefixed(pick(state, raw)))


def check_fit(state: dict[str, Any], path: str | Path, raw: bool = False) -> None:
    """A UsageError where pick()'s weights do not fit the model the checkpoint's own settings build: a file whose
    settings lie (another program wrote them, checksum and all) exported weights that no model of theirs took.
    Built on the meta device: the shapes alone, no memory (assign: the file's tensors are not copied into it)."""
    m = state["config"]["model"]
    with torch.device("meta"):
        model = models.build(m["name"], len(state["classes"]), m.get("dropout", 0.0), m.get("width", 1.0))
    with fitting(state, path):
        model.load_state_dict(unprefixed(pick(state, raw)), assign=True)


def unprefixed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    weights = dict(weights)
    for prefix in ("module.", "_orig_mod.", "module."):
        consume_prefix_in_state_dict_if_present(weights, prefix)
    return weights


@contextlib.contextmanager
def fitting(state: dict[str, Any], path: str | Path) -> Iterator[None]:
    """load_state_dict's refusal of weights that do not fit the model this version builds from the
    checkpoint's settings (a version that built it otherwise wrote them) as one line, a UsageError."""
    try:
        yield
    except RuntimeError as e:
        if "Error(s) in loading state_dict" not in str(e):
            raise
        written = state["versions"].get("ddp_cifar")  # (an export keeps none)
        reasons = str(e).partition("\n")[2]  # under torch's heading, one a line
        problem = " ".join(reasons.split("\n")[0].split()).rstrip(".")
        raise UsageError(
            f"{path}'s weights do not fit model.name={state['config']['model'].get('name')} as ddp-cifar "
            f"{__version__} builds it ({problem[:300]}); "
            + (f"ddp-cifar {written} wrote them" if written else "an export whose settings name another model")
        ) from None
