"""What a run shows while it runs: a tqdm bar with loss, lr and img/s on rank 0 in a terminal, only
the epoch lines elsewhere; run.debug for tracebacks."""

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios
import time

import torch
from conftest import REPO, TINY, TORCHRUN, TRAIN, clean_env, python

BIG = [*TINY, "data.synthetic_train=2048", "train.epochs=2"]  # 64 steps an epoch: 2-4 s here, a bar with loss=
# Where no bar (or one bar, not two) may show: 32 steps an epoch (1-2 s here), long enough for a bar's
# loss= (after 0.25 s; 6 of them in a terminal here); a bar drawn at all shows "it/s" from its first line.
MID = [*TINY, "data.synthetic_train=1024", "train.epochs=2"]


def in_terminal(*cmd: str) -> str:
    """Run cmd with stdout and stderr on a pseudo-terminal of 120 columns; everything it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal closed: the process is gone
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=300) == 0, out.decode()
    return out.decode()


def test_a_terminal_gets_a_bar_with_loss_lr_and_images_per_second(tmp_path):
    out = in_terminal(sys.executable, str(TRAIN), *BIG, f"run.out_dir={tmp_path}")
    assert "epoch 1:" in out and "it/s" in out
    assert "loss=" in out and "lr=" in out and "img/s=" in out
    assert out.count("epoch 1/2  loss") == 1 and out.count("epoch 2/2  loss") == 1  # one summary line each


def test_progress_false_or_a_pipe_gives_only_the_epoch_lines(tmp_path):
    quiet = in_terminal(sys.executable, str(TRAIN), *MID, f"run.out_dir={tmp_path / 'a'}", "run.progress=false")
    piped = python(str(TRAIN), *MID, f"run.out_dir={tmp_path / 'b'}")
    for out in (quiet, piped.stdout + piped.stderr):
        assert "it/s" not in out and "loss=" not in out
        assert out.count("epoch 1/2  loss") == 1 and out.count("epoch 2/2  loss") == 1


def test_under_torchrun_only_rank_0_shows_anything(tmp_path):
    out = in_terminal(TORCHRUN, "--standalone", "--nproc_per_node=2", str(TRAIN), *MID, f"run.out_dir={tmp_path}")
    assert out.count("small (0.09M params)") == 1  # the start line, once
    assert out.count("epoch 2/2  loss") == 1
    assert out.count("epoch 1:   0%") <= 1  # one bar (rank 1 draws none)


def test_run_debug_shows_the_traceback_instead_of_one_line(tmp_path):
    plain = python(str(TRAIN), "run.device=gpu", f"run.out_dir={tmp_path}")
    debug = python(str(TRAIN), "run.device=gpu", "run.debug=true", f"run.out_dir={tmp_path}")
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr
    assert "UsageError: run.device='gpu' is not a device" in debug.stderr
    in_file = tmp_path / "debug.yaml"
    in_file.write_text("run:\n  debug: true\n")
    from_yaml = python(str(TRAIN), "--config", str(in_file), "run.device=gpu", f"run.out_dir={tmp_path}")
    assert "Traceback (most recent call last)" in from_yaml.stderr  # a config file can ask for it too
    broken = python(str(TRAIN), "optim.lrr=1", "run.debug=true")  # even when the config cannot load
    assert "Traceback" in broken.stderr and "unknown key 'optim.lrr'" in broken.stderr


def test_cpu_runs_log_no_gpu_memory(tmp_path):
    python(str(TRAIN), *TINY, "train.epochs=1", f"run.out_dir={tmp_path}")
    first = (tmp_path / "metrics.jsonl").read_text()
    assert "gpu_allocated_mb" not in first and '"confusion"' in first


def test_a_note_mid_epoch_is_a_line_of_its_own_and_the_bar_is_drawn_again_below_it(monkeypatch):
    """logs.say while the bar shows (the hold's note, from the training loop): it was glued to the bar's end."""
    from ddp import logs

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    for batch in logs.Progress(range(4), True, "epoch 1", 1):
        if batch == 2:
            logs.say("note: holding")
    before, after = sys.stdout.getvalue().split("note: holding\n")
    assert before.startswith("\repoch 1:") and before.endswith("\r") and after.startswith("\repoch 1:"), (before, after)


def test_the_bars_own_rate_and_elapsed_time_leave_out_a_pause(monkeypatch):
    """A pause or hold between two steps (here 0.6 s that lifeline counts as stopped): tqdm's elapsed time, its it/s
    and its ETA counted it, for a few refreshes after a long pause; the bar's img/s and the epoch's time did not."""
    from ddp import lifeline, logs

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    stopped = [0.0]
    monkeypatch.setattr(lifeline, "stopped_s", lambda: stopped[0])
    progress = logs.Progress(range(3), True, "epoch 1", 1)
    for batch in progress:
        if batch == 1:
            time.sleep(0.6)
            stopped[0] += 0.6
        progress.update(torch.tensor(1.0), 0.1, 64)
    assert progress.bar.format_dict["elapsed"] < 0.4, progress.bar.format_dict
