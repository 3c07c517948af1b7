"""airbench94 (the PyPI package airbench 0.1.8, Keller Jordan's CIFAR-10 speed-run) on a .npz
subset, for `make gpu-check`: its training time and test accuracy beside ddp-cifar's on the same
images and the same GPU.

    python bench/airbench_subset.py --data .gpu/cifar10-subset.npz --airbench .gpu/airbench-0.1.8.tar.gz --out R.json

airbench reads `train.pt` / `test.pt` ({"images": uint8 N x 32 x 32 x 3, "labels", "classes"}) from a
directory (its CifarLoader), and its train94 evaluates on ./cifar10/test.pt: the subset is written
there, in a temporary working directory. Without CUDA (make gpu-check --dry-run) it converts the
data and imports airbench, then says it skipped the training; it never trains on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def import_airbench(archive: Path, into: Path):
    """airbench from its source archive (pure Python: no pip, no network on the GPU machine)."""
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    sys.path.insert(0, str(next(into.glob("airbench-*"))))
    import airbench

    return airbench


def write_split(npz: np.lib.npyio.NpzFile, split: str, path: Path, classes: list[str]) -> int:
    images = torch.from_numpy(np.ascontiguousarray(npz[f"x_{split}"])).to(torch.uint8)
    if images.shape[1:] != (32, 32, 3):
        raise SystemExit(f"x_{split} has shape {tuple(images.shape)}; airbench wants N x 32 x 32 x 3")
    torch.save({"images": images, "labels": torch.from_numpy(npz[f"y_{split}"]).long(), "classes": classes}, path)
    return len(images)


def prepare(archive: Path, data: Path, prefix: str):
    """airbench imported into a new temporary folder and the .npz written there as its ./cifar10/{train,test}.pt:
    (the airbench module, the folder, the images per split)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    airbench = import_airbench(archive.resolve(), work)
    npz = np.load(data)
    classes = [str(c) for c in npz["classes"]] if "classes" in npz.files else [str(i) for i in range(10)]
    (work / "cifar10").mkdir()
    counts = {split: write_split(npz, split, work / "cifar10" / f"{split}.pt", classes) for split in ("train", "test")}
    return airbench, work, counts


def per_epoch(printed: str) -> list[dict]:
    """The rows of airbench's printed table (`|  run  |  epoch  |  train_loss  | ... |`) whose epoch is a
    number: {"epoch" (1-based), "val_acc" (no TTA), "total_time_seconds" (its timer: training only)}."""
    rows, header = [], None
    for line in printed.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            continue
        if "epoch" in cells:
            header = cells
            continue
        row = dict(zip(header or [], cells))
        if row.get("epoch", "").isdigit() and row.get("val_acc"):
            rows.append({"epoch": int(row["epoch"]) + 1, "val_acc": float(row["val_acc"]),
                         "total_time_seconds": float(row["total_time_seconds"])})  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--airbench", type=Path, required=True, help="airbench-0.1.8.tar.gz")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    airbench, work, counts = prepare(args.airbench, args.data, "airbench-")
    result = {"airbench": airbench.__file__, "train_images": counts["train"], "test_images": counts["test"]}
    if not torch.cuda.is_available():
        result["skipped"] = "no CUDA device: airbench trains on a GPU only (data converted, package imported)"
    else:
        os.chdir(work)  # train94 evaluates on ./cifar10/test.pt
        from airbench.lib_airbench94 import hyp

        loader = airbench.CifarLoader("cifar10", train=True, batch_size=hyp["opt"]["batch_size"], aug=hyp["aug"],
                                      altflip=True)  # fmt: skip
        airbench.warmup94(train_loader=loader, verbose=False)  # CUDA context and kernels, untimed
        torch.cuda.synchronize()
        printed = io.StringIO()  # its per-epoch table, kept: test accuracy (no TTA) and seconds per epoch
        started = time.perf_counter()
        with contextlib.redirect_stdout(printed):
            model = airbench.train94(train_loader=loader, verbose=True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        print(printed.getvalue(), end="")
        test = airbench.CifarLoader("cifar10", train=False, batch_size=2000)
        accuracy = float(airbench.evaluate(model, test, tta_level=hyp["net"]["tta_level"]))
        result.update(accuracy=accuracy, seconds=seconds, epochs=hyp["opt"]["train_epochs"],
                      device=torch.cuda.get_device_name(0), per_epoch=per_epoch(printed.getvalue()))  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
