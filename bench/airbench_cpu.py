"""airbench94 (the PyPI package airbench 0.1.8, its own training code) on the CPU in float32: its
per-epoch test accuracy beside ddp/train.py's configs/fast.yaml on the same images
(bench/results/airbench-cpu.md). airbench runs on CUDA only; in this process its CUDA calls are made
the CPU's: `.cuda()` leaves tensors and modules where they are, `.half()` makes them float32 (the CPU
has no fast float16), CifarLoader loads onto the CPU, torch.cuda.Event times with the host's clock and
torch.cuda.synchronize does nothing. Its net, hyperparameters, data order, augmentation and printed
table are its own; torch.manual_seed(--seed) first, as airbench itself seeds nothing.

    python bench/airbench_cpu.py --data ../shared/data/cifar10-subset.npz --airbench airbench-0.1.8.tar.gz \
        --seed 0 --out R.json     (the archive: pip download --no-deps --no-binary :all: airbench==0.1.8)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `bench` from the checkout

from bench.airbench_subset import per_epoch, prepare  # noqa: E402


class HostEvent:
    """torch.cuda.Event's record / elapsed_time (milliseconds), on the host's clock."""

    def __init__(self, **_: object) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: HostEvent) -> float:
        return 1e3 * (end.at - self.at)


@contextlib.contextmanager
def on_the_cpu(airbench) -> Iterator[None]:  # noqa: ANN001 (the airbench module)
    """airbench's CUDA calls made the CPU's while inside; torch's own again after."""
    loader_init = airbench.CifarLoader.__init__

    def cpu_loader(self, *args, gpu="cpu", **kwargs) -> None:  # noqa: ANN001
        loader_init(self, *args, gpu=gpu, **kwargs)

    cpu = [
        (torch.Tensor, "cuda", lambda self, *_, **__: self),
        (nn.Module, "cuda", lambda self, *_, **__: self),
        (torch.Tensor, "half", lambda self, *_, **__: self.float()),
        (nn.Module, "half", lambda self: self.float()),
        (torch.cuda, "Event", HostEvent),
        (torch.cuda, "synchronize", lambda *_, **__: None),
        (airbench.CifarLoader, "__init__", cpu_loader),
    ]
    with replaced(cpu):
        yield


@contextlib.contextmanager
def replaced(attributes: list[tuple[object, str, object]]) -> Iterator[None]:
    """Each (owner, name, value): owner.name = value while inside, its own value again after."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in attributes]
    try:
        for owner, name, value in attributes:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--airbench", type=Path, required=True, help="airbench-0.1.8.tar.gz")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    airbench, work, counts = prepare(args.airbench, args.data, "airbench-cpu-")
    os.chdir(work)  # train94 evaluates on ./cifar10/test.pt
    from airbench.lib_airbench94 import hyp

    torch.manual_seed(args.seed)
    printed = io.StringIO()
    with on_the_cpu(airbench):
        loader = airbench.CifarLoader("cifar10", train=True, batch_size=hyp["opt"]["batch_size"], aug=hyp["aug"],
                                      altflip=True)  # fmt: skip
        started = time.perf_counter()
        with contextlib.redirect_stdout(printed):
            model = airbench.train94(train_loader=loader, verbose=True)
        seconds = time.perf_counter() - started
        print(printed.getvalue(), end="")
        test = airbench.CifarLoader("cifar10", train=False, batch_size=2000)
        tta = {f"tta{level}": float(airbench.evaluate(model, test, tta_level=level)) for level in (0, 1, 2)}
    result = {
        "airbench": "airbench 0.1.8, train94, float32 on the CPU", "seed": args.seed,
        "threads": torch.get_num_threads(),
        "train_images": counts["train"], "test_images": counts["test"], "epochs": hyp["opt"]["train_epochs"],
        "seconds": seconds, "final": tta, "per_epoch": per_epoch(printed.getvalue()),
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_epoch"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
