"""python -m ddp.evaluate: any checkpoint, any device, the tutorial's per-class table, --json."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, TINY, TRAIN, clean_env, metrics, ok, python, torchrun

from ddp.errors import UsageError


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    ok(torchrun(2, str(TRAIN), *TINY, f"run.out_dir={out}"))  # saved from DDP
    return out


def evaluate(*args: str):
    return python("-m", "ddp.evaluate", *args)


def test_json_agrees_with_the_runs_own_evaluation(ddp_run):
    got = json.loads(ok(evaluate("--checkpoint", str(ddp_run / "checkpoints" / "last.pt"), "--json")).stdout)
    last = metrics(ddp_run)[-1]
    assert got["accuracy"] == pytest.approx(last["test_acc"]) and got["test_images"] == 101
    assert got["per_class_accuracy"] == pytest.approx(last["per_class_acc"])
    assert got["confusion"] == last["confusion"] and sum(map(sum, got["confusion"])) == 101
    assert got["classes"] == [f"class{i}" for i in range(10)] and got["device"] == "cpu"
    assert got["images_per_s"] > 0 and got["epoch"] == 2


def test_the_table_reads_like_the_tutorials(ddp_run):
    out = ok(evaluate("--checkpoint", str(ddp_run / "checkpoints" / "last.pt"), "--device", "cpu")).stdout
    assert "Accuracy of the network on the 101 test images:" in out
    assert "Accuracy for class: class0 is" in out and "Accuracy for class: class9 is" in out
    assert "Confusion matrix (rows: true class, columns: predicted):" in out


def test_data_overrides_evaluate_on_other_data(ddp_run):
    """One that the checkpoint's dataset never reads is a note on stderr (a copy of CIFAR-10 was evaluated instead,
    silently); the checkpoint's own settings are not the user's to hear of."""
    proc = ok(evaluate("--checkpoint", str(ddp_run / "checkpoints" / "last.pt"), "--json", "data.synthetic_test=37",
                       "data.path=elsewhere.npz"))  # fmt: skip
    assert json.loads(proc.stdout)["test_images"] == 37
    assert (
        proc.stderr
        == "note: data.path=elsewhere.npz does nothing here: data.dataset=synthetic (data.dataset=npz's file)\n"
    )


def test_a_file_with_only_a_test_split_is_enough(ddp_run, tmp_path):
    """No training arrays: the model's classes and normalisation come from the checkpoint."""
    rng = np.random.default_rng(0)
    path = tmp_path / "test-only.npz"
    np.savez(path, x_test=rng.integers(0, 256, (23, 32, 32, 3), dtype=np.uint8), y_test=rng.integers(0, 10, 23))
    got = json.loads(ok(evaluate("--checkpoint", str(ddp_run / "checkpoints" / "last.pt"), "--json",
                                 "data.dataset=npz", f"data.path={path}")).stdout)  # fmt: skip
    assert got["test_images"] == 23 and got["classes"] == [f"class{i}" for i in range(10)]
    np.savez(path, x_test=np.zeros((2, 32, 32, 3), np.uint8), y_test=np.array([3, 10]))
    lying = evaluate("--checkpoint", str(ddp_run / "checkpoints" / "last.pt"), "data.dataset=npz", f"data.path={path}")
    assert lying.returncode == 2 and "y_test[1] = 10, but there are 10 classes" in lying.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--checkpoint", "/no/such.pt"], "error: checkpoint not found: /no/such.pt"),
        (["--checkpoint", "CKPT", "optim.lr=1"], "only data.* settings can change for evaluation"),
        (["--checkpoint", "CKPT", "--device", "gpu"], "error: --device='gpu' is not a device; use auto, cpu, cuda or"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(ddp_run, args, message):
    args = [str(ddp_run / "checkpoints" / "last.pt") if a == "CKPT" else a for a in args]
    proc = evaluate(*args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_a_checkpoint_of_a_newer_version_says_so(ddp_run, tmp_path, capsys):
    """A checkpoint whose config has a key this version does not know (written by a newer ddp-cifar): was
    "unknown key 'model.new_thing'" alone, as if the user had typed it."""
    from ddp import __version__, files
    from ddp import evaluate as ddp_evaluate
    from ddp.cli import command

    state = torch.load(ddp_run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    del state["checksum"]
    state["config"]["model"]["new_thing"], state["versions"]["ddp_cifar"] = 3, "9.0.0"
    state["checksum"] = files.digest(state)
    torch.save(state, tmp_path / "newer.pt")
    assert command(ddp_evaluate.main, ["--checkpoint", str(tmp_path / "newer.pt")]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: {tmp_path / 'newer.pt'} was written by ddp-cifar 9.0.0, this is {__version__}: unknown key "
        "'model.new_thing'"
    )


def test_an_export_evaluates_as_its_checkpoint_on_the_data_named(ddp_run, tmp_path, capsys):
    """`export`'s file (the weights, for inference) was refused: "not a ddp-cifar checkpoint (an export: the weights
    alone)". It evaluates as the checkpoint it came from, its test-time augmentation kept in it (an export made before
    has none); it names no data, so the data is asked for, not CIFAR-10 downloaded. Through stdin too."""
    from ddp import checkpoint
    from ddp import evaluate as ddp_evaluate
    from ddp.cli import command

    tta = tmp_path / "tta.pt"  # the run's checkpoint, as if it had evaluated with both test-time augmentations
    rewritten(ddp_run, tta, lambda s: s["config"]["train"].update(tta_flip=True, tta_translate=True))
    data = ["data.dataset=synthetic", "data.synthetic_train=256", "data.synthetic_test=101"]  # the run's (TINY)
    confusions = []
    for path in (ddp_run / "checkpoints" / "last.pt", tta):
        export = tmp_path / f"{path.stem}-export.pt"
        assert command(checkpoint.main, ["export", str(path), str(export)]) == 0
        ours = ddp_evaluate.measure(str(path), "cpu", 64, [])
        theirs = ddp_evaluate.measure(str(export), "cpu", 64, data)
        assert theirs["confusion"] == ours["confusion"] and (theirs["epoch"], theirs["weights"]) == (None, "exported")
        confusions.append(ours["confusion"])
    assert confusions[0] != confusions[1]  # (the augmentation changes the answers: its export had to keep it)
    older = torch.load(export, weights_only=True)
    del older["tta"]  # an export made before it was kept: evaluated without
    torch.save(older, tmp_path / "older.pt")
    assert ddp_evaluate.measure(str(tmp_path / "older.pt"), "cpu", 64, data)["confusion"] == confusions[0]
    lies = [({"width": 0.5}, "weights do not fit model.name=small as ddp-cifar"),
            ({"classes": "abc"}, "is an export (ddp-cifar-weights/1) whose classes are missing or")]  # fmt: skip
    for change, said in lies:
        torch.save(older | change, tmp_path / "lying.pt")  # another program wrote it so: one line
        with pytest.raises(UsageError, match=re.escape(said)):
            ddp_evaluate.measure(str(tmp_path / "lying.pt"), "cpu", 64, data)
    capsys.readouterr()
    assert command(ddp_evaluate.main, ["--checkpoint", str(export)]) == 2
    assert capsys.readouterr().err == (
        f"error: {export} is an export, which names no data: give its test data, e.g. "
        "data.dataset=npz data.path=FILE.npz, or data.dataset=cifar10 data.root=DIR\n"
    )
    piped = subprocess.run([sys.executable, "-m", "ddp.evaluate", "--checkpoint", "-", *data], cwd=REPO,
                           env=clean_env(), input=export.read_bytes(), capture_output=True, timeout=120)  # fmt: skip
    assert piped.stdout.decode().startswith("-: small (exported weights), on synthetic (101 test images)")
    assert command(ddp_evaluate.main, ["--checkpoint", str(export), "--raw", *data]) == 2
    assert (
        capsys.readouterr().err
        == f"error: --raw: {export} is an export, which holds one set of weights (export --raw chooses them)\n"
    )


def rewritten(ddp_run, path, change) -> None:
    """The run's last checkpoint with `change` made to it and its checksum made again: a file that another
    program (or another version of ddp-cifar) wrote so, not a damaged one."""
    from ddp import files

    state = torch.load(ddp_run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    del state["checksum"]
    change(state)
    state["checksum"] = files.digest(state)
    torch.save(state, path)


def test_weights_that_do_not_fit_the_model_are_one_line_in_evaluate_and_in_resume(ddp_run, tmp_path, capsys):
    """Weights from a version of ddp-cifar that built the model otherwise (here: one tensor of another shape,
    one key more): load_state_dict's RuntimeError traceback in evaluate and on every rank of a resume. The
    resume, through launch/torchrun.sh, ends with that line (rank 1, stopped by torchrun once rank 0 failed,
    was "error: rank 1 (pid ...) was killed by SIGTERM" after three lines of torchrun's log)."""
    from ddp import __version__
    from ddp import evaluate as ddp_evaluate
    from ddp.cli import command

    def narrower(state):
        state["model"]["0.0.weight"] = state["model"]["0.0.weight"][:8]
        state["versions"]["ddp_cifar"] = "0.0.9"

    rewritten(ddp_run, tmp_path / "old.pt", narrower)
    rewritten(ddp_run, tmp_path / "more.pt", lambda state: state["model"].update({"head.extra": torch.zeros(2)}))
    misfit = (f"error: {tmp_path / 'old.pt'}'s weights do not fit model.name=small as ddp-cifar {__version__} builds "
              "it (size mismatch for 0.0.weight: copying a param with shape torch.Size([8, 3, 3, 3]) from checkpoint, "
              "the shape in current model is torch.Size([32, 3, 3, 3])); ddp-cifar 0.0.9 wrote them\n")  # fmt: skip
    assert command(ddp_evaluate.main, ["--checkpoint", str(tmp_path / "old.pt")]) == 2
    assert capsys.readouterr().err == misfit
    resumed = subprocess.run(["bash", "launch/torchrun.sh", *TINY, f"run.out_dir={tmp_path / 'run'}",
                              f"run.resume={tmp_path / 'old.pt'}"], cwd=REPO, env=clean_env(NPROC="2"),
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 2 and resumed.stderr.count(misfit) == 1, resumed.stderr
    assert resumed.stderr.endswith(misfit), resumed.stderr  # torchrun's lines about the ranks it stopped: none
    assert command(ddp_evaluate.main, ["--checkpoint", str(tmp_path / "more.pt")]) == 2
    err = capsys.readouterr().err
    assert "weights do not fit model.name=small as ddp-cifar" in err
    assert 'Unexpected key(s) in state_dict: "head.extra"); ddp-cifar' in err
    from ddp import checkpoint  # export wrote them, for a models.build(...).load_state_dict that then failed

    rewritten(ddp_run, tmp_path / "wider.pt", lambda state: state["config"]["model"].update(width=2.0))
    for name in ("old.pt", "more.pt", "wider.pt"):
        assert command(checkpoint.main, ["export", str(tmp_path / name), str(tmp_path / "model.pt")]) == 2, name
        assert "weights do not fit model.name=small" in capsys.readouterr().err and not (tmp_path / "model.pt").exists()


@pytest.mark.parametrize("key, value", [("config", "quick"), ("epoch", "2"), ("normalize", None), ("ranks", {}),
                                        ("config.model", "small"), ("epoch", -1), ("step", 10**9), ("global_step", -3),
                                        ("world_size", 0), ("global_batch", True), ("train_images", 0), ("ranks", [1]),
                                        ("classes", []), ("normalize", {"mean": "x"}), ("metrics", [1]),
                                        ("config.model.name", {}), ("global_step", 2**63)])  # fmt: skip
def test_a_checkpoint_whose_entries_are_not_of_their_kind_is_refused_in_one_line(ddp_run, tmp_path, key, value, capsys):
    """Its checksum holds, so no damage made it: inspect and evaluate were a TypeError or AttributeError traceback
    (a string config, a string normalize), or went on with a string epoch. Values out of range or that disagree
    (a negative epoch, a step past the epoch's end, ranks of another number than world_size, no classes, metrics that
    are no record) went on too, or were an IndexError, a KeyError or a TypeError traceback in resume and inspect."""
    from ddp import checkpoint, train
    from ddp import evaluate as ddp_evaluate
    from ddp.cli import command

    path = tmp_path / "odd.pt"
    rewritten(
        ddp_run, path, lambda state: state["config"].update(model=value) if "." in key else state.update({key: value})
    )
    resume = [*TINY, f"run.out_dir={tmp_path / 'run'}", f"run.resume={path}"]  # (its settings read first: a peek)
    for main, argv in ((checkpoint.main, ["inspect", str(path)]), (ddp_evaluate.main, ["--checkpoint", str(path)]),
                       (train.main, resume)):  # fmt: skip
        assert command(main, argv) == 2
        assert (
            capsys.readouterr().err
            == f"error: {path} is no ddp-cifar checkpoint of format 2: {key} missing or malformed\n"
        )


@pytest.mark.parametrize("key", ["optimizer", "scheduler"])
def test_a_checkpoint_whose_states_this_version_cannot_restore_is_one_line_in_resume(ddp_run, tmp_path, key, capsys):
    """An optimizer's or a scheduler's state of another shape (its checksum holds): a KeyError traceback."""
    from ddp import train

    rewritten(ddp_run, tmp_path / "odd.pt", lambda state: state.update({key: {}}))
    assert train.cli([*TINY, f"run.out_dir={tmp_path / 'run'}", f"run.resume={tmp_path / 'odd.pt'}"]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: {tmp_path / 'odd.pt'} holds entries this ddp-cifar cannot restore (KeyError: "
    )


def test_the_runs_data_missing_here_names_the_key_that_gives_it(ddp_run, tmp_path, capsys):
    """A run given a relative data.path, evaluated from another directory or machine: the line says the path came
    from the checkpoint and which key gives this machine's copy (was "data.path=...: no such file" alone)."""
    from ddp import evaluate as ddp_evaluate
    from ddp import files
    from ddp.cli import command

    state = torch.load(ddp_run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    del state["checksum"]
    state["config"]["data"].update(dataset="npz", path="../data/subset.npz")
    state["checksum"] = files.digest(state)
    torch.save(state, tmp_path / "elsewhere.pt")
    assert command(ddp_evaluate.main, ["--checkpoint", str(tmp_path / "elsewhere.pt")]) == 2
    assert capsys.readouterr().err == (
        "error: data.path=../data/subset.npz: no such file (the run's data, as its checkpoint names it: give this "
        "machine's, data.path=FILE.npz)\n"
    )
    assert command(ddp_evaluate.main, ["--checkpoint", str(tmp_path / "elsewhere.pt"), "data.path=/no/such.npz"]) == 2
    assert capsys.readouterr().err == "error: data.path=/no/such.npz: no such file\n"  # what the user typed, as typed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible on this machine)")
def test_a_cpu_checkpoint_evaluates_on_the_gpu(ddp_run):
    env = {k: v for k, v in __import__("os").environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    proc = python("-m", "ddp.evaluate", "--checkpoint", str(ddp_run / "checkpoints" / "last.pt"), "--device", "cuda",
                  "--json", env=env)  # fmt: skip
    got = json.loads(ok(proc).stdout)
    assert got["device"] == "cuda:0" and got["accuracy"] == pytest.approx(metrics(ddp_run)[-1]["test_acc"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--json"], "error: --checkpoint is required: python -m ddp.evaluate --checkpoint PATH"),
        (["runs/a/last.pt", "data.path=t.npz"], "--checkpoint is required (a path goes after it: --checkpoint runs/a/"),
        (["--checkpoint", "a.pt", "b.pt"], "'b.pt' is no setting: evaluate takes one --checkpoint PATH, and data.*"),
        (["--checkpoint", "a.pt", "optim.lr=1"], "optim.lr=1: only data.* settings can change for evaluation"),
        (["--checkpoint"], "--checkpoint needs a file"),
        (["--checkpoint", "x.pt", "--batch-size", "0"], "--batch-size needs a number of images, e.g. 1024, not '0'"),
        (["--checkpoint", "x.pt", "--batch-size=many"], "--batch-size needs a number of images, e.g. 1024, not 'many'"),
        (["--checkpoint", "x.pt", "--batch-size"], "--batch-size needs a number of images, e.g. 1024, not ''"),
        (["--checkpoint", "x.pt", "--bogus"], "unknown option --bogus; options are --checkpoint PATH, --device DEVICE"),
        (["--checkpoint", "x.pt", "--device"], "--device needs a value: --device DEVICE; usage: "),  # was a TypeError
        (["--checkpoint", "x.pt", "--device="], "--device needs a value: --device DEVICE; usage: "),
        (["--checkpoint", "a.pt", "--checkpoint=b.pt"], "--checkpoint is given twice (a.pt and b.pt): give it once"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(argv, message, capsys):
    """The one command-line parser (ddp.cli.parse), as evaluate uses it: in this process, no run needed."""
    from ddp import evaluate as ddp_evaluate
    from ddp.cli import command

    assert command(ddp_evaluate.main, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_plot_without_a_run_is_one_line_and_exit_2(capsys):
    from ddp import plot
    from ddp.cli import command

    assert command(plot.main, ["--out", "charts"]) == 2
    assert "name at least one run: usage: python -m ddp.plot RUN_DIR" in capsys.readouterr().err
    for argv in (["runs/x", "--out"], ["runs/x", "--out="]):  # they wrote into the run (or "."), not refused
        assert command(plot.main, argv) == 2, argv
        assert capsys.readouterr().err.startswith("error: --out needs a value: --out DIR; usage: ")
