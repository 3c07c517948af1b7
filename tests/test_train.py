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
    [["run.amp=bf16"], ["run.channels_last=true"], ["run.compile=true", "model.name=tutorial"]],
    ids=["bf16", "channels_last", "compile"],
)
def test_speed_switches_train_and_save_a_plain_model(switches, tmp_path):
    last = train.main([f"run.out_dir={tmp_path}", *TINY, "train.epochs=1", *switches])
    assert last["test_images"] == 101 and last["train_loss"] == last["train_loss"]  # not NaN
    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])
    name = "tutorial" if "model.name=tutorial" in switches else "small"
    models.build(name, 10).load_state_dict(state["model"])


def test_schedule_warms_up_then_decays_to_zero():
    net = torch.nn.Linear(2, 2)
    cfg = train.config.OptimConfig(lr=1.0, warmup_epochs=1)
    optimizer, scheduler = train.make_optimizer(net, cfg, total_steps=40, steps_per_epoch=10)
    lrs = []
    for _ in range(40):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] < 0.01


def test_resume_from_a_named_checkpoint_into_a_new_out_dir(tmp_path):
    train.main([f"run.out_dir={tmp_path / 'a'}", *TINY, "train.epochs=1"])
    last = train.main(
        [f"run.out_dir={tmp_path / 'b'}", *TINY, f"run.resume={tmp_path / 'a' / 'checkpoints' / 'last.pt'}"]
    )
    assert last["epoch"] == 2
    assert [r["epoch"] for r in metrics(tmp_path / "b")] == [2]
