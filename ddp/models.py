"""CIFAR models by name: MODELS = {"name": builder(num_classes) -> nn.Module}, the one list of models
(model.name's choices come from it). Inputs are 3x32x32.

Models only compute logits; devices, memory format, compile and wrapping belong to train.py and
distributed.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ddp.errors import UsageError


class TutorialNet(nn.Module):
    """The PyTorch "Training a Classifier" CIFAR-10 tutorial net: 2 conv + 3 linear, no BatchNorm."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def _conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


def small(num_classes: int = 10) -> nn.Module:
    """Three conv-BN-ReLU stages (32-64-128 channels) and a linear head: ~0.1M parameters,
    trains an epoch of 6k images in seconds on a laptop CPU."""
    return nn.Sequential(
        _conv_bn(3, 32),
        nn.MaxPool2d(2),  # 16x16
        _conv_bn(32, 64),
        nn.MaxPool2d(2),  # 8x8
        _conv_bn(64, 128),
        nn.AdaptiveMaxPool2d(1),
        nn.Flatten(),
        nn.Linear(128, num_classes),
    )


class _Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def _fast_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.MaxPool2d(2),  # pool before BN: BN and GELU then run on a quarter of the pixels
        nn.BatchNorm2d(c_out),
        nn.GELU(),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.GELU(),
    )


def fast(num_classes: int = 10) -> nn.Module:
    """The layout of the fast CIFAR-10 speed-run nets (airbench): a 2x2 stem, three blocks of two
    3x3 convs with BatchNorm and GELU at 64-256-256 channels (32 -> 16 -> 8 -> 4 px), global max-pool,
    a linear head. ~2M parameters; made for large batches, bf16 and channels_last on a GPU."""
    return nn.Sequential(
        nn.Conv2d(3, 24, 2, padding=1, bias=False),  # 33x33
        nn.BatchNorm2d(24),
        nn.GELU(),
        _fast_block(24, 64),  # 16x16
        _fast_block(64, 256),  # 8x8
        _fast_block(256, 256),  # 4x4
        nn.AdaptiveMaxPool2d(1),
        nn.Flatten(),
        nn.Linear(256, num_classes, bias=False),
        _Scale(1 / 8),  # max-pooled GELU features are large: small initial logits let a high LR start
    )


def resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 adapted to 32x32: a 3x3 stride-1 stem and no max-pool, so the
    first stage sees 32x32 instead of ImageNet's 8x8 (the usual CIFAR variant, ~11M parameters)."""
    import torchvision  # here, not at the top: 1-2 s of every start that does not build a ResNet

    net = torchvision.models.resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


MODELS: dict[str, Callable[[int], nn.Module]] = {
    "tutorial": TutorialNet,
    "small": small,
    "fast": fast,
    "resnet18": resnet18,
}


def build(name: str, num_classes: int) -> nn.Module:
    if name not in MODELS:
        raise UsageError(f"model.name={name!r} is not one of {', '.join(MODELS)}")
    return MODELS[name](num_classes)
