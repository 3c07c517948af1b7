"""The `ddp:` settings and gradient accumulation do what they say, seen inside real torchrun jobs
(tests/knob_worker.py), and a model with unused parameters is a clear error unless DDP is told."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import REPO, REPORT, TINY, TRAIN, clean_env, ok, python, torchrun
from knob_worker import PROBES

from ddp import checks, config, train
from ddp.devices import World
from ddp.errors import UsageError

WORKER = str(REPO / "tests" / "knob_worker.py")


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("knobs") / "report.json"
    ok(torchrun(2, WORKER, str(out), json.dumps(PROBES), env=clean_env(PYTHONPATH=str(REPO))))
    return json.loads(out.read_text())


def test_defaults_one_bucket_per_step_buffers_from_rank_0_float32_gradients(probes):
    default = probes["default"]
    assert default["allreduces_per_step"] == [1, 1]  # the small net fits one 25 MiB bucket
    assert default["running_means"][0] == default["running_means"][1]  # rank 1's buffer was replaced
    assert default["grads_are_bucket_views"] and not default["grads_fp16_exact"]  # no copy out of the bucket
    assert not default["static_graph"]


def test_the_default_hook_divides_each_bucket_once_and_averages_as_torchs_own_reducer_does(probes):
    """ddp.comm_hook=allreduce (torch's C++ all-reduce hook) against none (torch's reducer, which divides
    each gradient on its way into the bucket): one all-reduce a step each, the same gradients to the bit
    (a division by 2 is exact either way)."""
    default, torchs = probes["default"], probes["torch's reducer"]
    assert default["comm_hook"].endswith("ALLREDUCE") and not torchs["comm_hook"].endswith("ALLREDUCE")
    assert torchs["allreduces_per_step"] == default["allreduces_per_step"] == [1, 1]
    assert default["grads_sha256"] == torchs["grads_sha256"]


def test_small_buckets_gradients_of_their_own_and_no_buffer_broadcast(probes):
    got, default = probes["small buckets"], probes["default"]
    REPORT.append(f"ddp.bucket_cap_mb=0.05: {got['allreduces_per_step'][-1]} all-reduces per optimizer step (25: 1)")
    assert got["allreduces_per_step"][-1] > default["allreduces_per_step"][-1]  # more, smaller buckets
    assert not got["grads_are_bucket_views"]  # gradient_as_bucket_view=false: torch's default
    assert got["running_means"][0] != got["running_means"][1]  # each rank kept its own


@pytest.mark.parametrize("accum", [2, 4])
def test_accumulation_all_reduces_once_per_optimizer_step_not_per_micro_batch(accum, probes):
    assert probes[f"accum {accum}"]["allreduces_per_step"] == [1, 1]


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_a_compression_hook_sends_the_gradients_in_its_dtype(hook, probes):
    got = probes[hook]
    assert got[f"grads_{hook}_exact"]  # every averaged gradient came back through that dtype
    assert not got["grads_fp16_exact" if hook == "bf16" else "grads_bf16_exact"]


def unused(tmp_path, *args: str):
    argv = [WORKER, "--unused-parameter", *TINY, "model.name=tutorial", "train.epochs=1", f"run.out_dir={tmp_path}"]
    return torchrun(2, *argv, *args, env=clean_env(PYTHONPATH=str(REPO)))


def test_a_model_with_unused_parameters_is_a_usage_error_naming_the_two_fixes(tmp_path):
    proc = unused(tmp_path)
    assert "exitcode  : 2" in proc.stderr, proc.stderr  # torchrun itself exits 1 when a worker fails
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "set ddp.find_unused_parameters=true" in errors[0], proc.stderr
    assert "ddp.static_graph=true" in errors[0]
    assert (
        "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
    )  # (torchrun's own follows)
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").glob("step-*.pt"))


@pytest.mark.parametrize("setting", ["ddp.find_unused_parameters=true", "ddp.static_graph=true"])
def test_either_setting_trains_the_model_with_unused_parameters(setting, tmp_path):
    ok(unused(tmp_path, setting))
    assert (tmp_path / "checkpoints" / "last.pt").exists()


def test_deterministic_mode_is_logged_at_start_and_trains_on_cpu(tmp_path):
    """(Bitwise repeatability on a GPU: tests/test_gpu.py.)"""
    proc = ok(python(str(TRAIN), *TINY, "train.epochs=1", "run.deterministic=true", f"run.out_dir={tmp_path}"))
    assert "deterministic=True" in proc.stdout


def test_sync_bn_under_data_parallel_is_refused():
    cfg = config.load(None, ["train.sync_bn=true"])
    world = World(0, 0, 1, torch.device("cuda", 0), "dp")  # (a World is only named here: no GPU needed)
    with pytest.raises(
        UsageError, match=r"train.sync_bn=true needs DDP \(nn.DataParallel computes BatchNorm per GPU\)"
    ):
        checks.check_combinations(cfg, world)


def test_compiled_ddp_with_buckets_under_a_mib_is_refused_in_one_line():
    """torch's compiled DDP asserts its buckets are no smaller than the first (1 MiB): an AssertionError from
    deep in the first forward before; eager DDP and the compiled bare model take any size."""
    world = World(0, 0, 2, torch.device("cpu"), "ddp")
    said = r"ddp.bucket_cap_mb=0.5 with run.compile=true: compiled DDP needs buckets no smaller than DDP's first one"
    with pytest.raises(UsageError, match=said + r" \(1 MiB\); use ddp.bucket_cap_mb >= 1 \(or ddp.split_graph=false\)"):
        checks.check_combinations(config.load(None, ["ddp.bucket_cap_mb=0.5", "run.compile=true"]), world)
    for fine in (["ddp.bucket_cap_mb=0.5"], ["ddp.bucket_cap_mb=1", "run.compile=true"]):
        checks.check_combinations(config.load(None, fine), world)
    checks.check_combinations(
        config.load(None, ["ddp.bucket_cap_mb=0.5", "run.compile=true"]), World(0, 0, 1, torch.device("cpu"), "none")
    )


def test_a_compile_with_no_compiler_to_build_with_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """run.compile=true where torch.compile cannot build: on the CPU inductor's own search for a C++ compiler (CXX,
    else g++) finds none; on a GPU Triton's for a C compiler (CC, else gcc or clang on PATH) finds none. Inductor's
    InvalidCxxCompiler traceback came out of the first step before; now one line, exit 2, nothing written."""
    from torch._inductor import config as inductor

    with inductor.patch({"cpp.cxx": (None, str(tmp_path / "g++"))}):  # (CXX=that, as inductor read it; its own patch:
        assert train.cli([*TINY, "run.compile=true", f"run.out_dir={tmp_path / 'run'}"]) == 2  # monkeypatch's undo
    assert inductor.cpp.cxx[1] != str(tmp_path / "g++")  # deleted the setting, and every later compile here failed)
    assert capsys.readouterr().err == (
        f"error: run.compile=true: torch.compile builds C++ for the CPU, and found no C++ compiler (it tried "
        f"{tmp_path / 'g++'}): install one (apt-get install g++; macOS: xcode-select --install), set CXX to one, or "
        "leave run.compile off\n"
    )
    assert not (tmp_path / "run").exists()
    gpu = World(0, 0, 1, torch.device("cuda", 0), "none")  # (named only: no GPU needed)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    none = "Triton builds torch.compile's GPU kernels with a C compiler, and found none ({}): install one"
    with pytest.raises(UsageError, match=r"^run.compile=true: " + re.escape(none.format("gcc and clang on PATH"))):
        checks.check_combinations(config.load(None, ["run.compile=true"]), gpu)
    monkeypatch.setenv("CC", str(tmp_path / "cc"))
    assert checks.compiler_missing(gpu.device).startswith(none.format(f"CC={tmp_path / 'cc'}"))
    (tmp_path / "cc").write_text("#!/bin/sh\n")
    (tmp_path / "cc").chmod(0o755)
    assert checks.compiler_missing(gpu.device) is None
    monkeypatch.delenv("CC")
    (tmp_path / "cc").rename(tmp_path / "clang")
    assert checks.compiler_missing(gpu.device) is None
    checks.check_combinations(config.load(None, ["run.compile=false"]), gpu)  # (no compile: nothing looked for)


def test_split_graph_false_compiles_ddp_as_one_graph_and_trains_the_same_weights(tmp_path):
    """ddp.split_graph=false: no DDPOptimizer (dynamo's log says when it cuts the graph at DDP's buckets), the
    same weights as torch's way on this one-bucket net, and buckets under 1 MiB allowed (nothing to cut);
    without run.compile it is refused."""
    runs = {}
    for name, knobs in (("split", ()), ("whole", ("ddp.split_graph=false", "ddp.bucket_cap_mb=0.5"))):
        args = (str(TRAIN), *TINY, "model.name=tutorial", "train.epochs=1", "run.parallel=ddp", "run.compile=true")
        proc = ok(torchrun(1, *args, *knobs, f"run.out_dir={tmp_path / name}", env=clean_env(TORCH_LOGS="dynamo")))
        runs[name] = torch.load(tmp_path / name / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
        assert proc.stderr.count("DDPOptimizer used bucket cap") == (name == "split"), proc.stderr[-2000:]
    assert all(torch.equal(runs["split"]["model"][k], w) for k, w in runs["whole"]["model"].items())
    with pytest.raises(UsageError, match=r"^ddp.split_graph=false is how compiled DDP's graph is cut: add run"):
        checks.check_combinations(
            config.load(None, ["ddp.split_graph=false"]), World(0, 0, 1, torch.device("cpu"), "none")
        )
    with pytest.raises(UsageError, match=r"ddp.split_graph: expected bool, got 'whole'"):
        config.load(None, ["ddp.split_graph=whole"])
