"""CIFAR models by name: MODELS = {"name": builder(num_classes, dropout[, width]) -> nn.Module}, the one
list of models (model.name's choices and their parameter counts in --help come from it). Inputs are
3x32x32; a model computes logits, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from ddp.errors import UsageError, first_line


class TutorialNet(nn.Module):
    """The PyTorch "Training a Classifier" CIFAR-10 tutorial net: 2 conv + 3 linear, no BatchNorm."""

    def __init__(self, num_classes: int = 10, dropout: float = 0.0) -> None:
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


def _scaled(channels: tuple[int, ...], width: float) -> list[int]:
    """model.width: each layer's channel count times `width` (at least 8)."""
    return [max(8, round(c * width)) for c in channels]


def _conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class _GlobalMaxPool(nn.Module):
    """nn.AdaptiveMaxPool2d(1) as a max-pool whose window is the whole map: the same output and the same
    gradient (to the same element, ties too), but a backward that gathers, one kernel (fused by
    torch.compile), where adaptive max-pool's adds atomically: on an H100 that kernel took 1.29 ms of the
    fast net's 25.7 ms step at batch 8192 in bf16 (bench/results/nvidia-h100-80gb-hbm3-check-2026-11-26-b.md)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.max_pool2d(x, x.shape[-2:])


def small(num_classes: int = 10, dropout: float = 0.0, width: float = 1.0) -> nn.Module:
    """Three conv-BN-ReLU stages (32-64-128 channels x width) and a linear head: ~0.1M parameters,
    trains an epoch of 6k images in seconds on a laptop CPU."""
    c1, c2, c3 = _scaled((32, 64, 128), width)
    return nn.Sequential(
        _conv_bn(3, c1),
        nn.MaxPool2d(2),  # 16x16
        _conv_bn(c1, c2),
        nn.MaxPool2d(2),  # 8x8
        _conv_bn(c2, c3),
        _GlobalMaxPool(),
        nn.Flatten(),
        nn.Linear(c3, num_classes),
    )


class _Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def _conv(c_in: int, c_out: int, kernel: int = 3, bias: bool = False) -> nn.Conv2d:
    """A convolution ("same" padding for 3x3) whose first c_in filters start as the identity (Dirac), the
    rest as torch's default: each block starts close to passing its input on (airbench's init)."""
    conv = nn.Conv2d(c_in, c_out, kernel, padding="same" if kernel == 3 else 0, bias=bias)
    with torch.no_grad():
        nn.init.dirac_(conv.weight[:c_in])
        if bias:
            conv.bias.zero_()
    return conv


def _fast_norm(channels: int) -> nn.BatchNorm2d:
    # airbench's BatchNorm: running statistics that follow the weights within a few steps (a short run
    # changes them fast), and an epsilon that does not blur the whitened channels
    return nn.BatchNorm2d(channels, eps=1e-12, momentum=0.4)


def _fast_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        _conv(c_in, c_out),
        nn.MaxPool2d(2),  # pool before BN: BN and GELU then run on a quarter of the pixels
        _fast_norm(c_out),
        nn.GELU(),
        _conv(c_out, c_out),
        _fast_norm(c_out),
        nn.GELU(),
    )


def fast_stem(width: float) -> int:
    """The channels of the fast net's 2x2 stem at model.width=`width`."""
    return _scaled((24,), width)[0]


def fast(num_classes: int = 10, dropout: float = 0.0, width: float = 1.0) -> nn.Module:
    """airbench94's net (Keller Jordan's CIFAR-10 speed-run): a 2x2 stem convolution with a bias (model.whiten
    makes it a whitening filter), three blocks of two 3x3 convs with BatchNorm and GELU at 64-256-256
    channels x width (31 -> 15 -> 7 -> 3 px), global max-pool, a linear head. ~2M parameters; made for
    large batches, bf16 and channels_last on a GPU (model.width=0.25 makes it a CPU net: 1/16 of the
    convolutions' work)."""
    stem, c1, c2, c3 = _scaled((24, 64, 256, 256), width)
    return nn.Sequential(
        _conv(3, stem, kernel=2, bias=True),  # 31x31
        nn.GELU(),
        _fast_block(stem, c1),  # 15x15
        _fast_block(c1, c2),  # 7x7
        _fast_block(c2, c3),  # 3x3
        _GlobalMaxPool(),
        nn.Flatten(),
        nn.Linear(c3, num_classes, bias=False),
        _Scale(1 / 9),  # max-pooled GELU features are large: small initial logits let a high LR start
    )


