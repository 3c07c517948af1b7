"""Evaluation (ddp/metrics.py): the confusion matrix, test-time augmentation."""

import torch

from ddp import devices, metrics


def test_flip_test_time_augmentation_adds_the_logits_of_the_mirror_image():
    class LeftMinusRight(torch.nn.Module):  # logit of class 1: left half minus right half; a mirror negates it
        def forward(self, x):
            score = x[..., :16].mean(dim=(1, 2, 3)) - x[..., 16:].mean(dim=(1, 2, 3))
            return torch.stack([torch.zeros_like(score), score], dim=1)

    images = torch.zeros(4, 3, 32, 32, dtype=torch.uint8)
    images[:2, :, :, :16] = 200  # class 1 alone; with its mirror the logits tie and argmax takes class 0
    labels = torch.tensor([0, 0, 1, 1])
    world = devices.World(0, 0, 1, torch.device("cpu"), "none")
    loader = [(images, labels)]
    to_input = lambda x: x.float()  # noqa: E731
    plain = metrics.confusion_matrix(LeftMinusRight(), loader, to_input, 2, world, None)
    tta = metrics.confusion_matrix(LeftMinusRight(), loader, to_input, 2, world, None, tta_flip=True)
    assert plain.tolist() == [[0, 2], [2, 0]]  # rows: true class; bright-left says 1, blank ties to 0
    assert tta.tolist() == [[2, 0], [2, 0]]  # the mirrored logits cancel: ties go to class 0


def test_test_time_augmentation_reads_no_output_after_the_modules_next_call():
    """A module compiled with CUDA graphs returns the same memory from every call (torch raises when an
    overwritten output is read). This one does the same, silently. Class 1's logit is the top-left pixel:
    with its mirror counted, the first image is class 0 (2 - 3) and the second class 1 (2 - 1); with the
    mirror's logit counted twice instead, both would be class 0."""

    class OneOutputBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.out = torch.zeros(2, 2)

        def forward(self, x):  # class 1's logit: the top-left pixel
            self.out[:, 1] = x[:, 0, 0, 0]
            return self.out

    images = torch.zeros(2, 3, 32, 32)
    images[0, 0, 0, 0], images[0, 0, 0, -1] = 2.0, -3.0  # alone class 1; with its mirror (-1) class 0
    images[1, 0, 0, 0], images[1, 0, 0, -1] = 2.0, -1.0  # class 1 both ways
    world = devices.World(0, 0, 1, torch.device("cpu"), "none")
    loader = [(images, torch.tensor([1, 1]))]
    for translate in (False, True):
        tta = metrics.confusion_matrix(OneOutputBuffer(), loader, lambda x: x, 2, world, None, True, translate)
        assert tta.tolist() == [[0, 0], [1, 1]], translate


def test_step_stats_fold_their_journal_into_the_sums_adding_each_step_in_float64_would_give():
    """StepStats journals each step's loss and norm and folds them when read: the sums, counts, maxima and
    finiteness record are those of adding each step in float64 as it came (the old per-step arithmetic on the
    device), across a full journal (folded mid-way), a checkpoint's read and a reset; a step is two copies."""
    import math

    from torch.utils._python_dispatch import TorchDispatchMode

    class Small(metrics.StepStats):
        JOURNAL_STEPS = 3  # a fold every 3 steps without a read

    g = torch.Generator().manual_seed(0)
    losses = (torch.rand(11, generator=g) * 3).tolist()
    losses[4], losses[7] = math.nan, math.inf
    norms = (torch.rand(11, generator=g) * 2).tolist()
    norms[2] = math.inf
    stats = Small(torch.device("cpu"))
    loss_sum = images = norm_sum = steps = norm_max = 0.0
    last, first = math.nan, -1
    for step, (loss, norm) in enumerate(zip(losses, norms), start=1):
        loss32, norm32 = torch.tensor(loss), torch.tensor(norm)  # float32, as a step's
        stats.add_grad_norm(norm32)
        stats.add(loss32, 7 + step, step)
        loss_sum += loss32.double().item() * (7 + step)
        images += 7 + step
        if math.isfinite(loss):
            last = loss32.item()
        elif first < 0:
            first = step
        if math.isfinite(norm):
            norm_sum, steps, norm_max = norm_sum + norm32.double().item(), steps + 1, max(norm_max, norm32.item())
        if step == 5:  # a checkpoint mid-way reads the partial sums
            assert torch.equal(stats.norms_partial(), torch.tensor([norm_sum, steps, norm_max], dtype=torch.float64))
    assert stats.images() == images and stats.first_non_finite() == first == 5 and stats.last_finite() == last
    assert stats.partial().tolist()[1] == images and math.isnan(stats.partial().tolist()[0])  # a NaN loss is in it
    assert stats.grad_norm() == {"grad_norm_mean": norm_sum / steps, "grad_norm_max": norm_max}
    stats.reset()
    assert stats.images() == 0 and stats.grad_norm() == {} and stats.first_non_finite() == 5  # finiteness carries

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    seen: list[str] = []
    with Ops():
        stats.add_grad_norm(torch.tensor(1.0))
        stats.add(torch.tensor(2.0), 8, 12)
    assert [op for op in seen if not op.startswith(("select", "lift_fresh", "detach"))] == ["copy_.default"] * 2
    kept = stats.snapshot()
    stats.add(torch.tensor(math.nan), 8, 13)
    stats.restore(kept)  # the warm-up's throwaway steps leave nothing
    assert stats.images() == 8 and stats.first_non_finite() == 5 and stats.last_finite() == 2.0
