"""The run directory, run.out_dir, as a whole: whether this run may start there, and making it
ready on rank 0 with every rank told whether that worked. Its contents have their own owners:
checkpoints/ is checkpoint.py's; config.yaml, metrics.jsonl and tensorboard/ are logs.py's.
"""

from __future__ import annotations

from pathlib import Path

from ddp import checkpoint, distributed, logs
from ddp.distributed import World
from ddp.errors import UsageError


def check_resume_setting(resume: str, out_dir: str) -> None:
    """run.resume must not overwrite checkpoints the user has not asked to continue (checked before
    the process group, so every rank stops alike)."""
    if resume == "auto":
        return
    if resume != "never" and not Path(resume).is_file():
        raise UsageError(f"run.resume={resume}: no such checkpoint file (use auto, never or a path)")
    existing = checkpoint.step_files(out_dir)
    if not existing:
        return
    if resume == "never":
        raise UsageError(
            f"run.resume=never but {existing[0]} exists and would be overwritten; "
            "use another run.out_dir, run.resume=auto to continue, or delete it yourself"
        )
    if not Path(resume).samefile(existing[0]):  # last.pt is a hard link to the newest
        raise UsageError(
            f"run.resume={resume} but {checkpoint.directory(out_dir)} holds newer checkpoints that a later "
            "auto-resume would pick; use another run.out_dir"
        )


def start(out_dir: str, config_yaml: str, epochs_done: int, world: World) -> None:
    """Rank 0 writes config.yaml, cuts metrics.jsonl back to the checkpoint being resumed and removes
    a killed writer's temporary files; every rank learns whether out_dir is writable (none waits)."""
    error = None
    if world.is_main:
        try:
            logs.start(out_dir, config_yaml, epochs_done)
            checkpoint.remove_partial_writes(out_dir)
        except OSError as e:
            error = e
    if not distributed.all_agree(error is None, world):
        raise UsageError(f"cannot write to run.out_dir={out_dir} ({error or 'failed on rank 0'})")
