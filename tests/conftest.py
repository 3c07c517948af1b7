"""Shared helpers: the repo's paths, real subprocess launches (python / torchrun) with a clean env."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before torch loads OpenMP (it reads this once): threads that wait for work sleep instead of spinning.
# Alone it changes nothing; when two processes with 2 threads each share the 2 cores of a laptop (a
# run's reference beside it, pytest-xdist's workers), spinning took their CPU: a training loop with 2
# threads, twice at once, 13.7-14.0 s each against 8.0-9.0 s passive (4.6-4.7 s alone, both ways).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# `nohup make test &` (or any background job of a script) starts the suite with SIGINT and SIGHUP ignored, and an
# ignored signal stays ignored in every process it starts: the tests' Ctrl-C and hang-up reached no run (9 failed).
# Here a handler instead, which exec resets: the runs get the default. SIGINT's is Python's own (KeyboardInterrupt:
# tests send it to themselves; no terminal's Ctrl-C reaches a background job); SIGHUP's does nothing (nohup's word).
for _signal, _handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGHUP, lambda *_: None)):
    if signal.getsignal(_signal) == signal.SIG_IGN:
        signal.signal(_signal, _handler)

import torch  # noqa: E402

from ddp import checkpoint, rundir  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "ddp" / "train.py"
SUBSET = REPO.parent / "shared" / "data" / "cifar10-subset.npz"
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")

# A tiny learnable job: 256 synthetic train images (8 steps of 32), 101 test images (not divisible
# by 2 or 3, so uneven evaluation shards are exercised), no loader workers.
TINY = [
    "data.dataset=synthetic",
    "data.synthetic_train=256",
    "data.synthetic_test=101",
    "data.workers=0",
    "model.name=small",
    "train.batch_size=32",
    "train.epochs=2",
    "optim.lr=0.05",
]


LAUNCH_PREFIXES = ("SLURM_", "ACCELERATE_", "OMPI_", "PMI_", "TORCHELASTIC_")  # e.g. pytest run inside a job
BIN = Path(sys.executable).parent  # this environment's python, torchrun, accelerate


def is_launch_var(name: str) -> bool:
    return name in LAUNCH_VARS or name.startswith(LAUNCH_PREFIXES)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh shell: no launcher variables, CPU only, unbuffered output, this
    environment's executables first on PATH."""
    env = {k: v for k, v in os.environ.items() if not is_launch_var(k)}
    env.update(PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    env.update(extra)
    return env


def can_install_system_packages() -> bool:
    """Whether `make test` installs missing system packages here (tests/system_packages.sh): root on a
    machine with apt-get."""
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def require(tool: str, install: str) -> str:
    """The path of a system tool the launcher tests need. Missing where `make test` can install it
    (root, apt-get), the test fails: the install went wrong. Missing elsewhere, or with
    DDP_CIFAR_ALLOW_MISSING=1, the test skips and says how to install it."""
    path = shutil.which(tool, path=f"{os.environ['PATH']}{os.pathsep}/usr/sbin{os.pathsep}/sbin")
    if path:
        return path
    reason = f"{tool} not found: {install} (make test does this when it runs as root with apt-get)"
    if not can_install_system_packages() or os.environ.get("DDP_CIFAR_ALLOW_MISSING") == "1":
        pytest.skip(reason)
    pytest.fail(reason)


def torchrun_shares_its_store() -> bool:
    """Whether this torch's torchrun gives its workers its rendezvous store (TORCHELASTIC_USE_AGENT_STORE=True),
    which outlives their rank 0: not torch 2.4's, whose workers meet in a store their rank 0 serves."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    return "use_agent_store" in vars(DynamicRendezvousHandler)  # (overridden where it shares it)


def has_fsdp2() -> bool:
    """Whether this torch has FSDP2's public fully_shard (torch 2.6 on): run.parallel=fsdp runs."""
    from ddp import fsdp
    from ddp.errors import UsageError

    try:
        fsdp.check_available()
    except UsageError:
        return False
    return True


def needs_fsdp2() -> None:
    """Skip a test that runs run.parallel=fsdp under a torch without FSDP2 (bench/old_torch.sh: torch 2.4 and 2.5),
    where ddp/train.py refuses it in one line (test_fsdp.py's test_a_torch_without_fully_shard_... tests that line)."""
    if not has_fsdp2():
        import torch

        pytest.skip(f"run.parallel=fsdp needs torch >= 2.6 (FSDP2's fully_shard); this is torch {torch.__version__}")


def python(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python ddp/train.py ARGS` (or any python command line) as a real subprocess."""
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env or clean_env(), capture_output=True, text=True, timeout=timeout
    )


TORCHRUN = str(BIN / "torchrun")


def torchrun(
    nproc: int, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The real torchrun executable of this environment, standalone rendezvous on loopback."""
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, cwd=REPO, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


REPORT: list[str] = []  # a test's lines for the end of the pytest run (e.g. the kill points tried)
_REPORTED: list[str] = []  # every test's, gathered where the run is reported (pytest-xdist: its controller)


def pytest_configure(config) -> None:
    # Drawn once here, so that every pytest-xdist worker (started after this, with this environment)
    # draws the same kill points; test_resume.py reads it.
    os.environ.setdefault("KILL_SEED", str(time.time_ns() % 2**31))


# make test gives pytest-xdist whole files (-n 2 --dist loadfile --no-loadscope-reorder), in this
# order: the longest first, so that the workers end together instead of one finishing a long file
# alone. Seconds of each file's tests in a 2-worker run (2026-11-25): 349, 254, 113, 107, 106, 87, 60,
# 55, 53, 43, 41; every other file under 35. A file not listed runs after these, in name order.
LONGEST_FIRST = [
    "test_hosts.py", "test_resume.py", "test_equivalence.py", "test_gpu_check.py", "test_fsdp.py", "test_launch.py",
    "test_slurm.py", "test_progress.py", "test_ddp.py", "test_cli_errors.py", "test_observe.py",
]  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if REPORT:  # carried in the test's report: the run's controller gets it from a pytest-xdist worker too
        outcome.get_result().user_properties.extend(("report", line) for line in REPORT)
        REPORT.clear()


def pytest_runtest_logreport(report) -> None:
    _REPORTED.extend(line for key, line in report.user_properties if key == "report")


def pytest_terminal_summary(terminalreporter) -> None:
    if _REPORTED:
        terminalreporter.section("launch / kill / resume report")
        terminalreporter.write_line(f"KILL_SEED={os.environ['KILL_SEED']}")
        for line in _REPORTED:
            terminalreporter.write_line(line)


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def tensors(state: object) -> list[torch.Tensor]:
    """Every tensor in a nested state (dicts and lists), in a fixed order; a number as a tensor."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in tensors(state[key])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in tensors(item)]
    return [torch.tensor(float(state))] if isinstance(state, (int, float)) and not isinstance(state, bool) else []


def same_last_checkpoints(root: Path, reference: str, others: tuple[str, ...], parts: tuple[str, ...]) -> dict:
    """The last checkpoints of the runs in root/<name>, each part of each of `others` equal to `reference`'s to the
    bit; returns them by name."""
    ends = {n: torch.load(root / n / "checkpoints" / "last.pt", weights_only=True) for n in (reference, *others)}
    for part in parts:
        for name in others:
            pairs = zip(tensors(ends[reference][part]), tensors(ends[name][part]), strict=True)
            assert all(torch.equal(a, b) for a, b in pairs), (name, part)
    return ends


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


@pytest.fixture(autouse=True)
def _no_launcher_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process tests are a plain single process, whatever shell pytest was started from."""
    for var in [k for k in os.environ if is_launch_var(k)]:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="session", autouse=True)
def _scratch_in_pytests_temp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """TMPDIR of the suite and every process it starts: a folder in pytest's own temporary directory, which pytest
    removes a few runs later. In /tmp a suite left 110 torchelastic_* folders (plain torchrun's log dirs) and more
    of torch's scratch, never removed. One folder for pytest-xdist's workers (torch.compile's cache is in it)."""
    base = tmp_path_factory.getbasetemp()
    scratch = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "TMPDIR"
    scratch.mkdir(exist_ok=True)
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"], tempfile.tempdir = str(scratch), None  # tempfile reads TMPDIR once, and again after None
    yield
    if before is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None


@pytest.fixture
def subset() -> Path:
    if not SUBSET.is_file():
        pytest.skip(f"real CIFAR-10 subset not found at {SUBSET} (it lives in ../shared/data beside the repo)")
    return SUBSET


# Processes of a run, from /proc: what a test checks is left after a kill.


@contextlib.contextmanager
def piped(data: bytes) -> Iterator[str]:
    """/dev/fd/N of a pipe that a thread fills with `data`, then closes: what bash's <(cat FILE) names."""
    read, write = os.pipe()

    def fill() -> None:
        with open(write, "wb") as f:
            f.write(data)

    filling = threading.Thread(target=fill)
    filling.start()
    try:
        yield f"/dev/fd/{read}"
    finally:
        filling.join(timeout=60)
        os.close(read)


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, ...], or None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _processes_with(field: int, value: int) -> list[int]:
    """The processes whose /proc/PID/stat field (counted as _stat does) is `value`."""
    return [int(p.name) for p in Path("/proc").glob("[0-9]*") if (f := _stat(int(p.name))) and int(f[field]) == value]


def children(pid: int) -> list[int]:
    return _processes_with(1, pid)  # ppid


def forks(pid: int) -> list[int]:
    """`pid`'s children running its own command line (a DataLoader worker), not another program (an import's
    `/sbin/ldconfig -p`, seen as the first child of ddp/train.py under load: 2026-11-28)."""

    def command(p: int) -> bytes | None:
        with contextlib.suppress(OSError):
            return Path(f"/proc/{p}/cmdline").read_bytes()
        return None

    parent = command(pid)
    return [child for child in children(pid) if parent is not None and command(child) == parent]


def session(sid: int) -> list[int]:
    """The processes of session `sid` (a Popen(start_new_session=True)'s pid): its whole tree, process
    groups of its own (timeout's) included."""
    return _processes_with(3, sid)


def state(pid: int) -> str | None:
    """/proc/PID/stat's state (R, S, T for stopped, Z...), or None if gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def running(pid: int) -> bool:
    """Alive, or still exiting: a killed process's main thread turns zombie before its other threads have
    exited, and its files (the run's lock) close only with the last of them."""
    fields = _stat(pid)
    if fields is None:
        return False
    if fields[0] != "Z":
        return True
    try:
        return any(task.name != str(pid) for task in Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False


def wait_for_checkpoint(
    out: Path, procs: subprocess.Popen | list[subprocess.Popen], timeout: float = 120, newer_than: Path | None = None
) -> None:
    """Until `out` has a checkpoint (one newer than `newer_than`, given), every process of its job (its
    launchers) still running; else fails naming the ones that ended, with their exit codes and stderr."""
    procs = procs if isinstance(procs, list) else [procs]
    deadline = time.monotonic() + timeout
    while not rundir.step_files(out) or (newer_than and rundir.step_files(out)[0] <= newer_than):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            ended = [
                (p.returncode, (p.communicate(timeout=30)[1] or "")[-2000:]) for p in procs if p.poll() is not None
            ]
            raise AssertionError(f"{out.name}: no new checkpoint within {timeout:.0f} s; launchers that ended: {ended}")
        time.sleep(0.05)


def seconds_until_gone(pids: list[int], since: float, limit: float = 10) -> float:
    """Seconds from `since` until none of `pids` runs; fails past `limit`."""
    while any(running(pid) for pid in pids):
        assert time.monotonic() - since < limit, f"processes {[p for p in pids if running(p)]} still run"
        time.sleep(0.05)
    return time.monotonic() - since


def kill_orphans(pids: list[int]) -> None:
    """SIGKILL what is left of `pids` (a failed test's: orphans that kill_job no longer finds)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_free_and_whole(out: Path) -> None:
    """run.out_dir after the run's processes are gone: the lock free, every checkpoint whole."""
    if (out / rundir.LOCK).exists():
        with open(out / rundir.LOCK) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise AssertionError(f"the lock is still held, open in: {holders(out / rundir.LOCK)}") from None
    for path in rundir.step_files(out):
        checkpoint.load(path)


def holders(path: Path) -> list[str]:
    """The processes with `path` open, as 'pid: command line'."""
    found = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            if os.readlink(fd) == str(path):
                pid = int(fd.parent.parent.name)
                command = cmdline(pid).replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{pid}: {command[:200]}")
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def pending(pid: int, sig: signal.Signals) -> bool:
    """Whether `sig` waits in `pid`'s pending signals (a stopped process takes it at SIGCONT)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return any(int(status[field], 16) >> (sig - 1) & 1 for field in ("SigPnd", "ShdPnd"))


def descendants(pid: int) -> list[int]:
    found = children(pid)
    return found + [d for child in found for d in descendants(child)]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The least d such that |a - b| <= d * (1 + |a|) for every float value of the two state dicts."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs() / (1 + a[k].abs())).max().item() for k in a if a[k].is_floating_point())


@contextlib.contextmanager
def cgroup(controller: str, v2: dict[str, int | str], v1: dict[str, int | str], needs: str) -> Iterator[Path]:
    """A cgroup of its own with `controller`'s limits (cgroup v2's files `v2`, or `v1`'s in v1's hierarchy of that
    controller), each written in order where its file exists: its cgroup.procs file, for a process to move itself
    into; its processes killed and the cgroup removed after. Skipped where none can be made (`needs` one)."""
    root = Path("/sys/fs/cgroup")
    if os.geteuid() != 0:
        pytest.skip(f"a {controller} cgroup ({needs}) needs root: run the tests as root")
    on_v2 = (root / "cgroup.controllers").is_file()
    group = (root if on_v2 else root / controller) / f"ddp-cifar-test-{controller}-{os.getpid()}"
    limits = v2 if on_v2 else v1
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"no {controller} cgroup could be made at {group} ({e.strerror}): {needs} needs one")
    try:
        if not (group / next(iter(limits))).exists():
            pytest.skip(f"{group} has no {controller} controller (not in its parent's cgroup.subtree_control)")
        for name, value in limits.items():
            if (group / name).exists():  # (memsw: only where swap is accounted)
                try:
                    (group / name).write_text(str(value))
                except OSError as e:  # (v1: a quota above the parent's)
                    pytest.skip(f"{group}: {name} refused {value} ({e.strerror}): {needs} needs it")
        yield group / "cgroup.procs"
    finally:
        deadline = time.monotonic() + 30
        while (pids := (group / "cgroup.procs").read_text().split()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.1)
        group.rmdir()


def memory_cgroup(limit: int) -> contextlib.AbstractContextManager[Path]:
    """A memory cgroup limited to `limit` bytes, no swap (v1: the swap limit after the memory limit, at least it)."""
    return cgroup(
        "memory",
        {"memory.max": limit, "memory.swap.max": 0},
        {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit},
        "a real out-of-memory kill",
    )


def cpu_cgroup(cpus: float) -> contextlib.AbstractContextManager[Path]:
    """A cgroup whose CPU quota is `cpus` CPUs' time a second (a container's --cpus)."""
    quota, period = int(cpus * 100_000), 100_000
    return cgroup(
        "cpu", {"cpu.max": f"{quota} {period}"}, {"cpu.cfs_period_us": period, "cpu.cfs_quota_us": quota}, "a CPU quota"
    )
