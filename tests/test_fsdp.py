"""run.parallel=fsdp (FSDP2's fully_shard) through the real torchrun on CPU with gloo: the same run as
DDP and as one process, the same checkpoint file, resumes across modes and world sizes, a rank killed
with -9 resumed bit for bit, and one line for what it does not do."""

import json
import subprocess
import sys
import types

import pytest
import torch
from conftest import REPO, REPORT, TRAIN, clean_env, max_diff, metrics, needs_fsdp2, ok, python, torchrun
from test_equivalence import SMALL
from test_resume import JOB, RNG, STEPS, assert_bitwise, final_state, train_cmd

from ddp import checks, config, fsdp, models
from ddp.errors import UsageError

# Beside test_resume's job (BatchNorm, augmentation, a checkpoint every 5 steps): clipping reads the
# norm of sharded gradients, 2 micro-batches skip the reduce-scatter of the first.
FSDP = ["run.parallel=fsdp", "optim.clip_grad_norm=0.5", "train.grad_accum_steps=2"]


def run(out, *extra, nproc=2, env=None):
    return ok(subprocess.run(train_cmd(out, *extra, nproc=nproc), cwd=REPO, env=env or clean_env(),
                             capture_output=True, text=True, timeout=300))  # fmt: skip


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory):
    """The FSDP2 run that never stops."""
    needs_fsdp2()
    out = tmp_path_factory.mktemp("fsdp")
    run(out, *FSDP)
    return out


def test_fsdp_is_ddp_and_one_process_and_saves_the_same_file(tmp_path):
    """test_equivalence's BatchNorm job (16 steps, sync_bn, its learning rate), with clipping and 2
    micro-batches: FSDP2 at 2 ranks ends with DDP's weights at 2 ranks and one process's, BatchNorm's
    statistics and the optimizer's momentum too, within its 1e-5; in a checkpoint of the same form
    (whole, unsharded plain tensors, DDP's keys and indices)."""
    needs_fsdp2()
    job = [*SMALL, "model.name=small", "train.sync_bn=true", "optim.clip_grad_norm=0.5", "train.grad_accum_steps=2"]
    states = {}
    for name, nproc, parallel in (("fsdp", 2, "fsdp"), ("ddp", 2, "ddp"), ("one", 1, "none")):
        args = [str(TRAIN), *job, f"run.out_dir={tmp_path / name}", f"run.parallel={parallel}"]
        ok(torchrun(2, *args) if nproc > 1 else python(*args))
        states[name] = final_state(tmp_path / name)
    fsdp, ddp, one = states["fsdp"], states["ddp"], states["one"]
    assert fsdp.keys() == ddp.keys() and fsdp["optimizer"]["param_groups"] == ddp["optimizer"]["param_groups"]
    assert all(type(t) is torch.Tensor and t.shape == ddp["model"][k].shape for k, t in fsdp["model"].items())
    assert max(max_diff(fsdp["model"], ddp["model"]), max_diff(fsdp["model"], one["model"])) <= 1e-5
    momentum = [{i: s["momentum_buffer"] for i, s in state["optimizer"]["state"].items()} for state in states.values()]
    assert max(max_diff(momentum[0], momentum[1]), max_diff(momentum[0], momentum[2])) <= 1e-5
    assert [m["parallel"] for m in metrics(tmp_path / "fsdp")] == ["fsdp", "fsdp"]


