"""configs/fast.yaml against airbench94's own training code, step for step (the PyPI package airbench
0.1.8, a dev dependency: `make install` installs it). ddp/train.py trains in this process; the batches
its loader made (translated, flipped, normalised) are replayed into airbench's train94, which starts from
our initial weights (after model.whiten); after every optimizer step the two models' weights and
BatchNorm statistics are compared. Both in float32 on the CPU, in one process.

    python bench/airbench_steps.py --data ../shared/data/cifar10-subset.npz --out bench/results
    python bench/airbench_steps.py --synthetic 16 --batch 16 --epochs 6 --lr-scale 0.01   (tests/test_recipe.py's run)

Compared step for step: everything train94 does with a batch (the net, the loss, the optimizer and its
parameter groups, the LR schedule, the whitening bias's first epochs, lookahead, BatchNorm). Compared
apart: the whitening (airbench's on the same images; filters equal up to their sign, airbench's covariance
in float32, ours in float64) and the test-time
augmentation (airbench's `evaluate` at tta_level 2 on the final weights, against our last evaluation).
Not compared: the data order and augmentation, ours in both (airbench draws its own from torch's global
generator: equal in distribution, not image for image).

--lr-scale s multiplies both learning rates (and divides our weight decay, which is per LR, so the decay
per step stays airbench's). At 0.01 a step is nearly linear and the two runs differ by float32's rounding
alone; at 1 (the recipe) its high LR amplifies that rounding step after step: --floor measures by how much,
with our run against itself in the other memory layout (contiguous instead of channels_last), which
changes nothing but the rounding.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `bench` and `ddp` from the checkout

from bench.airbench_cpu import on_the_cpu, replaced  # noqa: E402
from ddp import config, models, train  # noqa: E402
from ddp.errors import UsageError  # noqa: E402

AIRBENCH = "0.1.8"
FAST = ROOT / "configs" / "fast.yaml"
State = dict[str, torch.Tensor]


@dataclass
class Recorded:
    """What our run did: its weights before the first step and after each, the batches as the model saw them."""

    initial: State
    states: list[State]
    batches: list[tuple[torch.Tensor, torch.Tensor]]  # (normalised images, labels) per step
    steps_per_epoch: int
    whiten_images: torch.Tensor  # the normalised images model.whiten whitened
    test: tuple[torch.Tensor, torch.Tensor]  # normalised test images, labels
    test_acc: float  # our last evaluation (with fast.yaml's test-time augmentation)


def snapshot(model: nn.Module) -> State:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def ours(arguments: list[str]) -> Recorded:
    """ddp/train.py's main(arguments) in this process, each train_step recorded."""
    seen: dict[str, Any] = {"states": [], "batches": []}
    step = train.train_step

    def recorded_step(job: train.Job, images: torch.Tensor, labels: torch.Tensor, mix: Any = None) -> torch.Tensor:
        if "initial" not in seen:
            seen["initial"] = snapshot(job.trained.model)
            seen["job"] = job
        seen["batches"].append((job.to_input(images).clone(), labels.clone()))
        loss = step(job, images, labels, mix)
        seen["states"].append(snapshot(job.trained.model))
        return loss

    with replaced([(train, "train_step", recorded_step)]):
        last = train.main(arguments)
    job = seen["job"]
    return Recorded(
        seen["initial"], seen["states"], seen["batches"], job.plan.steps_per_epoch,
        job.to_input(job.data.train.images[: models.WHITEN_IMAGES]),
        (job.to_input(job.data.test.images), job.data.test.labels), last["test_acc"],
    )  # fmt: skip


class Replay:
    """airbench's CifarLoader as train94 uses it, yielding our batches, epoch by epoch; after each step
    (when train94 asks for the next batch, or the epoch's end) the model's state goes into `states`."""

    def __init__(self, run: Recorded, net: dict[str, nn.Module], states: list[State]) -> None:
        self.run, self.net, self.states = run, net, states
        self.batch_size = len(run.batches[0][1])
        self.images = run.whiten_images  # train94 whitens normalize(images[:5000]); the stem is ours already
        self.normalize = lambda images: images
        self.epoch = 0

    def __len__(self) -> int:
        return self.run.steps_per_epoch

    def __iter__(self):  # noqa: ANN204
        first = self.epoch * len(self)
        self.epoch += 1
        for images, labels in self.run.batches[first : first + len(self)]:
            yield images, labels
            self.states.append(snapshot(self.net["net"]))


