"""Lightning (lightning.pytorch) training ddp-cifar's `fast` net with configs/fast.yaml's recipe on the
same .npz data, DDP on one device: its wall time and per-epoch test accuracy beside ddp/train.py's,
for `make gpu-check`.

    python bench/lightning_fast.py --out R.json [--config configs/fast.yaml] [--workers 4] data.dataset=npz
        data.path=.gpu/cifar10-subset.npz [KEY=VALUE ...]   (ddp/train.py's overrides, e.g. run.device=cpu)

What is the same as ours: the model (ddp.models.build), the optimizer and its per-step schedule
(ddp.optim.make_optimizer over the config's optim section), global batch, epochs, label smoothing,
flip test-time augmentation when train.tta_flip, bf16 autocast ("bf16-mixed") and channels_last when
the config asks, evaluation on the whole test split after every epoch. What a Lightning user writes
instead of our device-resident loader: the usual DataLoader over PIL images with torchvision
RandomCrop(32, padding=4) + flip + Normalize in worker processes (bench.harness.tutorial_loader).
What it does without (a Lightning user writes them or goes without; the result's "left_out" names
the ones the config turns on): model.whiten, lookahead, the moving average, MixUp/CutMix, the
1-px translations of test-time augmentation, and data.translate/pad/flip other than the crop and flip above.
Timed: trainer.fit from its call to its return (training and the per-epoch evaluation), device
synchronised; the per-epoch times are from epoch start to the end of that epoch's evaluation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `ddp` and `bench` from the checkout

from bench.harness import CIFAR_MEAN, CIFAR_STD, PILImages, tutorial_loader  # noqa: E402
from ddp import checks, config, datasets, metrics  # noqa: E402
from ddp.devices import World  # noqa: E402
from ddp.errors import UsageError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the result, as JSON")
    parser.add_argument("--config", default=str(Path(__file__).resolve().parent.parent / "configs" / "fast.yaml"))
    parser.add_argument("--workers", type=workers, default=4, help="DataLoader worker processes (0 or more)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE, as ddp/train.py takes them")
    args = parser.parse_intermixed_args(argv)
    try:  # a bad setting or data that cannot be read: one line, as ddp/train.py says it
        cfg = config.load(args.config, args.overrides)
        cuda = cfg.run.device != "cpu" and torch.cuda.is_available()
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        data = datasets.read(cfg.data, World(0, 0, 1, device, "none"))
        steps = checks.steps_per_epoch(cfg, len(data.train.labels))  # ddp/train.py's count (drop_last)
    except UsageError as e:
        parser.error(str(e))
    try:  # Lightning only now: its import takes 6.6 s here, and a mistake above needs none of it
        from bench.lightning_net import FastNet, pl
    except ImportError:
        sys.exit("bench/lightning_fast.py needs Lightning: pip install lightning (make install includes it)")
    batch = cfg.train.batch_size
    train = tutorial_loader(data.train, batch, args.workers)
    test = torch.utils.data.DataLoader(
        PILImages(data.test, tutorial_transform_for_test()), batch_size=cfg.train.eval_batch_size,
        num_workers=args.workers, persistent_workers=args.workers > 0,
    )  # fmt: skip
    torch.manual_seed(cfg.run.seed)
    module = FastNet(cfg, len(data.classes), steps)
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy="ddp",  # DistributedDataParallel on the one device, as run.parallel=ddp does at world size 1
        precision="bf16-mixed" if cuda and cfg.run.amp == "bf16" else "32-true",
        max_epochs=cfg.train.epochs,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        benchmark=cuda and cfg.run.cudnn_benchmark,
    )
    if cuda and cfg.run.tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    metrics.synchronize(device)
    started = time.perf_counter()
    trainer.fit(module, train, test)
    wall = metrics.elapsed(started, device)
    result = {
        "framework": f"lightning {pl.__version__}",
        "device": torch.cuda.get_device_name(0) if cuda else "CPU",
        "model": cfg.model.name,
        "batch": batch,
        "precision": trainer.precision,
        "train_images": len(data.train.labels),
        "test_images": len(data.test.labels),
        "fit_wall_s": wall,
        "optimizer_steps": trainer.global_step,  # steps per epoch x epochs: the schedule's length
        "epochs": module.epochs,
        "left_out": left_out(cfg),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "epochs"}))
    return 0


def left_out(cfg: config.Config) -> list[str]:
    """The config's settings that this Lightning run does without."""
    d, t = cfg.data, cfg.train
    augment = f"data.translate={d.translate} data.pad={d.pad} data.flip={d.flip}"
    on = {
        "model.whiten": cfg.model.whiten, "train.lookahead_every": t.lookahead_every > 0,
        "train.ema_decay": t.ema_decay > 0, "data.mixup_alpha": d.mixup_alpha > 0,
        "data.cutmix_alpha": d.cutmix_alpha > 0, "train.tta_translate": t.tta_translate,
        augment: (d.translate, d.pad, d.flip) != (4, "zeros", "random"),
    }  # fmt: skip
    return [name for name, is_on in on.items() if is_on]


def workers(text: str) -> int:
    """--workers: a count of processes, 0 or more."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of processes (0, 1, 2, ...)")
    return int(text)


def tutorial_transform_for_test():  # noqa: ANN201 (a torchvision transform)
    """ToTensor + Normalize with the CIFAR mean and std: the test half of the usual pipeline."""
    from torchvision import transforms

    return transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])


if __name__ == "__main__":
    sys.exit(main())
