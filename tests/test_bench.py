"""python -m bench --quick: the same code as the full bench, small sizes (CPU, under a minute)."""

import json
import subprocess
import sys

from conftest import REPO, clean_env


def test_quick_bench_writes_json_and_a_markdown_table(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "quick-cpu.json").read_text())
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
    table = (tmp_path / "quick-cpu.md").read_text()
    assert table.startswith("# ddp.bench on CPU only (quick)")
    for heading in ("## Training images/s", "## Data path alone", "## DDP overhead", "## Startup"):
        assert heading in table
    assert f"| CPU | small | 128 | {train['ours_img_s']:.0f} |" in table


def test_bad_values_of_the_gpu_bench_options_end_in_one_line():
    """--gpu-only without a GPU, and bench/lightning_fast.py given a bad count, setting or file: exit 2
    and the reason, before anything trains (the Lightning run itself: tests/test_gpu_check.py)."""
    cases = [
        (["-m", "bench", "--gpu-only", "--quick"], "--gpu-only: no CUDA device here"),
        (["bench/lightning_fast.py", "--out", "r.json", "--workers", "-1"], "'-1' is not a count of processes"),
        (["bench/lightning_fast.py", "--out", "r.json", "train.batch_size=0"], "train.batch_size=0 is out of range"),
        (["bench/lightning_fast.py", "--out", "r.json", "data.dataset=npz", "data.path=/no/such.npz"],
         "data.path=/no/such.npz: no such file"),
    ]  # fmt: skip
    for args, reason in cases:
        proc = subprocess.run([sys.executable, *args], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 2 and reason in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert not (REPO / "r.json").exists()
