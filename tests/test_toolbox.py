"""The recipe toolbox, in one process: MixUp/CutMix draws and arithmetic, the weights' moving
average against its closed form, gradient clipping and the logged norm, run.profile's values.
(Multi-rank runs of them: test_toolbox_runs.py; the new models: test_models.py.)"""

import math
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY, TRAIN, clean_env, python
from torch import nn

from ddp import config, datasets, ema, mixing, profiling, train
from ddp.checks import Plan
from ddp.devices import World
from ddp.errors import UsageError

MIXING = ["data.mixup_alpha=0.4", "data.cutmix_alpha=1.0"]


def mix_config(*overrides: str) -> config.DataConfig:
    return config.load(None, [*MIXING, *overrides]).data


def test_a_mix_is_a_function_of_seed_epoch_step_and_rank():
    d = mix_config()
    draws = {
        key: mixing.draw(d, *key) for key in [(0, 1, 5, 0), (1, 1, 5, 0), (0, 2, 5, 0), (0, 1, 6, 0), (0, 1, 5, 1)]
    }
    assert mixing.draw(d, 0, 1, 5, 0) == draws[(0, 1, 5, 0)]  # the same key, the same mix (e.g. after a resume)
    assert len(set(draws.values())) == len(draws)  # any part of the key changed, another mix
    many = [mixing.draw(d, 0, 1, step, 0) for step in range(400)]
    cutmix = [m for m in many if m.box is not None]
    assert 120 < len(cutmix) < 280  # both on: each about half the batches
    for m in cutmix:  # lambda is the share of the image left unpasted
        y0, y1, x0, x1 = m.box
        assert 0 <= y0 <= y1 <= 32 and 0 <= x0 <= x1 <= 32
        assert m.lam == pytest.approx(1 - (y1 - y0) * (x1 - x0) / 1024)


def test_mixed_targets_hold_a_label_mass_of_one_and_the_pixels_follow_lambda():
    x = torch.randn(8, 3, 32, 32)
    labels = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    mixup = mixing.Mix(0.7)
    mixed, targets = mixing.apply(mixup, x, labels, 10)
    torch.testing.assert_close(targets.sum(1), torch.ones(8))
    assert targets[3, 3] == pytest.approx(0.7) and targets[3, 2] == pytest.approx(0.3)  # image 3 took image 2
    torch.testing.assert_close(mixed[3], 0.7 * x[3] + 0.3 * x[2])
    cut = mixing.Mix(0.75, (0, 16, 0, 16))
    mixed, targets = mixing.apply(cut, x, labels, 10)
    torch.testing.assert_close(targets.sum(1), torch.ones(8))
    assert torch.equal(mixed[3, :, :16, :16], x[2, :, :16, :16]) and torch.equal(mixed[3, :, 16:], x[3, :, 16:])
    assert torch.equal(x, x.clone())  # the input batch itself is untouched


def test_alpha_zero_or_no_draw_leaves_the_batch_and_labels_unchanged():
    x, labels = torch.randn(4, 3, 32, 32), torch.arange(4)
    assert mixing.draw(mix_config("data.mixup_alpha=0", "data.cutmix_alpha=0"), 0, 1, 0, 0) is None
    assert mixing.draw(mix_config("data.mix_prob=0"), 0, 1, 0, 0) is None
    same_x, same_labels = mixing.apply(None, x, labels, 10)
    assert same_x is x and same_labels is labels


def test_mix_off_epoch_turns_mixing_off_from_that_epoch():
    d = mix_config("data.mix_off_epoch=3")
    assert all(mixing.draw(d, 0, epoch, step, 0) is not None for epoch in (1, 2) for step in range(20))
    assert all(mixing.draw(d, 0, epoch, step, 0) is None for epoch in (3, 4) for step in range(20))


def test_mix_prob_is_the_share_of_mixed_batches():
    d = mix_config("data.mix_prob=0.25")
    mixed = sum(mixing.draw(d, 0, 1, step, 0) is not None for step in range(1000))
    assert 200 < mixed < 300


