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


def has_fused(kind, device="cpu"):
    try:
        kind([torch.nn.Parameter(torch.zeros(2, device=device))], lr=0.1, fused=True)
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_the_optimizer_is_fused_where_torch_has_it_and_keeps_its_own_choice_when_a_checkpoint_loads(name):
    """fused=True where this torch has the kernel (one per group, not five for-each operations), torch's
    default where it has none (here: the meta device); a checkpoint's optimizer state, saved by a
    machine that chose otherwise, loads with its numbers and leaves this machine's choice as it was."""
    kind = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    cfg = config.OptimConfig(name=name, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4, norm_bias_lr_scale=4.0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer, _ = optim.make_optimizer(net, cfg, total_steps=10, steps_per_epoch=5)
    assert len(optimizer.param_groups) == 2 and all(g["fused"] is has_fused(kind) for g in optimizer.param_groups)
    other = kind([{"params": g["params"]} for g in optimizer.param_groups], lr=0.1)  # the default: not fused
    for _ in range(2):  # the other machine's two steps: momentum buffers / moments in its state
        net(torch.randn(8, 3)).square().sum().backward()
        other.step()
    saved = other.state_dict()
    assert all(not g.get("fused") for g in saved["param_groups"])
    with optim.settings_kept(optimizer):
        optimizer.load_state_dict(saved)
    assert all(g["fused"] is has_fused(kind) for g in optimizer.param_groups)
    assert optimizer.state_dict()["state"].keys() == saved["state"].keys()
    optimizer.step()  # with the loaded state
    file = optim.portable(optimizer.state_dict())  # as a checkpoint holds it: no machine's implementation
    assert all(g["fused"] is None and g["foreach"] is None for g in file["param_groups"]) and optim.portable({}) == {}
    assert all(g["fused"] is has_fused(kind) for g in optimizer.param_groups)  # the optimizer's own: as it was
    with optim.settings_kept(other):  # and the other way: a fused machine's file into a default one
        other.load_state_dict(optimizer.state_dict())
    assert all(not g.get("fused") for g in other.param_groups)
    other.step()
    on_meta = torch.nn.Linear(2, 2, device="meta")  # a device no fused kernel is made for
    meta_optimizer, _ = optim.make_optimizer(on_meta, cfg, total_steps=10, steps_per_epoch=5)
    assert not meta_optimizer.param_groups[0]["fused"]
    on_meta(torch.randn(4, 2, device="meta")).sum().backward()
    meta_optimizer.step()


def test_a_fused_step_under_the_grad_scaler_skips_an_overflow_as_the_default_does():
    """The loop's order, scaler.unscale_ (for the gradient norm) then scaler.step: fused, the scaler
    hands the overflow flag to the kernel instead of skipping the call; the same weights either way."""
    settings = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}
    weights, implementations = [], []
    for build in (optim.fused, lambda kind, params, **kw: kind(params, **kw)):
        p = torch.nn.Parameter(torch.ones(3))
        optimizer = build(torch.optim.SGD, [{"params": [p]}], **settings)
        implementations.append(optimizer.param_groups[0]["fused"])
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        seen = []
        for g in ([1.0, 2.0, 3.0], [1.0, float("inf"), 3.0], [1.0, 2.0, 3.0]):
            scaler.scale((p * torch.tensor(g)).sum()).backward()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            seen.append(p.detach().clone())
        assert torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])  # the overflow: no step
        weights.append(torch.stack(seen))
    assert implementations == [has_fused(torch.optim.SGD), None]
    torch.testing.assert_close(weights[0], weights[1])
