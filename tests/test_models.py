import pytest
import torch
from torch import nn

from ddp import models
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
    with pytest.raises(UsageError, match="model.name='vgg' is not one of tutorial, small, fast, resnet18"):
        models.build("vgg", 10)
