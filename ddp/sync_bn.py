"""Synchronised BatchNorm: batch statistics over the global batch (every rank's images), as one
process training on the whole batch computes them. `train.sync_bn=true`.

On CUDA this is torch's nn.SyncBatchNorm. torch's refuses CPU tensors, so on CPU (gloo) the same
computation is GlobalMoments below: the forward gathers each rank's (count, mean, sum of squared
deviations) and combines them exactly (Chan et al.'s parallel variance); the backward sums the
gradients of the mean and the variance over the ranks, which is what makes each rank's input
gradient that of the one big batch. The rest of BatchNorm (normalise, scale, shift) is plain
autograd. The modules keep BatchNorm's state-dict keys, so a checkpoint loads into the plain model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class GlobalMoments(torch.autograd.Function):
    """(x of shape N, C, ...) -> per-channel mean and biased variance over every rank's x, and the
    number of values per channel behind them. One all_gather forward, one all_reduce backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.input_dtype = x.dtype
        x = x.to(torch.promote_types(x.dtype, torch.float32))  # statistics in float32 at least, under autocast too
        dims = [0, *range(2, x.dim())]
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        mean = x.mean(dims)
        m2 = (x - _per_channel(mean, x)).square().sum(dims)
        mine = torch.cat([count, mean, m2])
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        counts, means, m2s = torch.stack(every).split([1, mean.numel(), m2.numel()], dim=1)
        total = counts.sum()
        global_mean = (counts * means).sum(0) / total
        global_var = (m2s + counts * (means - global_mean).square()).sum(0) / total
        ctx.save_for_backward(x, global_mean, total)
        ctx.mark_non_differentiable(total)
        return global_mean, global_var, total

    @staticmethod
    def backward(ctx: Any, d_mean: torch.Tensor, d_var: torch.Tensor, _: Any) -> torch.Tensor:
        x, mean, total = ctx.saved_tensors
        both = torch.cat([d_mean, d_var])
        dist.all_reduce(both)  # every rank's loss depends on every rank's x through these two
        d_mean, d_var = both.split(mean.numel())
        dx = (_per_channel(d_mean, x) + 2 * _per_channel(d_var, x) * (x - _per_channel(mean, x))) / total
        return dx.to(ctx.input_dtype)


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, *([1] * (x.dim() - 2)))


class GlooSyncBatchNorm(_BatchNorm):
    """BatchNorm1d/2d/3d with the global batch's statistics in training, across a gloo group; in
    eval mode, or outside a process group, exactly nn.BatchNorm."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least a 2D input (got {x.dim()}D)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        self._check_input_dim(x)
        mean, var, total = GlobalMoments.apply(x)
        if self.track_running_stats:
            self._update_running_stats(*(t.detach().to(self.running_mean.dtype) for t in (mean, var, total)))
        y = (x - _per_channel(mean, x)) * _per_channel(torch.rsqrt(var + self.eps), x)
        return y * _per_channel(self.weight, x) + _per_channel(self.bias, x) if self.affine else y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, total: torch.Tensor) -> None:
        """As nn.BatchNorm: the running variance is the unbiased one; momentum=None averages all."""
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * total / (total - 1).clamp(min=1)
        self.running_mean.lerp_(mean, momentum)
        self.running_var.lerp_(unbiased, momentum)


def convert(model: nn.Module, device: torch.device, backend: str = "nccl") -> nn.Module:
    """Every BatchNorm of `model` made synchronised (torch's on CUDA with nccl, GlooSyncBatchNorm with
    gloo, on CPUs or GPUs), sharing the parameters and buffers, so the optimizer and the checkpoint see
    the same tensors."""
    if device.type == "cuda" and backend == "nccl":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _to_gloo_sync(model)


def _to_gloo_sync(module: nn.Module) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, (GlooSyncBatchNorm, nn.SyncBatchNorm)):
        synced = GlooSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                   module.track_running_stats)  # fmt: skip
        if module.affine:
            synced.weight, synced.bias = module.weight, module.bias
        if module.track_running_stats:
            synced.running_mean, synced.running_var = module.running_mean, module.running_var
            synced.num_batches_tracked = module.num_batches_tracked
        synced.train(module.training)
        return synced
    for name, child in module.named_children():
        module.add_module(name, _to_gloo_sync(child))
    return module
