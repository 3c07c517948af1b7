"""What a run leaves behind to look at: TensorBoard scalars (read back from the event file) and
ddp.plot's PNGs from a short run on the real CIFAR-10 subset."""

import os
import struct
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY, TORCHRUN, TRAIN, clean_env, metrics, ok, python
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddp import checkpoint, plot, rundir, train
from ddp.cli import command


def test_tensorboard_scalars_match_metrics_jsonl(tmp_path):
    ok(python(str(TRAIN), *TINY, "run.tensorboard=true", f"run.out_dir={tmp_path}"))
    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    scalars = board.Tags()["scalars"]
    for tag in ("train/loss", "train/lr", "train/images_per_s", "test/accuracy", "test_per_class/class0"):
        assert tag in scalars, tag
    rows = metrics(tmp_path)
    for tag, key in (("train/loss", "train_loss"), ("test/accuracy", "test_acc"), ("train/lr", "lr")):
        points = board.Scalars(tag)
        assert [p.step for p in points] == [1, 2]
        assert [p.value for p in points] == pytest.approx([r[key] for r in rows], rel=1e-6)
    assert [p.value for p in board.Scalars("test_per_class/class3")] == pytest.approx(
        [r["per_class_acc"][3] for r in rows]
    )
    assert not any(t.startswith("gpu/") for t in scalars)  # no GPU here: no GPU memory scalars


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, path  # a PNG with something drawn in it
    return struct.unpack(">II", data[16:24])


def test_plots_of_a_real_subset_run_and_of_several_runs_on_one_chart(subset, tmp_path, capsys):
    """`python -m ddp.plot` of a 1-process run on the real subset (trained in this process) and a 2-rank
    torchrun, into --out; then of one run, into its own directory."""
    two, real = tmp_path / "tiny-2proc", tmp_path / "subset-1proc"
    log = tmp_path / "torchrun.log"
    with open(log, "w") as output:  # the torchrun job runs while this process trains
        cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(TRAIN), *TINY, f"run.out_dir={two}"]
        job = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=output, stderr=subprocess.STDOUT)
        train.main(["--config", str(REPO / "configs/quick.yaml"), "data.dataset=npz", f"data.path={subset}",
                    "train.epochs=2", "train.eval_every=1", "run.device=cpu", "run.progress=false",
                    f"run.out_dir={real}"])  # fmt: skip
        assert job.wait(timeout=300) == 0, log.read_text()[-3000:]
    proc = ok(python("-m", "ddp.plot", str(real), str(two), "--out", str(tmp_path / "charts")))
    charts = tmp_path / "charts"
    assert png_size(charts / "curves.png") == (1000, 400)
    assert png_size(charts / "per_class.png") == (1000, 400)
    assert png_size(charts / "confusion-subset-1proc.png") == (700, 600)
    assert png_size(charts / "confusion-tiny-2proc.png") == (700, 600)
    assert proc.stdout.count(".png") == 4
    capsys.readouterr()
    plot.main([str(real)])  # default: into the run's own directory
    assert png_size(real / "curves.png") == (1000, 400) and "confusion-subset-1proc.png" in capsys.readouterr().out
    # --out a file (a typo), or where nothing can be written: one line each, no traceback, nothing half written
    jsonl = real / "metrics.jsonl"
    assert command(plot.main, [str(real), "--out", str(jsonl)]) == 2 and capsys.readouterr().err == (
        f"error: --out={jsonl} is a file: name a directory for the charts (made if missing)\n"
    )
    for image in ("curves.png", "Charts.PDF"):  # an image's name, which would have become a directory of that name
        assert command(plot.main, [str(real), "--out", str(tmp_path / image)]) == 2
        assert capsys.readouterr().err == (
            f"error: --out={tmp_path / image} names a directory for the charts (it "
            f"writes several PNGs), not an image: e.g. --out {tmp_path / image[:-4]}\n"
        )
        assert not (tmp_path / image).exists()
    assert command(plot.main, [str(real), "--out", "/proc/charts"]) == 1
    assert capsys.readouterr().err.startswith("error: cannot write /proc/charts/curves.png: ")


def test_plotting_a_directory_without_metrics_is_a_clear_error(tmp_path):
    proc = python("-m", "ddp.plot", str(tmp_path))
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr and "Traceback" not in proc.stderr


