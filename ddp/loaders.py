"""This rank's batches of a split, as uint8 (input_fn normalises them on the device): the
device-resident path (data.loader=device) and the DataLoader path (torch), which take the same images
in the same order with the same crops and flips; the shards of training (DistributedSampler) and of evaluation.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from ddp.datasets import Split
from ddp.devices import World


@dataclass(frozen=True)
class Augment:
    """How training images are augmented (data.translate, data.pad, data.flip): a 32x32 crop of the
    image padded by `translate` px on each side (zeros, or the edge mirrored: reflect), so shifted by
    up to `translate` px each way; and a horizontal flip, of a random half of the images each epoch
    (random), of a random half in odd epochs and the other half in even ones (alternate: airbench's
    alternating flip, every image seen both ways in any two epochs), or never (none)."""

    translate: int = 4
    reflect: bool = False
    flip: str = "random"


def augmentation_table(n: int, seed: int, epoch: int, how: Augment = Augment()) -> torch.Tensor:
    """(n, 3) rows of (dy, dx, flip) for image i in this epoch: crop offsets 0..2 x translate into
    the padded image, flip 0/1. A function of (seed, epoch) alone, so an image gets the same
    augmentation whatever the world size, the loader workers or a resume in mid-epoch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    offsets = torch.randint(0, 2 * how.translate + 1, (n, 2), generator=g)
    flips = torch.randint(0, 2, (n, 1), generator=g)
    if how.flip == "alternate":  # the random half of epoch 1, then the other half, and so on
        first = torch.randint(0, 2, (n, 1), generator=torch.Generator().manual_seed(seed * 1_000_003))
        flips = first ^ ((epoch - 1) % 2)
    elif how.flip == "none":
        flips = torch.zeros_like(flips)
    return torch.cat([offsets, flips], dim=1)


def pad(images: torch.Tensor, px: int, reflect: bool) -> torch.Tensor:
    """Square images (..., S, S) of any dtype padded by `px` on each side: zeros, or reflect (the
    pixels beside the edge mirrored, the edge itself not repeated, as F.pad's "reflect", which
    takes no uint8)."""
    if not reflect:
        return F.pad(images, (px, px, px, px))
    size = images.shape[-1]
    index = torch.arange(-px, size + px, device=images.device).abs()
    index = torch.where(index >= size, 2 * (size - 1) - index, index)
    return images.index_select(-2, index).index_select(-1, index)


def augment(image: torch.Tensor, dy: int, dx: int, flip: int, how: Augment = Augment()) -> torch.Tensor:
    """One image's augmentation, with its randomness given: a 32x32 crop at (dy, dx) of the image
    padded by how.translate px, then a horizontal flip if `flip`."""
    crop = pad(image, how.translate, how.reflect)[:, dy : dy + 32, dx : dx + 32]
    return crop.flip(-1) if flip else crop.contiguous()


class _Images(Dataset):
    """Images by index (evaluation) or by (index, epoch) (training, augmented from that epoch's table)."""

    def __init__(self, split: Split, augment_seed: int | None, how: Augment | None = None) -> None:
        self.split, self.augment_seed, self.how = split, augment_seed, how
        self._table_epoch, self._table = None, None

    def __len__(self) -> int:
        return len(self.split.labels)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        i, epoch = key if isinstance(key, tuple) else (key, None)
        image = self.split.images[i]
        if self.augment_seed is not None and epoch is not None:
            if self._table_epoch != epoch:  # once per epoch per worker: 0.4 ms for 50k images here
                self._table_epoch, self._table = (
                    epoch,
                    augmentation_table(len(self), self.augment_seed, epoch, self.how),
                )
            image = augment(image, *self._table[i].tolist(), self.how)
        return image, self.split.labels[i]


