"""run.profile=A:B: a torch.profiler trace of global steps A to B-1 on every rank (Chrome trace format:
open it in https://ui.perfetto.dev), and on rank 0 a printed top-10 of operators by self time. The
parts of a step are labelled (record_function) where they run; DDP's all-reduce shows as gloo/nccl:all_reduce."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from torch.profiler import ProfilerActivity, profile

from ddp import files, logs, rundir
from ddp.devices import World
from ddp.errors import UsageError, WriteFailed


def parse(text: str, total_steps: int, steps_done: int = 0) -> range | None:
    """run.profile's steps (global, 1-based), checked against the run's `total_steps`; None when off,
    or when a resumed run has done `steps_done` steps, all of them (a resume inside them profiles the rest)."""
    if not text:
        return None
    first, colon, end = text.partition(":")
    try:
        steps = range(int(first), int(end)) if colon else None
    except ValueError:
        steps = None
    if steps is None or steps.start < 1 or len(steps) == 0:
        raise UsageError(f"run.profile={text!r}: expected A:B, global steps A to B-1 with 1 <= A < B, e.g. 10:20")
    if steps.start > total_steps:
        raise UsageError(f"run.profile={text}: the run has {total_steps} steps; profile within 1:{total_steps + 1}")
    return left(steps, steps_done)


def left(steps: range | None, steps_done: int) -> range | None:
    """The profile of a run resumed after `steps_done` global steps: the rest of `steps` (Profile
    starts at the first step it sees), or None when it is past them all."""
    return None if steps is None or steps_done >= steps.stop - 1 else steps  # stop - 1 >= 1: a fresh run profiles


class Profile:
    """Call before_step(n) before global step n and after_step(n) after it. Leaving the `with` at the
    run's end writes a trace that the last step cut short; leaving on an error (a stop too) only
    stops the profiler."""

    def __init__(self, steps: range | None, out_dir: str, world: World) -> None:
        self.steps, self.out_dir, self.world = steps, out_dir, world
        self.profiler: profile | None = None
        self.first_step = self.last_step = 0  # the steps profiled

    def before_step(self, step: int) -> None:
        if self.steps is not None and self.profiler is None and step in self.steps and not self.last_step:
            cuda = [ProfilerActivity.CUDA] if self.world.device.type == "cuda" else []
            self.profiler = profile(activities=[ProfilerActivity.CPU, *cuda], record_shapes=False)
            self.profiler.start()
            self.first_step = step

    def after_step(self, step: int) -> None:
        if self.profiler is not None:
            self.last_step = step
            if step >= self.steps.stop - 1:
                self.finish()

    def finish(self) -> None:
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        path = rundir.profile_path(self.out_dir, self.world.rank)
        # torch writes the trace to a file it names: a scratch one beside the trace (not in TMPDIR, a small /tmp),
        # whose bytes files.atomic puts in place. Where it cannot write, torch only logs so: its trace is missing.
        try:
            path.parent.mkdir(exist_ok=True)  # profile/, in out_dir: not out_dir again, where it was removed
        except OSError as e:
            raise files.failure(path, 0, e) from None
        try:
            for killed in path.parent.glob(f".{path.stem}-*"):  # a killed export's scratch folder (this rank's: the
                shutil.rmtree(killed, ignore_errors=True)  # lock keeps out_dir one run's; other ranks may export now)
            files.remove_temporary(path.parent, f".{path.name}.*.tmp")
            with (
                tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.stem}-") as scratch,
                files.atomic(path) as trace,
            ):
                profiler.export_chrome_trace(f"{scratch}/trace.json")
                trace.write(Path(scratch, "trace.json").read_bytes())
        except FileNotFoundError:  # torch wrote nothing (it only logs "Failed to write to log file!")
            free = f"{shutil.disk_usage(path.parent).free:,} bytes free there"
            raise WriteFailed(f"cannot write {path}: torch's profiler wrote no trace ({free})") from None
        except OSError as e:
            raise files.failure(path, 0, e) from None
        if self.world.is_main:
            by = "self_cuda_time_total" if self.world.device.type == "cuda" else "self_cpu_time_total"
            table = profiler.key_averages().table(sort_by=by, row_limit=10)
            logs.say(f"profile of global steps {self.first_step}-{self.last_step} (rank 0; every rank's trace: "
                     f"{path.parent}/rank<r>.json):\n{table}")  # fmt: skip

    def __enter__(self) -> Profile:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self.profiler is not None:
            if error is None:
                self.finish()
            else:
                self.profiler.stop()  # a failing run: no trace, the error is what matters
