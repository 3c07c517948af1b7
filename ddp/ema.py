"""Averages of the weights: the exponential moving average (train.ema_decay > 0; class EMA) and lookahead
(train.lookahead_every > 0; class Lookahead, at the end of this file).

The moving average: torch's AveragedModel holds it
(parameters and buffers, BatchNorm's statistics too) and get_ema_multi_avg_fn does the arithmetic,
after every optimizer step on every rank. DDP's replicas are equal after a step: no communication.

Warm-up (train.ema_warmup = W): the first update copies the weights; update n after it (n = 1, 2,
...) decays by min(ema_decay, (1 + n) / (W + n)), so early updates move the average far and the
initialisation does not dominate it; W = 0 decays by ema_decay from update 1 on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class EMA:
    def __init__(self, model: nn.Module, decay: float, warmup: int) -> None:
        self.decay, self.warmup = decay, warmup
        # A copy of the model (same device and memory format), never trained, only averaged into.
        self.averaged = AveragedModel(model, use_buffers=True)
        self.averaged.requires_grad_(False)
        self.updates = 0  # on the host: AveragedModel's own count is a device tensor, a sync per step to read

    @property
    def module(self) -> nn.Module:
        """The averaged model: evaluate it, save its state_dict (the model's keys)."""
        return self.averaged.module

    def decay_at(self, update: int) -> float:
        """The decay of update number `update` after the first (which copies)."""
        return min(self.decay, (1 + update) / (self.warmup + update)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Average `model`'s current weights in (the first update copies them)."""
        mine = [*self.module.parameters(), *self.module.buffers()]
        theirs = [t.detach() for t in (*model.parameters(), *model.buffers())]
        floats = [(a, b) for a, b in zip(mine, theirs) if a.is_floating_point()]
        for a, b in zip(mine, theirs):
            if not a.is_floating_point() or self.updates == 0:
                a.copy_(b)  # BatchNorm's num_batches_tracked: a count, not averaged
        if self.updates > 0 and floats:
            average = get_ema_multi_avg_fn(self.decay_at(self.updates))  # weight' = lerp(weight, model, 1 - decay)
            average([a for a, _ in floats], [b for _, b in floats], self.averaged.n_averaged)
        self.updates += 1
        self.averaged.n_averaged += 1  # kept equal to self.updates, as AveragedModel counts

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["weights"])
        self.updates = int(state["updates"])
        self.averaged.n_averaged.fill_(self.updates)


class Lookahead:
    """Lookahead of the weights (train.lookahead_every = N > 0; Zhang et al. 2019, in airbench's form):
    a slow copy of the parameters and BatchNorm's running statistics; every N optimizer steps it moves
    towards them, keeping decay**N x (step / steps)**3 of itself (little early on, more as training
    ends), and the model is set to it. At the last step the model becomes the slow copy. The statistics
    follow the weights they were measured with, as airbench's lookahead of the whole state_dict does;
    each rank averages its own (the parameters are the same on every rank, the statistics become
    rank 0's or their mean where the ranks' statistics become one: train.dist_bn)."""

    def __init__(self, model: nn.Module, every: int, decay: float, total_steps: int) -> None:
        self.every, self.decay, self.total_steps = every, decay, total_steps
        self.start_from(model, 0)

    def start_from(self, model: nn.Module, steps: int) -> None:
        """The slow weights as `model`'s now, after `steps` optimizer steps."""
        self.slow = [p.detach().clone() for p in self._learning(model)]
        self.steps = steps

    @staticmethod
    def _learning(model: nn.Module) -> list[torch.Tensor]:
        """What training changes: the parameters with gradients, the floating-point buffers."""
        return [p for p in model.parameters() if p.requires_grad] + [
            b for b in model.buffers() if b.is_floating_point()
        ]

    def kept_at(self, step: int) -> float:
        """The share of itself the slow copy keeps at optimizer step `step`."""
        return self.decay**self.every * (step / self.total_steps) ** 3

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """After an optimizer step: every N-th, slow <- lerp(slow, weights) and weights <- slow; at
        the last step, weights <- slow."""
        self.steps += 1
        moves = self.steps % self.every == 0
        if not moves and self.steps != self.total_steps:
            return  # the other N-1 steps: nothing to do, not even listing the weights (26 operators, fast net)
        weights = [p.detach() for p in self._learning(model)]
        for slow, now in by_dtype(self.slow, weights):  # fp16 weights beside float32 BatchNorm: two calls each
            if moves:
                torch._foreach_lerp_(slow, now, 1.0 - self.kept_at(self.steps))
            torch._foreach_copy_(now, slow)

    def state_dict(self) -> dict[str, Any]:
        return {"slow": self.slow, "steps": self.steps}

    def restore(self, state: dict[str, Any] | None, model: nn.Module, global_step: int) -> None:
        """A checkpoint's state_dict(); None: start from `model` at `global_step`."""
        if state is None:
            return self.start_from(model, global_step)
        for mine, saved in zip(self.slow, state["slow"], strict=True):
            mine.copy_(saved)
        self.steps = int(state["steps"])


def by_dtype(*lists: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], ...]]:
    """`lists` (of one length) cut into groups of one dtype each (the first list's), in the order first met:
    torch's multi-tensor (_foreach_) kernels take one dtype a call on a GPU, and a call of several goes tensor
    by tensor. run.amp=fp16-weights' fp16 weights beside float32 BatchNorm make two groups, any other run one."""
    groups: dict[torch.dtype, tuple[list[torch.Tensor], ...]] = {}
    for tensors in zip(*lists, strict=True):
        for group, tensor in zip(groups.setdefault(tensors[0].dtype, tuple([] for _ in lists)), tensors):
            group.append(tensor)
    return list(groups.values())
