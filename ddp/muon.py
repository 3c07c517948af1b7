"""optim.muon_lr: Muon (Keller Jordan's MomentUm Orthogonalized by Newton-schulz, airbench94_muon) for the
convolution filters, SGD for every other parameter, in one optimizer: the checkpoint, the schedule and the
CUDA graph see torch's SGD. Which parameters are filters is make_optimizer's choice, not this module's."""

from __future__ import annotations

import torch

# The quintic Newton-Schulz iteration's coefficients (Keller Jordan's): they push every singular value of a
# normalised matrix towards 1 in a few steps, to about 0.5-1.5 rather than exactly 1, which trains as well.
COEFFICIENTS = (3.4445, -4.7750, 2.0315)
STEPS = 3  # airbench94_muon's
EPS = 1e-7  # the matrix is divided by its Frobenius norm + this: which bounds its largest singular value by 1


def orthogonalized(update: torch.Tensor, steps: int = STEPS) -> torch.Tensor:
    """A 2-D `update` with its singular values made about 1 (U S V^T -> U S' V^T, S' near the identity), in float32:
    each direction it holds gets about the same step, however large its gradient was."""
    x = update.float()
    return newton_schulz(x / (torch.linalg.matrix_norm(x) + EPS), steps)


def newton_schulz(x: torch.Tensor, steps: int = STEPS) -> torch.Tensor:
    """orthogonalized() of a float32 matrix already divided by its Frobenius norm (+ EPS)."""
    a, b, c = COEFFICIENTS
    wide = x.size(0) <= x.size(1)  # x @ x.T is the smaller Gram matrix of the two
    x = x if wide else x.T
    for _ in range(steps):  # x <- a x + (b G + c G G) x, G = x x^T: three matrix products a step, each one launch
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.T


class MuonSGD(torch.optim.SGD):
    """torch's SGD, where a group with "muon_momentum" set is Muon's: its parameters' gradients go into a
    momentum buffer (Nesterov), whose orthogonalized form, per filter matrix (out channels x the rest), is the
    step SGD then takes at the group's LR (the group itself has no momentum and no weight decay for SGD);
    before it, each such parameter is scaled back to norm sqrt(out channels), which stands in for weight decay.
    The buffer is the parameter's "momentum_buffer" in the state, as SGD's own is."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 (torch's SGD's)
        super().__init__(*args, **kwargs)
        # fused, SGD takes fp16's GradScaler's overflow flag into its kernel and skips the step there, after
        # step() has put the overflow into Muon's momentum (every later step NaN): the scaler skips the call instead
        self._step_supports_amp_scaling = False

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch's signature)
        loss = None
        if closure is not None:  # the gradients first: Muon's part below reads them
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("muon_momentum") is not None:
                self._orthogonalize(group)
        super().step()
        return loss

    def _orthogonalize(self, group: dict) -> None:
        """Each filter of a Muon group rescaled to norm sqrt(out channels), and its gradient replaced by the
        orthogonalized Nesterov momentum: the step SGD then takes. The momentum and the rescaling in multi-tensor
        calls (one launch for all filters, where a loop makes one each: on a GPU the eager step waits on them)."""
        filters = [p for p in group["params"] if p.grad is not None]
        if not filters:
            return
        grads = [p.grad for p in filters]
        for p in filters:  # a filter's first step: its buffer, from zero
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buffers = [self.state[p]["momentum_buffer"] for p in filters]
        torch._foreach_mul_(buffers, group["muon_momentum"])
        torch._foreach_add_(buffers, grads)
        nesterov = torch._foreach_add(grads, buffers, alpha=group["muon_momentum"])
        norms = torch._foreach_norm(nesterov)
        torch._foreach_add_(norms, EPS)
        torch._foreach_div_(nesterov, norms)
        scales = torch._foreach_norm(filters)
        torch._foreach_reciprocal_(scales)
        torch._foreach_mul_(scales, [len(p) ** 0.5 for p in filters])
        torch._foreach_mul_(filters, scales)
        for p, update in zip(filters, nesterov, strict=True):
            p.grad.copy_(newton_schulz(update.reshape(len(p), -1).float()).view_as(p))  # DDP's bucket: written in
