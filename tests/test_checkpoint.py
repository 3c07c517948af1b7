"""Checkpoint files: durability, fallback, refusal of code, inspection, export, loading anywhere."""

import ast
import io
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import time
import types
import zipfile

import numpy as np
import pytest
import torch
from conftest import REPO, TINY, TRAIN, clean_env, metrics, ok, piped, python

from ddp import checkpoint, config, errors, models, optim, rundir, train
from ddp.errors import UsageError, WriteFailed

RUN = [*TINY, "train.epochs=2", "run.save_every_steps=3", "run.keep_last=2"]


@pytest.fixture
def run_dir(tmp_path):
    """A finished 2-epoch single-process run: 16 steps, checkpoints every 3 steps, 2 kept."""
    train.main([f"run.out_dir={tmp_path}", *RUN])
    return tmp_path


def test_keeps_the_newest_files_and_last_pt_is_the_newest(run_dir):
    files = rundir.step_files(run_dir)
    assert [p.name for p in files] == ["step-000000016.pt", "step-000000015.pt"]  # keep_last=2
    assert os.path.samefile(files[0], rundir.last_path(run_dir))  # a hard link, not a copy
    state = checkpoint.load(files[1])
    assert (state["epoch"], state["step"], state["global_step"]) == (1, 7, 15)  # mid-epoch 2
    assert state["ranks"][0]["partial"] is not None  # the unfinished epoch's running loss sums


def test_a_checkpoint_holds_everything_for_an_exact_continuation(run_dir):
    state = torch.load(rundir.last_path(run_dir), map_location="cpu", weights_only=True)
    assert {
        "model", "optimizer", "scheduler", "scaler", "ranks", "epoch", "step", "global_step", "global_batch",
        "world_size", "config", "versions", "checksum", "metrics", "normalize", "train_images",
    } <= state.keys()  # fmt: skip
    assert set(state["ranks"][0]["rng"]) == {"python", "numpy", "torch", "cuda"}
    assert state["versions"]["torch"] == str(torch.__version__) and state["global_batch"] == 32