def test_a_rank_killed_mid_epoch_resumes_bitwise(fsdp_reference, tmp_path):
    step, rank = RNG.randint(1, STEPS - 1), RNG.randint(0, 1)
    env = clean_env(DDP_CIFAR_FAULT=f"step:{step}:r{rank}")
    first = subprocess.run(train_cmd(tmp_path, *FSDP), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode != 0 and list(tmp_path.glob("fault-fired.*"))
    run(tmp_path, *FSDP, env=env)
    assert_bitwise(fsdp_reference, tmp_path)
    REPORT.append(f"fsdp: kill -9 of rank {rank} after global step {step}/{STEPS}: resumed bitwise identical")


def test_the_checkpoint_loads_with_the_tutorials_line_and_evaluates_on_one_cpu(fsdp_reference, tmp_path):
    last = fsdp_reference / "checkpoints" / "last.pt"
    ok(python("-m", "ddp.checkpoint", "export", str(last), str(tmp_path / "net.pth"), "--state-dict"))
    net = models.build("small", 10)
    net.load_state_dict(torch.load(tmp_path / "net.pth"))  # the tutorial's line
    got = json.loads(ok(python("-m", "ddp.evaluate", "--checkpoint", str(last), "--json")).stdout)
    assert got["accuracy"] == metrics(fsdp_reference)[-1]["test_acc"]


def test_a_run_goes_from_ddp_to_fsdp_to_another_world_size_and_back(tmp_path):
    """A 4-epoch run, killed after each epoch's first step and resumed (from the epoch's end) in another
    mode: DDP at 2 ranks, FSDP2 at 2, FSDP2 at 1 (torchrun), DDP at 2. It ends where one process
    running all 4 epochs ends, within 1e-6: no BatchNorm (the tutorial net), so the world size
    changes nothing but the rounding."""
    needs_fsdp2()
    job = [
        "data.dataset=synthetic", "data.synthetic_train=128", "data.synthetic_test=16", "data.workers=0",
        "data.augment=false", "model.name=tutorial", "train.batch_size=32", "train.epochs=4", "optim.lr=0.05",
        "optim.warmup_epochs=0",
    ]  # fmt: skip
    out = f"run.out_dir={tmp_path / 'chain'}"
    for epoch, (nproc, parallel) in enumerate([(2, "ddp"), (2, "fsdp"), (1, "fsdp"), (2, "ddp")], start=1):
        env = clean_env(DDP_CIFAR_FAULT=f"step:{4 * epoch + 1}") if epoch < 4 else None  # 4 steps an epoch
        proc = torchrun(nproc, str(TRAIN), out, *job, f"run.parallel={parallel}", env=env)
        assert (proc.returncode != 0) == (epoch < 4), proc.stderr[-2000:]
    ok(python(str(TRAIN), f"run.out_dir={tmp_path / 'one'}", *job))
    assert [m["parallel"] for m in metrics(tmp_path / "chain")] == ["ddp", "fsdp", "fsdp", "ddp"]
    assert max_diff(final_state(tmp_path / "chain")["model"], final_state(tmp_path / "one")["model"]) <= 1e-6


@pytest.mark.parametrize(
    "args, message",
    [
        (["train.ema_decay=0.9"], "train.ema_decay does not work with run.parallel=fsdp (the moving average"),
        (["train.lookahead_every=5"], "train.lookahead_every does not work with run.parallel=fsdp"),
        (["run.channels_last=true"], "run.channels_last does not work with run.parallel=fsdp (FSDP2 shards contiguous"),
        (["run.warmup_steps=2"], "run.warmup_steps does not work with run.parallel=fsdp"),
        (["optim.muon_lr=0.2"], "optim.muon_lr does not work with run.parallel=fsdp (Muon orthogonalizes each filter"),
        (["ddp.comm_hook=fp16"], "ddp.comm_hook tunes DistributedDataParallel, which run.parallel=fsdp does not use"),
        (["ddp.static_graph=true"], "ddp.static_graph tunes DistributedDataParallel"),
        (["run.parallel=fsdq"], "run.parallel: 'fsdq' is not one of auto, none, dp, ddp, fsdp"),
    ],
)  # fmt: skip
def test_what_fsdp_does_not_do_is_one_line_before_any_process_starts(args, message):
    """The launch files' --preflight: each refusal names its alternative, exit 2."""
    proc = python(str(TRAIN), "--preflight", "2", "run.parallel=fsdp", *JOB, *args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("amp", ["fp16", "fp16-weights"])
def test_fp16_is_refused_with_bf16_named(amp):
    """(On this CPU run.amp=fp16 stops earlier, for want of CUDA: the check itself, here.)"""
    fp16 = r"run.amp does not work with run.parallel=fsdp \(no GradScaler for sharded gradients, .* use bf16"
    with pytest.raises(UsageError, match=fp16):
        checks.check_fsdp(config.load(None, [f"run.amp={amp}"]))


def test_fsdp_without_a_launcher_says_how_to_start_one():
    proc = python(str(TRAIN), "run.parallel=fsdp", *JOB)
    assert proc.returncode == 2 and "run.parallel=fsdp needs one process per device: torchrun" in proc.stderr


def test_a_torch_without_fully_shard_is_told_the_version_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", None)  # `from torch.distributed.fsdp import` fails
    with pytest.raises(UsageError, match=r"needs torch >= 2.6 \(torch.distributed.fsdp.fully_shard\); this is torch"):
        checks.check_fsdp(config.load(None, []))


def test_a_torch_before_fsdp2_saves_the_checkpoints_of_other_runs(monkeypatch):
    """torch 2.4 and 2.5 have torch.distributed.fsdp (FSDP1's) without FSDP2's FSDPModule: every checkpoint of a
    DDP or one-process run asked is_sharded and failed on it (AttributeError; 13 tests failed with torch 2.4.1)."""
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", types.ModuleType("torch.distributed.fsdp"))
    assert not fsdp.is_sharded(torch.nn.Linear(2, 2))
