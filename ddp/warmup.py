"""run.warmup_steps=N: N throwaway training steps and one evaluation before epoch 1, so that compiles (the
step's, the evaluation's), cuDNN's autotuning and first allocations happen outside the timed epochs (as
airbench warms up); all they change is put back: the run then trains as one without them."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from ddp import checkpoint, distributed, logs, metrics, rng


def throwaway_steps(
    checkpoints: checkpoint.Checkpoints,
    position: checkpoint.Position,
    stats: metrics.StepStats,
    steps: int,
    step: Callable[[], Any],
    evaluate: Callable[[], Any] = lambda: None,
) -> float:
    """Call `step` (one training step on a batch of the run's) `steps` times and `evaluate` once (the
    epoch's evaluation: compiled, it is a graph of its own, on shapes of its own), then put back what
    a checkpoint at `position` would (the weights and BatchNorm statistics, optimizer, schedule,
    GradScaler, moving average, lookahead; checkpoint.restore), this rank's step statistics and RNG
    states. Returns the seconds the steps and the evaluation took."""
    trained, device = checkpoints.trained, checkpoints.world.device
    full = distributed.full_state(trained.model, trained.optimizer)
    kept = copy.deepcopy(checkpoint.build_state(trained, position, [], checkpoints.info, None, full))
    kept_stats, kept_rng = stats.snapshot(), rng.get_state(device)
    if checkpoints.world.is_main:  # compiles and autotuning can take a minute: say what the wait is
        logs.say(f"warm-up: {steps} throwaway step{'s' * (steps != 1)} and an evaluation before epoch 1, then put back")
    metrics.synchronize(device)
    started = metrics.clock()
    for _ in range(steps):
        step()
    evaluate()
    seconds = metrics.elapsed(started, device)
    with torch.no_grad():
        checkpoint.restore(kept, trained)  # in place: DDP's and the compiled model's weights too
    stats.restore(kept_stats)
    rng.set_state(kept_rng, device)
    if checkpoints.world.is_main:
        logs.say(f"warm-up: {seconds:.1f} s (in metrics.jsonl as warmup_s; not in the epochs' seconds)")
    return seconds
