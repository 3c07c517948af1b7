"""`make gpu-check --dry-run` on this CPU: bench/gpu_check.sh runs every step end to end at toy sizes
(so that on a lent GPU machine it cannot fail for a typo), writes each step's log and summary.md, and
its exit status counts the failed steps."""

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from conftest import REPO, clean_env, has_fsdp2, kill_orphans, seconds_until_gone, session


def test_gpu_check_dry_run_runs_every_step(tmp_path):
    """Into a folder an earlier check left (its checkpoints would stop run.resume=never), as a rerun is."""
    for name in ("fast", "resnet18", "ranks-2"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        (tmp_path / name / "checkpoints" / "step-000000004.pt").write_bytes(b"an earlier check's")
    env = clean_env(GPU_CHECK_OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    summary = (tmp_path / "summary.md").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fsdp2 = has_fsdp2()  # (torch 2.4, 2.5: the step says it needs torch 2.6)
    steps = ("env", "tests", "bench", "fast", "resnet18", "ranks", "fsdp", "lightning")
    for step in [s for s in steps if fsdp2 or s != "fsdp"]:
        assert f"| {step} | ok (" in summary, (step, summary)
        assert (tmp_path / f"{step}.log").is_file()
    if not fsdp2:
        assert "| fsdp | skipped: run.parallel=fsdp needs torch >= 2.6 (FSDP2), this is 2." in summary, summary
    assert "| airbench |" in summary  # skipped here without .gpu/ (or run, with it)
    assert (tmp_path / "ranks-2" / "metrics.jsonl").read_text().count('"epoch"') == 2  # killed, resumed, done
    assert "| fast | 1 |" in summary and "| resnet18 | 1 |" in summary
    if fsdp2:
        fsdp = (tmp_path / "fsdp-1.md").read_text()  # FSDP2 beside DDP, one row each
        assert "| ddp | 1 | gloo, cpu |" in fsdp and "| fsdp | 1 | gloo, cpu |" in fsdp
    lightning = json.loads((tmp_path / "lightning.json").read_text())  # the same net and recipe, in Lightning
    assert lightning["optimizer_steps"] == 128 // 64 and [e["epoch"] for e in lightning["epochs"]] == [1]
    assert lightning["test_images"] == 64 and 0 <= lightning["epochs"][0]["test_acc"] <= 1
    assert "lightning 2." in summary and "ddp/train.py:" in summary
    check_quick_bench(tmp_path)  # its bench step is python -m bench --quick


def check_quick_bench(out):
    """python -m bench --quick (the dry run's bench step): its JSON and its Markdown table."""
    result = json.loads((out / "quick-cpu.json").read_text())
    assert result["quick"] and result["machine"]["cores"] >= 1 and result["machine"]["torch"]
    (train,) = result["train"]
    assert (train["device"], train["model"], train["batch"]) == ("CPU", "small", 128)
    for key in ("ours_img_s", "one_batch_img_s", "tutorial_pipeline_img_s", "peak_mb"):
        assert train[key] > 0, key
    loaders = {row["loader"]: row["img_s"] for row in result["data_path"]}
    assert "device-resident (ours)" in loaders and "torchvision DataLoader, 0 workers" in loaders
    assert "torchvision DataLoader, 2 workers" in loaders and all(v > 0 for v in loaders.values())
    (ddp,) = result["ddp"]
    assert ddp["bare_step_s"] > 0 and ddp["ddp1_step_s"] > 0 and ddp["processes"] == 2 and ddp["ddpN_step_s"] > 0
    assert 0 < result["startup"]["startup_s"] < 120
    table = (out / "quick-cpu.md").read_text()
    assert table.startswith("# ddp.bench on CPU only (quick)")
    for heading in ("## Training images/s", "## Data path alone", "## DDP overhead", "## Startup"):
        assert heading in table
    assert f"| CPU | small | 128 | {train['ours_img_s']:.0f} |" in table


def test_gpu_check_runs_only_the_steps_named_and_refuses_an_unknown_one(tmp_path):
    env = clean_env(GPU_CHECK_OUT=str(tmp_path), PYTHON=sys.executable)
    run = lambda *steps: subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", *steps], cwd=REPO, env=env,  # noqa: E731
                                        capture_output=True, text=True, timeout=120)  # fmt: skip
    proc = run("env", "bnech")
    assert proc.returncode == 64 and "no step 'bnech'" in proc.stderr and not (tmp_path / "summary.md").exists()
    proc = run("env")
    summary = (tmp_path / "summary.md").read_text()
    assert proc.returncode == 0 and "| env | ok (" in summary and "| bench |" not in summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.log", "summary.md"]


def test_a_failing_step_is_counted_in_the_exit_status(tmp_path):
    """A broken step (here: ddp/train.py given a python that is not there for the bench) fails the
    command with the number of failed steps, and the summary names it."""
    env = clean_env(GPU_CHECK_OUT=str(tmp_path), PYTHON="/nonexistent/python")
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode >= 5 and "FAILED" in (tmp_path / "summary.md").read_text()


def lease(tmp_path, *args, python="true", **env):
    """bash bench/gpu_lease.sh --dry-run ARGS, its archive in tmp_path/out, its work in tmp_path/work.
    The check's steps run PYTHON: here `true` (done at once) or a stand-in that takes 60 s and ignores
    SIGTERM: what these
    tests watch is the lease's packing and time limit, not the steps (the dry-run tests above run them)."""
    if python == "slow":
        python = tmp_path / "slow-python"
        python.write_text(f"#!/bin/sh\necho $$ >>{tmp_path / 'pids'}\ntrap '' TERM\nexec sleep 60\n")  # deaf to TERM
        python.chmod(0o755)
    env = clean_env(OUT=str(tmp_path / "out"), GPU_LEASE_DIR=str(tmp_path / "work"), PYTHON=str(python), **env)
    return ["bash", "bench/gpu_lease.sh", "--dry-run", *args], env


def packed(tmp_path):
    with tarfile.open(tmp_path / "out" / "gpu-lease.tgz") as archive:
        return archive.getnames()


def test_a_gpu_lease_brings_back_what_it_wrote_when_its_time_or_its_call_runs_out(tmp_path):
    """A device call brings back at most 8 files from $OUT and nothing at all of a command killed before
    it packed them: bench/gpu_lease.sh packs the check's folder at the end, at its own time limit too
    (ending the step that runs on, which ignores SIGTERM, with SIGKILL to the whole group), and
    every GPU_LEASE_PACK_S seconds while the check runs, so a kill of the whole call (the device tool's
    limit) still leaves an archive."""
    command, env = lease(tmp_path, "1", python="slow", CHECK_STEPS="bench")
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 124 and "out of time after 1 s" in proc.stderr, proc.stdout + proc.stderr
    assert "work/check/bench.log" in packed(tmp_path) and not (tmp_path / "out" / "summary.md").exists()
    seconds_until_gone([int(p) for p in (tmp_path / "pids").read_text().split()], time.monotonic(), limit=5)

    (tmp_path / "out" / "gpu-lease.tgz").unlink()
    command, env = lease(tmp_path, "120", python="slow", CHECK_STEPS="bench", GPU_LEASE_PACK_S="1")
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "out" / "gpu-lease.tgz").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        kill_orphans(session(proc.pid))  # the whole call, as the device tool's limit
        proc.wait(timeout=30)
    assert "work/check/bench.log" in packed(tmp_path)


