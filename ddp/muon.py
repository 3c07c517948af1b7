"""optim.muon_lr: Muon (Keller Jordan's MomentUm Orthogonalized by Newton-schulz, airbench94_muon) for the
convolution filters, SGD for every other parameter, in one optimizer: the checkpoint, the schedule and the
CUDA graph see torch's SGD. Which parameters are filters is make_optimizer's choice, not this module's."""

from __future__ import annotations

import torch

# The quintic Newton-Schulz iteration's coefficients (Keller Jordan's): they push every singular value of a
# normalised matrix towards 1 in a few steps, to about 0.5-1.5 rather than exactly 1, which trains as well.
COEFFICIENTS = (3.4445, -4.7750, 2.0315)
STEPS = 3  # airbench94_muon's


def orthogonalized(update: torch.Tensor, steps: int = STEPS) -> torch.Tensor:
    """A 2-D `update` with its singular values made about 1 (U S V^T -> U S' V^T, S' near the identity), in float32:
    each direction it holds gets about the same step, however large its gradient was."""
    a, b, c = COEFFICIENTS
    x = update.float()
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)  # the Frobenius norm bounds the largest singular value: <= 1
    wide = x.size(0) <= x.size(1)  # x @ x.T is the smaller Gram matrix of the two
    x = x if wide else x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
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
            if group.get("muon_momentum") is None:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buffer = state["momentum_buffer"]
                buffer.mul_(group["muon_momentum"]).add_(p.grad)
                nesterov = p.grad.add(buffer, alpha=group["muon_momentum"])
                p.mul_(len(p) ** 0.5 / torch.linalg.vector_norm(p.float()).to(p.dtype))
                p.grad.copy_(orthogonalized(nesterov.reshape(len(p), -1)).view_as(p))  # DDP's bucket: written in
        super().step()
        return loss
