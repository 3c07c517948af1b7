"""airbench94's methods in the recipe toolbox, each against what it should compute, in one process:
whitening, lookahead, BatchNorm's own learning rate and frozen scales, the whitening bias's epochs,
the linear schedule to optim.final_lr, the alternating flip and reflect-padded translation, and
test-time translation. (1 vs 2 vs 4 ranks and the killed-and-resumed run with all of them on:
tests/test_equivalence.py.)"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddp import config, devices, ema, loaders, metrics, models, muon, optim
from ddp.errors import UsageError


def test_whitening_decorrelates_the_patches_and_freezes_the_filters():
    g = torch.Generator().manual_seed(0)
    mixing = torch.randn(3, 3, generator=g)  # correlated channels, and neighbouring pixels alike
    images = torch.einsum("ij,njhw->nihw", mixing, torch.randn(64, 3, 32, 32, generator=g))
    images = images + images.roll(1, -1)
    conv = models.fast(10, 0.0, 1.0)[0]
    models.whiten(conv, images, eps=0.0)
    assert not conv.weight.requires_grad and conv.bias.requires_grad
    out = F.conv2d(images.double(), conv.weight.double())  # without the bias: 24 channels, 12 = -(the other 12)
    flat = out[:, :12].permute(0, 2, 3, 1).reshape(-1, 12)
    covariance = flat.T @ flat / len(flat)
    torch.testing.assert_close(covariance, torch.eye(12, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(out[:, 12:], -out[:, :12])


@pytest.mark.parametrize(
    "name, width, message",
    [
        ("small", 1.0, "model.whiten=true: small has no whitening stem; the model with one: fast"),
        ("fast", 0.7, "at model.width=0.7 the stem has 17 channels; whitening fills an even number up to 24"),
        ("fast", 2.0, "at model.width=2 the stem has 48 channels"),
    ],
)
def test_whiten_is_refused_where_there_is_no_stem_to_whiten(name, width, message):
    with pytest.raises(UsageError, match=message):
        models.check(name, 0.0, width, whiten=True)
    models.check("fast", 0.0, 0.25, whiten=True)  # 8 channels: 4 eigenvectors, +/-


def test_lookahead_follows_its_closed_form_and_ends_on_the_slow_weights():
    net = nn.Linear(1, 1, bias=False)
    look = ema.Lookahead(net, every=2, decay=0.9, total_steps=5)
    slow = net.weight.item()
    for step in range(1, 6):
        with torch.no_grad():
            net.weight.add_(1.0)  # an "optimizer step"
        fast = net.weight.item()
        look.update(net)
        if step % 2 == 0:
            kept = 0.9**2 * (step / 5) ** 3
            slow = kept * slow + (1 - kept) * fast
            assert net.weight.item() == pytest.approx(slow)  # the weights are set to the slow copy
        elif step == 5:
            assert net.weight.item() == pytest.approx(slow)  # the last step: the slow weights, not moved
        else:
            assert net.weight.item() == fast
    again = ema.Lookahead(net, 2, 0.9, 5)
    again.restore(look.state_dict(), net, 0)
    assert again.steps == 5 and torch.equal(again.slow[0], look.slow[0])


def test_lookahead_moves_batchnorm_statistics_with_the_weights_and_leaves_counts_alone():
    norm = nn.BatchNorm1d(1)
    look = ema.Lookahead(norm, every=1, decay=0.5, total_steps=1)  # keeps 0.5 x (1/1)**3 of itself
    with torch.no_grad():
        norm.running_mean.fill_(2.0)  # measured with the fast weights
        norm.bias.fill_(4.0)
        norm.num_batches_tracked.fill_(7)
    look.update(norm)
    assert norm.running_mean.item() == 1.0 and norm.bias.item() == 2.0  # halfway from the slow copy's 0
    assert norm.running_var.item() == 1.0 and norm.num_batches_tracked.item() == 7


def groups_of(cfg: config.OptimConfig, net: nn.Module, whitened: nn.Conv2d | None = None):
    optimizer, scheduler = optim.make_optimizer(net, cfg, total_steps=20, steps_per_epoch=5, whitened=whitened)
    return optimizer, scheduler


def test_batchnorm_biases_learn_at_their_own_rate_with_the_same_decay_per_step():
    net = models.fast(10, 0.0, 0.25)
    cfg = config.load(None, ["optim.lr=0.5", "optim.weight_decay=0.01", "optim.norm_bias_lr_scale=64"]).optim
    optimizer, _ = groups_of(cfg, net)
    main, biases = optimizer.param_groups  # optim.lr's group first: the LR a run reports
    norm_biases = {id(m.bias) for m in net.modules() if isinstance(m, nn.BatchNorm2d)}
    assert {id(p) for p in biases["params"]} == norm_biases
    assert biases["initial_lr"] == pytest.approx(32.0) and main["initial_lr"] == 0.5
    assert biases["lr"] * biases["weight_decay"] == pytest.approx(main["lr"] * main["weight_decay"])


def test_frozen_batchnorm_weights_and_no_decay_on_batchnorm():
    net = models.fast(10, 0.0, 0.25)
    cfg = config.load(None, ["optim.freeze_norm_weights=true", "optim.norm_weight_decay=false"]).optim
    optimizer, _ = groups_of(cfg, net)
    norms = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    assert not any(m.weight.requires_grad for m in norms)
    in_optimizer = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert all(id(m.weight) not in in_optimizer for m in norms)
    assert all(in_optimizer[id(m.bias)] == 0.0 for m in norms)
    assert sum(1 for d in in_optimizer.values() if d == cfg.weight_decay) == len(in_optimizer) - len(norms)


def test_the_default_is_one_group_of_every_parameter_as_before():
    net = models.fast(10, 0.0, 0.25)
    optimizer, _ = groups_of(config.OptimConfig(), net)
    assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0]["params"] == list(net.parameters())


def test_the_whitening_bias_learns_in_its_first_epochs_only():
    net = models.fast(10, 0.0, 0.25)
    cfg = config.load(None, ["optim.whiten_bias_epochs=2", "optim.warmup_epochs=0", "optim.schedule=constant"]).optim
    optimizer, scheduler = groups_of(cfg, net, whitened=net[0])
    bias_group = next(g for g in optimizer.param_groups if any(p is net[0].bias for p in g["params"]))
    assert len(bias_group["params"]) == 1
    net(torch.randn(4, 3, 32, 32)).sum().backward()
    before = net[0].bias.detach().clone()
    for step in range(20):
        assert bias_group["lr"] == (cfg.lr if step < 10 else 0.0), step  # 2 epochs of 5 steps
        if step == 10:
            moved = net[0].bias.detach().clone()
            assert not torch.equal(moved, before)
        optimizer.step()
        scheduler.step()
    assert torch.equal(net[0].bias.detach(), moved)  # lr 0: momentum and decay move it no more
    assert scheduler.get_last_lr()[0] == cfg.lr  # the reported LR is optim.lr's group's


def test_linear_schedule_ends_at_final_lr():
    cfg = config.load(None, ["optim.lr=1", "optim.schedule=linear", "optim.final_lr=0.07", "optim.warmup_epochs=1"])
    factor = optim.lr_factor(cfg.optim, total_steps=50, steps_per_epoch=10)
    assert factor(9) == 1.0 and factor(50) == pytest.approx(0.07)
    assert factor(30) == pytest.approx(0.07 + 0.93 * 0.5)
    cosine = optim.lr_factor(config.OptimConfig(final_lr=0.1), 50, 10)
    assert cosine(50) == pytest.approx(0.1) and cosine(30) == pytest.approx(0.1 + 0.9 * 0.5)
    assert [factor(step) for step in (0, 4)] == [0.1, 0.5]  # the warm-up from 0: 1/10 of the peak in its first step
    cfg.optim.warmup_from = 0.2  # airbench's triangle: 0.2 of the peak at step 0, the peak at step 10
    factor = optim.lr_factor(cfg.optim, total_steps=50, steps_per_epoch=10)
    assert [factor(step) for step in (0, 5, 9, 10, 11)] == pytest.approx([0.2, 0.6, 0.92, 1.0, 1 - 0.93 / 40])


def test_reflect_padding_is_torch_reflect_for_any_dtype():
    images = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8)
    padded = loaders.pad(images, 2, reflect=True)
    assert padded.dtype == torch.uint8 and padded.shape == (5, 3, 36, 36)
    assert torch.equal(padded.float(), F.pad(images.float(), (2, 2, 2, 2), mode="reflect"))


def test_alternate_flip_flips_each_image_every_other_epoch_and_translates_within_2px():
    how = loaders.Augment(translate=2, reflect=True, flip="alternate")
    tables = [loaders.augmentation_table(4000, seed=7, epoch=e, how=how) for e in (1, 2, 3, 4)]
    flips = [t[:, 2] for t in tables]
    assert 0.45 < flips[0].float().mean() < 0.55
    assert torch.equal(flips[1], 1 - flips[0]) and torch.equal(flips[2], flips[0]) and torch.equal(flips[3], flips[1])
    assert tables[0][:, :2].min() == 0 and tables[0][:, :2].max() == 4  # shifts of -2..2 px
    assert not torch.equal(tables[0][:, :2], tables[1][:, :2])  # a new translation each epoch
    other_seed = loaders.augmentation_table(4000, seed=8, epoch=1, how=how)
    assert not torch.equal(other_seed[:, 2], flips[0])
    never = loaders.augmentation_table(100, seed=7, epoch=1, how=loaders.Augment(flip="none"))
    assert never[:, 2].sum() == 0


def test_batched_reflect_translation_is_the_per_image_one():
    how = loaders.Augment(translate=2, reflect=True, flip="alternate")
    images = torch.randint(0, 256, (200, 3, 32, 32), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    table = loaders.augmentation_table(200, seed=2, epoch=2, how=how)
    batched = loaders.crop_flip(loaders.pad_hwc(images, how), torch.arange(200), table)
    for i in range(200):
        assert torch.equal(batched[i], loaders.augment(images[i], *table[i].tolist(), how)), i


def test_translation_test_time_augmentation_weighs_the_shifted_views_half():
    """Class 0's logit is 1, class 1's the top-left pixel. Both 1-px views read pixel (1, 1) there (the
    view moved down-right through the reflect padding), so class 1 scores a + w x 2v against class 0's
    1 + w x 2, w the weight of each shifted view: 0.5 (airbench's) is the one that puts the first
    image (v = 1.75) in class 1 and the second (v = 1.4) in class 0; 0.25 or 1 would not."""

    class Probe(nn.Module):
        def forward(self, x):
            return torch.stack([torch.ones(len(x)), x[:, 0, 0, 0]], dim=1)

    images = torch.zeros(2, 3, 32, 32)
    images[:, 0, 0, 0] = 0.5  # alone, each image says class 0
    images[0, 0, 1, 1], images[1, 0, 1, 1] = 1.75, 1.4
    world = devices.World(0, 0, 1, torch.device("cpu"), "none")
    loader = [(images, torch.tensor([1, 1]))]
    alone = metrics.confusion_matrix(Probe(), loader, lambda x: x, 2, world, None)
    shifted = metrics.confusion_matrix(Probe(), loader, lambda x: x, 2, world, None, tta_translate=True)
    assert alone.tolist() == [[0, 0], [2, 0]]
    assert shifted.tolist() == [[0, 0], [1, 1]]


def test_fast_yaml_trains_as_airbench94s_own_code_step_for_step(tmp_path):
    """configs/fast.yaml's run (ddp/train.py in this process) and airbench94's train94 (PyPI airbench
    0.1.8) over the same batches from the same initial weights: after every optimizer step the weights
    and BatchNorm statistics agree to float32's rounding (an LR 100x smaller keeps a step nearly linear,
    so the rounding does not grow). 6 steps of 16 images: the warm-up from 0.2 of the peak, the peak, the
    linear decay, the BatchNorm biases' own LR and decay, the whitening bias learning for 3 epochs only,
    lookahead at step 5 and the slow weights at the last. Their whitening of the same images and their
    test-time augmentation of the final weights agree too. bench/airbench_steps.py: the same at the
    recipe's size, and what a real difference looks like at this one (8.4e-05 for no decay on BatchNorm,
    0.37 for the whitening bias learning an epoch longer)."""
    from bench import airbench_steps

    data = ["data.dataset=synthetic", "data.synthetic_train=16", "data.synthetic_test=64"]
    result = airbench_steps.compare(data, 16, batch=16, epochs=6, lr_scale=0.01, floor=False, work=tmp_path, changes=[])
    assert [row["step"] for row in result["steps"]] == [1, 2, 3, 4, 5, 6]
    assert max(row["airbench"] for row in result["steps"]) < 1e-5, result["steps"]
    assert result["whitening"] < 1e-3  # airbench's patch covariance in float32, ours in float64
    assert result["test_acc"]["ours"] == result["test_acc"]["airbench"]


def test_orthogonalized_keeps_the_singular_vectors_and_brings_the_singular_values_near_1():
    """Newton-Schulz's odd polynomial acts on the singular values alone: U S V^T -> U p(S) V^T, p the quintic
    applied STEPS times to each singular value over the Frobenius norm; values within 8x of each other end in
    [0.5, 1.5] (airbench94_muon's "about 1"), however large the gradient was."""
    torch.manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(36, 16, dtype=torch.float64))
    s = torch.linspace(1.0, 8.0, 16, dtype=torch.float64) * 1e3
    expected = s / torch.linalg.vector_norm(s)
    a, b, c = muon.COEFFICIENTS
    for _ in range(muon.STEPS):
        expected = a * expected + b * expected**3 + c * expected**5
    for matrix in (u @ torch.diag(s) @ v.T, v @ torch.diag(s) @ u.T):  # wide and tall
        got = muon.orthogonalized(matrix)
        assert got.dtype == torch.float32 and got.shape == matrix.shape
        want = u @ torch.diag(expected) @ v.T if matrix.shape[0] == 16 else v @ torch.diag(expected) @ u.T
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
        assert 0.5 < float(torch.linalg.svdvals(got).min()) and float(torch.linalg.svdvals(got).max()) < 1.5


