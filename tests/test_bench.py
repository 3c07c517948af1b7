"""The bench's options refused with one line. `python -m bench --quick` itself (the full bench's
code at small sizes) is make gpu-check's dry-run bench step: tests/test_gpu_check.py checks its output."""

import subprocess
import sys

from conftest import REPO, clean_env


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
