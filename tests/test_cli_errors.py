"""Every bad input a user can type: exit code 2 and one line on stderr, never a traceback.

Run as real processes (`python ddp/train.py ...`), the way users meet them, where the process is
what is tested (the launcher variables, CUDA hidden, torchrun's report); the long list of bad values
runs through train.cli in this process (the same code, without the interpreter around it)."""

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, TINY, TRAIN, clean_env, forks, metrics, piped, python, torchrun
from launch_envs import TORCHRUN

from ddp import cli, errors, lost_rank, rundir, train


def assert_usage_error(proc, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


LONG = "/tmp/" + "a" * 300  # a path with one name longer than a filesystem's 255 bytes


def test_bad_input_exits_2_with_one_line_as_a_real_process(tmp_path):
    """The command itself: `python ddp/train.py` with a bad value exits 2 with the one line (the
    rest of the values below are checked in this process, through the same train.cli)."""
    assert_usage_error(python(str(TRAIN), f"run.out_dir={tmp_path}", "optim.lr=fast"), "optim.lr: expected float")


# Real processes with CUDA hidden, as on every CI machine: "cuda:7" and "cuda" fail for want of any
# GPU (the one-GPU case of cuda:7 is covered in test_distributed with a given GPU count). In this
# process a GPU machine's CUDA could not be hidden any more.
@pytest.mark.parametrize(
    "args, fragments",
    [
        (["run.device=cuda:7"], ["run.device=cuda:7 but no CUDA GPU is visible"]),
        (["run.device=cuda"], ["run.device=cuda but no CUDA GPU is visible"]),
        (["run.parallel=dp"], ["run.parallel=dp needs at least 2 visible GPUs, found 0"]),
        (["run.amp=fp16"], ["run.amp=fp16 needs a CUDA device"]),
    ],
)
def test_bad_input_for_want_of_a_gpu_exits_2_with_one_line(args, fragments, tmp_path):
    assert_usage_error(python(str(TRAIN), f"run.out_dir={tmp_path}", *args), *fragments)


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["run.device=cuda0"], ["run.device='cuda0' is not a device"]),
        (["run.device=gpu"], ["run.device='gpu' is not a device"]),
        (["run.parallel=ddp"], ["torchrun --standalone --nproc_per_node=N"]),
        (["optim.lrr=1"], ["unknown key 'optim.lrr'", "valid keys in optim"]),
        (["--config", "nope.yaml"], ["config file not found: nope.yaml"]),
        (["--config", "configs"], ["--config configs: Is a directory; name a YAML file, e.g. configs/quick.yaml"]),
        (
            ["--config", "configs/quick.yaml", "--config=configs/fast.yaml"],
            ["--config is given twice (configs/quick.yaml and configs/fast.yaml): give it once"],
        ),
        (["data.dataset=npz"], ["data.dataset=npz needs data.path"]),
        (["data.root=README.md", "data.download=false"], ["data.root=README.md is a file, not a directory"]),
        (["data.dataset=npz", "data.path=/no/such.npz"], ["data.path=/no/such.npz: no such file"]),
        (["data.dataset=npz", "data.path=configs"], ["data.path=configs is a directory: name the .npz file"]),
        (["data.dataset=npz", "data.path=/dev/null"], ["data.path=/dev/null: not a regular file (a pipe or a device"]),
        (["--bogus"], ["unknown option --bogus"]),
        (["--epochs", "3"], ["unknown option --epochs (settings are section.key=value: train.epochs=3)"]),
        (["--Batch-Size=256"], ["--Batch-Size=256 (settings are section.key=value: train.batch_size=256)"]),
        (["--lr", "--config", "x"], ["unknown option --lr (settings are section.key=value: optim.lr=VALUE)"]),
        (["--lr="], ["unknown option --lr= (settings are section.key=value: optim.lr=VALUE)"]),
        (["--nproc-per-node=4"], ["unknown option --nproc-per-node=4 (torchrun's option: it goes before ddp/train.py"]),
        (["run.stop_signal=SIGFOO"], ["run.stop_signal: 'SIGFOO' is not a signal that can be caught"]),
        (["run.stop_signal=KILL"], ["run.stop_signal: 'KILL' is not a signal that can be caught"]),
        (["optim.lrr=1"], ["did you mean 'optim.lr'?"]),
        (["optimizer.lr=1"], ["unknown section 'optimizer'", "did you mean 'optim'?"]),
        (["optim.lr=fast"], ["optim.lr: expected float, got 'fast'"]),
        (["run.compile=maybe"], ["run.compile: expected bool, got 'maybe'"]),
        (["model.name=vgg"], ["model.name: 'vgg' is not one of tutorial, small, fast, resnet18"]),
        (["optim.lr"], ["'optim.lr': overrides are section.key=value, e.g. optim.lr=0.1"]),
        (["--config"], ["--config needs a file: --config configs/quick.yaml"]),
        (["train.batch_size=0"], ["train.batch_size=0 is out of range: it must be >= 1"]),
        ([*TINY, "train.batch_size=4096"], ["train.batch_size=4096 exceeds the 256 training images"]),
        (["run.resume=/no/such.pt"], ["run.resume=/no/such.pt: no such checkpoint file (use auto, never or a path)"]),
        (["run.resume=/dev/null"], ["run.resume=/dev/null is a pipe or device, not a file: copy the checkpoint"]),
        (["run.launcher=torchrun"], ["run.launcher=torchrun but none of its variables are set: start with torchrun"]),
        (["run.launcher=slurm"], ["run.launcher=slurm but SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS not set"]),
        (["run.launcher=mpi"], ["run.launcher: 'mpi' is not one of auto, torchrun, accelerate, slurm, none"]),
        (["train.epochs=-1"], ["train.epochs=-1 is out of range: it must be >= 1"]),
        (["optim.lr=0"], ["optim.lr=0.0 is out of range: it must be > 0"]),
        (["--preflight"], ["--preflight needs the number of processes to be started, e.g. 2, not ''"]),
        (["--preflight", "0"], ["--preflight needs the number of processes to be started, e.g. 2, not '0'"]),
        (["--preflight", "two"], ["--preflight needs the number of processes"]),
        ([*TINY, "--preflight", "3"], ["train.batch_size=32 must be a positive multiple of world_size=3"]),
        (["train.grad_accum_steps=0"], ["train.grad_accum_steps=0 is out of range: it must be >= 1"]),
        (
            [*TINY, "train.grad_accum_steps=5", "--preflight", "2"],
            [
                "train.batch_size=32 must be a positive multiple of world_size x train.grad_accum_steps = 2 x 5 = 10",
                "try 30 or 40, or train.grad_accum_steps=4 or 8",
            ],
        ),
        ([*TINY, "train.grad_accum_steps=3"], ["= 1 x 3 = 3", "try 30 or 33, or train.grad_accum_steps=2 or 4"]),
        (["ddp.bucket_cap_mb=0"], ["ddp.bucket_cap_mb=0.0 is out of range: it must be in (0, 1048576]"]),
        (["ddp.comm_hook=int8"], ["ddp.comm_hook: 'int8' is not one of allreduce, none, fp16, bf16"]),
        (["ddp.static_graph=sometimes"], ["ddp.static_graph: expected bool, got 'sometimes'"]),
        (["ddp.static_graph=true", "train.grad_accum_steps=2"], ["DDP's static graph breaks under no_sync"]),
        (["train.dist_bn=mean"], ["train.dist_bn: 'mean' is not one of broadcast, reduce"]),
        (["run.deterministic=true", "run.cudnn_benchmark=true"], ["cuDNN's autotuning is not deterministic"]),
        (["train.micro_batch_size=-1"], ["train.micro_batch_size=-1 is out of range: it must be >= 0"]),
        (
            [*TINY, "train.micro_batch_size=5"],
            [
                "train.batch_size=32 is not a multiple of world_size x train.micro_batch_size = 1 x 5 = 5",
                "try train.micro_batch_size=4 or 8 or 16 or 32",
            ],
        ),  # fmt: skip
        ([*TINY, "train.micro_batch_size=8", "--preflight", "3"], ["3 x 8 = 24", "a train.batch_size that 3 divides"]),
        (["run.amp=fp16-weight"], ["run.amp: 'fp16-weight' is not one of off, bf16, fp16, fp16-weights"]),
        (["run.cuda_graph=true"], ["run.device=cpu does not work with run.cuda_graph=true (CUDA graphs need a GPU)"]),
        (["run.cuda_graph=maybe"], ["run.cuda_graph: 'maybe' is not one of false, true, auto"]),
        # a name over the filesystem's 255 bytes: pathlib's exists() raises on it (it says False for a missing one)
        ([f"run.out_dir={LONG}"], [f"cannot write to run.out_dir={LONG} (File name too long)"]),
        (["data.dataset=npz", f"data.path={LONG}.npz"], [f"{LONG}.npz: a path too long for this filesystem"]),
        (["--config", f"{LONG}.yaml"], [f"{LONG}.yaml: a path too long for this filesystem (a name in it is at most "]),
        ([f"run.resume={LONG}.pt"], [f"{LONG}.pt: a path too long for this filesystem", "choose a shorter one"]),
        (["run.amp=fp16-weights", "optim.name=adamw"], ["optim.name=adamw does not work with run.amp=fp16-weights "
                                                         "(its squared gradients overflow fp16); use run.amp=bf16"]),
        (["run.amp=fp16-weights", "train.ema_decay=0.99"], ["train.ema_decay does not work with run.amp=fp16-weights"]),
        (["run.amp=fp16-weights", "train.sync_bn=true"], ["train.sync_bn does not work with run.amp=fp16-weights"]),
        (["run.amp=fp16-weights", "optim.clip_grad_norm=1"], ["optim.clip_grad_norm does not work with run.amp=fp16"]),
        (["run.amp=fp16-weights", "optim.muon_lr=0.2"],
         ["optim.muon_lr does not work with run.amp=fp16-weights (its loss scale is undone in SGD's LR, and Muon's "
          "step has none)"]),
        (["--config", "configs/quick.yaml", "--config"], ["--config needs a file: --config configs/quick.yaml"]),
        (["optim.muon_lr=-0.1"], ["optim.muon_lr=-0.1 is out of range: it must be >= 0"]),
        (["data.loader=torch", "data.workers=1000"],
         ["data.workers=1000: 1,000 DataLoader worker processes a rank, 2,000 with evaluation's, on a machine where "
          "this process may use", "CPU", "use data.workers=", "or data.loader=device"]),
        (["data.loader=torch", "data.workers=-1"], ["data.workers=-1 is out of range: it must be >= 0"]),
        (["optim.muon_lr=nan"], ["optim.muon_lr: expected a finite float, got 'nan'"]),
        (["optim.muon_momentum=1"], ["optim.muon_momentum=1.0 is out of range: it must be in [0, 1)"]),
        (["optim.muon_lr=0.2", "optim.name=adamw"],
         ["optim.muon_lr=0.2: Muon steps the filters beside SGD, which steps the rest: use optim.name=sgd (not adamw), "
          "or optim.muon_lr=0"]),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_one_line(args, fragments, tmp_path, capsys, monkeypatch):
    """train.cli, the whole command but the interpreter around it (a python process costs 2 s here),
    from the repository as the process above runs (relative paths), launcher variables removed
    (conftest): exit code 2, one line on stderr, no exception out of it."""
    monkeypatch.chdir(REPO)
    code = train.cli([f"run.out_dir={tmp_path}", *args])
    assert_usage_error(subprocess.CompletedProcess(args, code, *capsys.readouterr()), *fragments)


