"""The exponential moving average of the weights (train.ema_decay > 0): torch's AveragedModel holds it
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
