"""run.cuda_graph=true (ddp/graphed.py): the step recorded once and replayed. On a CPU there are no CUDA graphs: a
replay calls the step again on the recording's static buffers and tensor LRs, which is what these tests check
computes the eager step's numbers; the recording itself is tests/test_gpu.py's (skipped without CUDA)."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import replace

import pytest
import torch
from conftest import TINY, same_last_checkpoints

from ddp import checks, config, graphed, train
from ddp.devices import World
from ddp.errors import UsageError

RUN = [*TINY, "model.width=0.25", "train.epochs=2", "train.lookahead_every=3", "train.ema_decay=0.9",
       "optim.clip_grad_norm=1.0", "optim.muon_lr=0.05", "run.save_every_steps=5", "run.keep_last=10",
       "run.progress=false"]  # fmt: skip
GPU = torch.device("cuda", 0)  # a torch.device needs no GPU


def test_a_replayed_step_trains_the_eager_steps_numbers_through_a_warm_up_and_a_resume(tmp_path, monkeypatch, capsys):
    """The same run eager and replayed (its schedule read from the LR tensors, lookahead, the moving average and
    clipping around the replays, Muon's filters in it), the replayed one with a warm-up that records and is then put
    back (new momentum tensors: recorded again) and resumed from a mid-epoch checkpoint: every epoch's metrics and
    the last checkpoint the same to the bit, and most steps replays. The resumed run asks run.cuda_graph=auto, which
    records here; with a setting that cannot be recorded, auto runs eager and says why."""
    as_on_a_gpu = checks.cuda_graph_refusal  # its "a GPU only" (its own test below): what it says, with a GPU's world
    monkeypatch.setattr(checks, "cuda_graph_refusal", lambda cfg, w: as_on_a_gpu(cfg, replace(w, device=GPU)))
    made: list[graphed.Recorder] = []

    class Counted(graphed.Recorder):
        def __init__(self, *args: object) -> None:
            super().__init__(*args)  # type: ignore[arg-type]
            made.append(self)

    monkeypatch.setattr(graphed, "Recorder", Counted)
    eager = train.main([f"run.out_dir={tmp_path / 'eager'}", *RUN])
    assert made == []
    replayed = train.main([f"run.out_dir={tmp_path / 'replayed'}", *RUN, "run.cuda_graph=true", "run.warmup_steps=3"])
    step_5 = tmp_path / "replayed" / "checkpoints" / "step-000000005.pt"
    resumed = train.main([f"run.out_dir={tmp_path / 'resumed'}", *RUN, "run.cuda_graph=auto", f"run.resume={step_5}"])
    keys = ("train_loss", "test_acc", "raw_test_acc", "grad_norm_mean", "grad_norm_max", "lr")
    assert {k: replayed[k] for k in keys} == {k: eager[k] for k in keys} == {k: resumed[k] for k in keys}
    ends = same_last_checkpoints(tmp_path, "eager", ("replayed", "resumed"), ("model", "ema", "lookahead", "optimizer"))
    for name in ("replayed", "resumed"):  # the file's LRs are floats, as an eager run's (the tensors are the replay's)
        assert ends[name]["optimizer"]["param_groups"] == ends["eager"]["optimizer"]["param_groups"], name
    # 16 steps (8 an epoch): the warm-up's 3 (1 eager, recorded at the 2nd) put back, then 1 eager and 15 replays;
    # resumed after step 5: 1 eager and 10 replays
    assert [r.replays for r in made] == [2 + 15, 10]
    out = capsys.readouterr().out
    said = [line.split("at this process's ")[1] for line in out.splitlines() if "recorded" in line]
    assert "clip_grad_norm=1, muon_lr=0.05; loader=" in out  # the start line names the toolbox options on
    assert said == ["step 2; replayed from here", "step 5; replayed from here", "step 2; replayed from here"]
    train.main([f"run.out_dir={tmp_path / 'accumulated'}", *RUN, "run.cuda_graph=auto", "train.grad_accum_steps=2"])
    note = "run.cuda_graph=auto: the step runs eager, not recorded (train.grad_accum_steps: one batch a step is "
    assert len(made) == 2 and note + "recorded: raise the batch instead)\n" in capsys.readouterr().out


def test_the_recording_calls_torch_cuda_graph_as_this_torch_takes_it_and_puts_the_float_lrs_back(monkeypatch):
    """graphed.Recorder's GPU path with torch.cuda's graph calls faked (no CUDA here): the arguments it passes bind to
    this torch's torch.cuda.graph; the step runs once inside it with the groups' LRs as tensors, floats again after;
    the recording call and every later one replay."""
    calls: list[object] = []

    class Graph:
        def replay(self) -> None:
            calls.append("replay")

    def graph(g: Graph, **kwargs: object) -> contextlib.AbstractContextManager[None]:
        inspect.signature(torch.cuda.graph).bind(g, **kwargs)  # a misspelt or missing argument: TypeError
        calls.append(("capture", kwargs.get("capture_error_mode")))
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "side")
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen_lrs: list[object] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> graphed.Pair:
        seen_lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach(), loss.detach()

    recorder = graphed.Recorder(step, optimizer, World(0, 0, 1, GPU, "none"))
    for _ in range(3):
        recorder(torch.randn(8, 4), torch.randn(8, 2))
    assert calls == [("capture", "thread_local"), "replay", "replay"] and recorder.replays == 2
    assert seen_lrs[0] == 0.1 and isinstance(seen_lrs[1], torch.Tensor) and optimizer.param_groups[0]["lr"] == 0.1

    def syncs(x: torch.Tensor, y: torch.Tensor) -> graphed.Pair:  # what torch raises for a host read in a capture
        if calls[-1] == ("capture", "thread_local"):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors ...")
        return step(x, y)

    failing = graphed.Recorder(syncs, optimizer, World(0, 0, 1, GPU, "none"))
    failing(torch.randn(8, 4), torch.randn(8, 2))  # the eager step before the recording
    with pytest.raises(UsageError) as e:  # one line naming the setting, the float LRs and autocast's cache put back
        failing(torch.randn(8, 4), torch.randn(8, 2))
    assert str(e.value) == (
        "run.cuda_graph: this run's step could not be recorded in a CUDA graph (CUDA error: "
        "operation not permitted when stream is capturing); run.cuda_graph=false runs it eager"
    )
    assert optimizer.param_groups[0]["lr"] == 0.1 and torch.is_autocast_cache_enabled()


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        (["run.parallel=dp"], "run.parallel=dp does not work with run.cuda_graph=true (a recording is one GPU's"),
        (["run.compile=true"], "run.compile does not work with run.cuda_graph=true (use one: run.compile_mode=reduce-"),
        (["run.amp=fp16"], "run.amp=fp16 does not work with run.cuda_graph=true (its GradScaler decides on the host"),
        (["train.grad_accum_steps=2"], "train.grad_accum_steps does not work with run.cuda_graph=true (one batch a"),
        (["train.sync_bn=true"], "train.sync_bn does not work with run.cuda_graph=true (its forward's collectives"),
        (["ddp.find_unused_parameters=true"], "ddp.find_unused_parameters does not work with run.cuda_graph=true"),
        (["optim.name=adamw"], "optim.name=adamw does not work with run.cuda_graph=true (only SGD's fused step"),
        (["data.cutmix_alpha=1", "train.epochs=3", "data.mix_off_epoch=4"], "data.mix_prob=1 does not work with "
                                                  "run.cuda_graph=true (every batch is mixed and a mixed one takes"),
        (["data.mixup_alpha=0.2", "run.parallel=ddp"], "data.mixup_alpha / cutmix_alpha under DDP does not work with "
                                                       "run.cuda_graph=true (each rank draws its own mixed batches"),
        (["run.parallel=ddp", "run.backend=gloo"], "run.backend=gloo does not work with run.cuda_graph=true (gloo's "
                                                   "all-reduce runs on the host: use nccl)"),
        (["run.device=cpu"], "run.device=cpu does not work with run.cuda_graph=true (CUDA graphs need a GPU)"),
    ],
)  # fmt: skip
def test_what_a_replay_would_get_wrong_is_refused_with_why_and_auto_runs_it_eager_saying_why(settings, said):
    """checks.check_combinations on a GPU's world (a torch.device needs no GPU): each refusal names the key and why.
    run.cuda_graph=auto refuses nothing: the same run's step runs eager, and the log says which setting and why."""
    given = dict(s.split("=") for s in settings)
    device = torch.device(given.get("run.device", "cuda:0"))
    world = World(0, 0, 1, device, given.get("run.parallel", "none"), backend=given.get("run.backend", "auto"))
    with pytest.raises(UsageError) as e:
        checks.check_combinations(config.load(None, ["run.cuda_graph=true", *settings]), world)
    assert said in str(e.value)
    auto, notes = config.load(None, ["run.cuda_graph=auto", *settings]), []
    checks.check_combinations(auto, world)
    assert checks.cuda_graph(auto, world, notes.append) is False and checks.cuda_graph(auto, world, None) is False
    key, why = str(e.value).split(" does not work with run.cuda_graph=true ")  # why in brackets
    assert notes == [f"run.cuda_graph=auto: the step runs eager, not recorded ({key}: {why[1:]}"], notes
    fine = ["run.cuda_graph=true", "data.mixup_alpha=0.2", "data.mix_prob=0.5"]  # one process: mixed ones eager
    checks.check_combinations(config.load(None, fine), World(0, 0, 1, GPU, "none"))
    mixed_first = [*fine[:2], "data.mix_off_epoch=2"]  # every batch of epoch 1 mixed, the epochs after recorded
    checks.check_combinations(config.load(None, mixed_first), World(0, 0, 1, GPU, "none"))
    on_nccl = World(0, 0, 1, GPU, "ddp", backend="nccl")
    checks.check_combinations(config.load(None, fine[:1]), on_nccl)
    for value, recorded in (("true", True), ("auto", True), ("false", False), ("on", True), ("off", False)):
        assert checks.cuda_graph(config.load(None, [f"run.cuda_graph={value}"]), on_nccl, notes.append) is recorded
    assert len(notes) == 1  # auto where nothing refuses it: nothing said