class TestImages:
    """What airbench's evaluate reads of a loader: normalize(images), labels."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels, self.normalize = images, labels, lambda x: x


def imported_airbench():  # noqa: ANN201 (the airbench module)
    """airbench, imported with torch's cudnn.benchmark left as it was (its modules set it to True)."""
    benchmark = torch.backends.cudnn.benchmark
    try:
        import airbench
    finally:
        torch.backends.cudnn.benchmark = benchmark
    return airbench


def theirs(run: Recorded, epochs: int, lr_scale: float) -> tuple[list[State], float]:
    """airbench's train94 over our batches from our initial weights: its state after each step, and the
    accuracy of its final weights by its own evaluate (tta_level 2)."""
    airbench = imported_airbench()
    utils, hyp = airbench.utils, airbench.lib_airbench94.hyp

    states: list[State] = []
    net: dict[str, nn.Module] = {}

    def make_net() -> nn.Module:
        net["net"] = model = airbench.make_net94()
        theirs_, ours_ = model.state_dict(), list(run.initial.values())  # the same tensors in the same order
        if [t.shape for t in theirs_.values()] != [t.shape for t in ours_]:
            raise SystemExit("airbench's make_net94 and our fast net differ in their tensors' shapes")
        model.load_state_dict(dict(zip(theirs_, (t.clone() for t in ours_))))
        return model

    stand_ins = [(utils, "init_whitening_conv", lambda *_, **__: None), (utils, "CifarLoader", lambda *_, **__: None)]
    with on_the_cpu(airbench), replaced(stand_ins):
        final = airbench.train94(train_loader=Replay(run, net, states), epochs=epochs, make_net=make_net,
                                 learning_rate=hyp["opt"]["lr"] * lr_scale, verbose=False)  # fmt: skip
        accuracy = float(airbench.evaluate(final, TestImages(*run.test), tta_level=2))
    states.append(snapshot(final))  # the last step ends train94 before it asks for another batch
    return states, accuracy


def whitening_difference(run: Recorded) -> float:
    """airbench's init_whitening_conv on the images model.whiten used, against our stem's filters: the
    largest difference, relative to the largest filter weight, each filter matched up to its sign."""
    utils = imported_airbench().utils
    conv = nn.Conv2d(3, run.initial["0.weight"].shape[0], 2)
    utils.init_whitening_conv(conv, run.whiten_images)
    a, b = run.initial["0.weight"].flatten(1), conv.weight.detach().flatten(1)
    per_filter = torch.minimum((a - b).abs().amax(1), (a + b).abs().amax(1))
    return float(per_filter.max() / a.abs().max())


def difference(a: State, b: State) -> tuple[float, str]:
    """The largest difference between two states' floating-point tensors, relative to the tensor's
    largest value, and the tensor's name (ours)."""
    worst, name = 0.0, ""
    for (key, x), y in zip(a.items(), b.values(), strict=True):
        if x.is_floating_point():
            d = float((x - y).abs().max() / x.abs().max().clamp_min(1e-12))
            worst, name = (d, key) if d > worst else (worst, name)
    return worst, name


def arguments(data: list[str], batch: int, epochs: int, lr_scale: float, out_dir: Path, images: int) -> list[str]:
    """configs/fast.yaml at `batch` and `epochs`, its LR per global batch and airbench's warm-up length."""
    fast = config.load(FAST, [])
    steps = images // batch  # drop_last, as both loaders
    if steps < 1:
        raise UsageError(f"--batch {batch} is more than the {images} training images")
    warmup_steps = int(0.23 * epochs * steps)  # train94's triangle: its peak at int(0.23 x its steps)
    return [
        "--config", str(FAST), *data, f"train.batch_size={batch}", f"train.epochs={epochs}",
        f"optim.lr={fast.optim.lr * batch / 1024 * lr_scale}",
        f"optim.weight_decay={fast.optim.weight_decay / lr_scale}",
        f"optim.warmup_epochs={warmup_steps / steps}", f"train.eval_every={epochs}", "run.amp=off",
        "run.progress=false", "run.resume=never", f"run.out_dir={out_dir}",
    ]  # fmt: skip


