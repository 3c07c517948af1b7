import copy

import pytest
import torch
from torch import nn

from ddp import config, models
from ddp.errors import UsageError


@pytest.mark.parametrize("name", sorted(models.MODELS))
@pytest.mark.parametrize("num_classes", [10, 100])
def test_logits_for_a_cifar_batch(name, num_classes):
    net = models.build(name, num_classes).eval()
    with torch.no_grad():
        assert net(torch.randn(2, 3, 32, 32)).shape == (2, num_classes)


def test_tutorial_net_is_the_tutorials():
    net = models.build("tutorial", 10)
    layers = [m for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear, nn.BatchNorm2d))]
    assert [type(m).__name__ for m in layers] == ["Conv2d", "Conv2d", "Linear", "Linear", "Linear"]
    assert sum(p.numel() for p in net.parameters()) == 62006  # the tutorial's parameter count


def test_resnet18_has_a_cifar_stem():
    net = models.build("resnet18", 10)
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1)
    assert isinstance(net.maxpool, nn.Identity)
    assert 11.0e6 < sum(p.numel() for p in net.parameters()) < 11.3e6


def test_small_is_small():
    assert sum(p.numel() for p in models.build("small", 10).parameters()) < 200_000


def test_unknown_model():
    with pytest.raises(UsageError, match="model.name='vgg' is not one of tutorial, small, fast, resnet18, preact"):
        models.build("vgg", 10)


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_parameter_counts_in_help_are_the_models(name):
    assert sum(p.numel() for p in models.build(name, 10).parameters()) == models.PARAMS[name]
    assert f"{name} ({models.PARAMS[name] / 1e6:.2f}M params)" in config.reference()


def test_wide_resnets_are_the_papers():
    """Zagoruyko & Komodakis (2016), table 1: WRN-28-10 36.5M parameters, WRN-16-8 11.0M; a 3x3
    stem of 16 channels; (depth - 4) / 6 blocks per stage at 16k, 32k, 64k channels."""
    assert round(models.PARAMS["wrn28_10"] / 1e6, 1) == 36.5
    assert round(models.PARAMS["wrn16_8"] / 1e6, 1) == 11.0
    net = models.build("wrn16_8", 10, dropout=0.3)
    assert net[0].kernel_size == (3, 3) and net[0].out_channels == 16
    blocks = [m for m in net if isinstance(m, models.PreActBlock)]
    assert [b.conv2.out_channels for b in blocks] == [128, 128, 256, 256, 512, 512]
    assert all(isinstance(b.dropout, nn.Dropout) and b.dropout.p == 0.3 for b in blocks)
    assert len([m for m in models.build("wrn28_10", 10) if isinstance(m, models.PreActBlock)]) == 12


def test_dropout_is_active_in_training_only():
    net = models.build("preact_resnet18", 10, dropout=0.5)
    x = torch.randn(2, 3, 32, 32)
    net.train()
    torch.manual_seed(0)
    a = net(x)
    torch.manual_seed(1)
    assert not torch.equal(a, net(x))
    net.eval()
    assert torch.equal(net(x), net(x))


@pytest.mark.parametrize("name", ["fast", "small"])
def test_global_max_pool_is_adaptive_max_pool_in_output_gradient_and_checkpoint(name):
    """The nets' global max-pool (a gather in its backward, not adaptive max-pool's atomic adds) computes
    what nn.AdaptiveMaxPool2d(1) did, gradients to the same elements with ties too, and a checkpoint
    of the net as it was loads into it."""
    torch.manual_seed(0)
    new = models.MODELS[name](10, 0.0, 0.25).double()
    old = copy.deepcopy(new)
    (index,) = [i for i, m in enumerate(new) if type(m).__name__ == "_GlobalMaxPool"]
    old[index] = nn.AdaptiveMaxPool2d(1)
    new.load_state_dict(old.state_dict())  # strict: the same keys
    for memory_format in (torch.contiguous_format, torch.channels_last):
        for ties in (False, True):
            x = torch.randn(4, 3, 32, 32, dtype=torch.float64).contiguous(memory_format=memory_format)
            maps = new[:index](x)
            maps = maps.round() if ties else maps  # many equal maxima in a window
            a, b = maps.detach().requires_grad_(), maps.detach().requires_grad_()
            out_old, out_new = old[index](a), new[index](b)
            assert torch.equal(out_old, out_new) and out_new.shape[-2:] == (1, 1)
            grad = torch.randn_like(out_old)
            out_old.backward(grad)
            out_new.backward(grad)
            assert torch.equal(a.grad, b.grad)
    assert torch.equal(old(x), new(x))
