"""The optimizer's learning-rate schedule (ddp/optim.py)."""

import pytest
import torch

from ddp import checks, config, ema, models, muon, optim


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


class SkippingSGD(torch.optim.SGD):
    """torch 2.4 to 2.13's fused CPU SGD on fp16 and bf16 weights (pytorch/pytorch#191763), on any torch: its
    fused step leaves a tensor's numbers unchanged but for the last few (the whole SIMD blocks); one number is right."""

    def step(self, closure=None):
        params = [p for group in self.param_groups if group["fused"] for p in group["params"]]
        kept = [p.detach()[:-1].clone() for p in params]
        super().step(closure)
        for p, before in zip(params, kept):
            p.detach()[:-1].copy_(before)


def test_a_fused_kernel_that_steps_wrong_is_not_taken():
    """With torch 2.4.1 (tried here) a run.amp=fp16-weights run on a CPU (the small net, 256 synthetic images, 2
    epochs) ended at loss 2.35, not 0.81: the fused probe of one number passed. Now it steps 64 numbers, fused and
    not, and takes the fused kernel only where both agree."""
    weights = torch.nn.Parameter(torch.zeros(100))
    optimizer = optim.fused(SkippingSGD, [{"params": [weights]}], lr=0.1, momentum=0.9)
    assert not optimizer.param_groups[0]["fused"] and optim.steps_fused(torch.optim.SGD, [{"params": [weights]}])
    weights.grad = torch.ones(100)
    optimizer.step()
    assert torch.equal(weights.detach(), torch.full((100,), -0.1))


def steps_through_an_overflow(optimizer: torch.optim.Optimizer, p: torch.Tensor, factors: list) -> list:
    """The loop's order under fp16's GradScaler, scaler.unscale_ (for the gradient norm) then scaler.step, for the
    losses (p x factor).sum(), the second's gradients not finite: p after each step; the overflow's was none."""
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    seen = []
    for factor in factors:
        scaler.scale((p * factor).sum()).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        seen.append(p.detach().clone())
    assert torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])  # the overflow: no step
    return seen


def test_a_fused_step_under_the_grad_scaler_skips_an_overflow_as_the_default_does():
    """The loop's order, scaler.unscale_ (for the gradient norm) then scaler.step: fused, the scaler
    hands the overflow flag to the kernel instead of skipping the call; the same weights either way."""
    settings = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}
    weights, implementations = [], []
    for build in (optim.fused, lambda kind, params, **kw: kind(params, **kw)):
        p = torch.nn.Parameter(torch.ones(3))
        optimizer = build(torch.optim.SGD, [{"params": [p]}], **settings)
        implementations.append(optimizer.param_groups[0]["fused"])
        factors = [torch.tensor(g) for g in ([1.0, 2.0, 3.0], [1.0, float("inf"), 3.0], [1.0, 2.0, 3.0])]
        weights.append(torch.stack(steps_through_an_overflow(optimizer, p, factors)))
    assert implementations == [has_fused(torch.optim.SGD), None]
    torch.testing.assert_close(weights[0], weights[1])


AIRBENCH_SGD = config.OptimConfig(lr=1.5, momentum=0.85, nesterov=True, weight_decay=1.33e-3, norm_bias_lr_scale=64,
                                  warmup_epochs=1, warmup_from=0.2)  # fmt: skip


def scaled_run(loss_scale: float, fp16: bool = False, steps: int = 4):
    """A conv + BatchNorm + linear net, SGD with airbench's groups (Nesterov, weight decay, BatchNorm biases at 64x
    the LR), `steps` steps on fixed images with the loss x `loss_scale`; fp16: models.fp16_weights' layout."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, bias=False), torch.nn.BatchNorm2d(8), torch.nn.GELU(),
                              torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10))  # fmt: skip
    if fp16:
        models.fp16_weights(net)
    optimizer, scheduler = optim.make_optimizer(net, AIRBENCH_SGD, 8, 2, loss_scale=loss_scale)
    x, y = torch.randn(16, 3, 8, 8, dtype=torch.float16 if fp16 else torch.float32), torch.arange(16) % 10
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        (torch.nn.functional.cross_entropy(net(x), y, label_smoothing=0.2) * loss_scale).backward()
        optimizer.step()
        scheduler.step()
    return net, optimizer, scheduler


def test_a_loss_scale_undone_by_the_lr_and_decay_steps_bit_for_bit_as_none_and_files_hold_neither():
    """run.amp=fp16-weights' loss x 1024 (a power of 2), the LR / it and the weight decay x it: in float32 the
    same weights as without, to the bit (fused SGD here where torch has it); portable() writes the same optimizer
    state either way (momentum / it, in float32); from_portable puts an fp16 run's momentum back exactly."""
    plain, scaled = scaled_run(1.0), scaled_run(1024.0)
    for a, b in zip(plain[0].state_dict().values(), scaled[0].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert scaled[1].param_groups[0]["lr"] * 1024 == plain[1].param_groups[0]["lr"]
    files = optim.portable(plain[1].state_dict()), optim.portable(scaled[1].state_dict(), 1024.0)
    assert files[0]["param_groups"] == files[1]["param_groups"]
    schedules = plain[2].state_dict(), scaled[2].state_dict()  # as a file holds them
    assert scaled[2].get_last_lr() == plain[2].get_last_lr()  # the LR as optim.lr means it
    assert {k: v for k, v in schedules[0].items() if k != "lr_lambdas"} == {
        k: v for k, v in schedules[1].items() if k != "lr_lambdas"
    }
    for a, b in zip(files[0]["state"].values(), files[1]["state"].values(), strict=True):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    net, optimizer, scheduler = scaled_run(1024.0, fp16=True)
    assert {p.dtype for p in net.parameters()} == {torch.float16, torch.float32}
    file = optim.portable(optimizer.state_dict(), 1024.0)
    assert {s["momentum_buffer"].dtype for s in file["state"].values()} == {torch.float32}
    again, _ = optim.make_optimizer(net, AIRBENCH_SGD, 8, 2, loss_scale=1024.0)
    again.load_state_dict(optim.from_portable(file, 1024.0))
    for key, state in optimizer.state.items():
        assert torch.equal(again.state[key]["momentum_buffer"], state["momentum_buffer"])
    with pytest.raises(ValueError, match="SGD's"):
        optim.make_optimizer(net, config.OptimConfig(name="adamw"), 8, 2, loss_scale=1024.0)


def test_the_fp16_weights_loss_scale_stops_at_1024_so_that_a_large_batchs_fp16_gradients_stay_finite():
    """The loss scale is the power of 2 nearest the global batch, at most 1024 (airbench94's batch). At a global
    batch of 65536 (64 GPUs x 1024) the nearest, 65536, is the fp16 loss's gradient and over fp16's largest number:
    every gradient came back NaN. Scaled by 1024 the mean loss's gradients are finite."""
    scales = {b: checks.precision("fp16-weights", torch.device("cpu"), b)[2] for b in (1, 3, 32, 1000, 4096, 65536)}
    assert scales == {1: 1.0, 3: 4.0, 32: 32.0, 1000: 1024.0, 4096: 1024.0, 65536: 1024.0}
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 10).half()
    x, y = torch.randn(65536, 16).half(), torch.randint(0, 10, (65536,))
    (torch.nn.CrossEntropyLoss(label_smoothing=0.2)(net(x), y) * scales[65536]).backward()
    assert all(p.grad.isfinite().all() for p in net.parameters())


