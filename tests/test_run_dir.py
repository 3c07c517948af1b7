"""run.out_dir against the world: a second run into it while one lives (refused), and a disk that
fills up (one line, the previous files intact, a later run with space continues). Real processes,
a real filesystem that fills (a small tmpfs)."""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, TRAIN, clean_env, metrics, ok, python, torchrun, wait_for_checkpoint

from ddp import checkpoint, doctor, files, rundir, train
from ddp.devices import World
from ddp.errors import UsageError, WriteFailed

# Minutes if not stopped (the tests stop it): a first checkpoint 1-2 s in, then steps on one thread
# while the test runs beside it.
LONG = [*TINY, "data.synthetic_train=1024", "train.epochs=120", "run.progress=false"]


def assert_one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr
    assert f'File "{REPO / "ddp"}' not in proc.stderr  # none of our tracebacks
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def start(out_dir: Path, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(TRAIN), f"run.out_dir={out_dir}", *LONG, *args], cwd=REPO,
                            env=clean_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    lock = out_dir / rundir.LOCK
    deadline = time.monotonic() + 120
    while not (lock.is_file() and lock.read_text() and rundir.step_files(out_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.1)
    return proc


def test_a_second_run_into_a_live_runs_out_dir_is_refused_and_the_lock_dies_with_the_first(tmp_path):
    first = start(tmp_path)
    first.send_signal(signal.SIGSTOP)  # holds its lock, frozen: its training would take the others' CPU
    try:
        config_yaml = (tmp_path / "config.yaml").read_text()
        holder = f"pid {first.pid} on {socket.gethostname()}, started "
        second = python(str(TRAIN), f"run.out_dir={tmp_path}", *TINY, timeout=60)
        assert second.returncode == 2
        assert_one_error_line(second, f"run.out_dir={tmp_path} is in use by another run ({holder}")
        # The launch scripts refuse before torchrun starts: the message once, last, and no traceback.
        scripted = subprocess.run(["bash", "launch/torchrun.sh", f"run.out_dir={tmp_path}", *TINY], cwd=REPO,
                                  env=clean_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
        assert scripted.returncode == 2 and "+ python" not in scripted.stderr
        assert scripted.stderr.strip().splitlines()[-1].startswith(f"error: run.out_dir={tmp_path} is in use by")
        # Two ranks started by torchrun directly: rank 0 refuses before its rendezvous, says so once.
        ranks = torchrun(2, str(TRAIN), f"run.out_dir={tmp_path}", *TINY, "run.timeout_s=30", timeout=120)
        said = [line for line in ranks.stderr.splitlines() if line.startswith("error: ") and "is in use by" in line]
        assert ranks.returncode != 0 and len(said) == 1  # torchrun's box repeats it as the root cause
        first.send_signal(signal.SIGCONT)
        # the first run goes on, untouched (a new checkpoint) ...
        wait_for_checkpoint(tmp_path, first, timeout=60, newer_than=rundir.step_files(tmp_path)[0])
        assert (tmp_path / "config.yaml").read_text() == config_yaml  # ... none of the refused ones wrote there
    finally:
        first.send_signal(signal.SIGKILL)  # no handler runs: only the OS can release the lock
        first.communicate(timeout=60)
    rows = [r["epoch"] for r in metrics(tmp_path)] if (tmp_path / "metrics.jsonl").exists() else []
    assert rows == sorted(set(rows))  # one run's epochs, each once
    resumed = ok(python(str(TRAIN), f"run.out_dir={tmp_path}", *LONG, "train.epochs=1", "run.resume=auto"))
    assert "is in use" not in resumed.stderr  # no stale lock after a SIGKILL


def test_where_locks_do_not_work_a_warning_and_no_wait(tmp_path, monkeypatch, capsys):
    """NFS without lockd answers flock with ENOLCK at once: warn, go on, never block."""

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(rundir.fcntl, "flock", no_locks)
    with rundir.lock(str(tmp_path), World(0, 0, 1, torch.device("cpu"), "none")):
        pass
    assert "warning: cannot lock run.out_dir=" in capsys.readouterr().err


def test_a_refused_run_takes_away_the_folders_it_made_for_its_lock_and_nothing_else(tmp_path, capsys):
    """A run refused before it wrote anything (here: no such data file) leaves no out_dir holding a lock file alone:
    the folders it made go, the ones that were there stay; and a lock file taken away between another run's open and
    its lock is opened again, so that the two never hold locks on different files."""
    new = tmp_path / "runs" / "new"
    assert train.cli([f"run.out_dir={new}", "data.dataset=npz", f"data.path={tmp_path / 'none.npz'}"]) == 2
    assert "none.npz" in capsys.readouterr().err and not (tmp_path / "runs").exists()
    (tmp_path / "there").mkdir()
    assert (
        train.cli([f"run.out_dir={tmp_path / 'there'}", "data.dataset=npz", f"data.path={tmp_path / 'none.npz'}"]) == 2
    )
    assert (tmp_path / "there").is_dir()  # not made by the run: stays (with its lock file)
    lock, real_take, taken = tmp_path / "raced" / rundir.LOCK, rundir._take, []

    def raced(fd: int, out_dir: str) -> bool:  # the first file removed after its open, as a refused run does
        if not taken:
            lock.unlink()
        taken.append(os.fstat(fd).st_ino)
        return real_take(fd, out_dir)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rundir, "_take", raced)
        with rundir.lock(str(lock.parent), World(0, 0, 1, torch.device("cpu"), "none")):
            assert len(taken) == 2 and taken[-1] == lock.stat().st_ino  # the second open's file: the one there


def test_a_lock_file_that_does_not_say_who_holds_it(tmp_path):
    (tmp_path / rundir.LOCK).write_text("not json")
    with open(tmp_path / rundir.LOCK) as held:  # another process's lock, as far as flock can tell
        rundir.fcntl.flock(held, rundir.fcntl.LOCK_EX)
        with pytest.raises(UsageError, match="in use by another run \\(its lock file does not say which\\)"):
            with rundir.lock(str(tmp_path), World(0, 0, 1, torch.device("cpu"), "none")):
                pass


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 2600 KiB at tmp_path/disk: three checkpoints of the small net fit, the fourth does not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"needs to mount a tmpfs (root with CAP_SYS_ADMIN): {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)])


def grow(disk: Path) -> None:
    subprocess.run(["mount", "-o", "remount,size=50m", str(disk)], check=True)


def leftovers(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.name.endswith(".tmp")]


def test_a_full_disk_is_one_line_the_last_checkpoint_stays_and_a_rerun_continues(small_disk):
    out = small_disk / "run"
    args = [f"run.out_dir={out}", *TINY, "run.save_every_steps=3", "run.progress=false"]
    full = python(str(TRAIN), *args)
    assert full.returncode == 1, full.stderr
    line = assert_one_error_line(full, "cannot write ", "No space left on device", "bytes needed", "bytes free")
    newest = rundir.step_files(out)[0]
    assert f"the previous checkpoint, {newest}, is intact" in line
    checkpoint.load(newest)  # whole: it loads and passes its checksum
    assert not leftovers(out)
    assert [m["epoch"] for m in metrics(out)] == [1]  # whole lines only
    grow(small_disk)
    again = ok(python(str(TRAIN), *args))
    assert f"resumed from {newest}" in again.stdout
    assert [m["epoch"] for m in metrics(out)] == [1, 2] and not leftovers(out)


def test_a_full_disk_under_two_ranks_stops_both_with_one_line(small_disk):
    out = small_disk / "run"
    proc = torchrun(2, str(TRAIN), f"run.out_dir={out}", *TINY, "run.save_every_steps=3", "run.timeout_s=60")
    assert proc.returncode != 0 and "exitcode  : 1" in proc.stderr
    assert_one_error_line(proc, "No space left on device", "is intact")
    assert "lost contact" not in proc.stderr and not leftovers(out)


def test_a_disk_full_from_the_start_fails_on_config_yaml(small_disk):
    filler = small_disk / "filler"
    with open(filler, "wb") as f:  # take all the space there is
        with pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    out = small_disk / "run"
    proc = python(str(TRAIN), f"run.out_dir={out}", *TINY)
    assert proc.returncode == 1
    assert_one_error_line(proc, f"cannot write {out / 'config.yaml'}: No space left on device")
    assert not leftovers(small_disk)


def test_an_append_that_does_not_fit_leaves_the_file_as_it_was(small_disk):
    """metrics.jsonl: a line either lands whole or not at all."""
    log = small_disk / "metrics.jsonl"
    log.write_text(json.dumps({"epoch": 1}) + "\n")
    before = log.read_bytes()
    with pytest.raises(WriteFailed, match=f"cannot write {log}: No space left on device"):
        files.append(log, "x" * 4_000_000 + "\n")  # larger than the whole disk
    assert log.read_bytes() == before


def test_a_write_that_fails_for_another_reason_than_space_names_no_free_space(tmp_path):
    """A read-only or missing place: its reason alone ("0 bytes free" of /proc said "a full disk" where none was; a
    folder that cannot be made there is not one "gone")."""
    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "model.pt"
    with pytest.raises(WriteFailed) as raised:
        files.replace(target, b"x")  # its directory is a file
    assert str(raised.value) == f"cannot write {target}: {target.parent} is a file, not a directory"  # not EEXIST's
    full = files.failure(target, 1234, OSError(errno.ENOSPC, "No space left on device"))
    assert str(full).startswith(f"cannot write {target}: No space left on device (1,234 bytes needed, ")
    unmade = Path("/proc/ddp-cifar-none/charts/curves.png")  # a folder no one can make: not one removed meanwhile
    with pytest.raises(WriteFailed, match=f"^cannot write {unmade}: No such file or directory$"):
        files.replace(unmade, b"x")


@pytest.mark.parametrize("before", ["metrics", "checkpoint", "profile"])
def test_a_run_folder_removed_as_the_run_trains_is_said_to_be_gone_in_one_line(tmp_path, monkeypatch, capsys, before):
    """`rm -rf runs/a` (or a cleaner of /tmp) while the run trains: its next metrics.jsonl write failed with "No such
    file or directory", and the lock's clean-up, listing the folder it had made, raised FileNotFoundError over it (a
    traceback, exit 1); a checkpoint's write, where it came first (a mid-epoch one), made the folder again, and the
    run went on there without its lock (another run could take the folder) or config.yaml, and so did a profile's.
    Now the first write names the folder gone in one line, and the run ends with exit 1."""
    from ddp import logs

    out, runs = tmp_path / "runs" / "a", tmp_path / "runs"
    module, name, file = {
        "metrics": (logs, "record_epoch", out / "metrics.jsonl"),
        "checkpoint": (rundir, "step_path", out / "checkpoints" / "step-000000008.pt"),
        "profile": (rundir, "profile_path", out / "profile" / "rank0.json"),  # (run.profile=1:3: before epoch 1 ends)
    }[before]
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: shutil.rmtree(runs, ignore_errors=True) or real(*args))
    assert train.cli([*TINY, "train.epochs=1", "run.profile=1:3", f"run.out_dir={out}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {file}: {runs} is gone (removed or moved meanwhile?)"), err
    assert len(err.splitlines()) == 1 and not runs.exists(), err


def test_an_out_dir_whose_parent_cannot_be_searched_says_why_instead_of_a_traceback(tmp_path, monkeypatch):
    """Looking for a file in the way, where a user who is not root may not search a parent (/root): each
    stat refused. Root, as the suite runs, is never refused, so stat refuses here as it would there."""

    def stat(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(os, "stat", stat)
    error = OSError(errno.ENOTDIR, "Not a directory")  # an errno that has it look for a file in the way
    assert files.in_the_way(tmp_path / "x" / "run", error) == "Not a directory"


def test_a_resume_keeps_the_saved_epochs_of_metrics_jsonl_and_drops_what_is_no_record(tmp_path):
    """A kill mid-line, an epoch the checkpoint does not hold, bytes that are no text (a disk's damage, an
    editor's): the resume's rewrite keeps the records up to the checkpoint's epoch (the bytes were a
    UnicodeDecodeError traceback)."""
    epoch = '{"epoch": %d, "train_loss": 1.0}\n'
    rundir.metrics_path(tmp_path).write_bytes(
        (epoch % 1 + epoch % 2 + '{"epoch": 3, "tra\n').encode() + b"\xff\xfe\x00junk\n" + (epoch % 3).encode()
    )
    rundir.prepare(str(tmp_path), "seed: 0\n", 2, World(0, 0, 1, torch.device("cpu"), "none"))
    assert rundir.metrics_path(tmp_path).read_text() == epoch % 1 + epoch % 2


def test_a_folder_whose_files_no_run_wrote_is_refused_and_left_as_it_was(tmp_path, capsys):
    """run.out_dir=. in a project (or any folder of another program's): its config.yaml, metrics.jsonl and
    checkpoints/last.pt were replaced by the run's, silently. Refused now on every rank before the lock, nothing
    written (no lock file left); the doctor says it. A run's own config.yaml (this config's sections, checkpoints/
    beside it) is no bar; a user's config of ddp-cifar's (`--config runs/a/config.yaml run.out_dir=runs/a`) was one."""
    yaml, jsonl = "model: {layers: 50}\nlr: 0.1\n", '{"loss": 1}\n'  # another program's
    cases = {"foreign-yaml": {"config.yaml": yaml}, "not-yaml": {"config.yaml": "\x00\x01 : ["},
             "users-own": {"config.yaml": "train:\n  epochs: 3  # mine\n"},
             "metrics": {"metrics.jsonl": jsonl},
             "metrics-and-last": {"checkpoints/last.pt": "x", "metrics.jsonl": jsonl},
             "steps": {f"checkpoints/step-00000000{n}.pt": "x" for n in range(1, 5)},  # were pruned to keep_last
             "trace": {"profile/rank0.json": "{}"}}  # fmt: skip
    for name, made in cases.items():
        folder = tmp_path / name
        for path, text in made.items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_text(text)
        assert train.cli([f"run.out_dir={folder}", *TINY]) == 2, name
        err = capsys.readouterr().err
        if "config.yaml" in made:
            why = "no checkpoints/ beside it, which a run makes first" if name == "users-own" else "not ddp-cifar's "
            assert err == (f"error: run.out_dir={folder} holds a config.yaml that is not a run's ({why}"
                           f"{'settings' if name != 'users-own' else ''}; a run writes its settings there, replacing "
                           f"it): choose another run.out_dir, or move {folder}/config.yaml away\n")  # fmt: skip
        else:
            names = " and ".join(sorted(made, key=lambda p: p != "metrics.jsonl"))
            if name == "steps":  # the first two named, the rest counted
                names = "checkpoints/step-000000001.pt, checkpoints/step-000000002.pt and 2 more"
            assert err.startswith(f"error: run.out_dir={folder} holds {names} but no run's config.yaml"), err
            assert "they are not a run's, and this run would replace or prune them; choose another" in err
        assert {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} == set(made), name
        assert all((folder / path).read_text() == text for path, text in made.items())
    assert doctor.run_files_problem(str(tmp_path / "foreign-yaml")).startswith("run.out_dir=")
    ours = tmp_path / "ours"  # a run's config.yaml: the run goes on (here: its first epoch, then another run's)
    rundir.checkpoint_dir(ours).mkdir(parents=True)
    rundir.config_path(ours).write_text("data:\n  dataset: synthetic\nrun:\n  seed: 3\n")
    assert train.cli([f"run.out_dir={ours}", *TINY, "train.epochs=1"]) == 0 and len(metrics(ours)) == 1


@pytest.mark.parametrize(
    "name, kind",
    [(".lock", "directory"), ("metrics.jsonl", "directory"), ("checkpoints", "file"), ("tensorboard", "file"),
     ("metrics.jsonl", "device"), ("config.yaml", "pipe")],
)  # fmt: skip
def test_a_file_or_directory_in_the_way_inside_out_dir_is_named_before_the_first_step(tmp_path, name, kind, capsys):
    """Each was said without its path ('(Is a directory)'), a FileExistsError traceback (tensorboard/), or, for
    checkpoints/, only when the first checkpoint was written, after an epoch of training. A pipe or a link to a
    device of a run's file's name: metrics.jsonl as /dev/zero was read whole (a MemoryError said as the model's, or
    the OOM killer), as a pipe it waited for good; a pipe named config.yaml was replaced."""
    path = tmp_path / name
    {"directory": path.mkdir, "file": lambda: path.write_text("x"), "pipe": lambda: os.mkfifo(path),
     "device": lambda: path.symlink_to("/dev/zero")}[kind]()  # fmt: skip
    assert train.cli([f"run.out_dir={tmp_path}", *TINY, "run.tensorboard=true"]) == 2
    out, err = capsys.readouterr()
    if kind in ("pipe", "device"):
        assert err == (f"error: run.out_dir={tmp_path}: {path} is a pipe or a device (or a link to one) where a run "
                       "keeps a file of its own: remove it, or choose another run.out_dir\n")  # fmt: skip
        return
    why = f"{path}: Is a directory" if kind == "directory" else f"{path} is a file, not a directory"
    assert err == f"error: cannot write to run.out_dir={tmp_path} ({why})\n" and "epoch 1/" not in out


def test_stdout_on_a_full_disk_leaves_a_run_training_and_is_one_line_for_a_command(tmp_path):
    """`> FILE` on a full disk (/dev/full): the run's log lines were an OSError traceback that ended the run at
    its start line; now the run goes on (one warning, its epochs in metrics.jsonl and its checkpoints). A
    command whose output is its result (evaluate, inspect, --help) says it cannot write it: exit 1, one line
    (--help's was exit 0, silent: the error's check for run.debug read --help again)."""

    def to_full_disk(*args: str) -> subprocess.CompletedProcess:
        with open("/dev/full", "w") as full:
            return subprocess.run([sys.executable, *args], cwd=REPO, env=clean_env(), stdout=full,
                                  stderr=subprocess.PIPE, text=True, timeout=180)  # fmt: skip

    run = to_full_disk(str(TRAIN), f"run.out_dir={tmp_path}", *TINY)
    assert run.returncode == 0 and run.stderr == (
        "warning: cannot write the run's log to stdout (No space left on device); the run goes on, its epochs in "
        "metrics.jsonl\n"
    )
    assert [r["epoch"] for r in metrics(tmp_path)] == [1, 2] and rundir.last_path(tmp_path).is_file()
    last = str(rundir.last_path(tmp_path))
    for args in (["-m", "ddp.evaluate", "--checkpoint", last, "--json"], ["-m", "ddp.checkpoint", "inspect", last],
                 [str(TRAIN), "--help"]):  # fmt: skip
        refused = to_full_disk(*args)
        assert (refused.returncode, refused.stderr) == (1, "error: cannot write the output to stdout (No space left "
                                                           "on device)\n"), args  # fmt: skip