def test_muon_steps_the_filters_and_leaves_every_other_parameter_sgds_bit_for_bit():
    """optim.muon_lr: the convolution filters in a group of their own at that LR (optim.lr's schedule, no SGD
    momentum or decay), each scaled to norm sqrt(out channels) and then stepped by lr x the orthogonalized Nesterov
    momentum of its gradients (muon_momentum); the head, biases and BatchNorm step as optim.name=sgd steps them."""
    torch.manual_seed(0)
    plain, net = models.fast(10, 0.0, 0.25), models.fast(10, 0.0, 0.25)
    net.load_state_dict(plain.state_dict())
    sgd, sgd_schedule = groups_of(config.load(None, ["optim.weight_decay=0.01"]).optim, plain)
    cfg = config.load(None, ["optim.weight_decay=0.01", "optim.muon_lr=0.2", "optim.muon_momentum=0.5"]).optim
    optimizer, scheduler = groups_of(cfg, net)
    filters = [p for p in net.parameters() if p.ndim == 4]
    assert optimizer.param_groups[-1]["params"] == filters and len(optimizer.param_groups) == 2
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([cfg.lr / 5, cfg.muon_lr / 5])  # warm-up step 1
    images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    momentum = [torch.zeros_like(p) for p in filters]
    for _ in range(3):
        with torch.no_grad():  # the same forward in both: plain's filters are net's
            for a, b in zip(plain.parameters(), net.parameters(), strict=True):
                a.copy_(b) if a.ndim == 4 else None
        for model, opt in ((plain, sgd), (net, optimizer)):
            opt.zero_grad()
            F.cross_entropy(model(images), labels).backward()
        lr = optimizer.param_groups[-1]["lr"]
        want = []
        for p, m in zip(filters, momentum, strict=True):
            m.mul_(0.5).add_(p.grad)
            scaled = p.detach() * (len(p) ** 0.5 / p.detach().norm())
            want.append(scaled - lr * muon.orthogonalized((p.grad + 0.5 * m).reshape(len(p), -1)).view_as(p))
        for opt, schedule in ((sgd, sgd_schedule), (optimizer, scheduler)):
            opt.step()
            schedule.step()
        for p, w in zip(filters, want, strict=True):
            torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-6)
        others = [(a, b) for a, b in zip(plain.parameters(), net.parameters(), strict=True) if a.ndim != 4]
        assert all(torch.equal(a, b) for a, b in others)
    saved = optimizer.state_dict()
    assert saved["param_groups"][-1]["muon_momentum"] == 0.5 and saved["param_groups"][-1]["momentum"] == 0.0
    assert all(torch.equal(saved["state"][i]["momentum_buffer"], m) for i, m in zip(
        saved["param_groups"][-1]["params"], momentum, strict=True))  # fmt: skip
