"""The optimizer's learning-rate schedule (ddp/optim.py)."""

import pytest
import torch

from ddp import config, optim


def test_schedule_warms_up_then_decays_to_zero():
    net = torch.nn.Linear(2, 2)
    cfg = config.OptimConfig(lr=1.0, warmup_epochs=1)
    optimizer, scheduler = optim.make_optimizer(net, cfg, total_steps=40, steps_per_epoch=10)
    lrs = []
    for _ in range(40):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] < 0.01
