"""The optimizer and its per-step LR schedule, from the config's optim section: SGD (with Muon for the filters)
or AdamW over the parameters that learn, grouped where their LR or decay differs (BatchNorm's, the whitening bias); a
linear warm-up from 0 (or optim.warmup_from), then constant, cosine or linear to optim.final_lr."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ddp.config import OptimConfig
from ddp.ema import by_dtype
from ddp.errors import UsageError
from ddp.muon import MuonSGD


def make_optimizer(
    model: nn.Module,
    o: OptimConfig,
    total_steps: int,
    steps_per_epoch: int,
    whitened: nn.Conv2d | None = None,
    loss_scale: float = 1.0,
) -> tuple[torch.optim.Optimizer, Schedule]:
    """The optimizer over the model's learning parameters and its per-step schedule. Freezes
    BatchNorm's weights first if optim.freeze_norm_weights (before the DDP wrap, which registers
    only the parameters that learn). `whitened`: model.whiten's stem, whose bias learns in the first
    optim.whiten_bias_epochs epochs only (its learning rate is 0 after them: no step moves it).
    `loss_scale` (SGD; a power of 2, checks.precision): the gradients come that many times too large, so each
    group's LR is / it and its weight decay x it: the same steps, bit for bit; the momentum is x it too."""
    if loss_scale != 1.0 and (o.name != "sgd" or o.muon_lr > 0):
        raise ValueError(f"a loss scale undone by the LR is SGD's, not {o.name}'s or Muon's")
    norms = norm_layers(model)
    if o.freeze_norm_weights:
        freeze_norm_weights(model)
    norm_biases = {id(m.bias) for m in norms}
    norm_weights = {id(m.weight) for m in norms}
    whiten_bias = id(whitened.bias) if whitened is not None and whitened.bias is not None else None
    groups: dict[tuple[float, float, bool], list[nn.Parameter]] = {}  # (lr x, weight decay, whiten bias)
    filters = [p for p in model.parameters() if p.requires_grad and p.ndim == 4 and o.muon_lr > 0]  # Muon's
    muon = {id(p) for p in filters}
    for p in model.parameters():
        if not p.requires_grad or id(p) in muon:
            continue
        scale, decay = 1.0, o.weight_decay
        if id(p) in norm_biases | norm_weights and not o.norm_weight_decay:
            decay = 0.0
        if id(p) in norm_biases:  # its own learning rate, the same decay per step (lr x weight_decay)
            scale, decay = o.norm_bias_lr_scale, decay / o.norm_bias_lr_scale
        groups.setdefault((scale, decay, id(p) == whiten_bias), []).append(p)
    # the group at optim.lr first: get_last_lr()[0], the LR a run reports, is its
    ordered = sorted(groups.items(), key=lambda group: group[0][0] != 1.0 or group[0][2])
    params = [{"params": ps, "lr": o.lr * scale / loss_scale, "weight_decay": decay * loss_scale}
              for (scale, decay, _), ps in ordered]  # fmt: skip
    if filters:  # last: no SGD momentum or decay of their own (muon.MuonSGD); the schedule of optim.lr's group
        ordered.append(((0.0, 0.0, False), filters))
        params.append({"params": filters, "lr": o.muon_lr, "weight_decay": 0.0, "momentum": 0.0, "nesterov": False,
                       "muon_momentum": o.muon_momentum})  # fmt: skip
    if o.name == "sgd":
        nesterov, kind = o.nesterov and o.momentum > 0, MuonSGD if filters else torch.optim.SGD
        optimizer = fused(kind, params, lr=o.lr / loss_scale, momentum=o.momentum, nesterov=nesterov)
    else:
        optimizer = fused(torch.optim.AdamW, params, lr=o.lr, weight_decay=o.weight_decay)
    factor = lr_factor(o, total_steps, steps_per_epoch)
    whiten_steps = o.whiten_bias_epochs * steps_per_epoch

    def whiten_bias_factor(step: int) -> float:
        return factor(step) if step < whiten_steps else 0.0

    factors = [whiten_bias_factor if is_whiten_bias else factor for (_, _, is_whiten_bias), _ in ordered]
    # fp16's GradScaler skips a step whose gradients overflow (often the first: its scale starts at 2**16) and
    # the schedule advances per global step all the same: torch's warning about that order tells a user nothing
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step")
    return optimizer, Schedule(optimizer, factors, loss_scale)


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """torch's LambdaLR, seen from outside as if there were no loss scale (make_optimizer divides the optimizer's
    LRs by it): get_last_lr() is the LR as optim.lr means it, and the state dict holds such LRs, as a file does
    (the loading run's own LRs replace them anyway: settings_kept). The scale itself is never in the state."""

    LRS = ("base_lrs", "_last_lr")

    def __init__(self, optimizer: torch.optim.Optimizer, factors: list[Callable[[int], float]], loss_scale: float):
        self._scale = loss_scale  # before LambdaLR's first step
        super().__init__(optimizer, factors)

    def get_last_lr(self) -> list[float]:
        return [lr * self._scale for lr in super().get_last_lr()]

    def state_dict(self) -> dict:
        state = {k: v for k, v in super().state_dict().items() if k != "_scale"}
        return {**state, **{k: [lr * self._scale for lr in state[k]] for k in self.LRS if k in state}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict({**state, **{k: [lr / self._scale for lr in state[k]] for k in self.LRS if k in state}})


def fused(kind: type[torch.optim.Optimizer], params: list[dict], **settings: float | bool) -> torch.optim.Optimizer:
    """`kind` with torch's fused kernel (fused=True: a group's whole update in one kernel, where the
    for-each path launches one per operation, five for Nesterov SGD with weight decay) where this torch
    steps it fused for these parameters; else torch's default. FSDP2's sharded parameters (DTensors)
    keep the default."""
    plain = all(type(p.detach()) is torch.Tensor for group in params for p in group["params"])
    return kind(params, fused=True, **settings) if plain and steps_fused(kind, params) else kind(params, **settings)


def steps_fused(kind: type[torch.optim.Optimizer], params: list[dict]) -> bool:
    """Whether this torch steps `kind` fused, and right, on each device and dtype of `params`, tried on 64 numbers
    of each against its default step: torch checks both at the first step, not when the optimizer is made (no kernel
    for the meta device or complex numbers; no fused=True at all in an older torch), and torch 2.4 to 2.13's fused
    CPU SGD left fp16 and bf16 numbers unchanged, in all but the last few of a tensor (pytorch/pytorch#191763)."""
    try:
        for device, dtype in {(p.device, p.dtype) for group in params for p in group["params"]}:
            stepped = []
            for fused in (True, None):
                probe = nn.Parameter(torch.zeros(64, device=device, dtype=dtype))
                probe.grad = torch.ones_like(probe)
                kind([probe], lr=1.0, fused=fused).step()
                stepped.append(probe.detach())
            if not torch.allclose(*stepped, rtol=0.01, atol=0.0):  # -1 each, or near
                return False
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    return True


IMPLEMENTATION = ("fused", "foreach")  # a parameter group's settings that say how the machine steps, not what


def portable(state: dict, loss_scale: float = 1.0) -> dict:
    """An optimizer's state dict with its groups' IMPLEMENTATION settings as torch's defaults (None),
    as a file holds it: the machine that loads it chooses its own (settings_kept). A run with a `loss_scale`
    (make_optimizer) has its momentum there in float32 and / it, its LRs x it and weight decay / it: as a run
    without one has them (exact: a power of 2; from_portable scales the momentum back, the rest is the loading
    run's own). An empty one (FSDP2's ranks other than 0) stays empty."""
    if "param_groups" not in state:
        return state
    unscaled = {"lr": loss_scale, "initial_lr": loss_scale, "weight_decay": 1 / loss_scale}
    groups = [{**group, **{k: group[k] * unscaled[k] for k in unscaled if k in group}, **dict.fromkeys(IMPLEMENTATION)}
              for group in state["param_groups"]]  # fmt: skip
    return {**state, "param_groups": groups, "state": _momentum_times(state["state"], 1 / loss_scale)}


def from_portable(state: dict, loss_scale: float = 1.0) -> dict:
    """portable()'s state dict for an optimizer with `loss_scale`: its momentum x it, in float32 still
    (load_state_dict casts it to each parameter's dtype: fp16's, exactly)."""
    return {**state, "state": _momentum_times(state["state"], loss_scale)} if "state" in state else state


def _momentum_times(state: dict, factor: float) -> dict:
    """SGD's per-parameter state with its momentum buffers x `factor`, in float32 at least (as it is for 1)."""
    if factor == 1.0:
        return state
    return {key: {name: value.float() * factor if name == "momentum_buffer" and value is not None else value
                  for name, value in per_param.items()} for key, per_param in state.items()}  # fmt: skip


@contextmanager
def settings_kept(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
) -> Iterator[None]:
    """Loading a checkpoint's optimizer state (and schedule) inside keeps this run's settings. load_state_dict
    takes each group's settings from the file: the LR, momentum and weight decay it was saved with (a resume
    with optim.lr=0.02 went on at the old LR, while its resume line said "changed since: optim.lr ... -> 0.02"),
    and the saving machine's implementation (IMPLEMENTATION), whose fused kernel this device, this torch or
    FSDP2's sharded parameters may not have. Only the state (momentum buffers, step counts) and the schedule's
    position come from the file: each group's LR is then this run's peak times the schedule at that position."""
    chosen = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]
    yield
    for group, keep in zip(optimizer.param_groups, chosen, strict=True):  # load_state_dict's new groups
        group.update(keep)
    if scheduler is not None:
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]  # the peaks of this run
        for group, peak, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
            group["lr"] = peak * factor(scheduler.last_epoch)  # what LambdaLR's step computes
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # get_last_lr(): no public setter