def compare(
    data: list[str], images: int, batch: int, epochs: int, lr_scale: float, floor: bool, work: Path, changes: list[str]
) -> dict:
    """Our run (with `changes`, section.key=value, after the rest), airbench's over its batches, and
    (floor) ours again in the other memory layout."""
    run = ours([*arguments(data, batch, epochs, lr_scale, work / "ours", images), *changes])
    states, their_acc = theirs(run, epochs, lr_scale)
    if len(states) != len(run.states):
        raise SystemExit(f"airbench took {len(states)} steps, ours {len(run.states)}")
    again = (
        ours([*arguments(data, batch, epochs, lr_scale, work / "floor", images), "run.channels_last=false"])
        if floor
        else None
    )
    accuracy = {"ours": run.test_acc, "airbench": their_acc, **({"floor": again.test_acc} if again else {})}
    steps = []
    for i, (mine, theirs_) in enumerate(zip(run.states, states)):
        d, name = difference(mine, theirs_)
        row = {"step": i + 1, "airbench": d, "tensor": name}
        if again:
            row["floor"] = difference(mine, again.states[i])[0]
        steps.append(row)
    return {
        "airbench": metadata.version("airbench"), "torch": torch.__version__, "source": source(data), "batch": batch,
        "epochs": epochs, "steps_per_epoch": run.steps_per_epoch, "lr_scale": lr_scale,
        "whitening": whitening_difference(run), "test_acc": accuracy,
        "changes": changes, "steps": steps,
    }  # fmt: skip


def source(data: list[str]) -> str:
    """The data settings as this script's option: --data NAME or --synthetic N."""
    settings = dict(setting.split("=", 1) for setting in data)
    if settings["data.dataset"] == "npz":
        return f"--data {Path(settings['data.path']).name}"
    return f"--synthetic {settings['data.synthetic_train']}"


def report(result: dict) -> str:
    floor = "floor" in result["steps"][0]
    lines = [
        f"## {result['source']} --batch {result['batch']} --epochs {result['epochs']} --lr-scale {result['lr_scale']:g}"
        + "".join(f" --ours {change}" for change in result["changes"]),
        "",
        f"Steps an epoch: {result['steps_per_epoch']}; airbench {result['airbench']}, torch {result['torch']}. "
        f"Whitening filters, airbench's against ours: {result['whitening']:.1e} (relative). Test accuracy of "
        f"the final weights with flip + translate TTA: ours {result['test_acc']['ours']:.2%}, airbench's "
        f"evaluate {result['test_acc']['airbench']:.2%}"
        + (f", ours in the other layout {result['test_acc']['floor']:.2%}." if floor else "."),
        "",
        "| step | ours vs airbench94 | where |" + (" floor: ours vs ours, other layout |" if floor else ""),
        "| ---: | ---: | --- |" + (" ---: |" if floor else ""),
    ]
    for row in result["steps"]:
        lines.append(f"| {row['step']} | {row['airbench']:.1e} | {row['tensor']} |"
                     + (f" {row['floor']:.1e} |" if floor else ""))  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--data", type=Path, help="an .npz of CIFAR images (x_train, y_train, x_test, y_test)")
    given.add_argument("--synthetic", type=int, metavar="N", help="N synthetic training images instead")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr-scale", type=float, default=1.0)
    parser.add_argument("--floor", action="store_true", help="also ours against ours in the other memory layout")
    parser.add_argument("--ours", action="append", default=[], metavar="KEY=VALUE",
                        help="a change to our run alone (to see what a real difference looks like)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="a folder: airbench-steps-cpu.md (appended) and .json")
    args = parser.parse_args()
    try:
        found = metadata.version("airbench")
    except metadata.PackageNotFoundError:
        found = None
    if found != AIRBENCH:
        parser.error(f"this compares with airbench {AIRBENCH}; found {found}: pip install airbench=={AIRBENCH}")
    if min(args.batch, args.epochs, 1 if args.synthetic is None else args.synthetic) < 1:
        parser.error("--batch, --epochs and --synthetic are counts of at least 1")
    if not (math.isfinite(args.lr_scale) and args.lr_scale > 0):
        parser.error(f"--lr-scale {args.lr_scale}: a positive number")
    if args.data:  # the count sets the warm-up's length; ddp/train.py checks the rest of the file
        try:
            images = len(np.load(args.data)["y_train"])
        except (OSError, KeyError, ValueError) as e:
            parser.error(f"--data {args.data}: not an .npz with y_train ({e})")
        data = ["data.dataset=npz", f"data.path={args.data.resolve()}"]
    else:
        images = args.synthetic
        data = ["data.dataset=synthetic", f"data.synthetic_train={images}", "data.synthetic_test=64"]
    work = Path(tempfile.mkdtemp(prefix="airbench-steps-"))
    try:
        result = compare(data, images, args.batch, args.epochs, args.lr_scale, args.floor, work, args.ours)
    except UsageError as e:  # a bad --ours, or data that lies: ddp/train.py's own one line
        parser.error(str(e))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(result)
    print(text, end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "airbench-steps-cpu.md", "a") as page:
            page.write(text + "\n")
        runs = args.out / "airbench-steps-cpu.json"
        kept = json.loads(runs.read_text()) if runs.exists() else []
        runs.write_text(json.dumps([*kept, result], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
