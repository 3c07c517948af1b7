"""Checks that need GPUs. CI has none, so they skip there with the reason; on a GPU machine they
run the real thing (cuda:0, DataParallel over 2+, torchrun with nccl)."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import BIN, TINY, TRAIN, metrics, ok

from ddp import datasets, models, train

GPUS = torch.cuda.device_count()
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU (none visible on this machine)")
needs_2_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ CUDA GPUs, this machine has {GPUS}")


def gpu_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}


@needs_gpu
def test_single_gpu_bf16_channels_last_then_loads_on_cpu(tmp_path):
    last = train.main([f"run.out_dir={tmp_path}", *TINY, "run.amp=bf16", "run.channels_last=true"])
    assert last["device"] == "cuda:0" and last["test_acc"] > 0.5
    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert all(t.device.type == "cpu" for t in state["model"].values())
    models.build("small", 10).load_state_dict(state["model"])


@needs_gpu
def test_fp16_uses_a_grad_scaler(tmp_path):
    train.main([f"run.out_dir={tmp_path}", *TINY, "train.epochs=1", "run.amp=fp16"])
    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert state["scaler"] is not None and state["scaler"]["scale"] > 0


@needs_gpu
def test_fp16_weights_train_on_the_gpu_with_lookahead_and_continue_on_the_cpu(tmp_path):
    """run.amp=fp16-weights where it is meant to run: cuDNN's fp16 convolutions, its BatchNorm with fp16 inputs
    and float32 weights in channels_last, lookahead over both dtypes; the file continues as a float32 CPU run."""
    run = [*TINY, "model.name=fast", "model.width=0.25", "model.whiten=true", "train.lookahead_every=3",
           "run.channels_last=true", "run.cudnn_benchmark=true"]  # fmt: skip
    last = train.main([f"run.out_dir={tmp_path}", *run, "run.amp=fp16-weights"])
    assert last["device"] == "cuda:0" and last["test_acc"] > 0.3 and last["train_loss"] < 2.2
    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert {t.dtype for t in state["model"].values() if t.is_floating_point()} == {torch.float16, torch.float32}
    more = train.main([f"run.out_dir={tmp_path}", *run, "train.epochs=3", "run.device=cpu"])
    assert more["epoch"] == 3 and more["train_loss"] == more["train_loss"]


@needs_gpu
def test_cpu_checkpoint_resumes_on_gpu(tmp_path):
    train.main([f"run.out_dir={tmp_path}", *TINY, "train.epochs=1", "run.device=cpu"])
    last = train.main([f"run.out_dir={tmp_path}", *TINY, "run.device=cuda"])
    assert last["epoch"] == 2 and last["device"] == "cuda:0"


@needs_2_gpus
def test_data_parallel_over_all_gpus(tmp_path):
    last = train.main([f"run.out_dir={tmp_path}", *TINY, "run.parallel=dp"])
    assert last["parallel"] == "dp" and last["test_images"] == 101


@needs_2_gpus
def test_torchrun_nccl_one_process_per_gpu(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [exe, "--standalone", f"--nproc_per_node={GPUS}", str(TRAIN), f"run.out_dir={tmp_path}", *TINY]
    batch = 32 * GPUS
    ok(subprocess.run([*cmd, f"train.batch_size={batch}"], env=gpu_env(), capture_output=True, text=True))
    assert metrics(tmp_path)[-1]["world_size"] == GPUS and metrics(tmp_path)[-1]["device"] == "cuda:0"


@needs_gpu
def test_device_loader_keeps_the_split_on_the_gpu_and_gives_the_cpu_batches():
    from ddp import loaders
    from ddp.devices import World

    split = datasets.Split(torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8), torch.arange(64))
    batches = {}
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        loader = loaders.train_loader(split, 16, World(0, 0, 1, device, "none"), loaders.Augment(), 0, 3, "device")
        loader.sampler.set_epoch(1, start_step=0)
        batches[device.type] = list(loader)
    assert loader.images.device.type == "cuda"
    for (a, la), (b, lb) in zip(batches["cpu"], batches["cuda"]):
        assert b.device.type == "cuda" and torch.equal(a, b.cpu()) and torch.equal(la, lb.cpu())


@needs_gpu
def test_gpu_memory_is_logged_per_epoch(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *TINY, "run.device=cuda", f"run.out_dir={tmp_path}"],
        env=gpu_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    ok(proc)
    for m in metrics(tmp_path):
        assert 0 < m["gpu_allocated_mb"] <= m["gpu_reserved_mb"] and m["gpu_peak_mb"] >= m["gpu_allocated_mb"]
    assert "MB allocated /" in proc.stdout and "MB reserved, peak" in proc.stdout


@needs_gpu
def test_deterministic_mode_gives_bitwise_equal_weights_twice(tmp_path):
    """run.deterministic=true: two runs on the GPU (each a fresh process) end with equal bits."""
    states = []
    for name in ("a", "b"):
        args = [str(TRAIN), *TINY, "model.name=resnet18", "run.deterministic=true", f"run.out_dir={tmp_path / name}"]
        proc = ok(subprocess.run([sys.executable, *args], env=gpu_env(), capture_output=True, text=True))
        assert "deterministic=True" in proc.stdout
        states.append(torch.load(tmp_path / name / "checkpoints" / "last.pt", map_location="cpu", weights_only=True))
    assert all(torch.equal(states[0]["model"][k], states[1]["model"][k]) for k in states[0]["model"])


@needs_gpu
def test_a_step_recorded_in_a_cuda_graph_trains_the_eager_steps_bits_alone_and_under_ddp(tmp_path):
    """run.cuda_graph=true on the GPU: recorded after its eager steps and replayed (bf16, channels_last, lookahead,
    clipping, Muon's filters); deterministic kernels, so the same bits as the eager run, in one process and under
    torchrun with nccl at world size 1 (DDP's all-reduce inside the graph), recorded at the step the log says."""
    run = [*TINY, "model.name=fast", "model.width=0.25", "train.epochs=3", "train.lookahead_every=3", "run.amp=bf16",
           "run.channels_last=true", "optim.clip_grad_norm=1.0", "optim.muon_lr=0.05",
           "run.deterministic=true"]  # fmt: skip
    launch = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node=1"]
    ways = {"eager": [sys.executable], "recorded": [sys.executable], "recorded-ddp": launch}
    states = {}
    for name, cmd in ways.items():
        extra = ["run.cuda_graph=true"] if name != "eager" else []
        extra += ["run.parallel=ddp"] if name.endswith("ddp") else []
        args = [*cmd, str(TRAIN), *run, *extra, f"run.out_dir={tmp_path / name}"]
        proc = ok(subprocess.run(args, env=gpu_env(), capture_output=True, text=True, timeout=600))
        step = {"eager": None, "recorded": 2, "recorded-ddp": 12}[name]  # graphed.EAGER_STEPS + 1
        assert (f"the step recorded in a CUDA graph at this process's step {step};" in proc.stdout) == bool(step)
        states[name] = torch.load(tmp_path / name / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
        assert metrics(tmp_path / name)[-1]["parallel"] == ("ddp" if name.endswith("ddp") else "none")
    for name in ("recorded", "recorded-ddp"):
        assert all(torch.equal(states["eager"]["model"][k], states[name]["model"][k]) for k in states["eager"]["model"])
        assert metrics(tmp_path / name)[-1]["train_loss"] == metrics(tmp_path / "eager")[-1]["train_loss"]


@needs_gpu
def test_fp16_clipping_unscales_first(tmp_path):
    """Under fp16 the GradScaler's gradients are the true ones x 65536: clipping and the logged norm
    must see the true ones. The same first step in fp32 gives the reference norm."""
    from ddp import checks, config
    from ddp.checks import Plan
    from ddp.devices import World

    norms, clipped = {}, {}
    for amp in ("off", "fp16"):
        settings = [f"run.out_dir={tmp_path / amp}", "run.resume=never", "optim.clip_grad_norm=0.01", f"run.amp={amp}"]
        cfg = config.load(None, [*TINY, *settings])
        world = World(0, 0, 1, torch.device("cuda", 0), "none")
        plan = Plan(32, 8, *checks.precision(amp, world.device, 32))
        job, _ = train.build(cfg, world, datasets.read(cfg.data, world), plan)
        assert job.trained.scaler.is_enabled() == (amp == "fp16")
        job.trained.scaler = torch.amp.GradScaler("cuda", init_scale=256.0, enabled=amp == "fp16")  # no skipped step
        train.train_step(job, *next(iter(job.train_loader)))
        norms[amp] = job.stats.grad_norm()["grad_norm_max"]
        grads = [p.grad.float().norm() for p in job.trained.model.parameters()]
        clipped[amp] = float(torch.linalg.vector_norm(torch.stack(grads)))
    assert norms["fp16"] == pytest.approx(norms["off"], rel=0.05)  # not 65536 x it
    assert clipped["fp16"] <= 0.01 * 1.001 and clipped["off"] <= 0.01 * 1.001


@needs_gpu
@pytest.mark.parametrize("ranks", [2, 3])
def test_several_ranks_share_one_gpu_with_gloo(tmp_path, ranks):
    """run.backend=gloo: 2 and 3 torchrun ranks on cuda:0 (nccl refuses that), synchronised BatchNorm
    on, the CUDA paths of a multi-rank run (per-rank CUDA RNG, buffer sync, exact evaluation with CUDA
    tensors) on a one-GPU machine."""
    settings = ["train.batch_size=48", "run.backend=gloo", "run.device=cuda", "train.sync_bn=true"]
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={ranks}", str(TRAIN), *TINY, *settings,
           f"run.out_dir={tmp_path}"]  # fmt: skip
    proc = ok(subprocess.run(cmd, env=gpu_env(), capture_output=True, text=True, timeout=300))
    assert "backend=gloo (gloo on GPUs: ranks may share a GPU" in proc.stdout
    last = metrics(tmp_path)[-1]
    assert last["world_size"] == ranks and last["device"] == "cuda:0" and last["test_images"] == 101
