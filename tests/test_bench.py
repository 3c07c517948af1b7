"""The bench's options refused with one line. `python -m bench --quick` itself (the full bench's
code at small sizes) is make gpu-check's dry-run bench step: tests/test_gpu_check.py checks its output."""

import json
import statistics
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, clean_env

from bench import host_cost


def test_bad_values_of_the_gpu_bench_options_end_in_one_line():
    """--gpu-only without a GPU, and bench/lightning_fast.py given a bad count, setting or file: exit 2
    and the reason, before anything trains (the Lightning run itself: tests/test_gpu_check.py)."""
    cases = [
        (["-m", "bench", "--gpu-only", "--quick"], "--gpu-only: no CUDA device here"),
        (["-m", "bench", "--host-cost", "--quick"], "--host-cost runs alone, on the CPU"),
        (["bench/lightning_fast.py", "--out", "r.json", "--workers", "-1"], "'-1' is not a count of processes"),
        (["bench/fsdp_memory.py", "--amp", "fp16"], "argument --amp: invalid choice: 'fp16'"),
        (["bench/lightning_fast.py", "--out", "r.json", "train.batch_size=0"], "train.batch_size=0 is out of range"),
        (["bench/lightning_fast.py", "--out", "r.json", "data.dataset=npz", "data.path=/no/such.npz"],
         "data.path=/no/such.npz: no such file"),
    ]  # fmt: skip
    for args, reason in cases:
        proc = subprocess.run([sys.executable, *args], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 2 and reason in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert not (REPO / "r.json").exists()


def test_old_torch_refuses_what_is_not_a_version_before_it_builds_anything():
    """bench/old_torch.sh (the suite under torch 2.4.1: bench/results/torch-2.4-cpu.md) would make a venv and
    download gigabytes for pip to refuse at the end."""
    proc = subprocess.run(["bash", "bench/old_torch.sh", "2.4", "latest"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 64 and proc.stderr == (
        "old_torch.sh: TORCH and TORCHVISION are versions such as 2.4.1 0.19.1, not '2.4' 'latest'\n"
    )


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--host-cost", "--out", "README.md"], "--out='README.md': name a directory for the results"),
        (["--host-cost", "--out="], "--out='': name a directory"),  # it wrote into the current directory
        (["--quick", "--data", "README.md"], "--data is the full bench's time-to-accuracy check: without --quick"),
        (["--data", "no/such.npz"], "--data=no/such.npz: no such file"),
        (["--tutorial-epochs", "0"], "--tutorial-epochs=0: 1 or more"),
    ],
)
def test_bench_values_that_would_fail_or_be_ignored_after_minutes_are_refused_first(argv, reason, capsys):
    """In this process: python -m bench's check runs before any section (a file as --out was a traceback
    after the whole run; --data with --quick was ignored without a word)."""
    from bench.__main__ import main

    with pytest.raises(SystemExit) as refused:
        main(argv)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.splitlines()[-1].startswith("python -m bench: error: "), err
    assert reason in err.splitlines()[-1], err


def test_host_cost_counts_top_level_operators_per_thread_and_tells_the_stop_flag_from_device_reads(tmp_path):
    """A made-up trace of 2 steps: nesting on one thread, an operator of another thread, a read inside
    the stop agreement's label and one outside it, a gloo all-reduce."""

    def op(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [
        op("aten::add", 0, 10), op("aten::empty", 1, 2), op("aten::mul", 20, 5), op("aten::mul", 21, 1, tid=2),
        op(host_cost.SCALAR_READ, 30, 1), op(host_cost.STOP_AGREEMENT, 40, 10, cat="user_annotation"),
        op(host_cost.SCALAR_READ, 45, 1), op("gloo:all_reduce", 42, 2), {"ph": "M", "name": "thread_name"},
    ]  # fmt: skip
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    counts = host_cost.per_step(trace, steps=2)
    # top level: add, mul, tid 2's mul, the first read, the all-reduce, the second read (its label is no op)
    assert counts["top_level_ops"] == 6 / 2 and counts["all_ops"] == 7 / 2
    assert counts["device_reads"] == counts["flag_reads"] == 1 / 2
    assert counts["collectives"] == 1 / 2 and counts["collective_kinds"] == ["gloo:all_reduce"]


def test_a_ddp_step_of_ours_reads_nothing_from_the_device_broadcasts_no_buffers_and_divides_nothing_by_one(tmp_path):
    """ddp/train.py under torchrun at 2 ranks, profiled: the gradients' all-reduce and the stop
    agreement are a step's only collectives (no buffer broadcast: train.dist_bn=broadcast makes rank
    0's statistics everyone's at the boundaries), and no tensor of the device is read in a step, Muon's
    step on the filters included (a CUDA graph records the step: a read would stop its capture). With
    one micro-batch the loss is not divided by 1: that was a kernel forward and one backward, a step."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    counts = host_cost.ours(torchrun, tmp_path / "ours", "optim.muon_lr=0.05")
    assert counts["collective_kinds"] == ["gloo:all_reduce"] and counts["collectives"] <= 2
    assert counts["device_reads"] == 0 and counts["flag_reads"] <= 1
    trace = json.loads((tmp_path / "ours" / "profile" / "rank0.json").read_text())["traceEvents"]
    assert not [e["name"] for e in trace if e.get("name") in ("aten::div", "DivBackward0")]


def test_a_bench_cut_off_keeps_the_json_of_the_sections_it_finished(tmp_path, monkeypatch):
    """A device call's time limit can stop the bench mid-way: the JSON holds every section done so far
    and names them; a finished bench's JSON does not carry that list. (Sections faked: no training.)"""
    import bench.__main__ as entry
    from bench import harness

    monkeypatch.setattr(harness, "train_throughput", lambda sizes, devices: [{"row": "train"}])
    monkeypatch.setattr(harness, "ddp_overhead", lambda sizes: [{"row": "ddp"}])

    def cut_off(sizes, devices):
        raise KeyboardInterrupt  # what a timeout's signal does mid-section

    monkeypatch.setattr(harness, "data_path", cut_off)
    try:
        entry.main(["--quick", "--out", str(tmp_path)])
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the faked cut-off did not stop the bench")
    kept = json.loads((tmp_path / "quick-cpu.json").read_text())
    assert kept["done"] == ["train", "ddp"] and kept["train"] == [{"row": "train"}] and "data_path" not in kept


def test_the_compiled_ddp_variants_patch_dynamo_and_inductor_only_while_they_run():
    """A variant's settings (bench/harness.py COMPILED_DDP) hold inside its step, its compile included,
    and are put back after it: the CUDA-graph one sets inductor's triton.cudagraphs (torch.compile's
    reduce-overhead), the whole-graph one dynamo's optimize_ddp. (No compile here: the step only looks.)"""
    import torch
    import torch._inductor.config as inductor

    from bench import harness

    seen = []
    look = lambda: seen.append((torch._dynamo.config.optimize_ddp, inductor.triton.cudagraphs))  # noqa: E731
    before = (torch._dynamo.config.optimize_ddp, inductor.triton.cudagraphs)
    for variant in ("ddp_compiled", "cuda_graphs", "whole_graph_cuda_graphs"):
        harness.under_dynamo(harness.COMPILED_DDP[variant][0], look)()
    assert seen == [before, (before[0], True), (False, True)] and before[1] is False
    assert (torch._dynamo.config.optimize_ddp, inductor.triton.cudagraphs) == before


def test_the_python_reducer_variants_build_ddp_in_their_mode_and_compile_each_backward(monkeypatch):
    """DDP reads dynamo's optimize_ddp as it is built, and dynamo's compiled_autograd flag acts only on a
    backward called inside a compiled function: the bench's first python_reducer variant built DDP
    outside its settings and ran the backward eagerly, so it measured one graph with DDP's C++ reducer.
    Now DDP is built in the variant's mode (no C++ reducer), the backward is compiled autograd's, and
    torch's settings (DDP's own changes to them included) are as before after it. torch.compile's backend
    here is eager: the plumbing, not inductor's code, on this CPU."""
    import torch
    import torch._inductor.config as inductor
    from torch._dynamo import trace_rules

    from bench import harness
    from ddp import distributed
    from ddp.devices import World

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model=None, **_: compile_(model, backend="eager") if model else
                        compile_(backend="eager"))  # fmt: skip
    cpu = torch.device("cpu")
    settings = lambda: (torch._dynamo.config.optimize_ddp, torch._dynamo.config.compiled_autograd,  # noqa: E731
                        inductor._fuse_ddp_communication, set(trace_rules.LEGACY_MOD_INLINELIST))  # fmt: skip
    before = settings()
    world = World(0, 0, 1, cpu, "ddp", "bench", f"tcp://127.0.0.1:{harness.free_port()}")
    with distributed.setup(world, 60) as world:
        eager = harness.job("tutorial", 8, 8, world)
        fixed = next(iter(eager.train_loader))
        step = harness.stepping(eager, lambda: fixed)
        run = lambda variant: harness.compiled_variant(world, "tutorial", 8, harness.COMPILED_DDP[variant], step,  # noqa: E731
                                                       fixed, (cpu, 0, 1, 1))  # fmt: skip
        row = run("python_reducer")
        assert row["reducer"] == "python" and row["compiled_autograd_captures"] >= 1
        assert settings() == before
        assert "reducer" not in run("whole_graph")


def test_a_compiled_ddp_variant_torch_cannot_run_is_reported_and_the_bench_goes_on(monkeypatch):
    """The CUDA-graph variants first run on a lent GPU, in one call: one that fails there (DDP with CUDA
    graphs has open torch issues) must leave its error in its row, and the other variants and sections
    their figures, not end the bench. Here a setting this torch lacks fails; dynamo's `disable` (the
    compiled model run eagerly: no compile on this CPU) stands for a variant that runs."""
    import torch

    from bench import harness
    from bench.report import ddp as ddp_table
    from ddp.devices import World

    cpu = torch.device("cpu")
    world = World(0, 0, 1, cpu, "none")
    eager = harness.job("small", 8, 8, world)
    fixed = next(iter(eager.train_loader))
    timing, what = (cpu, 0, 1, 1), (world, "small", 8)
    step = harness.stepping(eager, lambda: fixed)
    failed = harness.compiled_variant(*what, ({"no_such_setting": True}, ()), step, fixed, timing)
    torch_words = ("AttributeError: torch._dynamo.config.no_such_setting does not exist", "KeyError: 'no_such_setting'")
    assert failed.keys() == {"error"} and failed["error"] in torch_words, failed  # (torch 2.4's words: the second)
    ran = harness.compiled_variant(*what, ({"disable": True}, ()), step, fixed, timing)
    assert ran["step_s"] > 0 and ran["eager_s"] > 0 and ran["first_two_steps_s"] > 0 and "cudagraph_skips" not in ran
    graphed = harness.compiled_variant(*what, ({"disable": True, "inductor.triton.cudagraphs": True}, ()), step, fixed,
                                       timing)  # fmt: skip
    assert graphed["cudagraph_skips"] == 0  # counted where CUDA graphs are asked for (none compiled here)

    variants = {"ddp_compiled": ran, "cuda_graphs": failed,
                "python_reducer": {**ran, "compiled_autograd_captures": 1, "reducer": "python"}}  # fmt: skip
    one = {"bare": 0.01, "ddp": 0.012, "ddp_torch_reduction": 0.0115, "stop_agreement_s": 1e-4, "variants": variants}
    monkeypatch.setattr(harness, "ddp_step_seconds", lambda world_size, name, batch, sizes: one)
    [row] = harness.ddp_overhead({"ddp": [("fast", 1024)]})
    assert row["compiled_variants"]["cuda_graphs"] == failed and row["ddp1_compiled_step_s"] == ran["step_s"]
    assert row["compiled_variants"]["ddp_compiled"]["vs_bare"] == pytest.approx(0.01 / ran["step_s"])
    table = "\n".join(ddp_table([row]))
    assert "| 10.0 | 12.0 | +20.0% | 11.5, +15.0% |" in table  # ddp.comm_hook=none beside the default
    assert f"| fast | 1024 | cuda_graphs | failed: {failed['error']}" in table
    assert f"| fast | 1024 | ddp_compiled | {ran['first_two_steps_s']:.1f} |" in table and table.count(" - |") == 2
    assert "| fast | 1024 | python_reducer (python reducer, 1 backwards compiled) |" in table

    one["variants"]["ddp_compiled"] = failed  # the default way failed too: its row says so, no figure
    [row] = harness.ddp_overhead({"ddp": [("fast", 1024)]})
    assert "ddp1_compiled_step_s" not in row and "not measured" in "\n".join(ddp_table([row]))


def test_bad_values_of_the_airbench_comparison_end_in_one_line(tmp_path, monkeypatch, capsys):
    """bench/airbench_steps.py: bad counts, LR scale or file, a batch over the images, a bad --ours: exit 2
    and the reason (its own run: tests/test_recipe.py). In this process: its main() parses, checks, ends."""
    from bench import airbench_steps

    (tmp_path / "lies.npz").write_text("not an npz")
    synthetic = ["--synthetic", "16", "--batch", "16", "--epochs", "2"]
    cases = [
        (["--synthetic", "0"], "--batch, --epochs and --synthetic are counts of at least 1"),
        (["--synthetic", "8", "--epochs", "0"], "--batch, --epochs and --synthetic are counts of at least 1"),
        (["--synthetic", "8", "--lr-scale", "nan"], "--lr-scale nan: a positive number"),
        (["--synthetic", "8", "--lr-scale", "-1"], "--lr-scale -1.0: a positive number"),
        (["--data", str(tmp_path / "lies.npz")], "lies.npz: not an .npz with y_train"),
        (["--synthetic", "8", "--batch", "16"], "--batch 16 is more than the 8 training images"),
        ([*synthetic, "--ours", "optim.lr=-1"], "optim.lr=-1.0 is out of range: it must be > 0"),
        ([*synthetic, "--ours", "optim.nope=1"], "unknown key 'optim.nope'"),
    ]
    for args, reason in cases:
        monkeypatch.setattr(sys, "argv", ["airbench_steps.py", *args])
        with pytest.raises(SystemExit) as exit_:
            airbench_steps.main()
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and reason in err and "Traceback" not in err, (args, err)


def test_step_capture_dry_run_times_the_eager_ways_in_turns_and_refuses_a_bad_call(tmp_path):
    """bench/step_capture.py on the CPU as the device call runs it: no CUDA graphs there, so the eager ways (the
    plain step and train_step, each bare and in DDP over gloo at world size 1) and run.cuda_graph's, replayed by
    calling again, and the weights of bare and DDP one step apart from the same state."""
    proc = subprocess.run([sys.executable, "bench/step_capture.py", str(tmp_path)], cwd=REPO,
                          env=clean_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "capture.json").read_text())
    timed, agreements = rows[:-2], rows[-2:]
    ways = ["eager bare", "eager ddp", "train_step bare", "train_step ddp", "recorded bare", "recorded ddp"]
    assert [r["way"] for r in timed] == ways and all(r["step_s"] > 0 for r in timed), rows
    # run.cuda_graph's Recorder (a CPU: its replay calls the step again on the static buffers): past its eager steps
    assert [r.get("replays", 0) > 0 for r in timed] == [False] * 4 + [True] * 2, rows
    # DDP over one rank from the bare job's weights, buffers and momentum: the same step, to the bit in float32
    apart = "weights after one step from the same state, {0} ddp against {0} bare"
    assert agreements == [{"way": apart.format(how), "model": "small", "batch": 16, "max_abs_diff": 0.0}
                          for how in ("eager", "recorded")]  # fmt: skip
    md = (tmp_path / "capture.md").read_text()
    assert "- DDP over the bare model, eager: " in md and "- DDP over the bare model, train_step: " in md, md
    assert "captured" not in md, md
    wrong = subprocess.run([sys.executable, "bench/step_capture.py"], cwd=REPO, env=clean_env(PYTHONPATH=str(REPO)),
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert wrong.returncode == 64 and "python bench/step_capture.py OUT_DIR" in wrong.stderr


def test_ddp_runs_dry_run_trains_one_process_and_torchrun_ddp_and_compares_their_later_epochs(tmp_path):
    """bench/ddp_runs.sh on the CPU (the probe ddp-runs' dry run): fast.yaml at toy sizes, one process and DDP at
    world size 1 under the real torchrun over gloo, eager; its table from each run's own metrics.jsonl."""
    proc = subprocess.run(["bash", "bench/ddp_runs.sh", str(tmp_path)], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "launcher=torchrun parallel=ddp world_size=1" in (tmp_path / "ddp-eager-1.log").read_text()
    assert "launcher=none" in (tmp_path / "one-eager-1.log").read_text()
    later = [statistics.mean(json.loads(r)["train_s"] for r in (tmp_path / f"{launch}-eager-1" / "metrics.jsonl")
                             .read_text().splitlines()[1:]) for launch in ("one", "ddp")]  # fmt: skip
    rows = (tmp_path / "ddp-runs.md").read_text().splitlines()
    assert len(rows) == 3 and rows[2].startswith(f"| eager | 1 | {later[0]:.4f} | {later[1]:.4f} | "), rows
    wrong = subprocess.run(["bash", "bench/ddp_runs.sh"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert wrong.returncode != 0 and "usage: bash bench/ddp_runs.sh OUT" in wrong.stderr
    for epochs in ("1", "x", "0", "-2"):  # no later epoch to average, or not a number: said before any run
        wrong = subprocess.run(["bash", "bench/ddp_runs.sh", str(tmp_path / "bad"), epochs], cwd=REPO,
                               capture_output=True, text=True, timeout=30)  # fmt: skip
        assert wrong.returncode == 64 and wrong.stderr == (
            f"ddp_runs.sh: EPOCHS must be a whole number >= 2 (the table is of epochs 2 on), not '{epochs}'\n"
        )
        assert not (tmp_path / "bad").exists()


def test_graphs_split_dry_run_writes_both_tables_and_leaves_out_the_steps_labels(tmp_path):
    """bench/graphs_split.py on the CPU (eager, toy sizes) as the device call runs it; and its kernel
    sums leave out the step's record_function labels, which a GPU trace lists beside the kernels."""
    proc = subprocess.run([sys.executable, "bench/graphs_split.py", str(tmp_path), "pair", "fused", "split"], cwd=REPO,
                          env=clean_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "pair.json").read_text())
    assert [r["launch"] for r in rows] == [
        "bare",
        "ddp",
        "ddp, one graph",
        "bare, compiled autograd",
        "ddp, python reducer, compiled autograd",
    ]
    assert all(r["graphs_step_s"] > 0 and r["profiled"]["host_span_ms"] > 0 for r in rows), rows
    assert all(r["profiled"]["kernels"] == 0 for r in rows)  # no CUDA
    assert [r.get("compiled_autograd_captures", 0) >= 1 for r in rows] == [False, False, False, True, True]
    assert [r.get("reducer") for r in rows] == [None, "c++", "c++", None, "python"]
    assert "| launch, profiled | kernels + copies a step |" in (pair := (tmp_path / "pair.md").read_text())
    assert "DDP over the bare model, both with CUDA graphs:" in pair and "| kernels DDP adds to the step |" in pair
    assert "DDP over the bare model, both with CUDA graphs, both with compiled autograd:" in pair
    assert "DDP over the bare model, both with CUDA graphs, DDP's step one graph (optimize_ddp=False):" in pair
    wrong = subprocess.run([sys.executable, "bench/graphs_split.py", str(tmp_path / "x"), "pairs"], cwd=REPO,
                           env=clean_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=60)  # fmt: skip
    said = wrong.stderr.strip().splitlines()[-1]
    assert wrong.returncode == 64 and said == "graphs_split.py: no part 'pairs' (the parts: pair, fused, split)"
    assert not (tmp_path / "x").exists()
    from ddp import optim

    fused = json.loads((tmp_path / "fused.json").read_text())  # a row where this torch fuses SGD on a CPU
    assert len(fused) == optim.steps_fused(torch.optim.SGD, [{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    assert all(row["model"] == "small" and row["fused_step_s"] > 0 < row["default_step_s"] for row in fused)
    (split,) = json.loads((tmp_path / "split.json").read_text())
    assert split["model"] == "small" and split["kinds_s"]["conv/matmul"] > 0
    assert "| conv/matmul |" in (tmp_path / "split.md").read_text()

    from bench import graphs_split

    class Event:
        def __init__(self, key, device_type, us):
            self.key, self.device_type, self.self_device_time_total = key, device_type, us

    class Profile:
        def key_averages(self):
            return [Event("forward", "DeviceType.CPU", 0), Event("aten::convolution", "DeviceType.CPU", 0),
                    Event("triton_poi_fused_native_batch_norm", "DeviceType.CPU", 0),  # inductor's launch mark
                    Event("forward", "DeviceType.CUDA", 9000.0),  # the label's span over its kernels
                    Event("sm90_xmma_fprop_implicit_gemm_bf16", "DeviceType.CUDA", 3000.0),
                    Event("triton_poi_fused_native_batch_norm", "DeviceType.CUDA", 1000.0)]  # fmt: skip

    times = graphs_split.kernels(Profile(), gpu=True)
    assert times == {"sm90_xmma_fprop_implicit_gemm_bf16": 0.003, "triton_poi_fused_native_batch_norm": 0.001}
    assert graphs_split.kind("sm90_xmma_fprop_implicit_gemm_bf16") == "conv/matmul"
    assert graphs_split.kind("void at::native::nchwToNhwcKernel") == "layout"
    assert graphs_split.kind("triton_poi_fused_native_batch_norm").startswith("other")


def test_recipe_steps_profiles_whole_steps_of_ours_and_of_airbenchs_own_code_and_reports_both(tmp_path):
    """bench/recipe_steps.py's dry run (CPU, host_cost's toy sizes; also host_cost's airbench row): each trace
    holds END - FIRST whole steps (7 convolutions a step), airbench's from its own train94 with its 2 parameter
    groups stepped for-each as on a GPU, not its construction or evaluation; the table has a row for each."""
    from bench import recipe_steps

    rows = recipe_steps.measure(tmp_path)
    steps = host_cost.END - host_cost.FIRST

    def ops(trace):
        return Counter(e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "cpu_op")

    ours, theirs = ops(tmp_path / "ours" / "profile" / "rank0.json"), ops(tmp_path / "airbench.json")
    assert ours["aten::conv2d"] == theirs["aten::conv2d"] == 7 * steps
    assert theirs["aten::_foreach_mul_"] == 2 * steps and ours["aten::_fused_sgd_"] == 3 * steps
    assert list(rows) == ["ours (configs/fast.yaml)", "airbench94"]  # the fp16 row needs CUDA
    rows["a third row"] = rows["airbench94"]  # as on a GPU: every table takes each row
    table = "\n".join(recipe_steps.report(rows))
    for label, r in rows.items():
        assert f"| {label} | {r['top_level_ops']:.1f} | " in table and r["top_level_ops"] > 0
        assert f"{label}: top 15 kernels" in table
    header = "| device ms by kind | ours (configs/fast.yaml) | airbench94 | a third row |"
    assert f"{header}\n| --- | ---: | ---: | ---: |" in table
    missing = subprocess.run([sys.executable, "bench/recipe_steps.py", str(tmp_path / "out"), "--airbench", "nope.tgz"],
                             cwd=REPO, capture_output=True, text=True, env=clean_env())  # fmt: skip
    assert missing.returncode == 64 and not (tmp_path / "out").exists()
    assert missing.stderr == "recipe_steps.py: --airbench nope.tgz: no such file (make gpu-carry puts it in .gpu/)\n"


def test_device_time_sums_a_traces_kernels_and_copies_per_step_by_kind(tmp_path):
    """graphs_split.device_time on a made-up trace of 2 steps (no GPU here): kernels and copies counted,
    their device time by kind and the span from the first to the last; host operators apart."""
    from bench import graphs_split

    def event(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        event("cpu_op", "aten::conv2d", 0, 400),
        event("kernel", "sm90_xmma_fprop_implicit_gemm", 10, 100),
        event("kernel", "triton_poi_fused_gelu", 200, 50),
        event("gpu_memcpy", "Memcpy HtoD", 300, 10),
        event("kernel", "triton_poi_fused_gelu", 500, 50),
        event("user_annotation", "forward", 0, 600),
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = graphs_split.device_time(trace, steps=2)
    assert got["kernels"] == 2 and got["device_ms"] == pytest.approx(0.105)
    assert got["device_span_ms"] == pytest.approx(0.27) and got["host_span_ms"] == pytest.approx(0.2)
    assert got["kinds_ms"] == pytest.approx({"conv/matmul": 0.05, "copy": 0.005, graphs_split.kind("gelu"): 0.05})
    assert got["by_name_ms"]["triton_poi_fused_gelu"] == pytest.approx(0.05)
    assert got["launches_by_name"] == pytest.approx({"sm90_xmma_fprop_implicit_gemm": 0.5, "triton_poi_fused_gelu": 1,
                                                     "Memcpy HtoD": 0.5})  # fmt: skip


def test_the_fp16_emulation_computes_a_cpu_fp16_convolution_as_a_gpu_does_within_one_fp16_rounding():
    """bench/fp16_cpu.py's conv2d, for fp16 tensors on the CPU: the output and both gradients (for a given gradient
    of the output) are the exact ones (float64) rounded to fp16, at most one fp16 step apart, in fp16; float32
    tensors take F.conv2d untouched. It was compared with the CPU's own fp16 convolution (100x slower), whose
    accuracy depends on the CPU: on an AMD EPYC with AVX-512 BF16 the two were up to 0.0117 apart (1e-3 allowed)."""
    from bench import fp16_cpu

    torch.manual_seed(0)
    x, w = torch.randn(4, 8, 12, 12).half(), (torch.randn(16, 8, 3, 3) / 8).half()
    upstream = torch.randn(4, 16, 12, 12).half()  # the gradient the output gets

    def conv(conv2d, dtype):
        xs, ws = x.to(dtype, copy=True).requires_grad_(), w.to(dtype, copy=True).requires_grad_()
        y = conv2d(xs, ws, None, 1, 1)
        y.backward(upstream.to(dtype))
        return y, xs.grad, ws.grad

    for ours, exact in zip(conv(fp16_cpu.conv2d, torch.float16), conv(F.conv2d, torch.float64), strict=True):
        assert ours.dtype == torch.float16
        torch.testing.assert_close(ours.double(), exact.half().double(), rtol=2**-10, atol=2**-24)  # 1 step
    assert torch.equal(fp16_cpu.conv2d(x.float(), w.float(), None, 1, 1), F.conv2d(x.float(), w.float(), None, 1, 1))


def test_epoch_pairs_runs_ours_in_turns_in_one_process_and_sets_each_pair_against_airbench94(tmp_path, capsys):
    """bench/epoch_pairs.py's dry run (CPU, toy sizes, no airbench94): both arms of ours in each pair, the order
    reversed in the second, each with its later epochs, epoch 1 and accuracy, checkpoints removed; the report, with
    airbench94's figures put in as a GPU has them, sets each arm against the airbench94 of its pair; a run that fails
    is one cell and the pairs go on; bad values are one line."""
    from bench import epoch_pairs

    assert epoch_pairs.main([str(tmp_path), "--dry-run", "--pairs", "2", "--arms", "fast,fast-fp16w"]) == 0
    pairs = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert [p["order"] for p in pairs] == [["airbench94", "fast", "fast-fp16w"], ["fast-fp16w", "fast", "airbench94"]]
    assert all(p[a]["later_s"] > 0 and 0 <= p[a]["accuracy"] <= 1 for p in pairs for a in ("fast", "fast-fp16w"))
    assert not list((tmp_path / "pairs").glob("*/checkpoints"))
    assert "| 2 | fast-fp16w, fast, airbench94 | - |" in (tmp_path / "pairs.md").read_text()
    pairs[0].update(airbench94={"later_s": 0.03, "epoch1_s": 0.031, "accuracy": 0.7}, fast={"later_s": 0.033,
                    "epoch1_s": 0.06, "accuracy": 0.71}, **{"fast-fp16w": epoch_pairs.ours(tmp_path / "bad", None,
                    ("run.amp=nope",), 1)})  # fmt: skip
    pairs[1].update(airbench94={"later_s": 0.04, "epoch1_s": 0.04, "accuracy": 0.69}, fast={"later_s": 0.036,
                    "epoch1_s": 0.05, "accuracy": 0.7})  # fmt: skip
    table = "\n".join(epoch_pairs.report(pairs, "# pairs", ["fast", "fast-fp16w"]))
    assert "| 1 | airbench94, fast, fast-fp16w | 0.0300 (epoch 1 0.0310, 70.00%) | 0.0330 (epoch 1 0.0600, 71.00%) " \
           "| 1.10x | failed (UsageError: run.amp: 'nope' is not one of" in table  # fmt: skip
    assert "- fast: median 0.0345 s an epoch over 2 runs (0.0330-0.0360); against airbench94 of the same pair: " \
           "median 1.00x (0.90x-1.10x), no slower in 1 of 2" in table  # fmt: skip
    broken = object.__new__(epoch_pairs.Airbench)  # airbench94 failing (an OOM, say) is a cell too
    broken.airbench, broken.loader = type("Airbench", (), {"train94": staticmethod(lambda **kwargs: 1 / 0)}), None
    assert broken.run(tmp_path / "ab") == {"failed": "ZeroDivisionError: division by zero"}
    assert (tmp_path / "ab.log").is_file()
    unknown_arm = (
        "--arms=fast,fast-graph: each once, of fast, fast-fp16w, fast-graphs, fast-fp16w-graphs, "
        "fast-recorded (fast-graph)"
    )
    refusals = ((["--pairs", "0"], "--pairs must be at least 1, not 0"), ([], "no CUDA device"),
                (["--arms", "fast,fast-graph"], unknown_arm), (["--arms", "fast,fast"], "(a repeat)"))  # fmt: skip
    for argv, told in refusals:
        if argv or not torch.cuda.is_available():
            with pytest.raises(SystemExit) as refused:
                epoch_pairs.main([str(tmp_path / "refused"), *argv])
            assert refused.value.code == 2 and told in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
