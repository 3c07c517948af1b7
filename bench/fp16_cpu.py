"""run.amp=fp16-weights' accuracy on a CPU, whose own fp16 convolutions are 100x slower than float32: ddp/train.py
with each convolution of fp16 tensors computed in float32 from them and its output rounded to fp16, as a GPU's
fp16 convolutions accumulate in float32 and write fp16 (cuDNN's on tensor cores). Everything else is the run's
own: fp16 weights, their SGD steps, lookahead and the loss scale, float32 BatchNorm. An emulation of the GPU's
numerics, not its kernels: bench/results/fp16-weights-cpu.md says what it measured.

    torchrun --standalone --nproc_per_node=2 bench/fp16_cpu.py --config configs/fast.yaml run.amp=fp16-weights ...
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `ddp` from the checkout

from ddp import train  # noqa: E402

_conv2d = F.conv2d


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *args, **kwargs) -> torch.Tensor:
    """F.conv2d; of fp16 tensors on the CPU: in float32, the output rounded to fp16 (its gradients too)."""
    if x.dtype != torch.float16 or x.device.type != "cpu":
        return _conv2d(x, weight, bias, *args, **kwargs)
    bias = bias.float() if bias is not None else None
    return _conv2d(x.float(), weight.float(), bias, *args, **kwargs).half()


if __name__ == "__main__":
    F.conv2d = conv2d  # nn.Conv2d looks F.conv2d up at each call
    sys.exit(train.cli(sys.argv[1:]))