@pytest.mark.parametrize("warmup", [0, 3])
def test_the_moving_average_after_n_steps_is_its_closed_form(warmup):
    """e_1 = w_1, e_n = d_n e_(n-1) + (1 - d_n) w_n, so e_N = sum_n w_n (1 - d_n) prod_(m>n) d_m with
    d_1 = 0 and d_n = min(decay, n / (warmup + n - 1)); buffers (BatchNorm statistics) too."""
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    decay, steps = 0.9, 6
    average = ema.EMA(model, decay, warmup)
    weights = []
    for n in range(1, steps + 1):
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.copy_(torch.full_like(t, float(n * n)))  # w_n = n^2 everywhere
        weights.append(float(n * n))
        average.update(model)
    d = [0.0] + [min(decay, n / (warmup + n - 1)) if warmup else decay for n in range(2, steps + 1)]
    expected = sum(w * (1 - d[i]) * math.prod(d[i + 1 :]) for i, w in enumerate(weights))
    for name, value in average.module.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(value, torch.full_like(value, expected), msg=name)
        else:
            assert value.item() == steps * steps  # num_batches_tracked is copied, not averaged
    assert average.updates == steps and int(average.averaged.n_averaged) == steps


def test_the_average_resumes_from_its_state():
    model = nn.Linear(3, 3)
    a, b = ema.EMA(model, 0.9, 5), ema.EMA(model, 0.9, 5)
    for _ in range(3):
        a.update(model)
        with torch.no_grad():
            model.weight.add_(1)
    b.load_state_dict(a.state_dict())
    a.update(model)
    b.update(model)
    assert b.updates == 4 and torch.equal(a.module.weight, b.module.weight)


def tiny_job(tmp_path, *overrides: str) -> train.Job:
    cfg = config.load(None, [*TINY, f"run.out_dir={tmp_path}", "run.resume=never", *overrides])
    world = World(0, 0, 1, torch.device("cpu"), "none")
    job, _ = train.build(cfg, world, datasets.read(cfg.data, world), Plan(32, 8))
    return job


def test_clipping_bounds_the_total_norm_and_logs_the_norm_before_it(tmp_path):
    job = tiny_job(tmp_path, "optim.clip_grad_norm=0.01")
    train.train_step(job, *next(iter(job.train_loader)))
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in job.trained.model.parameters()]))
    assert clipped <= 0.01 * 1.0001
    logged = job.stats.grad_norm()
    assert logged["grad_norm_max"] > 0.1  # the norm before clipping, the one that tells a user something
    assert logged["grad_norm_mean"] == pytest.approx(logged["grad_norm_max"])  # one step


def test_grad_norm_is_logged_without_clipping_too(tmp_path):
    job = tiny_job(tmp_path)
    batches = iter(job.train_loader)
    norms = []
    for _ in range(3):
        train.train_step(job, *next(batches))
        norms.append(
            float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in job.trained.model.parameters()])))
        )
    logged = job.stats.grad_norm()
    assert logged["grad_norm_mean"] == pytest.approx(sum(norms) / 3)
    assert logged["grad_norm_max"] == pytest.approx(max(norms))


def test_a_mixed_step_trains_with_soft_targets_and_label_smoothing(tmp_path):
    job = tiny_job(tmp_path, *MIXING, "train.label_smoothing=0.1", "train.ema_decay=0.5")
    images, labels = next(iter(job.train_loader))
    loss = train.train_step(job, images, labels, mixing.Mix(0.6))
    assert math.isfinite(float(loss)) and job.trained.ema.updates == 1


