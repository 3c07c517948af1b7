"""What a run leaves behind to look at: TensorBoard scalars (read back from the event file) and
ddp.plot's PNGs from a short run on the real CIFAR-10 subset."""

import struct

import pytest
from conftest import TINY, TRAIN, metrics, ok, python, torchrun
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


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


def test_plots_of_a_real_subset_run_and_of_several_runs_on_one_chart(subset, tmp_path):
    real = tmp_path / "subset-1proc"
    ok(python(str(TRAIN), "--config", "configs/quick.yaml", "data.dataset=npz", f"data.path={subset}",
              "train.epochs=2", "run.device=cpu", f"run.out_dir={real}"))  # fmt: skip
    two = tmp_path / "tiny-2proc"
    ok(torchrun(2, str(TRAIN), *TINY, f"run.out_dir={two}"))
    proc = ok(python("-m", "ddp.plot", str(real), str(two), "--out", str(tmp_path / "charts")))
    charts = tmp_path / "charts"
    assert png_size(charts / "curves.png") == (1000, 400)
    assert png_size(charts / "per_class.png") == (1000, 400)
    assert png_size(charts / "confusion-subset-1proc.png") == (700, 600)
    assert png_size(charts / "confusion-tiny-2proc.png") == (700, 600)
    assert proc.stdout.count(".png") == 4
    alone = ok(python("-m", "ddp.plot", str(real)))  # default: into the run's own directory
    assert png_size(real / "curves.png") == (1000, 400) and "confusion-subset-1proc.png" in alone.stdout


def test_plotting_a_directory_without_metrics_is_a_clear_error(tmp_path):
    proc = python("-m", "ddp.plot", str(tmp_path))
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr and "Traceback" not in proc.stderr
