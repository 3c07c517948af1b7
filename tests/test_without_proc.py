"""A system without Linux's process interfaces, as macOS is: no /proc, no os.sched_getaffinity, no libc prctl. Made
here for real where it can be (a mount namespace whose /proc is an empty tmpfs) and by a sitecustomize that takes the
two calls away, with macOS's way of starting processes (spawn); not a Mac (torch's own cpuinfo reads /proc on Linux,
and says so in the output)."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, clean_env, metrics

from ddp import pausing

SITECUSTOMIZE = """
import ctypes, multiprocessing, os
multiprocessing.set_start_method("spawn")  # macOS's default: DataLoader workers import anew
del os.sched_getaffinity
class _NoPrctl(ctypes.CDLL):
    def __getattr__(self, name):
        if name == "prctl":
            raise AttributeError(name)
        return super().__getattr__(name)
ctypes.CDLL = _NoPrctl
"""
WITHOUT_PROC = 'mount -t tmpfs none /proc && exec "$@"'


def without_proc(tmp_path: Path, *args: str, **popen) -> subprocess.Popen:
    """`args` run in a mount namespace of their own whose /proc is empty, without sched_getaffinity and prctl."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a mount namespace with an empty /proc needs root and unshare (util-linux): run the tests as root")
    (tmp_path / "site").mkdir(exist_ok=True)
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = clean_env(PYTHONPATH=str(tmp_path / "site"))
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", WITHOUT_PROC, "sh", sys.executable, *args]
    return subprocess.Popen(command, cwd=REPO, env=env, text=True, **popen)


def test_without_proc_a_run_trains_and_ddp_torchrun_says_ctrl_z_does_not_pause_and_stops_and_resumes_on_ctrl_c(
    tmp_path,
):
    """A student's Mac: every run ended in `AttributeError: module 'os' has no attribute 'sched_getaffinity'` (the
    CPUs a rank's threads may use); the machine's CPU count stands in. ddp/torchrun.py's Ctrl-Z finds the ranks it
    pauses in /proc: without it, one line says the job goes on (it stopped itself, the ranks training on alone), and
    Ctrl-C stops the job with a checkpoint, which the same command resumes."""
    plain = without_proc(tmp_path, "ddp/train.py", *TINY, "train.epochs=1", "data.loader=torch", "data.workers=1",
                         f"run.out_dir={tmp_path / 'plain'}", stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)  # fmt: skip
    out, err = plain.communicate(timeout=120)
    assert plain.returncode == 0 and f"threads={os.cpu_count()} " in out, (out, err)
    job = ["ddp/torchrun.py", "--standalone", "--nproc_per_node=2", "ddp/train.py", *TINY, "train.epochs=40",
           f"run.out_dir={tmp_path / 'job'}"]  # fmt: skip
    agent = without_proc(tmp_path, *job, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    limit = threading.Timer(90, agent.kill)  # (an agent that stops itself would hold the reads below for good)
    limit.start()
    try:
        while (line := agent.stdout.readline()) and not line.startswith("epoch 1/"):
            pass
        agent.send_signal(signal.SIGTSTP)
        while (line := agent.stderr.readline()) and not line.startswith("note: Ctrl-Z"):
            pass
        assert line.startswith("note: Ctrl-Z does not pause ranks it cannot find on this system (no /proc"), line
        time.sleep(0.5)
        assert pausing._state(agent.pid) not in "TtZX"  # (this test's own /proc sees it)
        agent.send_signal(signal.SIGINT)
        out, err = agent.communicate(timeout=60)
    finally:
        limit.cancel()
        agent.kill()
    assert agent.returncode == 130 and "stopping on SIGINT: checkpoint" in out + err, (out, err)
    stopped_at = metrics(tmp_path / "job")[-1]["epoch"]
    again = without_proc(tmp_path, *job[:-2], "train.epochs=" + str(stopped_at + 1), job[-1],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0 and "resum" in out + err, (out, err)
    assert [m["epoch"] for m in metrics(tmp_path / "job")][-1] == stopped_at + 1


def test_on_windows_every_command_says_it_needs_a_posix_system_instead_of_a_traceback():
    """Windows has no SIGTSTP, no pwd module, no fork: an import of ddp ended in a ModuleNotFoundError's traceback
    (ddp.errors imports pwd). The package's first lines say what to do instead (WSL2). Not run on Windows: the
    check is of sys.platform, set here before the import."""
    windows = "import runpy, sys; sys.platform = 'win32'; sys.argv = ['ddp/train.py']; runpy.run_path(sys.argv[0])"
    proc = subprocess.run([sys.executable, "-c", windows], cwd=REPO, env=clean_env(), capture_output=True, text=True)
    said = "error: ddp-cifar needs a POSIX system (Linux, macOS): on Windows, run it in WSL2\n"
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, said, ""), proc.stderr
