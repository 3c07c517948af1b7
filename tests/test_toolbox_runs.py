"""The recipe toolbox in real runs: configs/cifar100-wrn.yaml on synthetic 100-class data with 2
torchrun ranks (EMA, MixUp/CutMix, label smoothing, a profile), then what evaluate, export and plot
make of its checkpoint; and each new model trains a step under DDP (tests/model_worker.py)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, TRAIN, metrics, ok, python, torchrun

from ddp import checkpoint
from ddp import evaluate as ddp_evaluate
from ddp.cli import command

# The CIFAR-100 recipe as it is, but a small net on 100-class synthetic images for 2 short epochs
# (mixing is switched off for the second), fp32 on the CPU, steps 2 and 3 profiled.
CIFAR100 = [
    "--config", "configs/cifar100-wrn.yaml", "model.name=small", "model.dropout=0",
    "data.dataset=synthetic", "data.synthetic_classes=100", "data.synthetic_train=1024", "data.synthetic_test=300",
    "data.workers=0", "data.mix_off_epoch=2", "train.epochs=2", "train.batch_size=64", "train.ema_decay=0.9",
    "run.amp=off", "run.channels_last=false", "run.profile=2:4",
]  # fmt: skip


@pytest.fixture(scope="module")
def cifar100_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("cifar100")
    proc = ok(torchrun(2, str(TRAIN), *CIFAR100, f"run.out_dir={out}"))
    return out, proc.stdout


def test_the_cifar100_recipe_trains_100_classes_with_the_toolbox(cifar100_run):
    out, stdout = cifar100_run
    assert "ema_decay=0.9, mixup_alpha=0.8, cutmix_alpha=1" in stdout  # the start line says what is on
    rows = metrics(out)
    assert [m["epoch"] for m in rows] == [1, 2]
    for m in rows:
        assert len(m["per_class_acc"]) == len(m["classes"]) == 100 and m["test_images"] == 300
        assert 0 <= m["raw_test_acc"] <= 1 and 0 < m["grad_norm_mean"] <= m["grad_norm_max"]
    assert rows[-1]["test_acc"] > 0.05  # chance is 1%
    state = checkpoint.load(out / "checkpoints" / "last.pt")
    assert state["ema"]["updates"] == 2 * 1024 // 64


def test_the_profile_has_a_trace_per_rank_that_names_the_all_reduce(cifar100_run):
    out, stdout = cifar100_run
    for rank in (0, 1):
        events = json.loads((out / "profile" / f"rank{rank}.json").read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert "gloo:all_reduce" in names  # DDP's gradient all-reduce, in the steps profiled
        assert {"forward", "backward", "optimizer", "ema"} <= names  # train_step's parts, labelled
    assert stdout.count("profile of global steps 2-3 (rank 0") == 1
    table = stdout.split("profile of global steps 2-3", 1)[1]
    assert "Self CPU" in table and len([line for line in table.splitlines() if "aten::" in line]) >= 5


def test_step_times_splits_the_profiled_steps_into_their_parts(cifar100_run, tmp_path, capsys):
    """bench/step_times.py on rank 0's trace: a line for each of steps 2 and 3, its labelled parts inside its
    span; a file that is no trace, or a trace of no steps, is one line."""
    from bench import step_times

    out, _ = cifar100_run
    assert step_times.main([str(out / "profile" / "rank0.json"), "2", "--out", str(tmp_path / "steps.md")]) == 0
    lines = [line for line in (tmp_path / "steps.md").read_text().splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| step | host ms | data | forward | backward |") and len(lines) == 4
    for n, line in zip((2, 3), lines[2:]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        host, parts, between = float(cells[1]), [float(c) for c in cells[2:10]], float(cells[10])
        assert (
            cells[0] == str(n) and host > 0 and parts[1] > 0 and parts[2] > 0 and parts[6] > 0
        )  # forward, backward, ema
        assert abs(host - sum(parts) - between) < 0.01 and cells[11] == "0"  # no kernels on a CPU
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "empty.json").write_text('{"traceEvents": []}')
    for name, said in (("bad.json", "cannot read"), ("empty.json", "no 'data' label in the trace")):
        with pytest.raises(SystemExit, match=said):
            step_times.main([str(tmp_path / name), "1"])


def evaluate(out: Path, capsys, *args: str) -> dict:
    """`python -m ddp.evaluate --json` run in this process (its main, through the command wrapper)."""
    assert command(ddp_evaluate.main, ["--checkpoint", str(out / "checkpoints" / "last.pt"), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_evaluate_takes_the_moving_average_unless_raw(cifar100_run, capsys):
    out, _ = cifar100_run
    last = metrics(out)[-1]
    ema, raw = evaluate(out, capsys), evaluate(out, capsys, "--raw")
    assert ema["weights"] == "ema" and raw["weights"] == "raw"
    assert ema["accuracy"] == last["test_acc"] and raw["accuracy"] == last["raw_test_acc"]
    assert ema["confusion"] == last["confusion"]


def test_the_100_class_table_shows_the_best_and_worst_ten(cifar100_run):
    out, _ = cifar100_run
    proc = ok(python("-m", "ddp.evaluate", "--checkpoint", str(out / "checkpoints" / "last.pt")))
    lines = proc.stdout.splitlines()
    assert "The 10 best and the 10 worst of 100 classes (--json for all):" in lines
    rows = [line for line in lines if line.startswith("Accuracy for class:")]
    assert len(rows) == 20 and "..." in lines and "Confusion matrix" not in proc.stdout
    accuracies = [float(r.rsplit(" is ", 1)[1].rstrip(" %")) for r in rows if not r.endswith("n/a")]
    assert accuracies == sorted(accuracies, reverse=True)


def test_export_takes_the_moving_average_unless_raw(cifar100_run, tmp_path, capsys):
    out, _ = cifar100_run
    last = str(out / "checkpoints" / "last.pt")
    state = checkpoint.load(last)
    for flag, expected in (([], state["ema"]["weights"]), (["--raw"], state["model"])):
        path = tmp_path / f"weights{len(flag)}.pt"
        assert command(checkpoint.main, ["export", last, str(path), *flag]) == 0
        assert ("moving average" in capsys.readouterr().out) == (not flag)
        weights = torch.load(path, weights_only=True)["model"]
        assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert command(checkpoint.main, ["export", last, str(tmp_path / "x.pt"), "--rw"]) == 2
    assert "export PATH OUT [--raw]" in capsys.readouterr().err
    assert command(checkpoint.main, ["inspect", last]) == 0
    assert "moving average of the weights: 32 updates" in capsys.readouterr().out


def test_the_per_class_chart_of_100_classes_shows_20_bars(cifar100_run, tmp_path):
    pytest.importorskip("matplotlib")
    out, _ = cifar100_run
    ok(python("-m", "ddp.plot", str(out), "--out", str(tmp_path)))
    assert (tmp_path / "per_class.png").stat().st_size > 0
    from ddp import plot

    shown = plot.shown_classes(metrics(out)[-1]["per_class_acc"])
    assert len(shown) == 20 and len(set(shown)) == 20


def test_each_new_model_trains_a_step_under_ddp(tmp_path):
    """preact_resnet18, wrn16_8 and wrn28_10 (dropout on) in a 2-rank torchrun job: one step on
    different images per rank, after which both replicas hold the same, changed weights."""
    report = tmp_path / "models.json"
    ok(torchrun(2, str(REPO / "tests" / "model_worker.py"), str(report), timeout=600))
    result = json.loads(report.read_text())
    assert sorted(result) == ["preact_resnet18", "wrn16_8", "wrn28_10"]
    for name, r in result.items():
        assert r["logits"] == [2, 100] and r["replicas_equal"] and r["changed"], (name, r)