def test_a_recipe_named_from_outside_the_repository_names_the_repositorys_file(tmp_path, capsys, monkeypatch):
    """`--config configs/quick.yaml` from another directory (python /path/to/ddp/train.py ...): the path it meant."""
    monkeypatch.chdir(tmp_path)
    assert train.cli(["--config", "configs/quick.yaml"]) == 2
    assert capsys.readouterr().err == (
        f"error: config file not found: configs/quick.yaml (in {tmp_path}); the repository's is "
        f"{REPO / 'configs/quick.yaml'}: run from the repository, or give that path\n"
    )


def test_a_config_through_a_pipe_is_one_processs_and_a_launchers_ranks_are_told(tmp_path, capsys):
    """`--config <(sed ... configs/smoke.yaml)`: one process reads it. A launch file's preflight read it, then
    the ranks torchrun started (without the shell's pipe) said "config file not found: /dev/fd/63"."""
    recipe = (REPO / "configs/smoke.yaml").read_bytes()
    with piped(recipe) as path:
        assert train.cli(["--config", path, "--print-config"]) == 0
        assert "name: small" in capsys.readouterr().out
    with piped(recipe) as path:
        assert train.cli(["--config", path, f"run.out_dir={tmp_path}", "--preflight", "2"]) == 2
        assert capsys.readouterr().err == f"error: --config {path} is {cli.PIPED}\n"
    assert train.cli(["--config", "/dev/fd/999"]) == 2  # a rank: the launching shell's pipe is not passed on
    assert capsys.readouterr().err == f"error: --config /dev/fd/999 is not here: {cli.PIPED}\n"


def test_batch_not_divisible_by_world_size_fails_before_the_rendezvous_and_tells_the_others(tmp_path):
    """torchrun's variables for rank 2 of 3, its agent's store here, nobody else coming: the check comes first (else
    this process would wait at the rendezvous), and its line goes to that store for the ranks waiting there."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    env = clean_env(RANK="2", LOCAL_RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(agent.port),
                    TORCHELASTIC_USE_AGENT_STORE="True")  # fmt: skip
    proc = python(str(TRAIN), f"run.out_dir={tmp_path}", "train.batch_size=100", env=env, timeout=60)
    line = "train.batch_size=100 must be a positive multiple of world_size=3"
    assert_usage_error(proc, line, "99 or 102")
    word = json.loads(agent.get(f"ddp-cifar/attempt-0/{lost_rank.WHY}"))
    assert (word["rank"], word["code"]) == (2, 2) and word["line"].startswith(line)


def test_offline_cifar_without_a_copy_names_data_root(tmp_path):
    proc = python(str(TRAIN), f"run.out_dir={tmp_path}", f"data.root={tmp_path}", "data.download=false")
    assert_usage_error(proc, f"CIFAR-10 not found in data.root={tmp_path}", "cifar-10-batches-py")


def test_existing_checkpoint_is_never_overwritten_by_resume_never(tmp_path, capsys):
    assert train.cli([f"run.out_dir={tmp_path}", *TINY, "train.epochs=1"]) == 0
    before = (tmp_path / "checkpoints" / "last.pt").read_bytes()
    assert train.cli([f"run.out_dir={tmp_path}", *TINY, "run.resume=never"]) == 2
    assert "run.resume=never but" in capsys.readouterr().err
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == before


def test_resuming_another_model_is_refused(tmp_path, capsys):
    assert train.cli([f"run.out_dir={tmp_path}", *TINY, "train.epochs=1"]) == 0
    assert train.cli([f"run.out_dir={tmp_path}", *TINY, "model.name=tutorial"]) == 2
    assert "was trained with model.name=small but this run has model.name=tutorial" in capsys.readouterr().err


def test_unwritable_out_dir(tmp_path, capsys):
    """A file where out_dir or a parent of it would be is named (and left as it was)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    for out in (blocker / "run", blocker):
        assert train.cli([f"run.out_dir={out}", *TINY]) == 2
        assert f"cannot write to run.out_dir={out} ({blocker} is a file, not a directory)" in capsys.readouterr().err
    assert blocker.read_text() == ""


