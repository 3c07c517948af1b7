"""The optimizer and its learning-rate schedule, from the config's optim section: SGD (momentum,
Nesterov) or AdamW, stepped once per optimizer step; linear warm-up from 0, then constant or cosine
to 0 at the last step."""

from __future__ import annotations

import math

import torch
from torch import nn

from ddp.config import OptimConfig


def make_optimizer(
    model: nn.Module, o: OptimConfig, total_steps: int, steps_per_epoch: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer over the model's parameters and its per-step schedule."""
    if o.name == "sgd":
        optimizer = torch.optim.SGD(
            model.parameters(),
            lr=o.lr,
            momentum=o.momentum,
            nesterov=o.nesterov and o.momentum > 0,
            weight_decay=o.weight_decay,
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    warmup = round(o.warmup_epochs * steps_per_epoch)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if o.schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The total L2 norm of the model's gradients, before clipping them to `max_norm` (0 = no clipping)."""
    if max_norm > 0:
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else torch.zeros(())