def test_a_gpu_lease_run_to_its_end_packs_the_summary_and_refuses_bad_values_in_one_line(tmp_path):
    command, env = lease(tmp_path, "120", python=sys.executable, CHECK_STEPS="env fast")
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "files in" in proc.stdout, proc.stdout + proc.stderr
    names = set(packed(tmp_path))
    assert {"work/.gpu-lease", "work/check/env.log", "work/check/summary.md", "work/later-epochs.md"} <= names
    assert "work/check/fast/metrics.jsonl" in names and not any(n.endswith(".pt") for n in names)
    # later-epochs.md, printed last: the dry run's one epoch has no later ones (airbench94: not a step here)
    assert proc.stdout.splitlines()[-2].startswith("| fast | 1 | - | - | "), proc.stdout
    assert "| env | ok (" in (tmp_path / "out" / "summary.md").read_text()
    bad = [(("0",), {}, "SECONDS must be a whole number >= 1, not '0'"),
           (("9m",), {}, "SECONDS must be a whole number >= 1, not '9m'"),
           ((), {"GPU_LEASE_PACK_S": "-1"}, "GPU_LEASE_PACK_S must be a whole number >= 1, not '-1'"),
           ((), {"GPU_LEASE_DIR": str(REPO)}, "holds files this script did not write: name a new or empty folder"),
           ((), {"GPU_LEASE_DIR": str(tmp_path / "out")}, "did not write: name a new or empty folder"),
           ((), {"PROBES": "mfu nope"}, "no probe 'nope' (the probes: ddp tune mfu graphs fast-graphs fast-seeds "
                                        "fast-muon fast-fp16 graphs-split recipe-steps overhead steps pairs capture "
                                        "ddp-runs alloc-conf fsdp)"),
           ((), {"PROBES": "mfu", "MFU_MODES": "fast"}, "MFU_MODES: 'fast' is no run.compile_mode (one of: default "
                                                        "reduce-overhead max-autotune max-autotune-no-cudagraphs)"),
           ((), {"PROBES": "mfu", "MFU_MODELS": "fast:0"}, "MFU_MODELS: 'fast:0' is not MODEL:BATCH (fast:8192, say)"),
           ((), {"PROBES": "mfu", "MFU_MODELS": "fast8192"}, "'fast8192' is not MODEL:BATCH (fast:8192, say)"),
           ((), {"GRAPHS_SPLIT": "pair splt"}, "GRAPHS_SPLIT: no part 'splt' (the parts: pair fused split)"),
           ((), {"PROBES": "pairs", "PAIRS": "0"}, "PAIRS: '0' is not a whole number >= 1 (the pairs probe's count)"),
           ((), {"PAIRS_ARMS": "fast,graphs"}, "PAIRS_ARMS: no arm 'graphs' (the arms: fast fast-fp16w fast-graphs "
                                               "fast-fp16w-graphs fast-recorded, comma-separated)"),
           ]  # fmt: skip
    for args, more, said in bad:
        command, env = lease(tmp_path, *args)
        env.update(more)
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 64 and proc.stderr.strip().endswith(said) and len(proc.stderr.splitlines()) == 1
    assert (REPO / "ddp" / "train.py").is_file()
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # python3: this environment's, with torch
    env = clean_env(OUT=str(tmp_path / "probe"), MFU_MODELS="fast:64 nonet:64", PATH=path)
    unknown = subprocess.run(["bash", "bench/gpu_probe.sh", "mfu"], cwd=REPO, env=env, capture_output=True, timeout=60)
    said = (tmp_path / "probe" / "probe-mfu.log").read_text()
    assert unknown.returncode == 1 and unknown.stderr.decode().strip().endswith("gpu_probe.sh: failed: mfu")
    assert said.startswith("gpu_probe.sh mfu: MFU_MODELS names ['nonet'], not models (the models:")