def middle_of_largest_tensor(path) -> int:
    """The file offset of the middle byte of the largest tensor's data in a torch.save zip file
    (a byte in the zip's padding or headers would leave the content intact)."""
    with zipfile.ZipFile(path) as z:
        member = max(z.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(member.header_offset)
        header = f.read(30)  # the local file header; then the name and the extra field
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return member.header_offset + 30 + name_len + extra_len + member.file_size // 2


@pytest.mark.parametrize("damage", ["truncate", "flip a byte"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_with_a_warning(run_dir, damage, capsys):
    newest = rundir.step_files(run_dir)[0]
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[middle_of_largest_tensor(newest)] ^= 0x40  # tensor bytes, which only the checksum sees
    newest.write_bytes(bytes(data))  # in place: last.pt, a hard link to it, is damaged alike
    with pytest.raises(checkpoint.CorruptCheckpoint):
        checkpoint.load(newest)
    last = train.main([f"run.out_dir={run_dir}", *RUN, "train.epochs=3"])
    err = capsys.readouterr()
    assert f"warning: skipping {newest}" in err.err
    assert "resumed from" in err.out and "step-000000015.pt" in err.out
    assert last["epoch"] == 3 and [m["epoch"] for m in metrics(run_dir)] == [1, 2, 3]


def test_when_every_checkpoint_is_damaged_the_run_stops_instead_of_starting_over(run_dir, capsys):
    for path in rundir.step_files(run_dir):
        path.write_bytes(b"garbage")  # in place: last.pt, a hard link to the newest, too
    assert train.cli([f"run.out_dir={run_dir}", *RUN]) == 2
    assert "no valid checkpoint in" in capsys.readouterr().err


def test_a_directory_or_a_dangling_link_named_like_a_checkpoint_is_no_checkpoint(run_dir, capsys):
    """run.resume=auto stopped on a directory step-000000099.pt ("is a directory: name a checkpoint file");
    now it and a link to nothing are passed over, and the run resumes from its newest file, at its end here."""
    checkpoints = rundir.checkpoint_dir(run_dir)
    (checkpoints / "step-000000099.pt").mkdir()
    (checkpoints / "step-000000098.pt").symlink_to(run_dir / "gone.pt")
    assert [p.name for p in rundir.step_files(run_dir)] == ["step-000000016.pt", "step-000000015.pt"]
    assert train.cli([f"run.out_dir={run_dir}", *RUN]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step-000000016.pt" in out and (checkpoints / "step-000000099.pt").is_dir()


def test_a_last_pt_of_its_own_is_resumed_and_never_replaced_unseen(run_dir, capsys):
    """last.pt that is no hard link to a numbered checkpoint (the numbered ones removed to save room, a copy brought
    in, `cp -r` of the run): run.resume=auto and never passed it over, trained afresh, and the first save replaced it.
    Now it is resumed where it is the only one or holds the newest numbered one's step; where it holds another (the
    newer numbered ones removed to go back, or a copy brought in) the run says how to choose; never refuses it."""
    last, (newest, older) = rundir.last_path(run_dir), rundir.step_files(run_dir)
    last.unlink()
    last.write_bytes(newest.read_bytes())  # as `cp -r` leaves it: a copy of step 16
    assert train.cli([f"run.out_dir={run_dir}", *RUN]) == 0  # at its end: nothing to train
    assert f"resumed from {last}: 2 epoch(s) + 0 step(s) done (global step 16)" in capsys.readouterr().out
    newest.unlink()  # to go back to step 15, say; last.pt stays
    assert train.cli([f"run.out_dir={run_dir}", *RUN]) == 2
    assert capsys.readouterr().err == (
        f"error: {last} holds global step 16 and is no hard link to {older} beside it: remove it to go on from "
        f"{older.name}, or move the numbered ones away to go on from it\n"
    )
    older.unlink()
    assert train.cli([f"run.out_dir={run_dir}", *RUN, "run.resume=never"]) == 2
    assert f"run.resume=never but {last} exists and would be overwritten" in capsys.readouterr().err
    assert train.cli([f"run.out_dir={run_dir}", *RUN, "train.epochs=3"]) == 0
    assert f"resumed from {last}: 2 epoch(s) + 0 step(s) done (global step 16)" in capsys.readouterr().out
    assert checkpoint.load(last)["global_step"] == 24 and [m["epoch"] for m in metrics(run_dir)] == [1, 2, 3]


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_not_executed(tmp_path):
    """A pickle that calls os.system as it loads: refused, and said to be one. Torch's line for it began with its
    advice to load with weights_only=False, which would have run the call (torch 2.4 named it as it names a class: a
    model's, said so); a refusal of another kind says torch's reason without the advice."""
    marker = tmp_path / "pwned"
    Evil.marker = marker
    evil = tmp_path / "evil.pt"
    torch.save({"model": Evil(), "epoch": 1}, evil)
    proc = python(str(TRAIN), f"run.out_dir={tmp_path / 'run'}", *TINY, f"run.resume={evil}")
    said = f"error: {evil} is not a loadable checkpoint (it would call posix.system as it loads, which torch.load " \
           "refuses: no checkpoint does; do not trust it)"  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.splitlines() == [said], proc.stderr  # (not torch's weights_only advice)
    inspected = python("-m", "ddp.checkpoint", "inspect", str(evil))
    assert inspected.returncode == 1 and "checksum FAILED" in inspected.stdout
    assert not marker.exists()
    advice = "Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` will likely succeed"
    refused = errors.refused_pickle(Exception(f"{advice}\n\n\tWeightsUnpickler error: Unsupported operand 149\n\nSee"))
    assert refused == "torch.load's weights-only unpickler refused it: Unsupported operand 149"
    assert errors.refused_pickle(Exception(f"{advice}\n\nSee")) == "torch.load's weights-only unpickler refused it"
    before_2_6 = f"{advice} WeightsUnpickler error: Unsupported global: GLOBAL posix.system was not an allowed global"
    assert errors.refused_pickle(Exception(before_2_6)).startswith("it would call posix.system as it loads")  # (2.4.1)


def cut_short(path):
    """A torch.save file that a copy or a write stopped in: the first 3/5 of it."""
    torch.save({"model": {"w": torch.zeros(10_000)}, "epoch": 1}, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 3 // 5])


@pytest.mark.parametrize(
    "write, why",
    [
        (lambda f: torch.save(torch.nn.Linear(2, 2), f),  # the tutorial's other way: torch.save(model, PATH)
         "(it holds Python objects (torch.nn.modules.linear.Linear), as torch.save of a whole model writes, not only "
         "tensors)"),
        (lambda f: f.write_bytes(b""), "(an empty file)"),  # was "(EOFError: EOFError)", then "(EOFError)"
        (lambda f: f.write_text('{"epoch": 1}\n'), "(not a file that torch.save wrote)"),  # metrics.jsonl, say
        (cut_short, "(cut short: a zip without its end, as an interrupted copy leaves)"),  # was "(OSError: [Errno 22]"
    ],
)  # fmt: skip
def test_a_file_that_is_no_checkpoint_says_what_it_holds_in_one_plain_line(write, why, tmp_path):
    """torch.load's refusal of a pickled model is many lines with terminal colours, and its advice is to
    load with weights_only=False (which runs the file's code), for a text file too: the line says what the
    file holds instead."""
    path = tmp_path / "model.pt"
    write(path)
    with pytest.raises(checkpoint.CorruptCheckpoint) as raised:
        checkpoint.load(path)
    assert str(raised.value) == f"{path} is not a loadable checkpoint {why}"


def test_inspect_and_export(run_dir, tmp_path):
    shown = ok(python("-m", "ddp.checkpoint", "inspect", str(rundir.last_path(run_dir)))).stdout
    assert "checksum ok" in shown and "epoch 2 done, step 0" in shown and "world_size 1" in shown
    assert "test_acc" in shown and "MB" in shown and "run.amp off" in shown
    out = tmp_path / "weights.pt"
    ok(python("-m", "ddp.checkpoint", "export", str(rundir.last_path(run_dir)), str(out)))
    weights = torch.load(out, map_location="cpu", weights_only=True)
    assert weights["model_name"] == "small" and len(weights["classes"]) == 10
    models.build(weights["model_name"], len(weights["classes"])).load_state_dict(weights["model"])
    assert set(weights) == {"format", "model_name", "width", "dropout", "classes", "normalize", "tta", "model"}
    assert python("-m", "ddp.checkpoint", "frobnicate").returncode == 2


def test_inspect_says_what_an_export_is(run_dir, tmp_path, capsys):
    """An export (the weights alone) was "checksum FAILED: ... not a ddp-cifar checkpoint", exit 1: it has no
    checksum to fail. Now what it holds, exit 0; a file that is neither still fails."""
    from ddp.cli import command

    last, tensors = rundir.last_path(run_dir), len(torch.load(rundir.last_path(run_dir), weights_only=True)["model"])
    for name, options, holds in [("w.pt", [], "model small at width 1.0, 10 classes"),
                                 ("sd.pt", ["--state-dict"], "a bare state dict")]:  # fmt: skip
        assert command(checkpoint.main, ["export", str(last), str(tmp_path / name), *options]) == 0
        capsys.readouterr()
        assert command(checkpoint.main, ["inspect", str(tmp_path / name)]) == 0
        shown = capsys.readouterr().out
        assert f"an export, the weights alone (no checksum, no training state): {holds}" in shown, shown
        assert f"; {tensors} tensors, " in shown and "FAILED" not in shown, shown
    torch.save({"step": torch.tensor(1), "note": "mine"}, tmp_path / "other.pt")
    assert command(checkpoint.main, ["inspect", str(tmp_path / "other.pt")]) == 1
    assert "checksum FAILED" in capsys.readouterr().out


def readme_python(containing: str) -> str:
    """The README's python block that contains `containing`."""
    blocks = (REPO / "README.md").read_text().split("```python\n")[1:]
    return next(block.split("```")[0] for block in blocks if containing in block)


def test_the_readmes_lines_rebuild_a_model_of_another_width_from_its_checkpoint_and_its_export(tmp_path):
    """The README's two ways to load a run's model, run as written on a model at model.width=0.5 (make train's
    is `fast` at 0.25): they built it at width 1 (the export had no width at all), a size mismatch. An export
    given where a checkpoint goes says that it is one."""
    run = tmp_path / "run"
    train.main([f"run.out_dir={run}", *TINY, "train.epochs=1", "model.width=0.5"])
    last = rundir.last_path(run)
    checkpoint.export(last, tmp_path / "model.pt")
    for block, path in [("runs/quick/checkpoints/last.pt", last), ('"model.pt"', tmp_path / "model.pt")]:
        code = readme_python(block).replace(block.strip('"'), str(path))
        scope = {"torch": torch}
        exec(code, scope)  # the README's lines, with this run's file
        assert sum(p.numel() for p in scope["model"].parameters()) < 0.3 * models.PARAMS["small"]  # ~ width**2
    with pytest.raises(checkpoint.CorruptCheckpoint, match="not a ddp-cifar checkpoint \\(an export: the weights"):
        checkpoint.load(tmp_path / "model.pt")


def test_an_export_never_replaces_a_file_made_by_a_second_export_meanwhile(tmp_path, monkeypatch):
    """Two exports to one name at once (two terminals, a script run twice): both found no OUT, and the second
    rename replaced the first's file. The last step is a hard link, which never replaces: the second fails."""
    out = tmp_path / "model.pt"
    weights = models.build("small", 1).state_dict()  # (export checks that they fit the model named)
    state = {"model": weights, "ema": None, "classes": ["a"], "normalize": {"mean": [0], "std": [1]},
             "config": {"model": {"name": "small", "width": 1.0, "dropout": 0.0}}}  # fmt: skip

    def load_while_another_export_finishes(path):
        out.write_bytes(b"the other export's")
        return state

    monkeypatch.setattr(checkpoint, "load", load_while_another_export_finishes)
    with pytest.raises(WriteFailed, match=f"^cannot write {out}: File exists$"):
        checkpoint.export("last.pt", out)
    assert out.read_bytes() == b"the other export's" and [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_resuming_with_other_settings_lists_every_one_that_changed_and_trains_with_them(tmp_path):
    """The LR, momentum and weight decay typed for the resume are what it steps with (before: the checkpoint's
    own, while the resume line said they had changed); settings that group the parameters otherwise, or another
    optimizer, are refused in one line (before: torch's ValueError, or a KeyError at the first step), another
    dataset before its data is read."""
    train.main([f"run.out_dir={tmp_path}", *TINY, "train.epochs=1"])
    for setting, refusal in (
        ("optim.norm_bias_lr_scale=4", "optimizer groups the parameters otherwise than this run's settings do "
         "(changed since: optim.norm_bias_lr_scale 1.0 -> 4.0): set them back to continue"),
        ("optim.name=adamw", "was trained with optim.name=sgd but this run has optim.name=adamw; set it back"),
    ):  # fmt: skip
        with pytest.raises(UsageError, match=re.escape(refusal)):
            train.main([f"run.out_dir={tmp_path}", *TINY, setting])
    root = tmp_path / "cifar"  # another dataset: refused before it is read (it was downloaded first: 169 MB)
    with pytest.raises(UsageError, match=re.escape("data.dataset=synthetic but this run has data.dataset=cifar100")):
        train.main([f"run.out_dir={tmp_path}", *TINY, "data.dataset=cifar100", f"data.root={root}"])
    assert not root.exists()
    changes = ("optim.lr=0.02", "optim.clip_grad_norm=2", "optim.momentum=0.5", "optim.weight_decay=0.001",
               "optim.schedule=constant")  # fmt: skip
    proc = ok(python(str(TRAIN), f"run.out_dir={tmp_path}", *TINY, *changes))
    line = next(line for line in proc.stdout.splitlines() if line.startswith("resumed from"))
    assert "; changed since: " in line
    for change in ("train.epochs 1 -> 2", "optim.lr 0.05 -> 0.02", "optim.clip_grad_norm 0.0 -> 2.0"):
        assert change in line, line
    state = checkpoint.load(rundir.last_path(tmp_path))
    groups = state["optimizer"]["param_groups"]
    assert [(g["initial_lr"], g["momentum"], g["weight_decay"]) for g in groups] == [(0.02, 0.5, 0.001)] * len(groups)
    assert state["scheduler"]["base_lrs"] == [0.02] * len(groups) and metrics(tmp_path)[-1]["lr"] == 0.02
    assert "run.seed" not in line and "model.name" not in line
    same = ok(python(str(TRAIN), f"run.out_dir={tmp_path}", *TINY, *changes, "train.epochs=3"))
    line = next(line for line in same.stdout.splitlines() if line.startswith("resumed from"))
    assert line.endswith("changed since: train.epochs 2 -> 3")


def test_a_resume_on_other_images_at_the_same_path_says_so_and_one_on_the_same_does_not(tmp_path, capsys):
    """The .npz at data.path written anew between two runs (other pixels, the same size): its resume line says
    the data changed, as it says a changed setting; the next resume, on the data its checkpoint was made on, not."""
    x = torch.randint(0, 256, (64, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).numpy()
    path, y = tmp_path / "data.npz", torch.arange(64).numpy() % 10
    run = [f"run.out_dir={tmp_path / 'run'}", *TINY, "data.dataset=npz", f"data.path={path}", "train.batch_size=16"]
    lines = []
    for epochs, images in ((1, x), (2, 255 - x), (3, 255 - x)):
        np.savez(path, x_train=images, y_train=y, x_test=images[:20], y_test=y[:20])
        train.main([*run, f"train.epochs={epochs}"])
        lines += [line for line in capsys.readouterr().out.splitlines() if line.startswith("resumed from")]
    assert lines[0].endswith("changed since: train.epochs 1 -> 2, the data (other images or labels than the "
                             "checkpoint's)"), lines[0]  # fmt: skip
    assert lines[1].endswith("changed since: train.epochs 2 -> 3"), lines[1]


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_weights_saved_from_a_wrapper_load_into_a_plain_model(run_dir, prefix):
    """DataParallel/DDP ("module."), torch.compile ("_orig_mod.") and both: a user's own state dict
    saved from the wrapper resumes into the plain model."""
    state = checkpoint.load(rundir.last_path(run_dir))
    state["model"] = {prefix + k: v for k, v in state["model"].items()}
    model = models.build("small", 10)
    optimizer, scheduler = optim.make_optimizer(model, config.OptimConfig(), 16, 8)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    checkpoint.restore(state, checkpoint.Trained(model, optimizer, scheduler, scaler))
    assert torch.equal(
        model.state_dict()["0.0.weight"], checkpoint.load(rundir.last_path(run_dir))["model"]["0.0.weight"]
    )


def test_stop_signal_under_slurm_requeues_the_job(tmp_path):
    """SLURM_JOB_ID set: after the stop checkpoint rank 0 asks the job's state and, SLURM still running it, runs
    `scontrol requeue` (an array task as ARRAYJOB_TASK); it asked once before, as training started. scontrol here is
    a stand-in that records its arguments and says RUNNING; real SLURM is tested with the SLURM launch files (a job
    scancel ended: tests/test_slurm.py)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "JobId=1234 JobState=RUNNING"\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = clean_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="1234", SLURM_ARRAY_JOB_ID="1200", SLURM_ARRAY_TASK_ID="7",
    )  # fmt: skip
    out = tmp_path / "run"
    args = [*TINY, "data.synthetic_train=1024", "train.epochs=80"]  # a first epoch of 1-2 s, then minutes
    proc = subprocess.Popen([sys.executable, str(TRAIN), f"run.out_dir={out}", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    while not (out / "metrics.jsonl").exists():
        assert proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr
    shows = ["show job -o 1200_7"] * 2  # as training starts (a preemption that signalled no rank?), and after the stop
    assert calls.read_text().splitlines() == [*shows, "requeue 1200_7"]
    assert "scontrol requeue 1200_7: requeued" in stdout
    assert checkpoint.load(rundir.last_path(out))["epoch"] < 80


class TutorialNet(torch.nn.Module):
    """PyTorch's "Training a Classifier" tutorial's own Net, as a reader of that tutorial has it."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 6, 5)
        self.pool = torch.nn.MaxPool2d(2, 2)
        self.conv2 = torch.nn.Conv2d(6, 16, 5)
        self.fc1 = torch.nn.Linear(16 * 5 * 5, 120)
        self.fc2 = torch.nn.Linear(120, 84)
        self.fc3 = torch.nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def test_the_tutorials_own_lines_load_an_exported_state_dict_and_reach_evaluates_accuracy(tmp_path, capsys):
    """export --state-dict writes what `net.load_state_dict(torch.load(PATH))` takes and prints the
    normalisation; the tutorial's Net, transforms and per-class loop then count exactly what
    python -m ddp.evaluate counts."""
    from torchvision import transforms

    from ddp import datasets, evaluate
    from ddp.cli import command
    from ddp.devices import World

    out = tmp_path / "run"
    train.main([f"run.out_dir={out}", *TINY, "model.name=tutorial", "train.epochs=1"])
    PATH = tmp_path / "cifar_net.pth"
    assert command(checkpoint.main, ["export", str(rundir.last_path(out)), str(PATH), "--state-dict"]) == 0
    printed = capsys.readouterr().out
    mean, std = (ast.literal_eval(v) for v in re.search(r"Normalize\((\[.*?\]), (\[.*?\])\)", printed).groups())

    net = TutorialNet()
    net.load_state_dict(torch.load(PATH))  # the tutorial's line, as it is
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    test = datasets.read(config.load(None, TINY).data, World(0, 0, 1, torch.device("cpu"), "none")).test
    testset = [(transform(image.permute(1, 2, 0).numpy()), label) for image, label in zip(test.images, test.labels)]
    testloader = torch.utils.data.DataLoader(testset, batch_size=4, shuffle=False)
    classes = [f"class{i}" for i in range(10)]
    correct_pred = {classname: 0 for classname in classes}
    total_pred = {classname: 0 for classname in classes}
    with torch.no_grad():
        for images, labels in testloader:
            _, predictions = torch.max(net(images), 1)
            for label, prediction in zip(labels, predictions):
                if label == prediction:
                    correct_pred[classes[label]] += 1
                total_pred[classes[label]] += 1

    reported = evaluate.measure(str(rundir.last_path(out)), "cpu", 1024, [])
    assert [correct_pred[c] / total_pred[c] if total_pred[c] else None for c in classes] == reported[
        "per_class_accuracy"
    ]
    assert sum(correct_pred.values()) / 101 == reported["accuracy"] == metrics(out)[-1]["test_acc"]


def test_bad_export_options_are_one_line_and_exit_2(run_dir, tmp_path, capsys):
    from ddp.cli import command

    last = str(rundir.last_path(run_dir))
    for argv in (
        ["export", last, str(tmp_path / "a.pt"), "--state-dict=yes"],  # a flag takes no value
        ["inspect", last, "--state-dict"],  # inspect writes nothing
        ["export", last, "--state-dict"],  # no OUT
    ):
        assert command(checkpoint.main, argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "export PATH OUT [--raw] [--state-dict]" in err, err
    assert not list(tmp_path.glob("*.pt"))


def test_export_never_replaces_a_file_a_typo_named(run_dir, tmp_path, capsys):
    """OUT the checkpoint itself (or last.pt's other name, a step file), a file of the user's, a directory:
    one line, exit 2, every file as it was. Before, `export last.pt last.pt --state-dict` put a bare
    state dict where the run's resume point was. A run's directory as PATH: the line names its newest file."""
    from ddp.cli import command

    last, older = rundir.last_path(run_dir), rundir.step_files(run_dir)[1]
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    dangling = tmp_path / "mine.pt"  # a link to a file not there: "File exists", exit 1, after the check said none
    dangling.symlink_to(f"{notes}.gone")
    before = {p: p.read_bytes() for p in (last, older, notes)}
    refused = ": name a new one, or remove it first"
    for out, said in [
        (last, f"exists, and export never replaces a file{refused}"),
        (older, f"exists, and export never replaces a file{refused}"),
        (notes, f"exists, and export never replaces a file{refused}"),
        (dangling, f"exists (a symbolic link to {notes}.gone), and export never replaces a file{refused}"),
        (tmp_path, f"is a directory: name the file to write, e.g. {tmp_path / 'model.pt'}"),
        (f"{tmp_path}/new/", f"names a directory: name the file to write, e.g. {tmp_path / 'new/model.pt'}"),
    ]:
        assert command(checkpoint.main, ["export", str(last), str(out), "--state-dict"]) == 2, out
        assert capsys.readouterr().err == f"error: OUT={out} {said}\n"
    under = notes / "model.pt"  # a file where OUT's directory must be: named (it was "File exists")
    assert command(checkpoint.main, ["export", str(last), str(under), "--state-dict"]) == 1
    assert capsys.readouterr().err == f"error: cannot write {under}: {notes} is a file, not a directory\n"
    assert command(checkpoint.main, ["export", str(last), ""]) == 2  # (it said "OUT= is a directory": ".")
    assert capsys.readouterr().err == "error: OUT is empty: name the file to write, e.g. model.pt\n"
    assert {p: p.read_bytes() for p in before} == before and not (tmp_path / "new").exists()  # (a file "new" was)
    assert os.readlink(dangling) == f"{notes}.gone" and not os.path.exists(dangling)
    for path in (run_dir, last.parent):  # PATH: a run, or its checkpoints/
        for argv in (["inspect", str(path)], ["export", str(path), str(tmp_path / "model.pt")]):
            assert command(checkpoint.main, argv) == 2, argv
            assert capsys.readouterr().err == f"error: {path} is a directory: its newest checkpoint is {last}\n"
    last.unlink()  # removed: the newest numbered one is named (it was "name a checkpoint file")
    assert command(checkpoint.main, ["inspect", str(run_dir)]) == 2
    newest = rundir.step_files(run_dir)[0]
    assert capsys.readouterr().err == f"error: {run_dir} is a directory: its newest checkpoint is {newest}\n"


def test_a_checkpoint_through_a_pipe_is_read_whole_and_one_cut_short_is_said_so(run_dir, tmp_path, capsys):
    """`inspect <(ssh host cat last.pt)`, `aws s3 cp s3://B/last.pt - | python -m ddp.evaluate --checkpoint
    /dev/stdin`: torch.load seeks, which a pipe cannot, and a whole checkpoint was "0.0 MB, checksum FAILED:
    ... (cut short: a zip without its end, as an interrupted copy leaves)". A pipe is now read whole first."""
    from ddp import evaluate
    from ddp.cli import command

    whole = rundir.last_path(run_dir).read_bytes()
    with piped(whole) as path:
        assert command(checkpoint.main, ["inspect", path]) == 0
        assert capsys.readouterr().out.startswith(f"{path}: {len(whole) / 1e6:.1f} MB, checksum ok\n  epoch 2 done")
    with piped(whole) as path:
        assert command(checkpoint.main, ["export", path, str(tmp_path / "model.pt")]) == 0
        assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'model.pt'}")
    assert torch.load(tmp_path / "model.pt", weights_only=True)["model_name"] == "small"
    with piped(whole) as path:
        assert command(evaluate.main, ["--checkpoint", path, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["epoch"] == 2
    with piped(whole[: len(whole) // 2]) as path:  # the pipe's writer stopped halfway: said as for a file
        assert command(checkpoint.main, ["inspect", path]) == 1
        assert "is not a loadable checkpoint (cut short: a zip without its end" in capsys.readouterr().out


def test_export_to_stdout_is_for_a_pipe_not_a_terminal(run_dir, capsysbinary, monkeypatch):
    """`export PATH - | ssh host 'cat > model.pt'`: the weights on stdout, what was written on stderr. "-" was an
    unknown option. To a terminal it is refused (a pty here, a real one)."""
    from ddp.cli import command

    last = str(rundir.last_path(run_dir))
    assert command(checkpoint.main, ["export", last, "-", "--state-dict"]) == 0
    out, err = capsysbinary.readouterr()
    assert set(torch.load(io.BytesIO(out), weights_only=True)) == set(models.build("small", 10).state_dict())
    assert err.decode().startswith("wrote stdout (model weights only: the trained model's)\na bare state dict, for "
                                   "net.load_state_dict(torch.load('FILE')); the model's inputs: ")  # fmt: skip
    controller, terminal = pty.openpty()
    with open(terminal, "w") as tty:
        monkeypatch.setattr(sys, "stdout", tty)
        assert command(checkpoint.main, ["export", last, "-"]) == 2
    os.close(controller)
    assert capsysbinary.readouterr().err.decode() == (
        "error: OUT=- writes the weights to stdout, a terminal here: pipe it, e.g. | ssh host 'cat > m.pt'\n"
    )


def test_a_checkpoint_from_stdin_is_read_as_path_dash_not_from_a_terminal(run_dir, capsys, monkeypatch):
    """`cat last.pt | python -m ddp.checkpoint inspect -` (evaluate --checkpoint -, export - OUT): "-" was "checkpoint
    not found". From a terminal it is refused (a pty here, a real one), where it would wait for input."""
    from ddp.cli import command

    whole = rundir.last_path(run_dir).read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(whole)))
    assert command(checkpoint.main, ["inspect", "-"]) == 0
    assert capsys.readouterr().out.startswith(f"-: {len(whole) / 1e6:.1f} MB, checksum ok\n  epoch 2 done")
    controller, terminal = pty.openpty()
    with open(terminal) as tty:
        monkeypatch.setattr(sys, "stdin", tty)
        assert command(checkpoint.main, ["inspect", "-"]) == 2
    os.close(controller)
    assert capsys.readouterr().err == (
        "error: PATH - reads the checkpoint from stdin, a terminal here: pipe it, e.g. cat last.pt |\n"
    )


def test_inspect_into_a_closed_pipe_ends_without_a_traceback(run_dir):
    """`python -m ddp.checkpoint inspect PATH | head -1`: head leaves, the rest of the text has no reader.
    Exit 1 and nothing on stderr (it was a BrokenPipeError traceback). The pipe's reader is closed before
    the process starts, so its first write fails every time."""
    read, write = os.pipe()
    os.close(read)
    cmd = [sys.executable, "-m", "ddp.checkpoint", "inspect", str(rundir.last_path(run_dir))]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr


def test_an_export_to_a_pipe_whose_reader_ends_midway_says_so_and_one_that_takes_it_in_pieces_gets_it_whole(
    run_dir, monkeypatch
):
    """`export PATH - | ssh host 'cat > m.pt'` with ssh gone midway: under PYTHONUNBUFFERED=1 (clean_env's, and many
    a container's) stdout's write took the 64 KiB the pipe held and the rest was dropped; the export said "wrote
    stdout", exit 0. Now one line, exit 1. A stdout that takes a write in pieces (a signal in the write) gets it all."""
    last = str(rundir.last_path(run_dir))
    cmd = [sys.executable, "-m", "ddp.checkpoint", "export", last, "-"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    proc.stdout.read(10)  # what `head -c 10` reads, then its end
    proc.stdout.close()
    assert proc.wait(timeout=120) == 1
    assert proc.stderr.read().decode().startswith("error: stdout's reader ended before it had the "), proc.stderr

    class Piecemeal(io.RawIOBase):
        def __init__(self) -> None:
            self.taken = bytearray()

        def write(self, data) -> int:
            self.taken += bytes(data[:1000])
            return min(len(data), 1000)

    piecemeal = Piecemeal()
    monkeypatch.setattr(sys, "stdout", types.SimpleNamespace(buffer=piecemeal, isatty=lambda: False))
    checkpoint.export(last, "-", state_dict=True)
    assert set(torch.load(io.BytesIO(bytes(piecemeal.taken)), weights_only=True)) == set(
        models.build("small", 10).state_dict()
    )