def test_a_symbolic_link_to_nothing_on_the_way_is_named_with_where_it_points(tmp_path, capsys):
    """runs/ or data/ linked to a scratch folder not made yet, or on a filesystem not mounted: run.out_dir (and plot's
    --out) said "File exists", data.path "no such file", data.root "not found" (a download: "File exists"). Each now
    names the link and where it points. The folder it names is not made (it would fill the filesystem beneath)."""
    from ddp import plot

    scratch = tmp_path / "scratch"
    for name in ("runs", "data"):
        (tmp_path / name).symlink_to(scratch / name)
    runs, data = (f"{tmp_path / n} is a symbolic link to {scratch / n}, which is not there" for n in ("runs", "data"))
    made = ": make that directory, mount its filesystem, or point the link at one"
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1, "train_loss": 1.0}\n')  # plot's charts into runs/
    cases = [(train.main, [*TINY, f"run.out_dir={tmp_path / 'runs' / 'a'}"],
              f"cannot write to run.out_dir={tmp_path / 'runs' / 'a'} ({runs}{made})"),
             (plot.main, [str(tmp_path), "--out", str(tmp_path / "runs")],
              f"cannot write {tmp_path / 'runs' / 'curves.png'}: {runs}{made}"),
             (train.main, [*TINY, "data.dataset=npz", f"data.path={tmp_path / 'data' / 'c.npz'}"],
              f"data.path={tmp_path / 'data' / 'c.npz'}: no such file ({data})"),
             (train.main, [*TINY, "data.dataset=cifar10", f"data.root={tmp_path / 'data'}", "data.download=true"],
              f"data.root={tmp_path / 'data'}: {data}: mount its filesystem, make that directory, or point the link at "
              "the data")]  # fmt: skip
    for main, argv, said in cases:
        assert cli.command(main, [f"run.out_dir={tmp_path / 'o'}", *argv] if main is train.main else argv) in (1, 2)
        assert capsys.readouterr().err == f"error: {said}\n"
    assert not scratch.exists()


def test_bad_npz_format(tmp_path, capsys):
    import numpy as np

    bad = tmp_path / "bad.npz"
    np.savez(bad, x_train=np.zeros((4, 28, 28), np.uint8), y_train=np.zeros(4), x_test=np.zeros(1), y_test=np.zeros(1))
    assert train.cli([f"run.out_dir={tmp_path}", "data.dataset=npz", f"data.path={bad}"]) == 2
    assert "x_train must be uint8 (N, 32, 32, 3)" in capsys.readouterr().err


def test_resume_from_an_older_file_of_the_same_out_dir_is_refused(tmp_path, capsys):
    """Continuing from step 3 would leave steps 6 and 8 on disk for the next auto-resume to pick."""
    assert train.cli([f"run.out_dir={tmp_path}", *TINY, "train.epochs=1", "run.save_every_steps=3"]) == 0
    older = rundir.step_files(tmp_path)[-1]
    assert older.name == "step-000000003.pt"
    assert train.cli([f"run.out_dir={tmp_path}", *TINY, f"run.resume={older}"]) == 2
    assert "holds newer checkpoints" in capsys.readouterr().err
    assert train.cli([f"run.out_dir={tmp_path}", *TINY, f"run.resume={rundir.last_path(tmp_path)}"]) == 0
    assert train.cli([f"run.out_dir={tmp_path / 'next'}", *TINY, f"run.resume={tmp_path}"]) == 2  # the run, not a file
    assert capsys.readouterr().err.endswith(f"; its newest checkpoint is {rundir.last_path(tmp_path)}\n")
    folder = rundir.checkpoint_dir(tmp_path)  # the run's checkpoints/ itself
    assert train.cli([f"run.out_dir={tmp_path / 'next'}", *TINY, f"run.resume={folder}"]) == 2
    assert capsys.readouterr().err.endswith(f"; its newest checkpoint is {rundir.last_path(tmp_path)}\n")


