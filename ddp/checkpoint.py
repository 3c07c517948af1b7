"""Checkpoints: what one holds (`build_state`), when one is taken (`Checkpoints.due`), writing one
(`Checkpoints.save`: rank 0, all or nothing, with a checksum) and continuing from one
(`Checkpoints.resume`, `load`); the only torch.save and torch.load of a run.

    python -m ddp.checkpoint inspect PATH       epoch, step, world size, metrics, size, checksum (an export: its model)
    python -m ddp.checkpoint export PATH OUT [--raw] [--state-dict]
        the model weights alone, for inference: the moving average's if the run kept one (--raw: the
        trained ones); --state-dict writes the bare state dict that model.load_state_dict(torch.load(OUT)) takes;
        PATH - reads stdin, OUT - writes stdout, for a pipe
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp.startup import quiet_startup

quiet_startup(__name__)  # run as a command: a Ctrl-C or a missing package in the imports below is one line

import torch
from torch import nn

from ddp import __version__ as ddp_version
from ddp import cli, compatible, config, distributed, files, lifeline, optim, rng, rundir, schema, weights
from ddp.compatible import RunInfo  # (checkpoint.RunInfo: what a checkpoint records of its run)
from ddp.config import RunConfig
from ddp.devices import World
from ddp.ema import EMA, Lookahead
from ddp.errors import EXIT_FAILURE, EXIT_OK, CorruptCheckpoint, UsageError, WriteFailed, first_line, refused_pickle
from ddp.metrics import StepStats


@dataclass
class Trained:
    """What training changes and a checkpoint keeps."""

    model: nn.Module  # the raw module (never the DDP or compiled wrapper): its keys load anywhere
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    ema: EMA | None = None  # the weights' moving average (train.ema_decay > 0)
    lookahead: Lookahead | None = None  # the slow weights of lookahead (train.lookahead_every > 0)
    loss_scale: float = 1.0  # run.amp=fp16-weights' (the optimizer's LR / it, its momentum x it: a file holds neither)


@dataclass
class Position:
    """Where a run is."""

    epochs_done: int = 0  # epochs finished
    step_in_epoch: int = 0  # global batches done in the next epoch
    global_step: int = 0  # optimizer steps since the start


def build_state(
    trained: Trained,
    position: Position,
    ranks: list[dict[str, Any]],
    info: RunInfo,
    metrics: dict | None,
    full: tuple[dict[str, Any], dict[str, Any]],
) -> dict[str, Any]:
    """The checkpoint of `trained` at `position`; `ranks` is every rank's rank_state, in rank order;
    `full`, the model's and optimizer's whole state dicts (distributed.full_state)."""
    model, optimizer = full
    return {
        "format": schema.FORMAT,
        "epoch": position.epochs_done,  # completed epochs
        "step": position.step_in_epoch,  # global batches done in epoch + 1; 0 at an epoch's end
        "global_step": position.global_step,
        "model": model,  # the raw module's: no "module." / "_orig_mod." prefix; whole, also under FSDP2
        "optimizer": optim.portable(optimizer, trained.loss_scale),  # no machine's implementation (fused or not)
        "scheduler": trained.scheduler.state_dict(),
        "scaler": trained.scaler.state_dict() if trained.scaler.is_enabled() else None,
        "ema": trained.ema.state_dict() if trained.ema else None,  # {"weights": the model's keys, "updates"}
        "lookahead": trained.lookahead.state_dict() if trained.lookahead else None,  # {"slow": [tensors], "steps"}
        "ranks": ranks,  # per rank: RNG states, and an unfinished epoch's loss sums
        "global_batch": info.config["train"]["batch_size"],
        "world_size": info.world_size,
        "train_images": info.train_images,
        "normalize": info.normalize,
        "classes": info.classes,
        "data_digest": info.data_digest,
        "config": info.config,
        "metrics": metrics,  # of the last finished epoch
        "versions": {"torch": str(torch.__version__), "ddp_cifar": ddp_version},
    }


def rank_state(device: torch.device, stats: StepStats | None) -> dict[str, Any]:
    """This rank's part: its RNG states, an unfinished epoch's loss sums and gradient norms (or None)."""
    partial, norms = (None, None) if stats is None else (stats.partial(), stats.norms_partial())
    return {"rng": rng.get_state(device), "partial": partial, "grad_norms": norms}


def restore(state: dict[str, Any], trained: Trained) -> None:
    """Load a checkpoint into objects built for this run's device: the weights, then optimizer,
    scheduler and scaler (optimizer state follows the parameters' device). Before compile and wrap;
    every rank, with the same state (a sharded model takes its slice)."""
    with optim.settings_kept(trained.optimizer, trained.scheduler):  # this run's LRs, momentum, fused or not, ...
        saved = optim.from_portable(state["optimizer"], trained.loss_scale)
        distributed.load_full_state(trained.model, trained.optimizer, weights.unprefixed(state["model"]), saved)
        trained.scheduler.load_state_dict(state["scheduler"])  # its position: the step
    if state["scaler"] is not None and trained.scaler.is_enabled():
        trained.scaler.load_state_dict(state["scaler"])
    if trained.ema and state.get("ema"):  # else the average starts at its first update, from these weights
        trained.ema.load_state_dict(state["ema"])
    if trained.lookahead:  # without a saved one (a run without lookahead), the slow weights start as these
        trained.lookahead.restore(state.get("lookahead"), trained.model, state["global_step"])


def restore_rank(state: dict[str, Any], world: World, stats: StepStats) -> bool:
    """This rank's RNG states (same world size only; data order and augmentation need none) and
    loss sums (all on rank 0 if the world size changed). Returns whether the world size is the same."""
    ranks = state["ranks"]
    same_world = len(ranks) == world.world_size
    if same_world:
        rng.set_state(ranks[world.rank]["rng"], world.device)
    partials = [r["partial"] for r in ranks if r["partial"] is not None]
    partial = (partials[world.rank] if same_world else sum(partials) * world.is_main) if partials else None
    stats.load(partial, ranks[0].get("grad_norms"))  # the norms' figures: the same on every rank
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


class Checkpoints:
    """One run's checkpoints in run.out_dir. Every rank calls resume and save at the same points (they
    compare and gather); rank 0 writes."""

    def __init__(self, run: RunConfig, world: World, trained: Trained, info: RunInfo) -> None:
        self.run, self.world, self.trained, self.info = run, world, trained, info

    def resume(self, stats: StepStats) -> Resumed | None:
        """Load the newest checkpoint in run.out_dir whose checksum holds (run.resume=auto; a damaged
        newer one is skipped with a warning), or run.resume's file, into the raw model and the rest of
        `trained` (before compile and wrap) and this rank's `stats`. None: nothing to resume."""
        run, world, auto = self.run, self.world, rundir.resumes_its_own(self.run.resume, self.run.out_dir)
        path, state, skipped, paths = None, None, [] if auto else None, resumed_paths(run)
        for path in paths:  # newest first
            with _reading(path, skipped):
                # Every tensor to the CPU first: a file saved on any GPU loads on a CPU-only machine and on
                # every rank's device; load_state_dict copies each into the tensor it replaces, on its device.
                state = schema.verified(torch.load(path, map_location="cpu", weights_only=True), path)
                if other := rundir.numbered_beside(path, state["global_step"], paths):
                    raise UsageError(f"{path} holds global step {state['global_step']} and is no hard link to {other} "
                                     f"beside it: remove it to go on from {other.name}, or move the numbered ones "
                                     "away to go on from it")  # fmt: skip
                break
        for warning in skipped if world.is_main and skipped else []:
            print(f"warning: skipping {warning}; trying the next newest", file=sys.stderr, flush=True)
        if paths and state is None:
            raise UsageError(f"no valid checkpoint in {rundir.checkpoint_dir(run.out_dir)}: {'; '.join(skipped)}")
        if not distributed.same_on_all_ranks(state["global_step"] if state else -1, world):
            raise UsageError(f"ranks found different checkpoints in {run.out_dir}: is it on a shared filesystem?")
        if state is None:
            return None
        compatible.check(state, self.info, path, self.trained.optimizer)
        with schema.restoring(path), weights.fitting(state, path):
            restore(state, self.trained)  # model.load_state_dict(...): the raw model, as it was saved
            same_world = restore_rank(state, world, stats)
        accum_steps = state["config"]["train"].get("grad_accum_steps", 1)
        position = Position(state["epoch"], state["step"], state["global_step"])
        changes = compatible.changed(state["config"], self.info.config) + compatible.data_changed(state, self.info)
        return Resumed(path, position, state["metrics"], state["world_size"], accum_steps, same_world, changes)

    def due(self, position: Position, steps_per_epoch: int, stopping: bool) -> bool:
        """Whether to save after the step to `position` (an epoch's last step: at its end, evaluated)."""
        every = self.run.save_every_steps
        periodic = every > 0 and position.global_step % every == 0
        return position.step_in_epoch < steps_per_epoch and (stopping or periodic)

    def save(self, position: Position, stats: StepStats, metrics: dict[str, Any] | None) -> Path | None:
        """Every rank calls this at the same step boundary: it gathers every rank's RNG states (and an
        unfinished epoch's sums); rank 0 writes step-<global_step>.pt, points last.pt at it and keeps
        the newest run.keep_last. Returns the file on rank 0, None on the others. A stop's grace waits for rank 0's
        write (a large file on a slow disk) on every rank (lifeline.busy), never for a hung rank: the gathering and
        rank 0's wait after its write are waits for the others, as a step's are."""
        out_dir, world, mid_epoch = self.run.out_dir, self.world, position.step_in_epoch > 0
        ranks = distributed.gather_objects(rank_state(world.device, stats if mid_epoch else None), world)
        full = distributed.full_state(self.trained.model, self.trained.optimizer)  # FSDP2: gathered to rank 0
        path = rundir.step_path(out_dir, position.global_step)
        writing = contextlib.nullcontext() if world.is_main else lifeline.busy()  # the others wait for rank 0's write
        with writing, distributed.fail_together(world):  # a failed write (a full disk) stops every rank, none waits
            if world.is_main:
                with lifeline.busy():
                    state = build_state(self.trained, position, ranks, self.info, metrics, full)  # the unwrapped model
                    state["checksum"] = files.digest(state)
                    with _previous_kept(out_dir):
                        # all or nothing (a temporary file, renamed); a removed run folder is not made again: it ends
                        with files.atomic(path, parents=False) as f:
                            torch.save(state, f)
                        files.link(path, rundir.last_path(out_dir))  # last.pt: the newest
                    for old in rundir.step_files(out_dir)[max(1, self.run.keep_last) :]:
                        old.unlink(missing_ok=True)
        return path if world.is_main else None


