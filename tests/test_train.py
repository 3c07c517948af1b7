"""The loop in one process: real data, the speed switches, and what a run leaves behind."""

import pytest
import torch
from conftest import TINY, metrics

from ddp import models, train


def test_learns_the_real_cifar10_subset(subset, tmp_path):
    last = train.main(
        [f"run.out_dir={tmp_path}", "data.dataset=npz", f"data.path={subset}", "model.name=small",
         "train.epochs=2", "train.batch_size=128", "data.workers=0"]
    )  # fmt: skip
    assert last["test_images"] == 1017
    assert last["test_acc"] > 0.3  # chance is 0.1
    assert len(metrics(tmp_path)) == 2


@pytest.mark.parametrize(
    "switches",
    [["run.amp=bf16"], ["run.channels_last=true"], ["run.compile=true", "model.name=tutorial"],
     ["run.tf32=true", "run.cudnn_benchmark=true", "train.tta_flip=true", "data.loader=torch"]],
    ids=["bf16", "channels_last", "compile", "tf32-benchmark-tta-torchloader"],
)  # fmt: skip
def test_speed_switches_train_and_save_a_plain_model(switches, tmp_path):
    last = train.main([f"run.out_dir={tmp_path}", *TINY, "train.epochs=1", *switches])
    assert last["test_images"] == 101 and last["train_loss"] == last["train_loss"]  # not NaN
    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])
    name = "tutorial" if "model.name=tutorial" in switches else "small"
    models.build(name, 10).load_state_dict(state["model"])


def test_resume_from_a_named_checkpoint_into_a_new_out_dir(tmp_path):
    train.main([f"run.out_dir={tmp_path / 'a'}", *TINY, "train.epochs=1"])
    last = train.main(
        [f"run.out_dir={tmp_path / 'b'}", *TINY, f"run.resume={tmp_path / 'a' / 'checkpoints' / 'last.pt'}"]
    )
    assert last["epoch"] == 2
    assert [r["epoch"] for r in metrics(tmp_path / "b")] == [2]


def test_gpu_switches_are_set_and_logged_and_startup_is_reported_once(tmp_path, capsys):
    args = [f"run.out_dir={tmp_path}", *TINY, "run.tf32=true", "run.cudnn_benchmark=true"]
    train.main(args)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32 and torch.backends.cudnn.benchmark
    assert "loader=device tf32=True cudnn_benchmark=True" in capsys.readouterr().out
    first, second = metrics(tmp_path)
    assert first["startup_s"] > 0 and "startup_s" not in second  # once per process (here pytest's), first epoch
    train.main([*args, "run.tf32=false", "run.cudnn_benchmark=false", "train.epochs=3"])
    assert not (
        torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32 or torch.backends.cudnn.benchmark
    )