WHITEN_IMAGES = 5000  # model.whiten: the training images whose patches it whitens (airbench's count)


@torch.no_grad()
def whiten(conv: nn.Conv2d, images: torch.Tensor, eps: float = 5e-4) -> None:
    """Set `conv` (C -> 2k channels, kernel h x w, k <= C x h x w) to whiten the h x w patches of `images`
    (normalised floats, N x C x H x W): filter i and k + i are +/- the i-th eigenvector of the patches'
    covariance, largest eigenvalue first, divided by the square root of its eigenvalue (+ eps); then
    freeze the filters. In float64 on the CPU, so every rank computes the same filters from the same
    images (DDP's wrap broadcasts rank 0's anyway). airbench's init_whitening_conv."""
    h, w = conv.kernel_size
    dims = conv.in_channels * h * w
    covariance, count = torch.zeros(dims, dims, dtype=torch.float64), 0
    for chunk in images.split(500):  # 500 images' patches at a time: ~40 MB in float64
        patches = chunk.cpu().double().unfold(2, h, 1).unfold(3, w, 1)  # N, C, H', W', h, w
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, dims)  # one row per patch, as (C, h, w)
        covariance += patches.T @ patches
        count += len(patches)
    values, vectors = torch.linalg.eigh(covariance / count)  # ascending eigenvalues, vectors as columns
    values, vectors = values.flip(0), vectors.T.flip(0)
    half = conv.out_channels // 2
    filters = vectors[:half] / torch.sqrt(values[:half, None] + eps)
    conv.weight.copy_(torch.cat([filters, -filters]).view_as(conv.weight))
    conv.weight.requires_grad_(False)


def fp16_weights(model: nn.Module) -> nn.Module:
    """run.amp=fp16-weights, as airbench94's make_net: every parameter and buffer in fp16 but BatchNorm's, which
    stay float32 (its statistics and biases need the digits; torch's BatchNorm takes fp16 in, gives fp16 out)."""
    model.half()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._NormBase):
            module.float()
    return model


def torchvision(needed_for: str) -> ModuleType:
    """torchvision, imported here, not at the top (1-2 s of every start that does not use it); a
    UsageError naming `needed_for` when it is missing or not built for this torch (PyPI's CUDA build
    of torchvision against a CPU build of torch: "operator torchvision::nms does not exist")."""
    try:
        import torchvision
    except (ImportError, RuntimeError) as e:
        raise UsageError(
            f"{needed_for} needs torchvision, and it does not import ({first_line(e, typed=True)}): "
            f"install the torchvision built for this torch {torch.__version__} (pytorch.org's install table; "
            "constraints.txt pins a pair that works)"
        ) from None
    return torchvision


def resnet18(num_classes: int = 10, dropout: float = 0.0) -> nn.Module:
    """torchvision's ResNet-18 adapted to 32x32: a 3x3 stride-1 stem and no max-pool, so the
    first stage sees 32x32 instead of ImageNet's 8x8 (the usual CIFAR variant, ~11M parameters)."""
    net = torchvision("model.name=resnet18").models.resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


class PreActBlock(nn.Module):
    """A pre-activation residual block (He et al., "Identity Mappings in Deep Residual Networks"):
    BN-ReLU-conv3x3-[dropout]-BN-ReLU-conv3x3 added to the input, through a 1x1 conv when the shape
    changes. The Wide ResNet block (Zagoruyko & Komodakis) is the same, with dropout between the convs."""

    def __init__(self, c_in: int, c_out: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm2d(c_in), nn.BatchNorm2d(c_out)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        same = stride == 1 and c_in == c_out
        self.shortcut = None if same else nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(x))
        skip = x if self.shortcut is None else self.shortcut(out)  # the projection sees the activated input
        out = self.conv1(out)
        out = self.conv2(self.dropout(torch.relu(self.bn2(out))))
        return out + skip