@contextlib.contextmanager
def _previous_kept(out_dir: str) -> Iterator[None]:
    """A failed write (WriteFailed: the file, the bytes, the space free) also names the newest intact one."""
    previous = rundir.checkpoint_files(out_dir)
    try:
        yield
    except WriteFailed as e:
        intact = f"the previous checkpoint, {previous[0]}, is intact" if previous else "no checkpoint was written yet"
        raise WriteFailed(f"{e}; {intact}") from None


@contextlib.contextmanager
def _reading(path: Path, skipped: list[str] | None = None, source: Path | io.BytesIO | None = None) -> Iterator[None]:
    """torch.load's failures as one line naming `path` (read from `source`, a pipe's bytes): a missing file is a
    UsageError, one that is not a whole, unaltered checkpoint a CorruptCheckpoint. With `skipped`, a damaged file
    is noted there instead, and the code after the `with` goes on (resume then tries the file before it)."""
    try:
        try:
            yield
        except FileNotFoundError:
            raise UsageError(f"checkpoint not found: {path}") from None
        except IsADirectoryError:
            found = rundir.newest_in(path)
            hint = f"its newest checkpoint is {found}" if found else "name a checkpoint file"
            raise UsageError(f"{path} is a directory: {hint}") from None
        except (UsageError, PermissionError):  # CorruptCheckpoint is one: the file's own checks said what is wrong;
            raise  # a file not open to this user is not damaged: never skipped for an older one (cli's line for it)
        except Exception as e:  # truncated, not a checkpoint, or a pickle that wants to run code
            found = files.torch_file_problem(path if source is None else source)  # (a pickle's refusal: in words)
            why = found or refused_pickle(e) or first_line(e, typed=True)
            raise CorruptCheckpoint(f"{path} is not a loadable checkpoint ({why})") from None
    except CorruptCheckpoint as e:
        if skipped is None:
            raise
        skipped.append(f"{path}: {e}")


