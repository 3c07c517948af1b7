"""The loop in one process: real data, the speed switches, what a run leaves behind, and run.warmup_steps."""

import re

import pytest
import torch
from conftest import TINY, TRAIN, metrics, ok, same_last_checkpoints, tensors, torchrun

from ddp import checkpoint, config, models, train, warmup
from ddp import metrics as step_metrics
from ddp.devices import World


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
    [["run.amp=bf16"], ["run.channels_last=true"],
     ["run.compile=true", "run.compile_mode=reduce-overhead", "model.name=tutorial"],  # CUDA graphs: none on a CPU
     ["run.tf32=true", "run.cudnn_benchmark=true", "train.tta_flip=true", "data.loader=torch"]],
    ids=["bf16", "channels_last", "compile", "tf32-benchmark-tta-torchloader"],
)  # fmt: skip
def test_speed_switches_train_and_save_a_plain_model(switches, tmp_path, capsys):
    last = train.main([f"run.out_dir={tmp_path}", *TINY, "train.epochs=1", *switches])
    assert last["test_images"] == 101 and last["train_loss"] == last["train_loss"]  # not NaN
    assert ("compile=reduce-overhead;" in capsys.readouterr().out) == ("run.compile=true" in switches)
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


def test_warmup_steps_are_put_back_and_the_run_trains_as_one_without_them(tmp_path):
    """run.warmup_steps=3 on 2 ranks, with all that a step changes beyond the weights on (the moving
    average, lookahead, BatchNorm's statistics, momentum, the schedule): the same checkpoint and
    metrics as without, bit for bit; its seconds in the first epoch's record only."""
    run = [str(TRAIN), *TINY, "model.name=fast", "model.width=0.25", "model.whiten=true", "train.ema_decay=0.9",
           "train.lookahead_every=2", "optim.norm_bias_lr_scale=4", "run.progress=false"]  # fmt: skip
    said = {}
    for name, steps in (("cold", "run.warmup_steps=0"), ("warm", "run.warmup_steps=3")):
        said[name] = ok(torchrun(2, *run, f"run.out_dir={tmp_path / name}", steps)).stdout
    assert said["warm"].count("warm-up: 3 throwaway steps and an evaluation before epoch 1") == 1  # rank 0's
    assert re.search(r"^warm-up: \d+\.\d s ", said["warm"], re.M) and "warm-up" not in said["cold"]
    cold, warm = (torch.load(tmp_path / n / "checkpoints" / "last.pt", weights_only=True) for n in ("cold", "warm"))
    for part in ("model", "optimizer", "scheduler", "ema", "lookahead"):
        a, b = cold[part], warm[part]
        assert torch.equal(torch.cat([t.flatten().double() for t in tensors(a)]),
                           torch.cat([t.flatten().double() for t in tensors(b)])), part  # fmt: skip
    rows = {name: metrics(tmp_path / name) for name in ("cold", "warm")}
    drop = ("seconds", "train_s", "images_per_s", "startup_s", "warmup_s")
    assert [{k: v for k, v in r.items() if k not in drop} for r in rows["cold"]] == [
        {k: v for k, v in r.items() if k not in drop} for r in rows["warm"]
    ]
    assert rows["warm"][0]["warmup_s"] > 0 and "warmup_s" not in rows["warm"][1] and "warmup_s" not in rows["cold"][0]


def test_warmup_puts_back_the_random_generators_a_step_draws_from():
    """Dropout draws from torch's generator (the run above has none): after the throwaway steps and the
    evaluation, each drawing, it is where it was; the evaluation ran once."""
    net = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    trained = checkpoint.Trained(net, sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0),
                                 torch.amp.GradScaler("cpu", enabled=False))  # fmt: skip
    cfg = config.load(None, [])
    info = checkpoint.RunInfo(config.to_dict(cfg), 1, 8, {"mean": [0.5] * 3, "std": [0.25] * 3}, ["a", "b"])
    checkpoints = checkpoint.Checkpoints(cfg.run, World(0, 0, 1, torch.device("cpu"), "none"), trained, info)
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    evaluations = []
    seconds = warmup.throwaway_steps(checkpoints, checkpoint.Position(), step_metrics.StepStats(torch.device("cpu")),
                                     2, lambda: torch.nn.functional.dropout(torch.ones(64), 0.5),
                                     lambda: evaluations.append(torch.rand(1)))  # fmt: skip
    assert torch.equal(torch.rand(3), expected) and seconds >= 0 and len(evaluations) == 1


def test_fp16_weights_train_warm_up_and_resume_bit_for_bit_and_the_file_loads_as_float32(tmp_path, capsys):
    """run.amp=fp16-weights (airbench's: fp16 weights but BatchNorm's, the loss x 32 here, the LR / 32): with
    lookahead, a warm-up and a resume from the middle of epoch 1 it ends on the same checkpoint to the bit; the file
    holds fp16 weights, float32 BatchNorm and float32 momentum as a run without the scale has it; its export holds
    float32 weights; a float32 run (run.amp=off) continues from it."""
    run = [*TINY, "model.width=0.25", "run.amp=fp16-weights", "train.lookahead_every=3", "run.save_every_steps=3",
           "run.keep_last=10", "run.progress=false"]  # fmt: skip
    whole = train.main([f"run.out_dir={tmp_path / 'whole'}", *run])
    assert "note: run.amp=fp16-weights on a CPU" in capsys.readouterr().out and whole["train_loss"] < 2.0
    train.main([f"run.out_dir={tmp_path / 'warm'}", *run, "run.warmup_steps=2"])
    step_3 = tmp_path / "whole" / "checkpoints" / "step-000000003.pt"
    train.main([f"run.out_dir={tmp_path / 'resumed'}", *run, f"run.resume={step_3}"])
    ends = same_last_checkpoints(
        tmp_path, "whole", ("warm", "resumed"), ("model", "optimizer", "scheduler", "lookahead")
    )
    weights = ends["whole"]["model"]
    assert weights["0.0.weight"].dtype == torch.float16 and weights["0.1.weight"].dtype == torch.float32  # conv, BN
    assert {s["momentum_buffer"].dtype for s in ends["whole"]["optimizer"]["state"].values()} == {torch.float32}
    assert "model small, dataset synthetic, run.amp fp16-weights" in checkpoint.describe(step_3)[0]  # inspect's
    checkpoint.export(tmp_path / "whole" / "checkpoints" / "last.pt", tmp_path / "net.pth", state_dict=True)
    exported = torch.load(tmp_path / "net.pth", weights_only=True)  # for inference anywhere: float32, widened exactly
    assert {v.dtype for v in exported.values() if v.is_floating_point()} == {torch.float32}
    assert all(torch.equal(exported[k], v.float()) for k, v in weights.items())
    as_float = train.main([f"run.out_dir={tmp_path / 'float'}", *run[:-5], "train.lookahead_every=3", "train.epochs=3",
                           f"run.resume={tmp_path / 'whole' / 'checkpoints' / 'last.pt'}"])  # fmt: skip
    assert as_float["epoch"] == 3 and as_float["train_loss"] < whole["train_loss"]
    assert "run.amp 'fp16-weights' -> 'off'" in capsys.readouterr().out.split("changed since: ")[-1]