def _preact_net(widths: list[int], blocks: int, stem: int, num_classes: int, dropout: float) -> nn.Module:
    """A 3x3 stem conv of `stem` channels, a stage of `blocks` PreActBlocks per width (every stage
    after the first halves the resolution), BN-ReLU, global average pool, linear head."""
    layers: list[nn.Module] = [nn.Conv2d(3, stem, 3, padding=1, bias=False)]
    c_in = stem
    for stage, width in enumerate(widths):
        for b in range(blocks):
            layers.append(PreActBlock(c_in, width, 2 if stage > 0 and b == 0 else 1, dropout))
            c_in = width
    layers += [nn.BatchNorm2d(c_in), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes)]
    return nn.Sequential(*layers)


def preact_resnet18(num_classes: int = 10, dropout: float = 0.0) -> nn.Module:
    """Pre-activation ResNet-18 for CIFAR: 3x3 stem, 4 stages of 2 blocks at 64-128-256-512 channels."""
    return _preact_net([64, 128, 256, 512], 2, 64, num_classes, dropout)


def wide_resnet(depth: int, k: int, num_classes: int = 10, dropout: float = 0.0) -> nn.Module:
    """WRN-depth-k as in Zagoruyko & Komodakis (2016): a 16-channel 3x3 stem, 3 stages of (depth-4)/6
    blocks at 16k-32k-64k channels (32 -> 16 -> 8 px), dropout between each block's convs."""
    return _preact_net([16 * k, 32 * k, 64 * k], (depth - 4) // 6, 16, num_classes, dropout)


def wrn16_8(num_classes: int = 10, dropout: float = 0.0) -> nn.Module:
    return wide_resnet(16, 8, num_classes, dropout)


def wrn28_10(num_classes: int = 10, dropout: float = 0.0) -> nn.Module:
    return wide_resnet(28, 10, num_classes, dropout)


MODELS: dict[str, Callable[[int, float], nn.Module]] = {
    "tutorial": TutorialNet,
    "small": small,
    "fast": fast,
    "resnet18": resnet18,
    "preact_resnet18": preact_resnet18,
    "wrn16_8": wrn16_8,
    "wrn28_10": wrn28_10,
}
# Parameters of each with 10 classes, for --help without building them (tests/test_models.py checks).
PARAMS = {
    "tutorial": 62_006,
    "small": 94_762,
    "fast": 1_972_792,
    "resnet18": 11_173_962,
    "preact_resnet18": 11_172_170,
    "wrn16_8": 10_961_370,
    "wrn28_10": 36_479_194,
}
HAS_DROPOUT = ("wrn16_8", "wrn28_10", "preact_resnet18")
HAS_WIDTH = ("small", "fast")


def described() -> str:
    """model.name's help: each model with its parameter count."""
    return "architecture: " + ", ".join(f"{name} ({PARAMS[name] / 1e6:.2f}M params)" for name in MODELS)


def check(name: str, dropout: float = 0.0, width: float = 1.0, whiten: bool = False) -> None:
    if name not in MODELS:
        raise UsageError(f"model.name={name!r} is not one of {', '.join(MODELS)}")
    if dropout > 0 and name not in HAS_DROPOUT:
        raise UsageError(f"model.dropout={dropout:g}: {name} has no dropout; models with one: {', '.join(HAS_DROPOUT)}")
    if width != 1 and name not in HAS_WIDTH:
        raise UsageError(f"model.width={width:g}: {name} has a fixed width; models with model.width: small, fast")
    if whiten and name != "fast":
        raise UsageError(f"model.whiten=true: {name} has no whitening stem; the model with one: fast")
    if whiten and (fast_stem(width) % 2 or fast_stem(width) > 2 * 3 * 2 * 2):
        raise UsageError(
            f"model.whiten=true: at model.width={width:g} the stem has {fast_stem(width)} channels; whitening "
            "fills an even number up to 24 (+/- 12 eigenvectors of 2x2x3 patches): a model.width of at most 1 "
            "whose 24 x width rounds to an even number, e.g. 0.25, 0.5, 1"
        )


def build(
    name: str, num_classes: int, dropout: float = 0.0, width: float = 1.0, weights: torch.dtype = torch.float32
) -> nn.Module:
    """The model `name`; with weights=torch.float16, in fp16_weights' layout (run.amp=fp16-weights)."""
    check(name, dropout, width)
    builder = MODELS[name]
    model = builder(num_classes, dropout, width) if name in HAS_WIDTH else builder(num_classes, dropout)
    return fp16_weights(model) if weights == torch.float16 else model