def test_fp16_weights_lookahead_and_the_gradient_norm_make_one_multi_tensor_call_per_dtype(monkeypatch):
    """fp16 weights beside float32 BatchNorm: torch's _foreach_ kernels take one dtype a call on a GPU (a call of
    two goes tensor by tensor), so lookahead's lerp and copy and the gradient norm make a call per dtype; the
    same norm as over every gradient at once, and one call each for a float32 net."""
    seen: list[tuple[str, set]] = []
    for name in ("_foreach_lerp_", "_foreach_copy_", "_foreach_norm"):
        op = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda ts, *a, _op=op, _n=name: seen.append((_n, {t.dtype for t in ts}))
                            or _op(ts, *a))  # fmt: skip
    for fp16, calls in ((True, 2), (False, 1)):
        net, _, _ = scaled_run(1024.0 if fp16 else 1.0, fp16=fp16, steps=1)
        seen.clear()
        lookahead = ema.Lookahead(net, 1, 0.5, 10)
        lookahead.update(net)
        norm = optim.clip_gradients(net, 0.0, 1024.0 if fp16 else 1.0)
        assert [n for n, _ in seen] == ["_foreach_lerp_", "_foreach_copy_"] * calls + ["_foreach_norm"] * calls
        assert all(len(dtypes) == 1 for _, dtypes in seen)
        every = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in net.parameters()]))
        torch.testing.assert_close(norm * (1024.0 if fp16 else 1.0), every, rtol=1e-3, atol=0)


def test_muon_under_the_grad_scaler_skips_an_overflow_whole_its_momentum_too():
    """run.amp=fp16 with optim.muon_lr: a step whose gradients overflowed is skipped before MuonSGD.step, so that
    Muon's momentum never takes an inf (which the fused SGD kernel's own skip would let in: every later step NaN)
    and the filters are not rescaled; the steps either side are taken, fused or not, to the same weights."""
    weights = []
    for build in (optim.fused, lambda kind, params, **kw: kind(params, **kw)):
        p = torch.nn.Parameter(torch.ones(2, 1, 2, 2))  # a filter: Muon's
        optimizer = build(muon.MuonSGD, [{"params": [p], "momentum": 0.0, "nesterov": False, "muon_momentum": 0.6}],
                          lr=0.1, momentum=0.9, nesterov=True)  # fmt: skip
        factors = [torch.arange(8.0).view(2, 1, 2, 2) * g for g in (1.0, float("inf"), 2.0)]
        seen = steps_through_an_overflow(optimizer, p, factors)
        assert torch.isfinite(seen[2]).all() and torch.isfinite(optimizer.state[p]["momentum_buffer"]).all()
        weights.append(torch.stack(seen))
    torch.testing.assert_close(weights[0], weights[1])


def test_muon_takes_a_closure_as_torchs_optimizers_do():
    """step(closure): the closure's gradients are the ones Muon orthogonalizes, and its loss is returned."""
    stepped = []
    for with_closure in (True, False):
        p = torch.nn.Parameter(torch.arange(8.0).view(2, 1, 2, 2))
        optimizer = muon.MuonSGD([{"params": [p], "momentum": 0.0, "nesterov": False, "muon_momentum": 0.6}], lr=0.1)

        def closure(optimizer: torch.optim.Optimizer = optimizer, p: torch.Tensor = p) -> torch.Tensor:
            optimizer.zero_grad()
            loss = (p**3).sum()
            loss.backward()
            return loss

        if with_closure:
            assert optimizer.step(closure) == (torch.arange(8.0) ** 3).sum()
        else:
            closure()
            assert optimizer.step() is None
        stepped.append(p.detach().clone())
    assert torch.equal(*stepped) and not torch.equal(stepped[0], torch.arange(8.0).view(2, 1, 2, 2))
