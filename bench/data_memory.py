"""Host memory of reading the data: each rank's peak RSS above its start (torch imported) while it reads
CIFAR-10-sized data, as ddp.datasets reads it for training (with the per-channel statistics) and for evaluate.

    python bench/data_memory.py [--repo DIR] [--out bench/results/data-memory-cpu.md]

Each row in a fresh process (ru_maxrss is a high-water mark); --repo DIR measures another checkout's ddp (a
worktree of an older commit, for a before and after). The .npz is random uint8 of CIFAR-10's shape, written
once to a temporary folder: 50,000 train and 10,000 test images, 176 MB as uint8.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CASES = {
    "npz, train + test (training)": ("read", ["data.dataset=npz", "data.path={npz}"]),
    "npz, test only (evaluate)": ("read_test", ["data.dataset=npz", "data.path={npz}"]),
    "synthetic, 50,000 + 10,000": (
        "read",
        ["data.dataset=synthetic", "data.synthetic_train=50000", "data.synthetic_test=10000"],
    ),  # fmt: skip
}
PROBE = """
import json, resource, sys, time
import torch
from ddp import config, datasets
from ddp.devices import World
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
start, world = peak(), World(0, 0, 1, torch.device("cpu"), "none")
cfg = config.load(None, sys.argv[2:])
began = time.perf_counter()
classes = [str(i) for i in range(10)]
data = datasets.read(cfg.data, world) if sys.argv[1] == "read" else datasets.read_test(cfg.data, world, classes)
print(json.dumps({"start_mb": start, "above_mb": peak() - start, "s": time.perf_counter() - began}))
"""


def measure(repo: Path, npz: Path) -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    rows = {}
    for name, (how, args) in CASES.items():
        argv = [sys.executable, "-c", PROBE, how, *(a.format(npz=npz) for a in args)]
        rows[name] = json.loads(
            subprocess.run(argv, env=env, cwd=repo, check=True, capture_output=True, text=True).stdout
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", default=str(REPO), help="the checkout whose ddp is measured")
    parser.add_argument("--out", default=None, help="a .md file for the table (default: print it)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        npz, rng = Path(tmp) / "cifar-shaped.npz", np.random.default_rng(0)
        images = {n: rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8) for n in (50_000, 10_000)}
        np.savez(npz, x_train=images[50_000], y_train=rng.integers(0, 10, 50_000), x_test=images[10_000],
                 y_test=rng.integers(0, 10, 10_000))  # fmt: skip
        rows = measure(Path(args.repo), npz)
    git = subprocess.run(["git", "-C", args.repo, "describe", "--always", "--dirty"], capture_output=True, text=True)
    head = git.stdout.strip() or "?"
    lines = [f"ddp at {args.repo} ({head}); peak RSS above the start (torch imported), MB", "",
             "| data | peak above start | seconds |", "| --- | ---: | ---: |"]  # fmt: skip
    lines += [f"| {name} | {r['above_mb']:.0f} | {r['s']:.2f} |" for name, r in rows.items()]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