def check_resume(cfg: config.Config) -> None:
    """run.resume against run.out_dir (rundir's check), and the settings of the checkpoint a resume would read
    first against cfg's (compatible.check_settings), before the data is read: a CIFAR-100 run resumed from a
    CIFAR-10 one downloaded CIFAR-100 (169 MB) first. Its settings alone are read (mmap: the tensors stay on
    disk); a file that does not read so is left to Checkpoints.resume, which says why."""
    rundir.check_resume_setting(cfg.run.resume, cfg.run.out_dir)
    if not (paths := resumed_paths(cfg.run)):
        return
    try:
        old = torch.load(paths[0], map_location="cpu", weights_only=True, mmap=True)["config"]
    except Exception:  # (damaged, not a checkpoint, no mmap there: resume's reading says which)
        return
    if isinstance(old, dict) and not schema.settings_problems(old):  # (else: said by resume's schema.verified)
        compatible.check_settings(old, config.to_dict(cfg), paths[0])


def resumed_paths(run: RunConfig) -> list[Path]:
    """The checkpoints a resume tries, newest first: run.out_dir's (run.resume=auto, or its own restart), run.resume's
    file, or none (never)."""
    if rundir.resumes_its_own(run.resume, run.out_dir):
        return rundir.checkpoint_files(run.out_dir)
    return [] if run.resume == "never" else [Path(run.resume)]


