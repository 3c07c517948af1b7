"""Loaders (ddp/loaders.py): every rank's share of each step, exact evaluation shards, the keyed
augmentation, the device-resident path against the DataLoader path."""

import math
import os
import signal

import pytest
import torch
from torch.utils.data import DistributedSampler

from ddp import datasets, errors, loaders
from ddp.config import DataConfig
from ddp.devices import World

CPU = World(0, 0, 1, torch.device("cpu"), "none")


def world(rank: int, world_size: int) -> World:
    return World(rank, rank, world_size, torch.device("cpu"), "ddp" if world_size > 1 else "none")


def indexed_split(n: int) -> datasets.Split:
    """Images whose label is their own index, to follow each one through a loader."""
    return datasets.Split(torch.zeros(n, 3, 32, 32, dtype=torch.uint8), torch.arange(n))


LOADERS = ["torch", "device"]


@pytest.mark.parametrize("kind", LOADERS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_n_ranks_see_per_step_what_one_process_sees(world_size, kind):
    n, batch, epoch = 100, 12, 3
    single = loaders.train_loader(indexed_split(n), batch, world(0, 1), None, 0, seed=7, kind=kind)
    single.sampler.set_epoch(epoch)
    ranks = []
    for r in range(world_size):
        loader = loaders.train_loader(
            indexed_split(n), batch // world_size, world(r, world_size), None, 0, seed=7, kind=kind
        )
        loader.sampler.set_epoch(epoch)
        ranks.append([labels.tolist() for _, labels in loader])
    steps = [labels.tolist() for _, labels in single]
    assert len(steps) == n // batch and all(len(r) == len(steps) for r in ranks)
    for step, expected in enumerate(steps):
        assert sorted(sum((r[step] for r in ranks), [])) == sorted(expected)
    # a new epoch is a new order
    single.sampler.set_epoch(epoch + 1)
    assert [labels.tolist() for _, labels in single] != steps


@pytest.mark.parametrize("kind", LOADERS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_eval_shards_partition_the_test_set_in_as_many_batches_on_every_rank(world_size, kind):
    """Every image exactly once (no padding duplicates), and every rank the same number of batches,
    empty ones last where its shard ran out (at 2 ranks and batch 50: 51 and 50 images); fewer images than ranks
    too (2 images, 3 or 7 ranks: torch's RuntimeError in every rank past them, whose arange ran backwards)."""
    for n, batch in ((101, 8), (101, 50), (2, 8)):
        seen, counts = [], set()
        for r in range(world_size):
            loader = loaders.eval_loader(indexed_split(n), batch, world(r, world_size), 0, kind=kind)
            batches = [labels.tolist() for _, labels in loader]
            seen += [i for labels in batches for i in labels]
            counts |= {len(batches), len(loader)}
        assert sorted(seen) == list(range(n))
        assert counts == {math.ceil(math.ceil(n / world_size) / batch)}


def test_augmentation_crops_within_4px_and_flips_half():
    # Channel 0 holds column + 1, channel 1 row + 1 (0 only in the padding), so each output tells
    # its crop offset and whether it was flipped.
    rows, cols = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    image = torch.stack([cols + 1, rows + 1, torch.zeros_like(rows)]).to(torch.uint8)
    table = loaders.augmentation_table(2000, seed=0, epoch=1)
    offsets, flips = set(), 0
    for dy, dx, flip in table.tolist():
        out = loaders.augment(image, dy, dx, flip)
        assert out.shape == (3, 32, 32) and out.dtype == torch.uint8
        out = out.long()
        i, j = (out[0] > 0).nonzero()[0]  # top-left image pixel; at least 28 more follow in its row
        flipped = bool(out[0, i, j + 1] < out[0, i, j])
        assert flipped == bool(flip)
        flips += flipped
        u = out.flip(-1) if flipped else out
        i, j = (u[0] > 0).nonzero()[0]
        offsets.add((int(u[1, i, j] - 1 - i), int(u[0, i, j] - 1 - j)))  # shift of the image in the crop
    assert offsets == {(dy, dx) for dy in range(-4, 5) for dx in range(-4, 5)}  # all 81, none beyond 4 px
    assert 0.45 < flips / 2000 < 0.55


def test_augmentation_is_a_function_of_seed_and_epoch():
    a = loaders.augmentation_table(100, seed=3, epoch=2)
    assert torch.equal(a, loaders.augmentation_table(100, seed=3, epoch=2))
    assert not torch.equal(a, loaders.augmentation_table(100, seed=3, epoch=3))
    assert not torch.equal(a, loaders.augmentation_table(100, seed=4, epoch=2))


@pytest.mark.parametrize(
    "world_size, workers, kind", [(1, 0, "torch"), (2, 0, "torch"), (3, 2, "torch"), (1, 0, "device"), (3, 0, "device")]
)
def test_an_image_gets_the_same_crop_whatever_the_world_size_workers_or_resume_step(world_size, workers, kind):
    """Rank r of world_size, with loader workers or on the device, started at step 2: each image id
    maps to the same augmented pixels as with the torch loader in one process from the start; with
    the standard augmentation and with airbench's (2-px reflect translation, alternating flip)."""
    n, batch = 36, 6
    split = datasets.Split(
        torch.randint(0, 256, (n, 3, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8),
        torch.arange(n),
    )

    def images_by_id(world_size: int, start: int, workers: int, kind: str, how) -> dict[int, torch.Tensor]:
        out = {}
        for r in range(world_size):
            loader = loaders.train_loader(split, batch // world_size, world(r, world_size), how, workers, 5, kind)
            loader.sampler.set_epoch(4, start_step=start)
            for images, ids in loader:
                out.update(zip(ids.tolist(), images))
        return out

    for how in (loaders.Augment(), loaders.Augment(translate=2, reflect=True, flip="alternate")):
        reference = images_by_id(1, 0, 0, "torch", how)
        resumed = images_by_id(world_size, 2, workers, kind, how)
        assert len(reference) == n and len(resumed) == n - 2 * batch
        for i, image in resumed.items():
            assert torch.equal(image, reference[i])


def test_input_fn_normalises_on_the_device():
    d = datasets.read(DataConfig(dataset="synthetic", synthetic_train=200, synthetic_test=8), CPU)
    x = loaders.input_fn(d.mean, d.std, torch.device("cpu"), channels_last=True)(d.train.images)
    assert x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4)
    assert torch.allclose(x.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-3)


def test_batched_augmentation_is_the_per_image_one():
    images = torch.randint(0, 256, (500, 3, 32, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    table = loaders.augmentation_table(500, seed=2, epoch=1)
    batched = loaders.crop_flip(loaders.pad_hwc(images), torch.arange(len(images)), table)
    assert batched.dtype == torch.uint8 and batched.shape == images.shape
    for i in range(500):
        assert torch.equal(batched[i], loaders.augment(images[i], *table[i].tolist())), i
    # the table's statistics: offsets 0..8 (at most 4 px each way), all 81 pairs, about half flipped
    big = loaders.augmentation_table(50_000, seed=0, epoch=1)
    assert big[:, :2].min() == 0 and big[:, :2].max() == 8
    assert len({(int(a), int(b)) for a, b in big[:, :2].unique(dim=0)}) == 81
    assert 0.49 < big[:, 2].float().mean() < 0.51


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_device_loader_covers_each_image_once_per_epoch_and_is_deterministic(world_size):
    n, batch = 96, 12  # 96 = 8 global batches: nothing dropped

    def epoch_ids(seed: int, epoch: int) -> list[list[int]]:
        per_rank = []
        for r in range(world_size):
            loader = loaders.train_loader(
                indexed_split(n), batch // world_size, world(r, world_size), loaders.Augment(), 0, seed, "device"
            )
            loader.sampler.set_epoch(epoch, start_step=0)
            per_rank.append([i for _, labels in loader for i in labels.tolist()])
        return per_rank

    ids = epoch_ids(seed=3, epoch=1)
    assert sorted(sum(ids, [])) == list(range(n))  # every image once across ranks
    assert all(len(r) == n // world_size for r in ids)  # each rank its equal shard
    assert epoch_ids(seed=3, epoch=1) == ids  # a function of (seed, epoch)
    assert epoch_ids(seed=3, epoch=2) != ids and epoch_ids(seed=4, epoch=1) != ids


def test_device_and_torch_loaders_give_the_same_batches():
    split = datasets.Split(
        torch.randint(0, 256, (64, 3, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8),
        torch.arange(64),
    )
    batches = {}
    for kind in LOADERS:
        loader = loaders.train_loader(split, 16, world(1, 2), loaders.Augment(), 0, 9, kind)
        loader.sampler.set_epoch(2, start_step=1)
        batches[kind] = list(loader)
    assert len(batches["device"]) == len(batches["torch"]) == 1  # 64 / (2 x 16) = 2 steps, 1 after step 1
    for (a, la), (b, lb) in zip(batches["device"], batches["torch"]):
        assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.parametrize("how", [loaders.Augment(), None])
def test_device_loader_gathers_an_epoch_at_once_in_chunks_and_steps_slice_it(monkeypatch, how):
    """The epoch's images are gathered in chunks (7 images here: chunks that end mid-batch and a short last
    one), each step's batch a slice of them: the torch loader's batches bit for bit, on one storage."""
    monkeypatch.setattr(loaders, "GATHER_CHUNK", 7)
    split = datasets.Split(
        torch.randint(0, 256, (60, 3, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8),
        torch.arange(60),
    )
    batches = {}
    for kind in LOADERS:
        loader = loaders.train_loader(split, 6, world(0, 1), how, 0, 4, kind)
        loader.sampler.set_epoch(3, start_step=1)
        batches[kind] = list(loader)
    assert len(batches["device"]) == len(batches["torch"]) == 9
    for (a, la), (b, lb) in zip(batches["device"], batches["torch"]):
        assert torch.equal(a, b) and torch.equal(la, lb)
        assert a.is_contiguous(memory_format=torch.channels_last if how else torch.contiguous_format)
    assert len({images.untyped_storage().data_ptr() for images, _ in batches["device"]}) == 1
    assert len({labels.untyped_storage().data_ptr() for _, labels in batches["device"]}) == 1


def test_the_samplers_order_is_distributed_samplers_own_for_every_rank_seed_epoch_and_start():
    """ResumableSampler.order() draws the permutation itself (a tensor, no list of every index): it must stay
    DistributedSampler's order (shuffle, drop_last), the one every checkpoint's position was written in."""
    for n, world_size in [(37, 1), (37, 3), (64, 4), (100, 7)]:
        dataset = range(n)  # a sampler asks only its length
        for r in range(world_size):
            ours = loaders.ResumableSampler(dataset, world(r, world_size), 2, seed=11)
            theirs = DistributedSampler(dataset, world_size, r, shuffle=True, seed=11, drop_last=True)
            for epoch, start in [(1, 0), (2, 3), (9, 1)]:
                ours.set_epoch(epoch, start_step=start)
                theirs.set_epoch(epoch)
                assert ours.order().tolist() == list(theirs)[2 * start :] == [i for i, _ in ours]


def test_a_worker_lost_while_its_batch_is_received_is_said_as_torch_says_a_lost_worker(monkeypatch):
    """data.loader=torch: a worker killed while the main process fetches its batch's shared memory from it raised
    the socket's EOFError or ConnectionResetError (a loaded suite, 2026-11-28), a traceback. Now torch's own line for a
    worker gone, which the CLI says in one line; the same error with every worker alive stays what it was."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    loader = loaders.WorkerLoader(torch.utils.data.TensorDataset(torch.zeros(8, 1)), batch_size=2, num_workers=1)

    killed: list[int] = []

    def lost(self: _MultiProcessingDataLoaderIter) -> object:
        killed.append(self._workers[0].pid)
        os.kill(killed[0], signal.SIGKILL)
        raise EOFError  # what multiprocessing's resource_sharer raises for the dead worker's socket

    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "_next_data", lost)
    with pytest.raises(RuntimeError) as e:
        next(iter(loader))
    # torch's line for a worker found gone, or the one of its SIGCHLD handler if that finds it first
    gone = (f"DataLoader worker (pid(s) {killed[0]}) exited unexpectedly", f"DataLoader worker (pid {killed[0]}) is ")
    assert str(e.value).startswith(gone) and errors.lost_worker(e.value), e.value

    def reset(self: _MultiProcessingDataLoaderIter) -> object:
        raise ConnectionResetError(104, "Connection reset by peer")  # every worker alive: not a lost one

    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "_next_data", reset)
    with pytest.raises(ConnectionResetError):
        next(iter(loader))
