"""Checkpoints: what one holds (`build_state`: the schema), when one is taken (`Checkpointer.due`: at
each epoch's end after its evaluation, every run.save_every_steps steps, when a stop is requested),
resuming from one (`Checkpointer.resume`), and the files. The only torch.save / torch.load.

A checkpoint holds everything an exact continuation needs, as tensors and plain types only, so it
loads with weights_only=True and never runs code. Files: checkpoints/step-<global_step>.pt (the
newest run.keep_last kept) and last.pt, a hard link to the newest; rank 0 writes a temporary file,
fsyncs and renames it, so a final name never holds a partial file; each holds a sha256 of its
content. On resume the newest file whose checksum holds wins; a bad newer one is skipped.

    python -m ddp.checkpoint inspect PATH       epoch, step, world size, metrics, size, checksum
    python -m ddp.checkpoint export PATH OUT [--raw]   the model weights alone, for inference (the
                                                moving average's if the run kept one; --raw: the trained ones)
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from ddp import __version__ as ddp_version
from ddp import config, distributed, faults, files, rng
from ddp.cli import command
from ddp.config import RunConfig
from ddp.distributed import World
from ddp.ema import EMA
from ddp.errors import EXIT_FAILURE, EXIT_OK, CorruptCheckpoint, UsageError, WriteFailed
from ddp.metrics import EpochLoss

FORMAT = 2
_STEP_FILES = "step-" + "[0-9]" * 9 + ".pt"  # step-<global_step, 9 digits>.pt: by name is by step


@dataclass
class Trained:
    """What training changes and a checkpoint keeps."""

    model: nn.Module  # the raw module (never the DDP or compiled wrapper): its keys load anywhere
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    ema: EMA | None = None  # the weights' moving average (train.ema_decay > 0)


@dataclass
class Position:
    """Where a run is."""

    epochs_done: int = 0  # epochs finished
    step_in_epoch: int = 0  # global batches done in the next epoch
    global_step: int = 0  # optimizer steps since the start


@dataclass(frozen=True)
class RunInfo:
    """What a checkpoint records about the run besides the weights, to refuse a wrong continuation."""

    config: dict[str, dict[str, Any]]  # config.to_dict(cfg)
    world_size: int
    train_images: int
    normalize: dict[str, list[float]]  # the training split's per-channel mean and std, as the model saw them
    classes: list[str]  # the names of the model's outputs, in order


def build_state(
    trained: Trained, position: Position, ranks: list[dict[str, Any]], info: RunInfo, metrics: dict | None
) -> dict[str, Any]:
    """The checkpoint of `trained` at `position`; `ranks` is every rank's rank_state, in rank order."""
    return {
        "format": FORMAT,
        "epoch": position.epochs_done,  # completed epochs
        "step": position.step_in_epoch,  # global batches done in epoch + 1; 0 at an epoch's end
        "global_step": position.global_step,
        "model": trained.model.state_dict(),  # the raw module's: no "module." / "_orig_mod." prefix
        "optimizer": trained.optimizer.state_dict(),
        "scheduler": trained.scheduler.state_dict(),
        "scaler": trained.scaler.state_dict() if trained.scaler.is_enabled() else None,
        "ema": trained.ema.state_dict() if trained.ema else None,  # {"weights": the model's keys, "updates"}
        "ranks": ranks,  # per rank: RNG states, and an unfinished epoch's loss sums
        "global_batch": info.config["train"]["batch_size"],
        "world_size": info.world_size,
        "train_images": info.train_images,
        "normalize": info.normalize,
        "classes": info.classes,
        "config": info.config,
        "metrics": metrics,  # of the last finished epoch
        "versions": {"torch": str(torch.__version__), "ddp_cifar": ddp_version},
    }


def rank_state(device: torch.device, epoch_loss: EpochLoss | None) -> dict[str, Any]:
    """This rank's part of a checkpoint: its RNG states, an unfinished epoch's loss sums and gradient
    norms (or None)."""
    unfinished = epoch_loss is not None
    return {
        "rng": rng.get_state(device),
        "partial": epoch_loss.sums.cpu() if unfinished else None,
        "grad_norms": epoch_loss.grad_norms.cpu() if unfinished else None,
    }


