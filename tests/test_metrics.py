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
