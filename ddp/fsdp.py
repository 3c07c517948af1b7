"""FSDP2 (run.parallel=fsdp): torch's fully_shard on each block and the root, so that each rank holds
1/N of the parameters, gradients and optimizer state; and the sharded model's state as one whole,
unsharded state dict, the same as DDP's (what rank 0 saves, and what every rank loads)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ddp.errors import UsageError

# torch.distributed.fsdp is imported where it is used: 0.4 s that runs without FSDP2 do not pay.
NEEDS = "2.6"  # torch.distributed.fsdp.fully_shard, public from torch 2.6


def check_available() -> None:
    """A torch without the public fully_shard: one line naming the version needed."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        raise UsageError(
            f"run.parallel=fsdp needs torch >= {NEEDS} (torch.distributed.fsdp.fully_shard); this is torch "
            f"{torch.__version__}: upgrade torch, or use run.parallel=ddp"
        ) from None


def shard(model: nn.Module, amp: torch.dtype | None) -> nn.Module:
    """fully_shard on each child of the model that holds parameters (its blocks), then on the root:
    in place, its parameters become DTensors of which this rank holds a 1/N slice. With run.amp=bf16
    the weights are gathered in bfloat16 and the gradients reduced in float32; BatchNorm's own, in
    float32 (its statistics are float32: torch's batch_norm takes no mix)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if amp is not None:
        for norm in (m for m in model.modules() if isinstance(m, nn.modules.batchnorm._NormBase)):
            fully_shard(norm, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
    policy = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32 if amp else None)
    for block in model.children():
        if any(True for _ in block.parameters()) and not is_sharded(block):  # (a BatchNorm child: sharded above)
            fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether fully_shard made this module sharded (without importing FSDP2 where nothing used it)."""
    kind = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)  # none before torch 2.6
    return kind is not None and isinstance(model, kind)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole model's and optimizer's state dicts on rank 0's CPU (empty on the other ranks), in DDP's
    form: the model's keys, the optimizer's state by parameter index. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    by_name = get_optimizer_state_dict(model, optimizer, options=options)
    if not by_name:
        return weights, {}
    index = {name: i for i, name in enumerate(n for g in by_name["param_groups"] for n in g["params"])}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]
    return weights, {"state": {index[n]: s for n, s in by_name["state"].items()}, "param_groups": groups}


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict[str, Any], state: dict[str, Any] | None
) -> None:
    """A whole (unsharded) model state dict, and an optimizer's in DDP's form, into the sharded model and
    its optimizer: each rank keeps its slice. Every rank calls it with the same dicts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=options)
    if optimizer is None or state is None:
        return
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    groups = [{**g, "params": [ordered[i] for i in g["params"]]} for g in state["param_groups"]]
    by_name = {"state": {ordered[i]: s for i, s in state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, by_name, options=options)