def write_metrics(run_dir, *lines: str) -> None:
    run_dir.mkdir(parents=True)
    rundir.metrics_path(run_dir).write_text("".join(line + "\n" for line in lines))


EPOCH = (
    '{"epoch": %d, "train_loss": 2.0, "test_acc": 0.5, "per_class_acc": [0.5, 0.5], "classes": ["cat", "dog"], '
    '"confusion": [[1, 1], [1, 1]], "world_size": 1}'
)


def test_plot_leaves_out_the_lines_of_a_metrics_file_that_lies_and_tells_runs_of_one_name_apart(tmp_path, capsys):
    """A line a kill left half-written, or an edit, was a JSONDecodeError, TypeError or KeyError traceback (lists
    nested deeper than the parser's recursion a RecursionError, in the resume's reading too); two
    runs named alike (runs/a/quick, runs/b/quick) shared one confusion chart's file, the second replacing the first;
    runs of other classes made the per-class chart an IndexError."""
    a, b = tmp_path / "a" / "quick", tmp_path / "b" / "quick"
    deep, huge = "[" * 10**5, '{"epoch": 1' + "0" * 400 + ', "train_loss": 1.0}'  # an OverflowError in matplotlib
    write_metrics(a, EPOCH % 1, "[1, 2]", '{"epoch": 2, "train_loss": "low"}', EPOCH % 3, '{"epoch": 4, "train', deep,
                  huge)  # fmt: skip
    write_metrics(b, EPOCH % 1, '{"epoch": 2, "train_loss": 1.0, "test_acc": "high"}')
    three = tmp_path / "three-classes"  # its per-class bars would not line up with a's (was an IndexError)
    write_metrics(three, EPOCH.replace('[0.5, 0.5], "classes": ["cat", "dog"]', '[1, 0, 0], "classes": ["x", "y", "z"]')
                  .replace("[[1, 1], [1, 1]]", "[[1, 0, 0], [0, 1, 0], [0, 0, 1]]") % 1)  # fmt: skip
    charts = plot.plot([a, b, tmp_path / "a" / ".." / "a" / "quick", three], tmp_path / "charts")  # a twice: once
    assert [p.name for p in charts] == ["curves.png", "per_class.png", "confusion-a-quick.png", "confusion-b-quick.png",
                                        "confusion-three-classes.png"]  # fmt: skip
    assert capsys.readouterr().err == (
        f"note: {a}/metrics.jsonl: line 2, 3, 5, 6, 7: not an epoch's whole record, left out\n"
        f"note: {b}/metrics.jsonl: line 2: not an epoch's whole record, left out\n"
        "note: three-classes has other classes than a-quick: left out of per_class.png\n"
    )
    write_metrics(tmp_path / "bad", "garbage", "")
    assert command(plot.main, [str(tmp_path / "bad")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}/bad/metrics.jsonl: line 1: not an epoch's whole record\n"


def test_a_run_whose_path_is_not_utf8_is_drawn_under_its_name(tmp_path):
    """A directory named in another encoding (Latin-1's bytes, say): matplotlib's font refused the name's
    surrogates in the legend and the confusion chart's title with a traceback; now a replacement character. Its
    charts' paths are printed with the directory's bytes, where a UTF-8 locale outside Python's UTF-8 mode
    (PYTHONIOENCODING=utf-8:strict here) refused them with a traceback (ddp/train.py's "resumed from" line too); so did
    PYTHONIOENCODING=ascii a path with an é in it (ddp.evaluate's first line too): escaped now, as \\xe9."""
    run = tmp_path / os.fsdecode(b"caf\xe9")
    write_metrics(run, EPOCH % 1)
    proc = subprocess.run([sys.executable, "-m", "ddp.plot", run], cwd=REPO, capture_output=True,
                          env=clean_env(PYTHONIOENCODING="utf-8:strict", PYTHONUTF8="0"))  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr.decode()
    assert proc.stdout.endswith(b"caf\xe9/confusion-caf\xe9.png\n")
    assert png_size(run / os.fsdecode(b"confusion-caf\xe9.png")) == (700, 600)  # its file keeps the path's bytes
    assert plot.drawable(run.name) == "caf\ufffd"
    ascii_only = tmp_path / "café"  # an é where stdout's encoding has none: escaped, not a traceback
    write_metrics(ascii_only, EPOCH % 1)
    proc = subprocess.run([sys.executable, "-m", "ddp.plot", ascii_only], cwd=REPO, capture_output=True,
                          env=clean_env(PYTHONIOENCODING="ascii"))  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.endswith(b"caf\\xe9/confusion-caf\\xe9.png\n"), proc


def test_plot_leaves_out_records_whose_classes_accuracies_or_confusion_do_not_fit(tmp_path, capsys):
    """Each was drawn: as a run's last epoch, a traceback (a string accuracy, a class named by a dict, a confusion
    matrix smaller than the classes) or a chart of nonsense (an accuracy of 150% or NaN, a boolean loss); before
    it, a point of the curves. Now each is a line left out, with the note. The run's metrics.jsonl named instead
    of the run: its run (was "no metrics.jsonl")."""
    lies = [("[0.5, 0.5]", '["x", 0.5]'), ("[0.5, 0.5]", "[1.5, 0.5]"), ('"test_acc": 0.5', '"test_acc": NaN'),
            ('["cat", "dog"]', '["cat", {"a": 1}]'), ("[[1, 1], [1, 1]]", "[[1]]"), ("[[1, 1], [1, 1]]", "[[1, 1], 7]"),
            ("[[1, 1], [1, 1]]", '"many"'), ('"train_loss": 2.0', '"train_loss": true')]  # fmt: skip
    none = EPOCH.replace("[0.5, 0.5]", "[0.5, null]")  # a class without test images: its bar at 0
    write_metrics(tmp_path / "run", EPOCH % 1, *[EPOCH.replace(old, new) % 2 for old, new in lies], none % 3)
    assert command(plot.main, [str(rundir.metrics_path(tmp_path / "run"))]) == 0  # the file named: its run
    assert capsys.readouterr() == (
        "".join(f"{tmp_path}/run/{name}.png\n" for name in ("curves", "per_class", "confusion-run")),
        f"note: {tmp_path}/run/metrics.jsonl: line 2, 3, 4, 5, 6, 7, 8, 9: not an epoch's whole record, left out\n",
    )


def test_metrics_files_of_other_names_are_runs_of_those_names_and_a_file_of_no_records_is_one_short_line(
    tmp_path, capsys
):
    """Metrics copied off a cluster under names of their own (runs/a.jsonl, runs/a.txt): each was "no metrics.jsonl";
    now each is the run of its name, drawn into their directory, and a run's directory of the same name (runs/a) is
    told apart from the file. A checkpoint named by mistake listed each of its lines' numbers; now the first ten, a
    count, and what was wanted."""
    for name in ("a.jsonl", "a.txt"):
        (tmp_path / name).write_text(EPOCH % 1 + "\n")
    write_metrics(tmp_path / "a", EPOCH % 1)
    assert command(plot.main, [str(tmp_path / n) for n in ("a.jsonl", "a.txt", "a/metrics.jsonl")]) == 0
    parent = "-".join(tmp_path.parts[1:])
    assert capsys.readouterr().out.splitlines()[-3:] == [
        f"{tmp_path}/confusion-{name}.png" for name in (f"{parent}-a", "a.txt", f"{parent}-a-2")
    ]
    binary = tmp_path / "last.pt"
    binary.write_bytes(b"PK\x03\x04" + b"\x00\n" * 12)
    assert command(plot.main, [str(binary)]) == 2
    assert capsys.readouterr().err == (
        f"error: {binary}: line 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 2 more: not an epoch's whole record (is it a "
        "run's metrics.jsonl?)\n"
    )


def test_plot_replaces_its_own_charts_and_no_file_of_the_users_of_a_charts_name(tmp_path, capsys):
    """ddp.plot wrote over whatever stood at its charts' names in --out: a user's own curves.png (the
    default --out is the run's directory, where people keep their figures), a link's name, a folder (a traceback).
    Now each is refused before any chart is written, naming it; its own charts (its mark in their text) it
    replaces, as on every replot."""
    write_metrics(tmp_path / "run", EPOCH % 1)
    charts = [tmp_path / "run" / f"{name}.png" for name in ("curves", "per_class", "confusion-run")]
    assert plot.plot([tmp_path / "run"], tmp_path / "run") == charts
    assert plot.plot([tmp_path / "run"], tmp_path / "run") == charts  # its own: replaced
    assert all(plot.foreign(c) is None for c in charts) and capsys.readouterr().err == ""
    mine = tmp_path / "mine.png"
    mine.write_bytes(charts[0].read_bytes().replace(plot.MARK.encode(), b"GIMP 2.10 ".ljust(len(plot.MARK), b" ")))
    huge = plot.PNG_SIGNATURE + struct.pack(">I4s", 2**31, b"tEXt")  # a chunk longer than anything matplotlib writes
    other = "a PNG that ddp.plot did not write (or wrote before it marked its charts)"
    users = {"curves": (mine.read_bytes(), other), "per_class": (b"my notes", "not a PNG"),
             "confusion-run": (huge, other)}  # fmt: skip
    for name, (content, why) in users.items():
        chart = tmp_path / "run" / f"{name}.png"
        chart.write_bytes(content)
        before = files_in(tmp_path / "run")
        assert command(plot.main, [str(tmp_path / "run")]) == 2, name
        assert capsys.readouterr().err == (f"error: {chart}: {why}; ddp.plot replaces only the charts it wrote: move "
                                           "it, or name another --out\n")  # fmt: skip
        assert files_in(tmp_path / "run") == before  # nothing written, not even the charts before it
        chart.unlink()
    charts[1].symlink_to(mine)
    (tmp_path / "run" / "confusion-run.png").mkdir()
    assert command(plot.main, [str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {charts[1]}: a symbolic link; ddp.plot replaces only")
    charts[1].unlink()
    before = files_in(tmp_path / "run")
    assert command(plot.main, [str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {charts[2]}: not a file; ddp.plot replaces only")
    assert files_in(tmp_path / "run") == before and mine.read_bytes() == users["curves"][0]


def files_in(directory) -> dict:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def test_eval_every_evaluates_every_nth_and_the_last_epoch_and_trains_the_same(tmp_path, capsys):
    """train.eval_every=2 over 3 epochs: epochs 2 and 3 evaluate, epoch 1 has its loss and speed only,
    in the epoch line, metrics.jsonl, TensorBoard, the checkpoint's summary and the plots; and the
    losses, every checkpoint's weights and buffers (the moving average's too) and the final
    evaluation are those of a run that evaluates every epoch: evaluating changes nothing trained."""
    every, some = tmp_path / "every", tmp_path / "some"
    run = [*TINY, "train.epochs=3", "train.ema_decay=0.9", "run.progress=false"]
    last_every = train.main([f"run.out_dir={every}", *run])
    capsys.readouterr()
    last_some = train.main([f"run.out_dir={some}", *run, "train.eval_every=2", "run.tensorboard=true"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    assert ["test_acc" in line for line in lines] == [False, True, True], lines
    rows = metrics(some)
    assert [sorted(set(r) - set(rows[0])) for r in rows][1:] == [
        ["classes", "confusion", "per_class_acc", "raw_test_acc", "test_acc", "test_images"]
    ] * 2
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in metrics(every)]
    assert last_some["test_acc"] == last_every["test_acc"] and last_some["confusion"] == last_every["confusion"]
    for a, b in zip(rundir.step_files(every), rundir.step_files(some), strict=True):
        saved_a, saved_b = checkpoint.load(a), checkpoint.load(b)
        for part_a, part_b in (
            (saved_a["model"], saved_b["model"]),
            (saved_a["ema"]["weights"], saved_b["ema"]["weights"]),
        ):
            assert part_a.keys() == part_b.keys() and all(torch.equal(part_a[k], part_b[k]) for k in part_a), a
    oldest = rundir.step_files(some)[-1]  # epoch 1's
    assert "last epoch: not evaluated, train_loss" in checkpoint.describe(oldest)[0]
    board = EventAccumulator(str(some / "tensorboard"))
    board.Reload()
    assert [p.step for p in board.Scalars("train/loss")] == [1, 2, 3]
    assert [p.step for p in board.Scalars("test/accuracy")] == [2, 3]
    assert [p.step for p in board.Scalars("test_per_class/class0")] == [2, 3]
    charts = plot.plot([some], tmp_path / "charts")
    assert [p.name for p in charts] == ["curves.png", "per_class.png", "confusion-some.png"]
    rundir.metrics_path(some).write_text(rundir.metrics_path(some).read_text().splitlines()[0] + "\n")
    assert [p.name for p in plot.plot([some], tmp_path / "early")] == ["curves.png"]  # nothing evaluated yet