def test_the_alloc_conf_probe_tables_what_a_run_says_of_each_setting(tmp_path):
    """bench/gpu_probe.sh alloc-conf on this CPU (ALLOC_CONF_DEVICE=cpu): a good setting trains, a malformed one is
    ddp-cifar's line and exit 2; on a GPU the same table shows what torch says at its first CUDA use."""
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # python3: this environment's, with torch
    env = clean_env(OUT=str(tmp_path), ALLOC_CONF_DEVICE="cpu", ALLOC_CONFS="expandable_segments:True a=b", PATH=path)
    proc = subprocess.run(["bash", "bench/gpu_probe.sh", "alloc-conf"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = (tmp_path / "alloc-conf.md").read_text().splitlines()[2:]
    assert len(rows) == 2 and rows[0].startswith("| `expandable_segments:True` | 0 | epoch 1/1 "), rows
    assert rows[1].startswith("| `a=b` | 2 | error: PYTORCH_CUDA_ALLOC_CONF='a=b': option 'a=b' has no value"), rows


AIRBENCH_PRINTED = """\
----------------------------------------------------------------------------------------
|  run     |  epoch  |  train_loss  |  train_acc  |  val_acc  |  tta_val_acc  |  total_time_seconds  |
----------------------------------------------------------------------------------------
|      0  |      0  |      1.7310  |     0.3916  |   0.3702  |               |              0.1044  |
|         |      1  |      1.3999  |     0.5371  |   0.5011  |               |              0.1601  |
|         |   eval  |      1.3999  |     0.5371  |   0.5011  |       0.5230  |              0.1710  |
----------------------------------------------------------------------------------------
"""


def test_airbench_per_epoch_table_is_read_and_set_beside_ours(tmp_path):
    """bench/airbench_subset.py keeps airbench's printed per-epoch rows (not its warm-up's or the final
    TTA row); gpu_summary.py sets them beside the fast run's epochs, with the seconds summed: the
    training's alone (train_s, what airbench's timer counts) and with the evaluations."""
    from bench import airbench_subset, gpu_summary

    rows = airbench_subset.per_epoch(AIRBENCH_PRINTED)
    assert rows == [
        {"epoch": 1, "val_acc": 0.3702, "total_time_seconds": 0.1044},
        {"epoch": 2, "val_acc": 0.5011, "total_time_seconds": 0.1601},
    ]
    result = {"train_images": 6034, "test_images": 1017, "device": "a GPU", "accuracy": 0.523, "seconds": 0.17,
              "epochs": 9.9, "per_epoch": rows}  # fmt: skip
    (tmp_path / "airbench.json").write_text(json.dumps(result))
    (tmp_path / "fast").mkdir()
    record = {"train_loss": 2.0, "per_class_acc": [0.5], "classes": ["a"]}  # a run's, as plot.read_run takes them
    ours = [{**record, "epoch": 1, "test_acc": 0.25, "train_s": 4.25, "seconds": 4.5},
            {**record, "epoch": 2, "test_acc": 0.5, "train_s": 0.25, "seconds": 0.5}]  # fmt: skip
    (tmp_path / "fast" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ours))
    table = gpu_summary.airbench(tmp_path)
    assert "| 1 | 37.02% | 0.10 | 25.00% | 4.25 | 4.50 |" in table, table
    assert "| 2 | 50.11% | 0.16 | 50.00% | 4.50 | 5.00 |" in table, table
    (tmp_path / "fast-fp16").mkdir()  # a probe's run that failed before its first epoch ended
    (tmp_path / "fast-graphs").mkdir()  # one that reached 70% (airbench94 here did not)
    reached = [{**record, "epoch": 1, "test_acc": 0.5, "train_s": 2.0, "seconds": 2.5},
               {**record, "epoch": 2, "test_acc": 0.75, "train_s": 0.125, "seconds": 0.25}]  # fmt: skip
    (tmp_path / "fast-graphs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reached))
    later = gpu_summary.later_epochs(tmp_path, [tmp_path / "fast-fp16", tmp_path / "fast-graphs"])
    assert later[2:] == [  # epochs 2 on: 0.25 s and 0.125 s against airbench's 0.0557 s
        "| airbench94 | 2 | 0.0557 | 1.00x | not reached | - | 52.30% (its TTA) |",
        "| fast | 2 | 0.2500 | 4.49x | not reached | - | 50.00% |",
        "| fast-fp16 | - | no finished epoch | - | - | - | - |",
        "| fast-graphs | 2 | 0.1250 | 2.24x | 2.125 (epoch 2) | - | 75.00% |"]  # fmt: skip
    result["per_epoch"][1]["val_acc"] = 0.7  # airbench94 at 70% after its epoch 2, 0.1601 s
    (tmp_path / "airbench.json").write_text(json.dumps(result))
    assert gpu_summary.later_epochs(tmp_path, [tmp_path / "fast-graphs"])[-1] == (
        "| fast-graphs | 2 | 0.1250 | 2.24x | 2.125 (epoch 2) | 13.27x | 75.00% |"
    )
    (tmp_path / "airbench.json").write_text(json.dumps(result)[:40])  # airbench_subset.py cut off as it wrote it
    assert gpu_summary.airbench(tmp_path) == ["airbench94: its airbench.json is not whole (cut off as it was written)"]
    assert gpu_summary.later_epochs(tmp_path, [])[2:] == [
        "| airbench94 | - | its airbench.json is not whole | - | - | - | - |",
        "| fast | 2 | 0.2500 | - | not reached | - | 50.00% |"]  # fmt: skip


def test_gpu_rounds_dry_run_sets_each_rounds_runs_beside_each_other_and_refuses_bad_values(tmp_path):
    """bench/gpu_rounds.sh --dry-run: a round's two fast runs (bf16 and fp16 weights: float32 here) at toy sizes,
    its table and each run's first epoch in rounds.md, packed; a bad ROUNDS or another's folder refused."""
    env = clean_env(OUT=str(tmp_path / "out"), GPU_ROUNDS_DIR=str(tmp_path / "work"), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "bench/gpu_rounds.sh", "--dry-run", "1"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = (tmp_path / "out" / "rounds.md").read_text()
    assert said.startswith("## round 1 (airbench fast fast-fp16w)")
    assert "| fast | 2 | " in said and "| fast-fp16w | 2 | " in said
    assert "fast: epoch 1 " in said and "fast-fp16w: epoch 1 " in said and "warm-up" in said
    with tarfile.open(tmp_path / "out" / "gpu-rounds.tgz") as archive:
        names = archive.getnames()
    assert "work/round1/fast-fp16w/metrics.jsonl" in names and not any(n.endswith(".pt") for n in names)
    for args, more, told in (
        (["0"], {}, "ROUNDS must be a whole number >= 1, not '0'"),
        (["x"], {}, "ROUNDS must be a whole number >= 1, not 'x'"),
        (["1"], {"GPU_ROUNDS_DIR": str(REPO / "ddp")}, f"{REPO / 'ddp'} is not this script's"),
        (["1"], {"GPU_ROUNDS_DIR": str(tmp_path / "out")}, "GPU_ROUNDS_DIR is $OUT: name another"),
    ):
        wrong = subprocess.run(["bash", "bench/gpu_rounds.sh", "--dry-run", *args], cwd=REPO, env={**env, **more},
                               capture_output=True, text=True, timeout=30)  # fmt: skip
        assert wrong.returncode == 64 and wrong.stderr.strip() == f"gpu_rounds.sh: {told}", wrong.stderr
    assert (REPO / "ddp" / "train.py").is_file()