def test_the_same_command_with_run_resume_path_again_continues_its_own_checkpoints(tmp_path, capsys):
    """A fine-tune from PATH into a new out_dir, restarted with the same command (a SLURM requeue, torchrun
    --max-restarts, a rerun after a crash): it was refused ("holds newer checkpoints"), as if PATH were an older
    file of that out_dir. It goes on from the run's own newest checkpoint, PATH there or not; another PATH is
    still refused."""
    assert train.cli([f"run.out_dir={tmp_path / 'pre'}", *TINY, "train.epochs=1"]) == 0
    start = tmp_path / "pretrained.pt"
    start.write_bytes(rundir.last_path(tmp_path / "pre").read_bytes())
    tune = [f"run.out_dir={tmp_path / 'tune'}", *TINY, f"run.resume={start}"]
    assert train.cli([*tune, "train.epochs=2"]) == 0
    capsys.readouterr()
    start.unlink()  # gone (a scratch disk cleaned): not needed any more
    assert train.cli([*tune, "train.epochs=3"]) == 0
    newest = rundir.step_files(tmp_path / "tune")
    assert capsys.readouterr().out.startswith(f"resumed from {newest[1]}: 2 epoch(s) + 0 step(s) done")
    assert [m["epoch"] for m in metrics(tmp_path / "tune")] == [2, 3]
    other = [f"run.out_dir={tmp_path / 'tune'}", *TINY, f"run.resume={rundir.last_path(tmp_path / 'pre')}"]
    assert train.cli(other) == 2
    assert "holds newer checkpoints that a later auto-resume would pick" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("optim:\n  lr: [0.1\nrun:\n  seed: 1\n", ["invalid YAML", "line 3"]),  # the unclosed list
        ("lr: 0.1\n", ["expected sections of keys; write 'lr: 0.1' as 'optim:\\n  lr: 0.1'"]),
        ("optim:\n  lr: 0.1\n  momentun: 0.9\n", ["unknown key 'optim.momentun'", "did you mean 'optim.momentum'?"]),
    ],
    ids=["yaml-syntax", "yaml-not-sections", "yaml-typo"],
)
def test_mistakes_in_a_config_file(text, fragments, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert_usage_error(python(str(TRAIN), "--config", str(path), f"run.out_dir={tmp_path}"), *fragments)


@pytest.mark.parametrize(
    "env, args, fragments",
    [
        ({"WORLD_SIZE": "2"}, [], ["WORLD_SIZE set but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not"]),
        ({"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, [],
         ["RANK, LOCAL_RANK, WORLD_SIZE must be integers"]),
        ({"ACCELERATE_USE_CPU": "True"}, ["run.device=cuda:0"], ["accelerate launch --cpu but run.device=cuda:0"]),
        ({"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, [],
         ["accelerate started 1 process for --num_processes > 1", "--mpirun_hostfile"]),
    ],
    ids=["world-size-alone", "rank-not-a-number", "accelerate-cpu-vs-cuda", "accelerate-cpu-without-mpi"],
)  # fmt: skip
def test_launcher_variables_set_inconsistently(env, args, fragments, tmp_path):
    proc = python(str(TRAIN), f"run.out_dir={tmp_path}", *args, env=clean_env(**env), timeout=60)
    assert_usage_error(proc, *fragments)


@pytest.mark.parametrize(
    "nproc, args, fragment, rank_0_late, more_env",
    [
        (3, ["train.batch_size=64"], "train.batch_size=64 must be a positive multiple of world_size=3", False, {}),
        (2, ["run.stop_signal=SIGFOO"], "run.stop_signal: 'SIGFOO' is not a signal that can be caught", True, {}),
        (2, ["data.dataset=npz", "data.path=/no/such.npz"], "data.path=/no/such.npz: no such file", False, {}),
        # another cluster's job script: every rank's rendezvous failed in gloo's "Unable to find address for", exit 1
        (2, [], "GLOO_SOCKET_IFNAME=lo,nonesuch0: this machine (", False, {"GLOO_SOCKET_IFNAME": "lo,nonesuch0"}),
    ],
    ids=["batch", "signal, rank 0 late", "data", "gloo interface"],
)  # fmt: skip
def test_under_plain_torchrun_the_line_comes_once_first_and_is_the_root_cause(
    nproc, args, fragment, rank_0_late, more_env, tmp_path
):
    """No --preflight here: torchrun's report follows the line, and its box shows the line as the
    root cause's traceback with the worker's exit code (2), not error_file: <N/A>. Also when local rank
    0, the one that prints, reaches the error 2 s after the others (as on a busy machine: a
    sitecustomize on PYTHONPATH delays its start), which once stopped it before it had printed."""
    env = clean_env(**more_env)
    if rank_0_late:
        (tmp_path / "site").mkdir()
        delay = "import os, time\nif os.environ.get('LOCAL_RANK') == '0':\n    time.sleep(2)\n"
        (tmp_path / "site" / "sitecustomize.py").write_text(delay)
        env["PYTHONPATH"] = str(tmp_path / "site")
    proc = torchrun(nproc, str(TRAIN), *TINY, f"run.out_dir={tmp_path / 'run'}", *args, timeout=120, env=env)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
    assert proc.stderr.index(lines[0]) < proc.stderr.index("ChildFailedError")
    root_cause = proc.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "exitcode  : 2" in root_cause and f"traceback : {lines[0]}" in root_cause, root_cause


def test_a_command_leaves_with_its_code_after_its_exit_handlers_and_all_its_output():
    """cli.leave (the end of every ddp command): the exit handlers run, output still buffered in a pipe
    comes out, the code is the command's; only the interpreter's teardown is skipped."""
    code = (
        "import atexit, sys; from ddp import cli; atexit.register(print, 'handler ran', file=sys.stderr); "
        "print('buffered, no newline', end=''); cli.leave(3)"
    )
    proc = python("-c", code, env=clean_env(PYTHONUNBUFFERED=""))  # a pipe: stdout is block-buffered
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "buffered, no newline", "handler ran\n")


def test_ddp_train_the_installed_command_trains_and_leaves_as_ddp_train_py_does(tmp_path, monkeypatch, capsys):
    """pyproject's console script `ddp-train` (sys.exit(train.cli())) went through the interpreter's teardown, where
    `python ddp/train.py` leaves without it (cli.leave): train.cli() with no argv, as the script calls it, leaves."""
    script = Path(sys.executable).parent / "ddp-train"  # (pip install -e . puts it beside the interpreter)
    proc = subprocess.run([str(script), *TINY, "train.epochs=1", f"run.out_dir={tmp_path}"], capture_output=True,
                          text=True, cwd=tmp_path, env=clean_env(), timeout=120)  # fmt: skip
    assert proc.returncode == 0 and len(metrics(tmp_path)) == 1, proc.stderr

    def leave(code: int) -> None:
        raise RuntimeError(f"left {code} without the teardown")

    monkeypatch.setattr(train, "leave", leave)
    monkeypatch.setattr(sys, "argv", ["ddp-train", "--print-config"])
    with pytest.raises(RuntimeError, match="left 0 without the teardown"):
        train.cli()
    assert "epochs:" in capsys.readouterr().out


def test_a_failed_rank_with_a_thread_given_up_inside_a_call_leaves_without_the_teardown_that_would_end_it():
    """A rank of several that failed exits the usual way, unless a thread given up on (lost_rank.asked: torch's
    store client) is still inside its call: the teardown would end it, and torch's C++ would abort the process
    (exit 134, 1 run in 8). Here that thread sleeps 60 s and is not a daemon, so the usual way would wait for it."""
    code = (
        "import threading, time; from ddp import cli; thread = threading.Thread(target=time.sleep, args=(60,)); "
        "thread.start(); cli.given_up(thread); print('failed'); cli.leave(2)"
    )
    start = time.monotonic()
    proc = python("-c", code, env=clean_env(**TORCHRUN), timeout=30)
    assert (proc.returncode, proc.stdout, time.monotonic() - start < 20) == (2, "failed\n", True), proc.stderr


def test_a_question_to_a_store_where_no_thread_can_start_is_no_answer(monkeypatch):
    """lost_rank.asked where the interpreter is exiting: serve_word's fallback (the port taken) asks from its thread
    while the process exits, and Python 3.12 on refuses new threads then. The serving thread's traceback followed
    the one line (seen under 3.12.1: MASTER_PORT taken by another program). It is no answer now."""

    def refused(thread: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")  # (3.12's words)

    monkeypatch.setattr(threading.Thread, "start", refused)
    assert lost_rank.asked(lambda: "an answer", 1.0) is None


# Each command as a user starts it; each installs startup.quiet_startup before its imports. ddp-train too, pyproject's
# console script, where ddp is found (not under python -S: its import of ddp.train is the first thing it does).
COMMANDS = [[str(TRAIN)], [str(REPO / "ddp" / "torchrun.py")]] + [
    ["-m", f"ddp.{name}"] for name in ("evaluate", "checkpoint", "doctor", "plot")
]
SCRIPTS = [*COMMANDS, [str(Path(sys.executable).parent / "ddp-train")]]


def test_ctrl_c_while_a_command_imports_torch_is_one_line():
    """Ctrl-C in the seconds of `import torch` (as a terminal sends it to the process), in each command:
    the one line, no traceback, and the process ends as Ctrl-C ends it (128 + SIGINT)."""
    procs = [subprocess.Popen([sys.executable, *command], cwd=REPO, env=clean_env(), stderr=subprocess.PIPE,
                              text=True) for command in SCRIPTS]  # fmt: skip
    waiting, deadline = list(procs), time.monotonic() + 60  # each watched at once: torch 2.4 imports in under a
    while waiting and time.monotonic() < deadline:  # second, and the last had ended before one after the other
        for proc in list(waiting):
            with contextlib.suppress(FileNotFoundError):  # (ended meanwhile: its code says so below)
                if proc.poll() is None and "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text():
                    continue  # once there, torch's import goes on for another second or more, in Python
            proc.send_signal(signal.SIGINT)
            waiting.remove(proc)
        time.sleep(0.01)
    for command, proc in zip(SCRIPTS, procs):
        err = proc.communicate(timeout=60)[1]
        assert proc.returncode == -signal.SIGINT and err == f"{errors.INTERRUPTED}\n", (command, err)


def test_a_ctrl_c_that_an_import_lost_ends_the_command_as_it_starts_and_an_ignored_one_stays_ignored(monkeypatch):
    """torch 2.4 loses a KeyboardInterrupt raised inside torch._C's initialisation: the command ran on as if no
    Ctrl-C had come (a run trained). Remembered, it is raised again as the command starts (cli.command)."""
    monkeypatch.setattr(errors, "_interrupted", False)
    for ignored in (False, True):
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else signal.default_int_handler)
        try:
            errors.remember_interrupts()
            with contextlib.suppress(KeyboardInterrupt):  # the import that lost it
                signal.raise_signal(signal.SIGINT)
                time.sleep(0.5)  # (an ignored one: nothing comes)
            if ignored:  # started in the background by a script: Ctrl-C is not for it
                assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and not errors._interrupted
                assert cli.command(lambda argv: 0, []) == 0
            else:
                with pytest.raises(KeyboardInterrupt):
                    cli.command(lambda argv: 0, [])
                assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own again
        finally:
            signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[-1].rpartition("/")[2])
def test_a_python_without_the_packages_is_one_line_naming_the_fix(command):
    """`python` that is not the venv's (python -S: no site-packages, so no torch, yaml or numpy): the package
    it lacks, this interpreter and how to install, exit 2; not a ModuleNotFoundError traceback."""
    proc = subprocess.run([sys.executable, "-S", *command, "--help"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert_usage_error(proc, "no module named ", f"in {sys.executable}", "make install", "pip install -e .")


@pytest.mark.parametrize("command", SCRIPTS, ids=lambda c: c[-1].rpartition("/")[2])
def test_a_debug_level_that_torchs_import_refuses_is_one_line_before_it(command):
    """`export TORCH_DISTRIBUTED_DEBUG=` (set, empty) or a word torch does not take: `import torch` raised a ValueError
    (torch.distributed reads it as it loads), every command's traceback, every rank's."""
    proc = subprocess.run([sys.executable, *command, "--help"], cwd=REPO, env=clean_env(TORCH_DISTRIBUTED_DEBUG=""),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert_usage_error(proc, "TORCH_DISTRIBUTED_DEBUG='': torch takes OFF, INFO, DETAIL; set one, or unset it")


# PYTORCH_CUDA_ALLOC_CONF values: whether ddp-cifar refuses each, which is whether a CUDA torch's load aborted on it
# (torch 2.14.1: libc10_cuda.so's load, in `import torch`, on a CPU too; test_..._as_torchs_load_does checks it)
ALLOC_CONFS = {
    "": False,
    "expandable_segments:True": False,
    "expandable_segments:True,max_split_size_mb:128": False,
    " expandable_segments : True , max_split_size_mb:128 ,": False,  # (spaces dropped; a comma at the end)
    "roundup_power2_divisions:[256:1,512:2,>:1],backend:native": False,
    ",expandable_segments:True": False,  # `export PYTORCH_CUDA_ALLOC_CONF="$PYTORCH_CUDA_ALLOC_CONF,..."`, unset before
    "expandable_segments:yes": False,  # a value torch checks at its first CUDA use, not as it loads
    "garbage": True,
    "max_split_size_mb": True,
    "max_split_size_mb:": True,
    "max_split_size_mb=128": True,
    "expandable_segments:True max_split_size_mb:128": True,  # a space for the comma
    "expandable_segments:True;max_split_size_mb:128": True,
    "max_split_size_mb:128:3": True,
    ",": True,
    "expandable_segments:True,,": True,
    "roundup_power2_divisions:[256:1,512:2": True,
    "[expandable_segments:True]": True,
}


def test_an_allocator_setting_torch_cannot_split_into_options_is_refused_and_no_other():
    from ddp.startup import allocator_conf_broken

    assert {value: allocator_conf_broken(value) is not None for value in ALLOC_CONFS} == ALLOC_CONFS
    assert allocator_conf_broken("max_split_size_mb=128") == "option 'max_split_size_mb=128' has no value after it"
    assert "(torch drops spaces: commas part options)" in allocator_conf_broken("expandable_segments:True a:b")
    unclosed = allocator_conf_broken("roundup_power2_divisions:[1")
    assert unclosed == "option 'roundup_power2_divisions' opens a list with '[' and no ']' closes it"


def test_the_allocator_settings_refused_are_the_ones_a_cuda_torchs_load_aborts_on_as_torchs_load_does():
    """Each of ALLOC_CONFS in this torch itself: its libc10_cuda.so loaded (what `import torch` does first, 0.05 s
    instead of 2), under each of the two names; refused where it aborted (SIGABRT), and nowhere else."""
    lib = Path(torch.__file__).parent / "lib"
    if not (lib / "libc10_cuda.so").is_file():
        pytest.skip(f"this torch {torch.__version__} is a CPU build: no libc10_cuda.so, whose load reads the setting")
    c10, c10_cuda = str(lib / "libc10.so"), str(lib / "libc10_cuda.so")
    load = f"import ctypes; ctypes.CDLL({c10!r}, ctypes.RTLD_GLOBAL); ctypes.CDLL({c10_cuda!r})"
    aborted = {}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        procs = {value: subprocess.Popen([sys.executable, "-c", load], env=clean_env(**{name: value}),
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for value in ALLOC_CONFS}  # fmt: skip
        for value, proc in procs.items():
            err = proc.communicate(timeout=60)[1].decode()
            assert proc.returncode in (0, -signal.SIGABRT), (name, value, proc.returncode, err)
            aborted[value] = proc.returncode == -signal.SIGABRT
        if not aborted["garbage"]:
            pytest.skip(f"torch {torch.__version__} reads {name} at its first CUDA use, not as it loads")
        assert aborted == ALLOC_CONFS, name


def test_an_allocator_setting_that_aborts_torchs_load_is_one_line_before_it_in_every_command():
    """`PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb=128` (an `=` for the `:`): a CUDA torch aborted in `import torch`,
    on a CPU too, 40 C++ frames under "INTERNAL ASSERT FAILED ... please report a bug to PyTorch", exit 134."""
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    procs = [subprocess.Popen([sys.executable, *command, "--help"], cwd=REPO, env=clean_env(**{names[i % 2]: "a=b"}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, command in enumerate(SCRIPTS)]  # fmt: skip
    for i, (command, proc) in enumerate(zip(SCRIPTS, procs)):
        proc.stdout, proc.stderr = proc.communicate(timeout=60)
        assert f"{names[i % 2]}='a=b': option 'a=b' has no value after it" in proc.stderr, command
        assert_usage_error(proc, "; torch takes comma-separated key:value options (e.g. ", "fix it, or unset it")


def test_a_torch_logs_name_torch_does_not_know_is_one_line_with_the_closest_and_help_is_torchs_list():
    """TORCH_LOGS=recompile (for recompiles), as one debugging torch.compile types it: `import torch` raised a
    ValueError, a traceback over a list of every valid name, in every command and rank. torch's own import here."""
    runs = {  # TORCH_LOGS: the command
        "recompile,+dynamo,torch._dynamo,nonesuch": [str(TRAIN), "--help"],
        "graph_break": [str(REPO / "ddp" / "torchrun.py"), "--help"],
        "help": [str(TRAIN), "--help"],
    }
    procs = {logs: subprocess.Popen([sys.executable, *command], cwd=REPO, env=clean_env(TORCH_LOGS=logs),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for logs, command in runs.items()}  # fmt: skip
    for proc in procs.values():
        proc.stdout, proc.stderr = proc.communicate(timeout=120)
    assert_usage_error(procs["recompile,+dynamo,torch._dynamo,nonesuch"], "TORCH_LOGS='recompile,+dynamo,torch._dynamo,"
                       "nonesuch': torch takes comma-separated log and artifact names, each with an optional + or -, "
                       "or module names; not 'recompile' (did you mean 'recompiles'?); not 'nonesuch'; TORCH_LOGS=help "
                       "lists them")  # fmt: skip
    assert_usage_error(procs["graph_break"], "; not 'graph_break' (did you mean 'graph_breaks'?);")
    listed = procs["help"]
    assert listed.returncode == 0 and "Traceback" not in listed.stderr + listed.stdout, listed.stderr
    assert "TORCH_LOGS" in listed.stdout and "recompiles" in listed.stdout and "usage:" not in listed.stdout


def test_a_setting_of_torchs_that_its_config_cannot_read_is_one_line(tmp_path):
    """TORCH_COMPILE_DEBUG=true (torch reads a number: 1), TORCHINDUCTOR_COMPILE_THREADS=abc: torch/_inductor/config.py
    raised a ValueError as torch._dynamo loaded, which every run does (distributed.setup), in every rank."""
    from ddp.startup import torch_variable_refused

    runs = {"TORCH_COMPILE_DEBUG": "true", "TORCHINDUCTOR_COMPILE_THREADS": "abc"}
    procs = {name: subprocess.Popen([sys.executable, str(TRAIN), *TINY, f"run.out_dir={tmp_path / name}"], cwd=REPO,
                                    env=clean_env(**{name: value}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name, value in runs.items()}  # fmt: skip
    for name, proc in procs.items():
        proc.stdout, proc.stderr = proc.communicate(timeout=120)
        said = f"{name}={runs[name]!r}: torch cannot read it as it loads (invalid literal for int() with base 10: "
        assert_usage_error(proc, said, "; fix it, or unset it")
    with pytest.raises(ValueError) as raised:
        int(os.environ.get("PATH", ""))  # a variable that is set, read by a file of no torch config: not torch's
    assert torch_variable_refused(raised.value) is None


def test_a_compile_cache_that_cannot_be_made_is_one_line(tmp_path):
    """TORCHINDUCTOR_CACHE_DIR that cannot be made (a file there; a scratch disk this machine lacks): torch makes it
    as torch._dynamo loads, which every run does, and every rank ended in a FileNotFoundError's traceback."""
    (tmp_path / "file").touch()
    env = clean_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "file"))
    proc = subprocess.run([sys.executable, str(TRAIN), *TINY, f"run.out_dir={tmp_path / 'run'}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    said = "torch makes its compile cache there as it loads, and cannot (File exists); set it to a directory this"
    assert_usage_error(proc, f"TORCHINDUCTOR_CACHE_DIR={tmp_path / 'file'}: {said} user may write, or unset it")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "raised, local_rank, said",
    [
        ("KeyboardInterrupt", "0", f"{errors.INTERRUPTED}\n"),
        ("KeyboardInterrupt", "1", ""),  # its machine's local rank 0 says it
        ("ModuleNotFoundError(name='tqdm')", "0", "error: no module named 'tqdm' in "),
        ("ModuleNotFoundError(name='tqdm')", "1", ""),
        ("ModuleNotFoundError(name='ddp.gone')", "0", "Traceback"),  # ddp's own module missing: a bug
        ("ValueError('x')", "0", "Traceback"),  # any other exception: its traceback, as before
    ],
)
def test_the_startup_hook_speaks_for_local_rank_0_and_keeps_other_tracebacks(raised, local_rank, said):
    code = f"from ddp.startup import quiet_startup; quiet_startup(__name__); raise {raised}"
    torchrun = {"RANK": local_rank, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(LOCAL_RANK=local_rank, **torchrun),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.stderr.startswith(said) and (said in ("Traceback", "error: no module named 'tqdm' in ")
                                             or proc.stderr == said), proc.stderr  # fmt: skip
    assert proc.returncode == (2 if "tqdm" in raised else 1 if "Error" in raised else -signal.SIGINT)


def test_an_error_in_the_imports_after_a_ctrl_c_they_swallowed_is_the_ctrl_c():
    """A Ctrl-C as a rank under torchrun imported numpy (in torch's import): numpy's module was left half made and
    the import failed again, `ImportError: cannot load module more than once per process`, a 15-line traceback that
    reads as a broken install. Now the Ctrl-C's line and its end (killed by SIGINT). Played here: the KeyboardInterrupt
    swallowed, then that ImportError."""
    code = ("import os, signal, time\nfrom ddp.startup import quiet_startup\nquiet_startup(__name__)\ntry:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(5)\nexcept KeyboardInterrupt:\n    pass\n"
            "raise ImportError('cannot load module more than once per process')")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert (proc.stderr, proc.returncode) == (f"{errors.INTERRUPTED}\n", -signal.SIGINT), proc.stderr


def test_out_of_memory_is_one_line_naming_the_rank_and_what_to_try(tmp_path, capsys, monkeypatch):
    """A failed allocation was torch's traceback: the CPU's and a GPU's (torch.cuda.OutOfMemoryError, raised on
    rank 1 of 2 under torchrun's variables), each in a step. Data too large (3 TB of uint8 images asked for, here
    in this process) says so, exit 2: it was the step's advice, a smaller train.batch_size."""
    monkeypatch.chdir(REPO)
    code = train.cli([f"run.out_dir={tmp_path}", *TINY, "data.synthetic_train=1000000000"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: data.dataset=synthetic: the data does not fit in this machine's memory (") and (
        "can't allocate memory" in err
    ), err

    def cpu_step(argv):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried")

    assert cli.command(cpu_step, []) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: out of memory (") and err.count("\n") == 1, err
    assert "can't allocate memory" in err and "try a smaller train.batch_size, or train.micro_batch_size=N" in err

    def step(argv):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total ...")

    torchrun = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    assert cli.command(step, []) == 1
    assert capsys.readouterr().err.startswith("error: rank 1 of 2: out of memory (CUDA out of memory. Tried to")
    with pytest.raises(torch.cuda.OutOfMemoryError):  # run.debug=true: the traceback, for a bug report
        cli.command(step, ["run.debug=true"])
    for name in torchrun:  # a plain mpirun's process: it has peers, but no rank of ours to name
        monkeypatch.delenv(name)
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.setenv(name, "2" if name.endswith("SIZE") else "1")
    assert cli.command(step, []) == 1
    assert capsys.readouterr().err.startswith("error: out of memory (CUDA out of memory. Tried to")


# Each command, run in one child process by a user whom file permissions bind (root without CAP_DAC_OVERRIDE and
# CAP_DAC_READ_SEARCH, as a user not root is): what it says and its exit code for each case below.
AS_A_USER = """
import contextlib, io, json, sys
from ddp import checkpoint, cli, doctor, evaluate, plot, train
mains = {"train": train.main, "evaluate": evaluate.main, "checkpoint": checkpoint.main, "plot": plot.main,
         "doctor": doctor.main}
said = []
for name, argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.command(mains[name], argv)
    said.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(said))
"""


def _bound_by_file_permissions() -> None:
    """In the child before its exec: root's pass over file permissions dropped from its capabilities' bounding
    set, so the program it runs has them no more (a user not root never had them)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) refused: no CAP_SETPCAP here")


@pytest.mark.parametrize("pathlib_of", ["this-python", "python-3.13"])
def test_a_symbolic_link_that_loops_is_one_line_naming_it_in_every_command(pathlib_of, tmp_path, capsys, monkeypatch):
    """Through a link that loops, data.path said "no such file", inspect "checkpoint not found", --config "Too many
    levels of symbolic links", run.resume was an OSError (ELOOP) traceback, and plot and the doctor pathlib's
    RuntimeError ("Symlink loop from") traceback. From Python 3.13 resolve() says nothing of a loop (os.path's
    realpath): the doctor said "is not writable (File exists)" (exit 1) and plot named RUN/metrics.jsonl; a run's
    out_dir through it was "File exists" (or "Too many levels of symbolic links" below it) in every Python."""
    from ddp import checkpoint, doctor, plot

    if pathlib_of == "python-3.13":  # (Lib/pathlib/_local.py)
        monkeypatch.setattr(
            Path, "resolve", lambda self, strict=False: type(self)(os.path.realpath(self, strict=strict))
        )
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "back")
    (tmp_path / "back").symlink_to(loop)
    tiny = [*TINY, f"run.out_dir={tmp_path / 'run'}"]
    cases = [(train.main, [*tiny, "data.dataset=npz", f"data.path={loop}"]), (train.main, ["--config", str(loop)]),
             (train.main, [*tiny, f"run.resume={loop}"]), (plot.main, [str(loop)]),
             (checkpoint.main, ["inspect", str(loop)]), (doctor.main, [*TINY, f"run.out_dir={loop}"]),
             (train.main, [*TINY, f"run.out_dir={loop}"]), (train.main, [*TINY, f"run.out_dir={loop}/a/b"]),
             (plot.main, [str(tmp_path), "--out", f"{loop}/charts"])]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1, "train_loss": 1.0}\n')  # plot's run, a chart to write
    for main, argv in cases:
        assert cli.command(main, argv) == 2, argv
        said = capsys.readouterr().err
        assert said == f"error: {loop}: a symbolic link on the way loops (ls -l each link on the way); name the file " \
            "itself\n", (argv, said)  # fmt: skip


PATHLIB_3_14 = """
import os, pathlib  # Python 3.14's (Lib/pathlib/_local.py): os.path's, False on any OSError, a PermissionError too
pathlib.Path.exists = lambda self, *, follow_symlinks=True: os.path.exists(self)
pathlib.Path.is_dir = lambda self, *, follow_symlinks=True: os.path.isdir(self)
pathlib.Path.is_file = lambda self, *, follow_symlinks=True: os.path.isfile(self)
"""


@pytest.mark.parametrize("pathlib_of", ["this-python", "python-3.14"])
def test_a_path_not_open_to_this_user_is_one_line_naming_it_and_never_a_fallback(pathlib_of, tmp_path):
    """A data file, data.root, a config, a checkpoint, a run's folder or its checkpoints/ that this user may not
    read (or write): exit 2 and one line naming the path (the doctor: a PROBLEM, exit 1). It was a PermissionError
    traceback (pathlib's exists() raises on it), a download attempted into a data.root it could not list, a run
    begun afresh beside checkpoints it could not list, and a checkpoint it could not read skipped for an older.
    Python 3.14's pathlib says False where it may not look: the data file, the config, the checkpoint and the
    metrics were "no such file" or "not found", a run.resume its folder's checkpoints/; files.existing raises."""
    locked = tmp_path / "locked"
    (locked / "run").mkdir(parents=True)
    for name in ("ok.npz", "c.yaml", "x.pt", "run/metrics.jsonl"):
        (locked / name).write_text("{}")
    unlisted, unwritable, unread = (tmp_path / name / "checkpoints" for name in ("unlisted", "unwritable", "unread"))
    for folder in (unlisted, unwritable, unread):
        folder.mkdir(parents=True)
    (unlisted / "step-000000002.pt").write_text("")
    (unread / "step-000000001.pt").write_text("an older file")
    (unread / "step-000000002.pt").write_text("")
    rundir.config_path(unread.parent).write_text("data:\n  dataset: synthetic\n")  # a run's: its checkpoints
    for path, mode in ((locked, 0), (unlisted, 0), (unwritable, 0o500), (unread / "step-000000002.pt", 0)):
        path.chmod(mode)
    tiny = [*TINY, "train.epochs=1"]
    cases = [
        ("train", [*tiny, f"run.out_dir={tmp_path / 'o'}", "data.dataset=npz", f"data.path={locked}/ok.npz"]),
        ("train", [*tiny, f"run.out_dir={tmp_path / 'o'}", "data.dataset=cifar10", f"data.root={locked}"]),
        ("train", ["--config", f"{locked}/c.yaml"]),
        ("train", [*tiny, f"run.out_dir={tmp_path / 'o'}", f"run.resume={locked}/x.pt"]),
        ("train", [*tiny, f"run.out_dir={unlisted.parent}"]),
        ("train", [*tiny, f"run.out_dir={unwritable.parent}"]),
        ("train", [*tiny, f"run.out_dir={unread.parent}"]),
        ("evaluate", ["--checkpoint", f"{locked}/x.pt"]),
        ("checkpoint", ["inspect", f"{locked}/x.pt"]),
        ("plot", [f"{locked}/run"]),
        ("doctor", ["data.dataset=npz", f"data.path={locked}/ok.npz", f"run.out_dir={tmp_path / 'o'}"]),
        ("doctor", [*tiny, f"run.out_dir={unwritable.parent}"]),
    ]
    try:
        child = subprocess.run(
            [sys.executable, "-c", {"python-3.14": PATHLIB_3_14}.get(pathlib_of, "") + AS_A_USER, json.dumps(cases)],
            cwd=REPO,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=_bound_by_file_permissions,
        )
    finally:
        for path in (locked, unlisted, unwritable, unread / "step-000000002.pt"):
            path.chmod(0o700)  # for tmp_path's removal by a user not root
    assert child.returncode == 0, child.stderr
    said = json.loads(child.stdout.splitlines()[-1])
    denied = ": permission denied to user "
    expected = [
        f"{locked}/ok.npz{denied}", f"{locked}{denied}", f"{locked}/c.yaml{denied}", f"{locked}/x.pt{denied}",
        f"{unlisted}{denied}", f"cannot write to run.out_dir={unwritable.parent} ({unwritable}: Permission denied)",
        f"{unread}/step-000000002.pt{denied}", f"{locked}/x.pt{denied}", f"{locked}/x.pt{denied}",
        f"{locked}/run/metrics.jsonl{denied}",
    ]  # fmt: skip
    for (code, _, err), fragment, case in zip(said, expected, cases):
        assert_usage_error(subprocess.CompletedProcess(case, code, "", err), fragment)
    assert all("it, or a folder above it, is not open to this user" in err for _, _, err in said[:5])
    for (code, out, err), line in zip(said[-2:], [f"PROBLEM: {locked}/ok.npz{denied}", "PROBLEM: cannot write"]):
        assert code == 1 and "Traceback" not in err and line in out + err, out + err
    assert "data: unusable" in said[-2][1]
    assert not list((tmp_path / "o").glob("**/cifar-10*")), "no download was tried into another folder"


def test_no_space_outside_the_runs_own_files_is_one_line_naming_tmpdir(capsys):
    """A full disk met outside the run's own writes (those are WriteFailed): torch.compile's cache in a full
    TMPDIR was torch's traceback (`torch._inductor.exc.InductorError: OSError: [Errno 28] No space left on
    device`, seen with a 64 KiB tmpfs as TMPDIR: 30 s of a compile, too slow here). The OSError among the
    causes, or quoted in the message as inductor's wrapper quotes it: one line, exit 1."""

    def caused(argv):
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/tmp/torchinductor_root/ab/c.py")
        except OSError as e:
            raise RuntimeError("the compile failed") from e

    def quoted(argv):
        raise RuntimeError("OSError: [Errno 28] No space left on device\n\nSet TORCHDYNAMO_VERBOSE=1 for ...")

    for step, line in [(caused, "OSError: [Errno 28] No space left on device: '/tmp/torchinductor_root/ab/c.py'"),
                       (quoted, "OSError: [Errno 28] No space left on device")]:  # fmt: skip
        assert cli.command(step, []) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: no space left ({line}); free some, or set TMPDIR to a disk with room: "), err
        assert f"torch.compile's cache is in TMPDIR={tempfile.gettempdir()} (" in err and err.count("\n") == 1

    def bug(argv):
        raise RuntimeError("no such thing: 28")

    with pytest.raises(RuntimeError):  # any other error is a bug: its traceback
        cli.command(bug, [])


def test_a_dataloader_worker_killed_is_one_line_saying_who_kills_so(tmp_path, monkeypatch):
    """A worker of data.loader=torch killed with SIGKILL, as the kernel's out-of-memory killer does: torch's
    traceback ("DataLoader worker (pid N) is killed by signal: Killed.", or by the timing "DataLoader worker
    (pid(s) N) exited unexpectedly"). Now one line, exit 1; with the out-of-memory kills counted since the run began,
    what the kernel did, where it was "most often"."""
    # The worker killed is a fork of the run, after its start line (its imports' `ldconfig -p` done), in one long
    # epoch: under load the first child of the run had been that ldconfig, or an epoch's worker already exiting,
    # and the run went on (2026-11-28).
    run = [sys.executable, str(TRAIN), f"run.out_dir={tmp_path}", *TINY, "data.synthetic_train=20000",
           "data.loader=torch", "data.workers=1"]  # fmt: skip
    proc = subprocess.Popen(run, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout and " on synthetic (20000 train " in proc.stdout.readline()
        while not (workers := forks(proc.pid)) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        os.kill(workers[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "Traceback" not in err, err
    killed = (f"(pid {workers[0]}) is killed by signal: Killed; SIGKILL: the kernel's out-of-memory killer, most "
              "often (dmesg says)")  # fmt: skip
    gone = f"(pid(s) {workers[0]}) exited unexpectedly"  # torch's other way to find it, by the timing
    said = [f"error: a DataLoader worker was lost (DataLoader worker {how}); {errors.LOST_WORKER_FIX}" for how in
            (killed, gone)]  # fmt: skip
    assert err.splitlines()[-1] in said, err
    monkeypatch.setattr(errors, "OOM_KILLS_AT_START", 3)
    monkeypatch.setattr(errors, "oom_kills", lambda: 4)  # one kill in this process's memory cgroup since it began
    lost = errors.machine_failure(RuntimeError(f"DataLoader worker (pid 9) is killed by signal: Killed. {'x' * 9}"))
    assert lost == ("a DataLoader worker was lost (DataLoader worker (pid 9) is killed by signal: Killed. xxxxxxxxx; "
                    "SIGKILL: the kernel's out-of-memory killer ended 1 process on this machine meanwhile (dmesg names "
                    f"it)); {errors.LOST_WORKER_FIX}")  # fmt: skip


def test_dataloader_workers_out_of_shared_memory_is_one_line_with_what_to_try(tmp_path, capsys):
    """data.loader=torch's workers hand their batches over in /dev/shm, 64 MB in a Docker container unless
    --shm-size. Full, the run was torch's traceback ("Caught RuntimeError in DataLoader worker process 0 ...
    unable to allocate shared memory(shm)"). A real 256 KiB /dev/shm, in a mount namespace of the run's own."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "true"]).returncode != 0:
        pytest.skip("needs `unshare --mount` (root, util-linux) to give the run a small /dev/shm of its own")
    run = [sys.executable, str(TRAIN), f"run.out_dir={tmp_path}", *TINY, "data.loader=torch", "data.workers=1"]
    small = 'mount -t tmpfs -o size=256k none /dev/shm && exec "$@"'
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", small, "run", *run],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.splitlines()[-1].lstrip("\0")  # (torch 2.4's worker ends its bus error's line with a NUL)
    ran_out = ("(RuntimeError: unable to allocate shared memory(shm)", "(DataLoader worker (pid ")  # torch 2.14, 2.4
    assert line.startswith(tuple(f"error: out of shared memory {words}" for words in ran_out)), line
    assert line.endswith(f"; /dev/shm: 0.2 MiB); {errors.SHARED_MEMORY_FIX}"), line
    assert ("No space left on device (28)" if ran_out[0] in line else "is killed by signal: Bus error") in line, line

    def bus_error(argv):  # the worker killed by SIGBUS where the space ran out while it wrote: torch's line
        raise RuntimeError(
            "DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that dataloader's workers "
            "are out of shared memory. Please try to raise your shared memory limit."
        )

    assert cli.command(bus_error, []) == 1
    assert capsys.readouterr().err.startswith("error: out of shared memory (DataLoader worker (pid 4242) is killed")


@pytest.mark.parametrize(
    "error",
    [errors.UsageError("data.path=/x.npz: no such file"), MemoryError("no room"), KeyboardInterrupt(),
     PermissionError(13, "Permission denied", "/root/secret.npz"), errors.Stopped("stopped on SIGTERM at step 4"),
     errors.WriteFailed("cannot write metrics.jsonl: no space left")],
)  # fmt: skip
def test_what_a_rank_tells_the_others_when_it_leaves_is_its_own_line_and_exit_code(error, capsys):
    """errors.ending (what lost_rank leaves at torchrun's store) against cli.command's line and exit code."""

    def main(argv: list[str]) -> None:
        raise error

    code = cli.command(main, [])
    assert errors.ending(error) == (code, capsys.readouterr().err.strip().removeprefix("error: "))


def test_python_m_ddp_lists_every_command_and_takes_no_arguments():
    """`python -m ddp` was Python's own "No module named ddp.__main__". It lists the commands: each module that
    runs as a command (its `__main__` guard) but the launchers' own (torchrun.py, accelerate_launch.py, which the
    launch files start), and nothing else; with arguments it runs nothing, exit 2. `--help`, which each listed
    command takes, was such an argument's error: it lists them, exit 0."""
    listed = subprocess.run([sys.executable, "-m", "ddp"], cwd=REPO, env=clean_env(), capture_output=True, text=True)
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    named = set(re.findall(r"-m ddp\.(\w+)|ddp/(train)\.py", listed.stdout))
    commands = {p.stem for p in (REPO / "ddp").glob("*.py") if 'if __name__ == "__main__":' in p.read_text()}
    assert {module or script for module, script in named} == commands - {"__main__", "torchrun", "accelerate_launch"}
    given = subprocess.run([sys.executable, "-m", "ddp", "train"], cwd=REPO, env=clean_env(), capture_output=True,
                           text=True)  # fmt: skip
    assert given.returncode == 2 and given.stdout == "", given
    assert given.stderr.startswith("error: python -m ddp takes no arguments (it lists the commands); got train\n")
    for asked in ("-h", "--help"):
        helped = subprocess.run([sys.executable, "-m", "ddp", asked], cwd=REPO, env=clean_env(), capture_output=True,
                                text=True)  # fmt: skip
        assert (helped.returncode, helped.stdout, helped.stderr) == (0, listed.stdout, ""), helped