class ResumableSampler(DistributedSampler):
    """A DistributedSampler (the same permutation of (seed, epoch) on every rank, each rank its
    slice, drop_last) that yields (index, epoch) for the dataset's augmentation table and can start
    at a global step of the epoch. Steps count global batches, so a position means the same images
    for any world size. The augmentation is drawn per image from a table of (seed, epoch): a resumed
    run sees exactly the images and crops it would have seen."""

    def __init__(self, dataset: Dataset, world: World, per_rank_batch: int, seed: int) -> None:
        super().__init__(
            dataset, num_replicas=world.world_size, rank=world.rank, shuffle=True, seed=seed, drop_last=True
        )
        self.per_rank_batch, self.start_step = per_rank_batch, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The next iteration yields epoch `epoch`'s shuffle (DistributedSampler.set_epoch), from its
        global step `start_step` on (a resumed epoch goes on where it stopped)."""
        super().set_epoch(epoch)
        self.start_step = start_step

    def order(self) -> torch.Tensor:
        """This rank's image indices from the start step on: DistributedSampler's order (shuffle, drop_last) as a
        tensor, made without its Python list of every index (tests/test_loaders.py holds the two equal)."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        mine = torch.randperm(len(self.dataset), generator=g)[: self.total_size][self.rank :: self.num_replicas]
        return mine[self.start_step * self.per_rank_batch :]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((i, self.epoch) for i in self.order().tolist())

    def __len__(self) -> int:
        return super().__len__() - self.start_step * self.per_rank_batch