def check_groups(saved: dict, optimizer: torch.optim.Optimizer, where: str | Path, changes: list[str]) -> None:
    """A UsageError unless an optimizer state dict puts as many parameters in as many groups as `optimizer` does
    (`changes`, "section.key old -> new", name the settings that may have changed them: model.whiten,
    optim.norm_bias_lr_scale, ...). An empty one (FSDP2's ranks other than 0) does not say."""
    if "param_groups" not in saved:
        return
    if [len(g["params"]) for g in saved["param_groups"]] != [len(g["params"]) for g in optimizer.param_groups]:
        settings = ", ".join(c for c in changes if c.startswith(("optim.", "model.")))
        raise UsageError(f"{where}'s optimizer groups the parameters otherwise than this run's settings do (changed "
                         f"since: {settings}): set them back to continue, or start a new run.out_dir")  # fmt: skip


def norm_layers(model: nn.Module) -> list[nn.Module]:
    """The model's BatchNorm layers with a weight and a bias."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.affine]


def freeze_norm_weights(model: nn.Module) -> None:
    """BatchNorm's weights (scales) stay as they are: before a DDP wrap, which registers the ones that learn."""
    for norm in norm_layers(model):
        norm.weight.requires_grad_(False)


def lr_factor(o: OptimConfig, total_steps: int, steps_per_epoch: int) -> Callable[[int], float]:
    """The schedule: step -> the fraction of each group's peak learning rate."""
    warmup = round(o.warmup_epochs * steps_per_epoch)
    # From warmup_from > 0: that fraction at step 0, the peak at step `warmup` (airbench's triangle, step for
    # step). From 0: 1/warmup at step 0 (a first step at LR 0 would be wasted), the peak at step warmup - 1.
    first = 0 if o.warmup_from > 0 else 1

    def factor(step: int) -> float:
        if step < warmup:
            return o.warmup_from + (1.0 - o.warmup_from) * (step + first) / warmup
        if o.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if o.schedule == "cosine" else 1.0 - progress
        return o.final_lr + (1.0 - o.final_lr) * shape

    return factor


def clip_gradients(model: nn.Module, max_norm: float, loss_scale: float = 1.0) -> torch.Tensor:
    """The total L2 norm of the model's gradients, before clipping them to `max_norm` (0 = no clipping).
    Under FSDP2 the gradients are sharded DTensors: their norm is reduced over the ranks, then read whole.
    With a `loss_scale` (make_optimizer; no clipping) the gradients are x it: the norm returned is / it,
    summed in float32 (fp16's per-tensor norms; fp16's largest number is 65504), one multi-tensor call per dtype."""
    if max_norm > 0:
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    else:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms = [torch.linalg.vector_norm(torch.stack(torch._foreach_norm(g)).float()) for (g,) in by_dtype(grads)]
        norms = norms or [torch.zeros(())]
        norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return norm / loss_scale if loss_scale != 1.0 else norm