def load(path: str | Path, source: Path | io.BytesIO | None = None) -> dict[str, Any]:
    """A checkpoint's dict with every tensor on the CPU, its checksum verified; never unpickles code. A pipe
    is read whole first (or `source`, files.seekable's: what torch.load reads of `path`)."""
    source = files.seekable(Path(path)) if source is None else source
    with _reading(Path(path), source=source):
        return schema.verified(torch.load(source, map_location="cpu", weights_only=True), Path(path))


def export(path: str | Path, out: str | Path, raw: bool = False, state_dict: bool = False) -> dict[str, Any]:
    """The model alone, for inference: with what rebuilding it needs (name, classes, normalisation),
    or with `state_dict` the bare state dict of the tutorial's `net.load_state_dict(torch.load(PATH))`.
    The moving average's weights when the run kept one, unless `raw`; in float32 (fp16-weights'
    widened, exactly). Never replaces a file (a typo could name the checkpoint, or another run's); OUT "-" is stdout,
    to a pipe (`| ssh host 'cat > model.pt'`). Returns the state."""
    if str(out) == "-" and sys.stdout.isatty():
        raise UsageError("OUT=- writes the weights to stdout, a terminal here: pipe it, e.g. | ssh host 'cat > m.pt'")
    if not str(out):  # (Path("") is ".", a directory)
        raise UsageError("OUT is empty: name the file to write, e.g. model.pt")
    if Path(out).is_dir() or str(out).endswith("/"):  # ("new/": Path drops the slash, and wrote a file "new")
        is_one = "is a directory" if Path(out).is_dir() else "names a directory"
        raise UsageError(f"OUT={out} {is_one}: name the file to write, e.g. {Path(out) / 'model.pt'}")
    if str(out) != "-" and os.path.lexists(out):  # a symbolic link to nothing too: it said "File exists", exit 1
        link = f" (a symbolic link to {os.readlink(out)})" if Path(out).is_symlink() else ""
        raise UsageError(
            f"OUT={out} exists{link}, and export never replaces a file: name a new one, or remove it first"
        )
    state = load(path)
    weights.check_fit(state, path, raw)  # (its settings name the model that rebuilds it: they must fit)
    exported = {k: v.float() if v.dtype == torch.float16 else v for k, v in weights.pick(state, raw).items()}
    if not state_dict:
        model = state["config"]["model"]  # models.build(model_name, len(classes), dropout, width) rebuilds it
        train = state["config"].get("train", {})  # its test-time augmentation: evaluate's of the export
        exported = {"format": weights.EXPORT_FORMAT, "model_name": model["name"], "width": model.get("width", 1.0),
                    "dropout": model.get("dropout", 0.0), "classes": state["classes"], "normalize": state["normalize"],
                    "tta": {"flip": train.get("tta_flip", False), "translate": train.get("tta_translate", False)},
                    "model": exported}  # fmt: skip
    with files.atomic(Path(out), exclusive=True) if str(out) != "-" else cli.stdout_bytes() as f:
        torch.save(exported, f)
    return state