def weights(state: dict[str, Any], raw: bool = False) -> dict[str, torch.Tensor]:
    """The weights to evaluate or export: the moving average's when the run kept one, unless `raw`."""
    return state["model"] if raw or not state.get("ema") else state["ema"]["weights"]


def load_weights(state: dict[str, Any], model: nn.Module, raw: bool = True) -> None:
    """A checkpoint's weights (the trained ones, or with raw=False those weights() picks) into a plain
    model on any device, also when saved from a DataParallel/DDP ("module.") or compiled ("_orig_mod.") wrapper."""
    weights_ = dict(weights(state, raw))
    for prefix in ("module.", "_orig_mod.", "module."):
        consume_prefix_in_state_dict_if_present(weights_, prefix)
    model.load_state_dict(weights_)


def restore(state: dict[str, Any], trained: Trained) -> None:
    """Load a checkpoint into objects built for this run's device: the weights, then optimizer,
    scheduler and scaler (optimizer state follows the parameters' device). Before compile and wrap."""
    load_weights(state, trained.model)
    trained.optimizer.load_state_dict(state["optimizer"])
    trained.scheduler.load_state_dict(state["scheduler"])
    if state["scaler"] is not None and trained.scaler.is_enabled():
        trained.scaler.load_state_dict(state["scaler"])
    if trained.ema and state.get("ema"):  # else the average starts at its first update, from these weights
        trained.ema.load_state_dict(state["ema"])


def restore_rank(state: dict[str, Any], world: World, epoch_loss: EpochLoss) -> bool:
    """This rank's RNG states (same world size only; data order and augmentation need none) and
    loss sums (all on rank 0 if the world size changed). Returns whether the world size is the same."""
    ranks = state["ranks"]
    same_world = len(ranks) == world.world_size
    if same_world:
        rng.set_state(ranks[world.rank]["rng"], world.device)
    partials = [r["partial"] for r in ranks if r["partial"] is not None]
    if partials:
        epoch_loss.sums.copy_(partials[world.rank] if same_world else sum(partials) * world.is_main)
    if ranks[0].get("grad_norms") is not None:  # the same on every rank
        epoch_loss.grad_norms.copy_(ranks[0]["grad_norms"])
    return same_world


@dataclass(frozen=True)
class Resumed:
    """What resume found: the file, the position and metrics it holds, the world size it was saved at."""

    path: Path
    position: Position
    metrics: dict[str, Any] | None  # of the last finished epoch
    saved_world_size: int
    saved_accum_steps: int  # its train.grad_accum_steps: world size x this is what the global batch was split into
    same_world: bool  # RNG states restored (they are per rank)
    changes: list[str]  # "section.key old -> new" for every setting that differs from the checkpoint's


class Checkpointer:
    """One run's checkpoints in run.out_dir: resume from there (or run.resume), save when due.
    Every rank calls resume and save at the same points (they gather and compare); rank 0 writes."""

    def __init__(self, run: RunConfig, world: World, trained: Trained, info: RunInfo) -> None:
        self.run, self.world, self.trained, self.info = run, world, trained, info

    def resume(self, epoch_loss: EpochLoss) -> Resumed | None:
        """Restore the newest valid checkpoint (run.resume=auto) or the named one into `trained`
        and `epoch_loss`; None when there is none (or run.resume=never)."""
        if self.run.resume == "never":
            return None
        if self.run.resume == "auto":
            path, state, warnings = newest_valid(self.run.out_dir)
        else:
            path, state, warnings = Path(self.run.resume), load(self.run.resume), []
        for warning in warnings if self.world.is_main else []:
            print(warning, file=sys.stderr, flush=True)
        if not distributed.same_on_all_ranks(state["global_step"] if state else -1, self.world):
            raise UsageError(f"ranks found different checkpoints in {self.run.out_dir}: is it on a shared filesystem?")
        if state is None:
            return None
        check_compatible(state, self.info, path)
        restore(state, self.trained)
        same_world = restore_rank(state, self.world, epoch_loss)
        position = Position(state["epoch"], state["step"], state["global_step"])
        return Resumed(
            path,
            position,
            state["metrics"],
            state["world_size"],
            state["config"]["train"].get("grad_accum_steps", 1),
            same_world,
            changed(state["config"], self.info.config),
        )

    def due(self, position: Position, steps_per_epoch: int, stopping: bool) -> bool:
        """Whether to save after the step that led to `position` (mid-epoch: the epoch's last step
        is saved at the epoch's end, after its evaluation)."""
        every = self.run.save_every_steps
        periodic = every > 0 and position.global_step % every == 0
        return position.step_in_epoch < steps_per_epoch and (stopping or periodic)

    def save(self, position: Position, epoch_loss: EpochLoss, metrics: dict[str, Any] | None) -> Path | None:
        """Every rank calls this at the same boundary (it gathers their RNG states); rank 0 writes and
        gets the file's path, the others None."""
        mid_epoch = position.step_in_epoch > 0
        ranks = distributed.gather_objects(rank_state(self.world.device, epoch_loss if mid_epoch else None), self.world)

        def write() -> Path:  # on rank 0
            state = build_state(self.trained, position, ranks, self.info, metrics)
            return save(state, self.run.out_dir, self.run.keep_last)

        return distributed.on_rank0(self.world, write)


