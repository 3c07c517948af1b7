"""A run whose loss or weights stop being finite: it stops (exit 3, one line) before it writes a
checkpoint, so every checkpoint on disk stays finite and none is rotated out by NaN ones."""

import math
import re
import warnings

import pytest
import torch
from conftest import REPO, TINY, TRAIN, clean_env, metrics, python, torchrun

from ddp import checkpoint, config, datasets, rundir, train
from ddp.checkpoint import Position
from ddp.checks import Plan
from ddp.devices import World
from ddp.errors import Diverged

# lr 1e4 after a 2-epoch warm-up: the first steps are small enough to stay finite, then the weights
# (BatchNorm's running variance first) blow up: measured, non-finite by global step 4. A checkpoint
# every step, the newest 2 kept: NaN checkpoints would rotate the finite ones out.
DIVERGING = [*TINY, "train.epochs=3", "optim.lr=1e4", "optim.warmup_epochs=2", "run.save_every_steps=1",
             "run.keep_last=2"]  # fmt: skip


def assert_every_checkpoint_finite(out) -> list:
    files = rundir.step_files(out)
    for path in files:
        state = checkpoint.load(path)
        assert all(torch.isfinite(t).all() for t in state["model"].values()), path
    assert not list(rundir.checkpoint_dir(out).glob(".*.tmp"))
    return files


def assert_one_divergence_line(stderr: str, out) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: training diverged: "), stderr
    assert f'File "{REPO / "ddp"}' not in stderr  # no traceback of ours (torchrun prints its own report)
    newest = rundir.step_files(out)[0]
    assert f"the newest checkpoint, {newest}, is finite" in lines[0]
    assert "Try a lower optim.lr (now 10000), optim.clip_grad_norm=1.0" in lines[0]
    return lines[0]


def test_one_process_stops_with_exit_3_and_keeps_its_finite_checkpoints(tmp_path):
    proc = python(str(TRAIN), f"run.out_dir={tmp_path}", *DIVERGING)
    assert proc.returncode == 3, proc.stderr
    line = assert_one_divergence_line(proc.stderr, tmp_path)
    files = assert_every_checkpoint_finite(tmp_path)
    step = int(re.search(r"\(step (\d+) now", line).group(1))  # found non-finite after this step, before its save
    assert step > 2 and [p.name for p in files] == [f"step-{s:09d}.pt" for s in (step - 1, step - 2)], line
    assert not (tmp_path / "metrics.jsonl").exists() or all(math.isfinite(m["train_loss"]) for m in metrics(tmp_path))
    again = python(str(TRAIN), f"run.out_dir={tmp_path}", *DIVERGING)  # the same command diverges the same way
    assert again.returncode == 3 and [p.name for p in rundir.step_files(tmp_path)] == [p.name for p in files]


def test_a_muon_rate_that_diverges_is_named_in_the_line(tmp_path):
    """optim.muon_lr=1e30: the line told to lower optim.lr alone, which Muon's matrices do not use."""
    proc = python(str(TRAIN), f"run.out_dir={tmp_path}", *TINY, "train.epochs=1", "optim.muon_lr=1e30")
    assert proc.returncode == 3, proc.stderr
    assert "Try a lower optim.lr (now 0.05) or optim.muon_lr (now 1e+30), optim.clip_grad_norm=1.0" in proc.stderr


def test_two_ranks_stop_together_and_one_says_why(tmp_path):
    proc = torchrun(2, str(TRAIN), f"run.out_dir={tmp_path}", *DIVERGING)
    assert proc.returncode != 0 and "exitcode  : 3" in proc.stderr, proc.stderr
    assert_one_divergence_line(proc.stderr, tmp_path)
    assert_every_checkpoint_finite(tmp_path)


def test_a_step_skipped_by_the_grad_scaler_is_not_a_divergence(tmp_path):
    """fp16's GradScaler skips a step whose gradients are inf: the loss is finite and the weights
    unchanged, and the run goes on. A non-finite loss is a divergence."""
    cfg = config.load(None, [*TINY, f"run.out_dir={tmp_path}", "run.resume=never"])
    world = World(0, 0, 1, torch.device("cpu"), "none")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # what the run adds to it, in train.build, comes before
        job, _ = train.build(cfg, world, datasets.read(cfg.data, world), Plan(32, 8))
        job.trained.scaler = torch.amp.GradScaler("cpu", enabled=True)  # fp16's scaler (fp16 itself needs CUDA)
        weights = [p.detach().clone() for p in job.trained.model.parameters()]
        first = next(job.trained.model.parameters())
        first.register_hook(lambda grad: grad * math.inf)
        images, labels = next(iter(job.train_loader))
        loss = train.train_step(job, images, labels)
    assert not [w for w in seen if "lr_scheduler.step()" in str(w.message)]  # torch's "wrong order" warning: none
    job.stats.add(loss, len(labels), 1)
    assert all(torch.equal(a, b) for a, b in zip(weights, job.trained.model.parameters()))  # the step was skipped
    train.stop_if_diverged(job, Position(0, 1, 1))  # nothing raised
    job.stats.add(torch.tensor(math.nan), len(labels), 2)
    job.stats.add(torch.tensor(2.0), len(labels), 3)  # a finite loss later does not hide it
    with pytest.raises(Diverged, match="the loss was not finite at global step 2 .*last finite loss 2,"):
        train.stop_if_diverged(job, Position(0, 3, 3))


def test_clip_grad_norm_bounds_the_step(tmp_path):
    """optim.clip_grad_norm=0.001: no parameter moves by more than lr x 0.001 in the first step
    (plain SGD, no momentum or weight decay)."""
    plain_sgd = ["optim.momentum=0", "optim.weight_decay=0", "optim.warmup_epochs=0", "optim.lr=1"]
    cfg = config.load(
        None, [*TINY, f"run.out_dir={tmp_path}", "run.resume=never", "optim.clip_grad_norm=0.001", *plain_sgd]
    )
    world = World(0, 0, 1, torch.device("cpu"), "none")
    job, _ = train.build(cfg, world, datasets.read(cfg.data, world), Plan(32, 8))
    before = torch.cat([p.detach().flatten().clone() for p in job.trained.model.parameters()])
    train.train_step(job, *next(iter(job.train_loader)))
    after = torch.cat([p.detach().flatten() for p in job.trained.model.parameters()])
    assert 0 < (after - before).norm() <= 0.001 * 1.0001


def test_bad_clip_values_are_refused():
    proc = python(str(TRAIN), "optim.clip_grad_norm=-1", env=clean_env())
    assert proc.returncode == 2 and "optim.clip_grad_norm=-1.0 is out of range: it must be >= 0" in proc.stderr
