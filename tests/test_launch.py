import os
import subprocess
import sys

import pytest
from conftest import REPO, TINY, clean_env, metrics

SCRIPTS = sorted((REPO / "launch").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launch_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_torchrun_launcher_defaults_to_2_cpu_processes_and_passes_arguments(tmp_path):
    env = clean_env(PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")
    env.pop("NPROC", None)
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "torchrun.sh"), *TINY, "train.epochs=1", f"run.out_dir={tmp_path}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "+ torchrun --standalone --nproc_per_node=2" in proc.stderr
    assert metrics(tmp_path)[0]["world_size"] == 2