def changed(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """ "section.key old -> new" for every setting of `new` that differs from `old` (a key that `old`'s
    version did not have yet counts as its default)."""
    default = config.to_dict(config.Config())
    was = {s: {k: old.get(s, {}).get(k, default[s][k]) for k in keys} for s, keys in new.items()}
    return [f"{s}.{k} {was[s][k]!r} -> {v!r}" for s in new for k, v in new[s].items() if was[s][k] != v]


def check_compatible(state: dict[str, Any], info: RunInfo, path: str | Path) -> None:
    """Refuse to continue a run of another model, dataset or batch in this one."""
    defaults = config.to_dict(config.Config())  # for keys a checkpoint of an older version lacks
    for section, key in (("model", "name"), ("model", "width"), ("data", "dataset"), ("train", "batch_size")):
        old, new = state["config"][section].get(key, defaults[section][key]), info.config[section][key]
        if old != new:
            raise UsageError(
                f"{path} was trained with {section}.{key}={old} but this run has {section}.{key}={new}; "
                "set it back to continue, or start a new run.out_dir"
            )
    if len(state["classes"]) != len(info.classes):
        raise UsageError(
            f"{path} has a model of {len(state['classes'])} classes, this data has {len(info.classes)}; "
            "use the same data, or start a new run.out_dir"
        )
    if state["train_images"] != info.train_images:
        raise UsageError(
            f"{path} was trained on {state['train_images']} training images, this data has {info.train_images}; "
            "the data order cannot continue: use the same data, or start a new run.out_dir"
        )


def directory(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def last_path(out_dir: str | Path) -> Path:
    return directory(out_dir) / "last.pt"


def _atomic_write(obj: dict[str, Any], path: Path, fault_step: int | None = None) -> None:
    """torch.save `obj` to `path`, all or nothing (files.replace)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    halfway = None if fault_step is None else lambda: faults.maybe_kill("write", fault_step, 0, path.parent.parent)
    files.replace(path, buffer.getvalue(), halfway)


def _point_last_at(path: Path) -> None:
    """last.pt -> `path`, replaced atomically (a hard link: no second copy of the bytes)."""
    tmp = path.parent / f".last.pt.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(path, tmp)
    os.replace(tmp, path.parent / "last.pt")


def step_files(out_dir: str | Path) -> list[Path]:
    """This run's numbered checkpoints, newest first."""
    return sorted(directory(out_dir).glob(_STEP_FILES), reverse=True)


def save(state: dict[str, Any], out_dir: str | Path, keep_last: int) -> Path:
    """Write `state` as step-<global_step>.pt with its checksum, point last.pt at it, keep the
    newest `keep_last` numbered files. Rank 0 only. On a failed write (a full disk) the files
    already there are untouched, and the error says which one is the newest."""
    state = {**state, "checksum": files.digest(state)}
    path = directory(out_dir) / f"step-{state['global_step']:09d}.pt"
    previous = step_files(out_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(state, path, fault_step=state["global_step"])
        _point_last_at(path)
    except (OSError, WriteFailed) as e:
        intact = f"the previous checkpoint, {previous[0]}, is intact" if previous else "no checkpoint was written yet"
        reason = e if isinstance(e, WriteFailed) else files.failure(path, 0, e)
        raise WriteFailed(f"{reason}; {intact}") from None
    for old in step_files(out_dir)[max(1, keep_last) :]:
        old.unlink(missing_ok=True)
    return path


def remove_partial_writes(out_dir: str | Path) -> None:
    """Temporary files left by a writer that was killed; never a complete checkpoint."""
    for tmp in directory(out_dir).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def load(path: str | Path) -> dict[str, Any]:
    """A checkpoint's dict with every tensor on the CPU; its checksum verified; never unpickles code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UsageError(f"checkpoint not found: {path}") from None
    except Exception as e:  # truncated, not a checkpoint, or a pickle that wants to run code
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CorruptCheckpoint(f"{path} is not a loadable checkpoint ({type(e).__name__}: {first})") from None
    if not isinstance(state, dict) or not {"model", "epoch", "checksum"} <= state.keys():
        raise CorruptCheckpoint(f"{path} is not a ddp-cifar checkpoint (no model/epoch/checksum entries)")
    stored = state.pop("checksum")
    if files.digest(state) != stored:
        raise CorruptCheckpoint(f"{path} fails its checksum (the file was altered or damaged)")
    if state.get("format") != FORMAT:
        raise UsageError(f"{path} has checkpoint format {state.get('format')}; this ddp-cifar reads format {FORMAT}")
    state["checksum"] = stored
    return state


def newest_valid(out_dir: str | Path) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """(path, state, warnings) of the newest checkpoint in out_dir that loads and checks out."""
    candidates = step_files(out_dir)
    warnings = []
    for path in candidates:
        try:
            return path, load(path), warnings
        except CorruptCheckpoint as e:
            warnings.append(f"warning: skipping {path}: {e}; falling back to the previous checkpoint")
    if candidates:
        raise UsageError(f"no valid checkpoint in {directory(out_dir)}: {'; '.join(warnings)}")
    return None, None, warnings


def export(path: str | Path, out: str | Path, raw: bool = False) -> str:
    """The model alone, with what inference needs to rebuild it: name, classes, normalisation. The
    moving average's weights when the run kept one, unless `raw`. Returns which weights it took."""
    state = load(path)
    exported = {
        "format": "ddp-cifar-weights/1",
        "model_name": state["config"]["model"]["name"],
        "classes": state["classes"],
        "normalize": state["normalize"],
        "model": weights(state, raw),
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(exported, out)
    return "raw" if raw or not state.get("ema") else "ema"


def describe(path: str | Path) -> tuple[str, bool]:
    """What `inspect` prints about a checkpoint file, and whether it is whole."""
    size = f"{path}: {Path(path).stat().st_size / 1e6:.1f} MB, checksum"
    try:
        state = load(path)
    except CorruptCheckpoint as e:
        return f"{size} FAILED: {e}", False
    config, metrics = state["config"], state["metrics"]
    lines = [
        f"{size} ok",
        f"  epoch {state['epoch']} done, step {state['step']} of the next, global step {state['global_step']}",
        f"  world_size {state['world_size']}, global batch {state['global_batch']}, "
        f"model {config['model']['name']}, dataset {config['data']['dataset']}",
        f"  versions {state['versions']}",
    ]
    if metrics:
        lines.append(f"  last epoch: test_acc {metrics['test_acc']:.4f}, train_loss {metrics['train_loss']:.4f}")
    if state.get("ema"):
        lines.append(f"  moving average of the weights: {state['ema']['updates']} updates (evaluate/export take it)")
    return "\n".join(lines), True


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "inspect" and Path(argv[1]).is_file():
        text, whole = describe(argv[1])
        print(text)
        return EXIT_OK if whole else EXIT_FAILURE
    if len(argv) == 2 and argv[0] == "inspect":
        raise UsageError(f"checkpoint not found: {argv[1]}")
    raw = "--raw" in argv[3:]
    if len(argv) == 3 + raw and argv[0] == "export" and argv[3:] in ([], ["--raw"]):
        which = export(argv[1], argv[2], raw)
        weights_of = "the moving average" if which == "ema" else "the trained model"
        print(f"wrote {argv[2]} (model weights only: {weights_of}'s)")
        return EXIT_OK
    raise UsageError("usage: python -m ddp.checkpoint inspect PATH | export PATH OUT [--raw]")


if __name__ == "__main__":
    sys.exit(command(main))