def describe(path: str | Path) -> tuple[str, bool]:
    """What `inspect` prints about a checkpoint file (or an export), and whether it is whole."""
    source = files.seekable(Path(path))
    size = f"{path}: {files.size_of(source) / 1e6:.1f} MB"
    try:
        state = load(path, source)
    except CorruptCheckpoint as e:
        exported = _export_of(source, path)
        return (f"{size}, {exported}", True) if exported else (f"{size}, checksum FAILED: {e}", False)
    size = f"{size}, checksum"
    config, metrics = state["config"], state["metrics"]
    lines = [
        f"{size} ok",
        f"  epoch {state['epoch']} done, step {state['step']} of the next, global step {state['global_step']}",
        f"  world_size {state['world_size']}, global batch {state['global_batch']}, model {config['model']['name']}, "
        f"dataset {config['data']['dataset']}, run.amp {config['run'].get('amp', 'off')}",
        f"  versions {state['versions']}",
    ]
    if metrics:
        tested = f"test_acc {metrics['test_acc']:.4f}, " if "test_acc" in metrics else "not evaluated, "
        lines.append(f"  last epoch: {tested}train_loss {metrics['train_loss']:.4f}")
    if state.get("ema"):
        lines.append(f"  moving average of the weights: {state['ema']['updates']} updates (evaluate/export take it)")
    return "\n".join(lines), True


def loaded(source: Path | io.BytesIO) -> Any:
    """What torch.load reads at `source` (from its start) without unpickling code, or None: an export, say."""
    with contextlib.suppress(Exception):  # (not a torch file, or not one that loads without code)
        if isinstance(source, io.BytesIO):
            source.seek(0)
        return torch.load(source, map_location="cpu", weights_only=True)
    return None


def _export_of(source: Path | io.BytesIO, path: str | Path) -> str:
    """What `export` wrote, as inspect says it ("checksum FAILED" before: an export has none); "" for another file."""
    if state := weights.exported(read := loaded(source), path):
        tensors = state["model"]
        what = f"model {state['model_name']} at width {state['width']}, {len(state['classes'])} classes"
    elif isinstance(read, dict) and read and all(isinstance(v, torch.Tensor) for v in read.values()):
        tensors, what = read, "a bare state dict (as export --state-dict writes it)"
    else:
        return ""
    count = f"{len(tensors)} tensors, {sum(t.numel() for t in tensors.values()) / 1e6:.2f}M values"
    return f"an export, the weights alone (no checksum, no training state): {what}; {count}"


USAGE = "usage: python -m ddp.checkpoint inspect PATH | export PATH OUT [--raw] [--state-dict]"


def main(argv: list[str]) -> int:
    options, words = cli.parse(argv, USAGE, [cli.Option("--raw"), cli.Option("--state-dict")])
    if len(words) == 2 and words[0] == "inspect" and not any(options.values()):
        if words[1] != "-" and not files.existing(Path(words[1])):  # "-": stdin; a directory: load names its newest
            raise UsageError(f"checkpoint not found: {words[1]}")
        text, whole = describe(words[1])
        cli.show(text)
        return EXIT_OK if whole else EXIT_FAILURE
    if len(words) != 3 or words[0] != "export":
        raise UsageError(USAGE)
    out, stdout = words[2], words[2] == "-"
    state = export(words[1], out, options["raw"], options["state_dict"])
    weights_of = "the moving average" if state.get("ema") and not options["raw"] else "the trained model"
    say = (lambda line: print(line, file=sys.stderr)) if stdout else cli.show  # "-": stdout holds the weights
    say(f"wrote {'stdout' if stdout else out} (model weights only: {weights_of}'s)")
    if options["state_dict"]:  # what the file itself does not hold
        norm = state["normalize"]
        say(
            f"a bare state dict, for net.load_state_dict(torch.load({'FILE' if stdout else out!r})); the model's "
            f"inputs: transforms.ToTensor() then transforms.Normalize({norm['mean']}, {norm['std']}); "
            f"its outputs: {state['classes']}"
        )
    return EXIT_OK


if __name__ == "__main__":
    cli.leave(cli.command(main))