@pytest.mark.parametrize(
    "value, message",
    [
        ("5", "expected A:B"),
        ("4:4", "expected A:B"),
        ("0:3", "expected A:B"),
        ("a:b", "expected A:B"),
        ("9:20", "the run has 8 steps"),
    ],
)
def test_bad_profile_values(value, message):
    with pytest.raises(UsageError, match=message):
        profiling.parse(value, 8)
    assert profiling.parse("2:4", 8) == range(2, 4) and profiling.parse("", 8) is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.ema_decay=1", "train.ema_decay=1.0 is out of range: it must be in [0, 1)"),
        ("train.ema_decay=-0.1", "train.ema_decay=-0.1 is out of range"),
        ("train.ema_warmup=-1", "train.ema_warmup=-1 is out of range: it must be >= 0"),
        ("data.mixup_alpha=-1", "data.mixup_alpha=-1.0 is out of range: it must be >= 0"),
        ("data.cutmix_alpha=nan", "data.cutmix_alpha: expected a finite float"),
        ("data.mix_prob=1.5", "data.mix_prob=1.5 is out of range: it must be in [0, 1]"),
        ("data.mix_off_epoch=-2", "data.mix_off_epoch=-2 is out of range: it must be >= 0"),
        ("model.dropout=1", "model.dropout=1.0 is out of range: it must be in [0, 1)"),
        ("model.dropout=0.3", "model.dropout=0.3: small has no dropout; models with one: wrn16_8"),
        ("run.profile=3", "run.profile='3': expected A:B"),
        ("run.profile=100:200", "run.profile=100:200: the run has 16 steps"),
        ("data.synthetic_classes=1", "data.synthetic_classes=1 is out of range: it must be in [2, 100000]"),
        ("data.translate=-1", "data.translate=-1 is out of range: it must be in [0, 16]"),
        ("data.translate=17", "data.translate=17 is out of range: it must be in [0, 16]"),
        ("data.translate=1.5", "data.translate: expected int, got '1.5'"),
        ("data.pad=edge", "data.pad: 'edge' is not one of zeros, reflect"),
        ("data.flip=sometimes", "data.flip: 'sometimes' is not one of random, alternate, none"),
        ("model.whiten=maybe", "model.whiten: expected bool, got 'maybe'"),
        ("model.whiten=true", "model.whiten=true: small has no whitening stem; the model with one: fast"),
        ("train.tta_translate=2", "train.tta_translate: expected bool, got '2'"),
        ("train.lookahead_every=-5", "train.lookahead_every=-5 is out of range: it must be >= 0"),
        ("run.warmup_steps=-1", "run.warmup_steps=-1 is out of range: it must be >= 0"),
        ("run.warmup_steps=some", "run.warmup_steps: expected int, got 'some'"),
        ("run.compile_mode=fast", "run.compile_mode: 'fast' is not one of default, reduce-overhead, max-autotune"),
        ("run.compile_mode=reduce-overhead", "reduce-overhead is torch.compile's mode: add run.compile=true"),
        ("train.lookahead_every=every", "train.lookahead_every: expected int, got 'every'"),
        ("train.lookahead_decay=1", "train.lookahead_decay=1.0 is out of range: it must be in [0, 1)"),
        ("train.lookahead_decay=-0.5", "train.lookahead_decay=-0.5 is out of range: it must be in [0, 1)"),
        ("optim.schedule=step", "optim.schedule: 'step' is not one of cosine, linear, constant"),
        ("optim.final_lr=1", "optim.final_lr=1.0 is out of range: it must be in [0, 1)"),
        ("optim.warmup_from=1", "optim.warmup_from=1.0 is out of range: it must be in [0, 1)"),
        ("optim.warmup_from=-0.2", "optim.warmup_from=-0.2 is out of range: it must be in [0, 1)"),
        ("optim.final_lr=inf", "optim.final_lr: expected a finite float"),
        ("optim.norm_bias_lr_scale=0", "optim.norm_bias_lr_scale=0.0 is out of range: it must be > 0"),
        ("optim.norm_bias_lr_scale=-64", "optim.norm_bias_lr_scale=-64.0 is out of range: it must be > 0"),
        ("optim.norm_weight_decay=some", "optim.norm_weight_decay: expected bool, got 'some'"),
        ("optim.freeze_norm_weights=2", "optim.freeze_norm_weights: expected bool, got '2'"),
        ("optim.whiten_bias_epochs=-1", "optim.whiten_bias_epochs=-1 is out of range: it must be >= 0"),
    ],
)
def test_bad_toolbox_values_are_one_line_and_exit_2(override, message, tmp_path, capsys):
    """ddp/train.py's own command (in this process: the same code path as the script, without
    the seconds of a new process's imports)."""
    assert train.cli([*TINY, override, f"run.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "checkpoints").exists()


def test_a_bad_value_from_the_command_line_is_exit_2():
    proc = python(str(TRAIN), *TINY, "data.mix_prob=2", env=clean_env())
    assert proc.returncode == 2 and "data.mix_prob=2.0 is out of range: it must be in [0, 1]" in proc.stderr


def test_a_checkpoint_of_another_width_is_refused_on_resume(tmp_path):
    """model.width changes every tensor's shape: continuing is refused with the fix, not a traceback
    from load_state_dict. (A checkpoint from before model.width existed counts as width 1.)"""
    from ddp import checkpoint, compatible

    saved = config.to_dict(config.load(None, ["model.name=fast", "model.width=0.25"]))
    now = config.to_dict(config.load(None, ["model.name=fast", "model.width=0.5"]))
    state = {"config": saved, "classes": list("abcdefghij"), "train_images": 100}
    info = checkpoint.RunInfo(now, 1, 100, {}, list("abcdefghij"))
    with pytest.raises(UsageError, match="trained with model.width=0.25 but this run has model.width=0.5"):
        compatible.check(state, info, "old.pt")
    del saved["model"]["width"]  # an older checkpoint
    info = checkpoint.RunInfo(config.to_dict(config.load(None, ["model.name=fast"])), 1, 100, {}, list("abcdefghij"))
    compatible.check(state, info, "old.pt")  # width 1 both: nothing raised


def test_a_profile_resumed_inside_its_steps_traces_the_rest(tmp_path, capsys):
    """run.profile=2:5 and a run resumed after step 2: steps 3 and 4 are profiled; resumed after
    step 4 or later, nothing is left (and parse says so with None). What this rank's export left when it was killed
    (its scratch folder, its temporary file) goes; another rank's, which may be exporting now, stays."""
    assert profiling.parse("2:5", 10, steps_done=4) is None and profiling.parse("2:5", 10, steps_done=2) == range(2, 5)
    world = World(0, 0, 1, torch.device("cpu"), "none")
    killed = [tmp_path / "profile" / name for name in (".rank0-a1b2", ".rank0.json.k3y.tmp", ".rank1-c3d4")]
    killed[0].mkdir(parents=True)
    (killed[0] / "trace.json").write_text("{")
    killed[1].write_text("{")
    killed[2].mkdir()
    with profiling.Profile(range(2, 5), str(tmp_path), world) as profile:
        for step in (3, 4, 5):
            profile.before_step(step)
            torch.ones(64, 64) @ torch.ones(64, 64)
            profile.after_step(step)
    assert "profile of global steps 3-4 (rank 0" in capsys.readouterr().out
    assert "aten::mm" in (tmp_path / "profile" / "rank0.json").read_text()
    assert [p.exists() for p in killed] == [False, False, True]


def test_a_profile_needs_no_room_in_tmpdir_and_a_full_out_dir_is_one_line(tmp_path):
    """torch writes its trace to a file it names: that was a scratch file in TMPDIR, and where TMPDIR was full (a
    small /tmp) torch only logged "Failed to write to log file!" and the run ended in a FileNotFoundError
    traceback. The scratch file is beside the trace now; an out_dir with no room is one line, exit 1. Two 64 KiB
    tmpfs, in a mount namespace of the runs' own: TMPDIR for the first run, out_dir for the second."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "true"]).returncode != 0:
        pytest.skip("needs `unshare --mount` (root, util-linux) to give the runs small filesystems of their own")
    small, full = tmp_path / "small", tmp_path / "full"
    small.mkdir(), full.mkdir()
    run = [sys.executable, str(TRAIN), *TINY, "train.epochs=1", "run.profile=1:3"]
    mounts = f'mount -t tmpfs -o size=64k none "{small}" && mount -t tmpfs -o size=64k none "{full}"'
    script = f'{mounts} && TMPDIR="{small}" "$@" run.out_dir="{tmp_path / "run"}" && "$@" run.out_dir="{full / "run"}"'
    proc = subprocess.run(["unshare", "--mount", "bash", "-c", script, "runs", *run], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert "aten::" in (tmp_path / "run" / "profile" / "rank0.json").read_text()  # the first run, TMPDIR full
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    trace = full / "run" / "profile" / "rank0.json"
    assert re.match(f"error: cannot write {trace}: torch's profiler wrote no trace \\([0-9,]+ bytes free there\\)$",
                    proc.stderr.splitlines()[-1]), proc.stderr  # fmt: skip


def test_a_step_the_grad_scaler_skips_leaves_the_norm_statistics_alone():
    """fp16's first steps often overflow (inf gradients) and are skipped: their norm is not a figure."""
    from ddp.metrics import StepStats

    sums = StepStats(torch.device("cpu"))
    for norm in (2.0, math.inf, math.nan, 4.0):
        sums.add_grad_norm(torch.tensor(norm))
    assert sums.grad_norm() == {"grad_norm_mean": 3.0, "grad_norm_max": 4.0}
    sums.reset()
    sums.add_grad_norm(torch.tensor(math.inf))
    assert sums.grad_norm() == {}
