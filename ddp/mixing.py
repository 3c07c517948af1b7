"""MixUp and CutMix (data.mixup_alpha, data.cutmix_alpha, data.mix_prob, data.mix_off_epoch): a
training batch blended with itself rolled by one image, on the training device after the crop and
flip, with soft targets to match.

The arithmetic is torchvision.transforms.v2's MixUp and CutMix (pairs by rolling the batch; CutMix's
box from a uniform centre and the area 1 - lambda, lambda then set to the box's true area), with the
randomness drawn here instead of from the global RNG.

`draw` is a function of (seed, epoch, step in epoch, rank) alone, like the crops: a resumed run, or
the same step run twice, mixes the same way. With both alphas on, each mixed batch is CutMix or
MixUp with even odds (as timm does). The soft targets go into the cross-entropy with its label
smoothing, which smooths them as it smooths one-hot labels (the same as mixing smoothed labels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ddp.config import DataConfig


@dataclass(frozen=True)
class Mix:
    """One batch's mix: each image keeps `lam` of itself and takes 1 - lam from the image before it
    (the batch rolled by one); for CutMix, as the box rows y0:y1, columns x0:x1 of that image."""

    lam: float
    box: tuple[int, int, int, int] | None = None  # (y0, y1, x0, x1) for CutMix, None for MixUp


def enabled(d: DataConfig, epoch: int) -> bool:
    """Whether batches of `epoch` may be mixed (data.mix_off_epoch: from that epoch on, never)."""
    on = (d.mixup_alpha > 0 or d.cutmix_alpha > 0) and d.mix_prob > 0
    return on and not (d.mix_off_epoch and epoch >= d.mix_off_epoch)


def draw(d: DataConfig, seed: int, epoch: int, step: int, rank: int, size: int = 32) -> Mix | None:
    """The mix of rank `rank`'s batch at `step` of `epoch` (None: this batch is not mixed)."""
    if not enabled(d, epoch):
        return None
    g = np.random.default_rng([seed, epoch, step, rank])
    if g.random() >= d.mix_prob:
        return None
    cutmix = d.cutmix_alpha > 0 and (d.mixup_alpha == 0 or g.random() < 0.5)
    alpha = d.cutmix_alpha if cutmix else d.mixup_alpha
    lam = float(g.beta(alpha, alpha))
    if not cutmix:
        return Mix(lam)
    centre_y, centre_x = int(g.integers(size)), int(g.integers(size))
    half = int(0.5 * math.sqrt(1.0 - lam) * size)  # a square box of area (1 - lam) x size², cut at the edges
    y0, y1 = max(centre_y - half, 0), min(centre_y + half, size)
    x0, x1 = max(centre_x - half, 0), min(centre_x + half, size)
    return Mix(1.0 - (y1 - y0) * (x1 - x0) / size**2, (y0, y1, x0, x1))


def apply(
    mix: Mix | None, x: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixed batch and its targets: class probabilities (B, num_classes) summing to 1 per image,
    or `labels` unchanged when `mix` is None."""
    if mix is None:
        return x, labels
    rolled = x.roll(1, 0)
    if mix.box is None:
        x = x * mix.lam + rolled * (1.0 - mix.lam)
    else:
        y0, y1, x0, x1 = mix.box
        x = x.clone()
        x[..., y0:y1, x0:x1] = rolled[..., y0:y1, x0:x1]
    one_hot = F.one_hot(labels, num_classes).to(x.dtype if x.is_floating_point() else torch.float32)
    return x, one_hot * mix.lam + one_hot.roll(1, 0) * (1.0 - mix.lam)
