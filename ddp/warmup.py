"""run.warmup_steps=N: N throwaway training steps before the first epoch, so that torch.compile's
compile, cuDNN's autotuning and the allocator's first requests happen outside the timed epochs (as
airbench warms up); everything the steps change is put back, so the run then trains as one without them."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from ddp import metrics, rng
from ddp.checkpoint import Trained


def throwaway_steps(
    trained: Trained,
    stats: metrics.StepStats,
    device: torch.device,
    steps: int,
    step: Callable[[], Any],
) -> float:
    """Call `step` (one training step on a batch of the run's) `steps` times, then restore the
    weights, BatchNorm statistics, optimizer, schedule, GradScaler, moving average, lookahead, this
    rank's loss sums and RNG states as they were. Returns the seconds the steps took."""
    kept = copy.deepcopy(
        {
            "model": trained.model.state_dict(),
            "optimizer": trained.optimizer.state_dict(),
            "scheduler": trained.scheduler.state_dict(),
            "scaler": trained.scaler.state_dict(),
            "ema": trained.ema.state_dict() if trained.ema else None,
            "lookahead": trained.lookahead.state_dict() if trained.lookahead else None,
            "stats": [stats.sums, stats.grad_norms, stats.last_finite, stats.first_non_finite_step],
            "rng": rng.get_state(device),
        }
    )
    metrics.synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = metrics.elapsed(started, device)
    with torch.no_grad():
        trained.model.load_state_dict(kept["model"])  # in place: DDP's and the compiled model's too
        for mine, saved in zip([stats.sums, stats.grad_norms, stats.last_finite, stats.first_non_finite_step],
                               kept["stats"]):  # fmt: skip
            mine.copy_(saved)
    trained.optimizer.load_state_dict(kept["optimizer"])  # its momentum gone again, its groups' LR put back
    trained.scheduler.load_state_dict(kept["scheduler"])
    if trained.scaler.is_enabled():
        trained.scaler.load_state_dict(kept["scaler"])
    if trained.ema:
        trained.ema.load_state_dict(kept["ema"])
    if trained.lookahead:
        trained.lookahead.restore(kept["lookahead"], trained.model, 0)
    rng.set_state(kept["rng"], device)
    return seconds