def _leave_stopping_to_the_main_process(worker_id: int) -> None:
    """SLURM (and torchrun) signal every process of a job. A loader worker killed by that SIGTERM
    would fail the very step that should checkpoint; the main process decides when to stop and
    shuts its workers down itself."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


class WorkerLoader(DataLoader):
    """A DataLoader (data.loader=torch) that says a worker lost while its batch was being received as torch says it
    when it finds a worker gone ("DataLoader worker (pid(s) N) exited unexpectedly": errors.lost_worker, one line),
    not as a socket's EOFError or ConnectionResetError from fetching the batch's shared memory of the dead worker."""

    def __iter__(self) -> Iterator[Any]:
        batches = super().__iter__()
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (EOFError, ConnectionError) as e:
                lost = _lost_worker(batches)
                if lost is None:
                    raise
                raise lost from e
            yield batch


def _lost_worker(batches: Iterator[Any]) -> RuntimeError | None:
    """torch's error for a worker of `batches` found dead within 2 s (its socket closes before it can be reaped),
    its workers shut down (torch's SIGCHLD handler would raise it again in their clean-up); None if all live."""
    workers, deadline = getattr(batches, "_workers", []), time.monotonic() + 2
    try:
        while not (gone := [w.pid for w in workers if not w.is_alive()]) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = ", ".join(map(str, gone))
        lost = RuntimeError(f"DataLoader worker (pid(s) {pids}) exited unexpectedly") if gone else None
    except RuntimeError as found:  # torch's SIGCHLD handler found it first: its own line for it
        lost = found
    if lost:
        with contextlib.suppress(RuntimeError):
            batches._shutdown_workers()  # type: ignore[attr-defined]
    return lost


def train_loader(
    split: Split,
    per_rank_batch: int,
    world: World,
    how: Augment | None,
    workers: int,
    seed: int,
    kind: str = "torch",
) -> DataLoader | DeviceLoader:
    """Per-rank batches of uint8 images, augmented as `how` says (None: not at all); call
    .sampler.set_epoch(epoch[, start_step]) before each epoch.
    kind: "device" (DeviceLoader) or "torch" (a DataLoader with `workers` processes).

    drop_last everywhere: every rank takes the same number of equal steps, and N ranks x B/N see
    exactly the images one process x B sees.
    """
    if kind == "device":
        return DeviceLoader(split, per_rank_batch, world, how, seed)
    dataset = _Images(split, None if how is None else seed, how)
    return WorkerLoader(
        dataset,
        batch_size=per_rank_batch,
        sampler=ResumableSampler(dataset, world, per_rank_batch, seed),
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        worker_init_fn=_leave_stopping_to_the_main_process,
        pin_memory=world.device.type == "cuda",
        generator=torch.Generator().manual_seed(seed),  # worker seeds; leaves the global RNG alone
    )


def eval_shard(n: int, world: World) -> torch.Tensor:
    """The test images rank r evaluates: r, r + world_size, ... Together the ranks take every image
    exactly once, with no padding duplicates (DistributedSampler pads), for any world size: none for a rank past
    the last image (3 ranks, 1 image: rank 2's arange(2, 1, 3) was torch's RuntimeError in every rank)."""
    return torch.arange(world.rank, max(n, world.rank), world.world_size)


def eval_loader(split: Split, per_rank_batch: int, world: World, workers: int, kind: str = "torch") -> EvalBatches:
    """This rank's images r, r + world_size, ...: a partition of the test set, no duplicates; in as
    many batches on every rank (EvalBatches)."""
    if kind == "device":
        loader: Iterable[tuple[torch.Tensor, torch.Tensor]] = DeviceEvalLoader(split, per_rank_batch, world)
    else:
        shard = Subset(_Images(split, None), eval_shard(len(split.labels), world).tolist())
        loader = WorkerLoader(
            shard,
            batch_size=per_rank_batch,
            num_workers=workers,
            persistent_workers=workers > 0,
            worker_init_fn=_leave_stopping_to_the_main_process,
            pin_memory=world.device.type == "cuda",
            generator=torch.Generator(),  # leaves the global RNG alone
        )
    largest_shard = -(-len(split.labels) // world.world_size)
    return EvalBatches(loader, -(-largest_shard // per_rank_batch), (split.images[:0], split.labels[:0]))


class EvalBatches:
    """An evaluation loader that yields the same number of batches on every rank: its own, then empty
    ones. Under FSDP2 each forward gathers the weights from every rank, so a rank that stopped one
    batch early would leave the others waiting; an empty batch counts nothing."""

    def __init__(self, loader: Iterable[tuple[torch.Tensor, torch.Tensor]], batches: int, empty: tuple) -> None:
        self.loader, self.batches, self.empty = loader, batches, empty

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yielded = 0
        for batch in self.loader:
            yielded += 1
            yield batch
        for _ in range(self.batches - yielded):
            yield self.empty


def crop_flip(
    padded_hwc: torch.Tensor, index: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """augment() for a batch, as one gather: images `index` of a split padded (pad_hwc) and stored
    (N, 32 + 2 x translate, 32 + 2 x translate, C), each cropped at its (dy, dx) and flipped per its
    table row. Returns (B, C, 32, 32) in channels_last memory (the gather writes pixels with their
    channels together), written into `out` ((B x 32 x 32, C), contiguous) if given."""
    n, height, width, channels = padded_hwc.shape
    span = torch.arange(32, device=padded_hwc.device)
    dy, dx, flip = table[:, 0:1], table[:, 1:2], table[:, 2:3].bool()
    rows = dy + span  # (B, 32)
    cols = torch.where(flip, dx + 31 - span, dx + span)  # a flipped crop reads its columns backwards
    # One index_select of whole pixels (rows of C bytes) by flat position: 4x faster on a CPU than
    # indexing with three broadcast index tensors (measured).
    pixel = (index[:, None, None] * height + rows[:, :, None]) * width + cols[:, None, :]
    pixels = torch.index_select(padded_hwc.view(n * height * width, channels), 0, pixel.view(-1), out=out)
    return pixels.view(len(index), 32, 32, channels).permute(0, 3, 1, 2)


def pad_hwc(images: torch.Tensor, how: Augment = Augment()) -> torch.Tensor:
    """(N, C, 32, 32) -> padded by how.translate px (zeros or reflect), (N, H, W, C): crop_flip's source."""
    return pad(images, how.translate, how.reflect).permute(0, 2, 3, 1).contiguous()


GATHER_CHUNK = 4096  # DeviceLoader: images gathered at a time (their int64 index: 34 MB)


class DeviceLoader:
    """data.loader=device: the split lives on the training device as uint8, copied there once
    (padded for cropping when augmenting: 1.6x the bytes at 4 px, 240 MB for CIFAR's 50k). Each epoch
    gathers this rank's images there in the epoch's order, cropped and flipped (one more uint8 copy
    of the rank's shard: 150 MB for CIFAR's 50k on one rank); each step's batch is a slice of it.
    No worker processes, no host-to-device copy and no gather per step.

    Which images a step takes, and each image's crop and flip, are the torch loader's: the same
    ResumableSampler order (permutation of (seed, epoch), each rank its slice, resumable at a global
    step) and the same augmentation table. So switching loaders changes speed, not the run."""

    def __init__(self, split: Split, per_rank_batch: int, world: World, how: Augment | None, seed: int) -> None:
        self.how, self.seed = how, seed
        source = pad_hwc(split.images, how) if how is not None else split.images
        self.images = source.to(world.device)  # padded (N, H, W, C) when augmenting, else (N, C, 32, 32)
        self.labels = split.labels.to(world.device)
        self.per_rank_batch = per_rank_batch
        self.sampler = ResumableSampler(_Images(split, None), world, per_rank_batch, seed)

    def __len__(self) -> int:
        return len(self.sampler) // self.per_rank_batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        batch, steps = self.per_rank_batch, len(self)
        order = self.sampler.order()[: steps * batch].to(self.images.device)
        images, labels = self.epoch_images(order), self.labels[order]
        for k in range(steps):  # a step's batch is a view: no work on the device, a few operations on the host
            yield images[k * batch : (k + 1) * batch], labels[k * batch : (k + 1) * batch]

    def epoch_images(self, order: torch.Tensor) -> torch.Tensor:
        """Images `order` of the split, augmented with this epoch's table, in that order: gathered once an epoch,
        not once a step, in chunks of GATHER_CHUNK images (the gather's index takes 8 bytes a pixel)."""
        if self.how is None:
            return self.images[order]
        table = augmentation_table(len(self.labels), self.seed, self.sampler.epoch, self.how).to(order.device)
        pixels = torch.empty(
            (len(order) * 32 * 32, self.images.shape[-1]), dtype=self.images.dtype, device=order.device
        )
        for start in range(0, len(order), GATHER_CHUNK):
            chunk = order[start : start + GATHER_CHUNK]
            crop_flip(self.images, chunk, table[chunk], out=pixels[start * 32 * 32 : (start + len(chunk)) * 32 * 32])
        return pixels.view(len(order), 32, 32, -1).permute(0, 3, 1, 2)


class DeviceEvalLoader:
    """Evaluation from the device-resident split: rank r's images r, r + world_size, ..., in batches."""

    def __init__(self, split: Split, per_rank_batch: int, world: World) -> None:
        shard = eval_shard(len(split.labels), world)
        self.images, self.labels = split.images[shard].to(world.device), split.labels[shard].to(world.device)
        self.per_rank_batch = per_rank_batch

    def __len__(self) -> int:
        return -(-len(self.labels) // self.per_rank_batch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for k in range(0, len(self.labels), self.per_rank_batch):
            yield self.images[k : k + self.per_rank_batch], self.labels[k : k + self.per_rank_batch]


def input_fn(
    mean: tuple[float, ...],
    std: tuple[float, ...],
    device: torch.device,
    channels_last: bool,
    dtype: torch.dtype = torch.float32,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """uint8 batch -> `dtype` (float32; fp16 for run.amp=fp16-weights) on `device`, normalised by the per-channel
    `mean` and `std` (0..1 scale). The conversion runs there, not on the host, and the statistics go to the
    device once here, not once per step."""
    mean = torch.tensor(mean, device=device).view(1, 3, 1, 1)
    std = torch.tensor(std, device=device).view(1, 3, 1, 1)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    # (x / 255 - mean) / std as x * scale + shift, with scale and shift laid out like the batch at
    # full image size: broadcasting only over the batch keeps the loops simple (5x faster on a CPU
    # for channels_last than per-channel (1, 3, 1, 1) constants, measured).
    constants: dict[torch.Size, tuple[torch.Tensor, torch.Tensor]] = {}

    def to_input(images: torch.Tensor) -> torch.Tensor:
        x = images.to(device, non_blocking=True).contiguous(memory_format=layout)  # uint8: the cheap copy
        size = x.shape[1:]
        if size not in constants:
            full = (1, *size)
            constants[size] = tuple(
                c.expand(full).contiguous(memory_format=layout).to(dtype) for c in (1 / (255 * std), -mean / std)
            )
        scale, shift = constants[size]
        return x.to(dtype).mul_(scale).add_(shift)  # keeps x's memory format

    return to_input
