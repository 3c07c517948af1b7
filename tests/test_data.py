import hashlib
import pickle
import urllib.error

import numpy as np
import pytest
import torch
from torchvision import datasets as tv_datasets

from ddp import data
from ddp.config import DataConfig
from ddp.distributed import World
from ddp.errors import UsageError

CPU = World(0, 0, 1, torch.device("cpu"), "none")


def world(rank: int, world_size: int) -> World:
    return World(rank, rank, world_size, torch.device("cpu"), "ddp" if world_size > 1 else "none")


def arrays(n_train: int = 60, n_test: int = 25, num_classes: int = 10, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, (n_train, 32, 32, 3), dtype=np.uint8),
        rng.integers(0, num_classes, n_train),
        rng.integers(0, 256, (n_test, 32, 32, 3), dtype=np.uint8),
        rng.integers(0, num_classes, n_test),
    )


def assert_same_images(split: data.Split, x_hwc: np.ndarray, y: np.ndarray) -> None:
    assert split.images.dtype == torch.uint8 and split.images.shape == (len(x_hwc), 3, 32, 32)
    assert torch.equal(split.images, torch.from_numpy(x_hwc).permute(0, 3, 1, 2))
    assert split.labels.tolist() == list(y)


def test_synthetic_is_fixed_and_shaped(tmp_path):
    cfg = DataConfig(dataset="synthetic", synthetic_train=50, synthetic_test=7)
    a, b = data.load(cfg, CPU), data.load(cfg, CPU)
    assert a.train.images.shape == (50, 3, 32, 32) and a.test.labels.shape == (7,)
    assert torch.equal(a.train.images, b.train.images) and a.num_classes == 10


def test_npz_with_and_without_class_names(tmp_path):
    x, y, xt, yt = arrays()
    path = tmp_path / "d.npz"
    np.savez(path, x_train=x, y_train=y, x_test=xt, y_test=yt, classes=np.array([f"c{i}" for i in range(10)]))
    d = data.load(DataConfig(dataset="npz", path=str(path)), CPU)
    assert_same_images(d.train, x, y)
    assert_same_images(d.test, xt, yt)
    assert d.classes == [f"c{i}" for i in range(10)]
    np.savez(path, x_train=x, y_train=y, x_test=xt, y_test=yt)
    assert data.load(DataConfig(dataset="npz", path=str(path)), CPU).classes == [str(i) for i in range(10)]


def test_npz_mistakes_name_data_path(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x_train=np.zeros((2, 32, 32, 3), np.uint8), y_train=np.zeros(2))
    with pytest.raises(UsageError, match=f"data.path={path}: missing arrays x_test, y_test"):
        data.load(DataConfig(dataset="npz", path=str(path)), CPU)
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(UsageError, match="not a readable .npz file"):
        data.load(DataConfig(dataset="npz", path=str(tmp_path / "junk.npz")), CPU)


def test_empty_split_is_an_error():
    with pytest.raises(UsageError, match="the test split is empty"):
        data.load(DataConfig(dataset="synthetic", synthetic_test=0), CPU)


def test_real_cifar10_subset(subset):
    d = data.load(DataConfig(dataset="npz", path=str(subset)), CPU)
    assert (len(d.train.labels), len(d.test.labels)) == (6034, 1017)
    assert d.classes[:3] == ["airplane", "automobile", "bird"] and d.num_classes == 10
    assert set(d.test.labels.tolist()) == set(range(10))
    # per-channel statistics of real CIFAR-10 images (mean of the full set is about 0.49, 0.48, 0.45)
    assert all(0.4 < m < 0.55 for m in d.mean) and all(0.2 < s < 0.3 for s in d.std)


def _pickle(path, obj) -> str:
    path.write_bytes(pickle.dumps(obj))
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("kind", ["cifar10", "cifar100"])
def test_torchvision_cifar_from_a_local_copy(kind, tmp_path, monkeypatch):
    """A copy in torchvision's own on-disk format, read through torchvision.datasets. The files
    are ours (no download here), so the class's expected md5 sums are set to theirs: torchvision
    still checks every file's integrity."""
    num_classes = 10 if kind == "cifar10" else 100
    x, y, xt, yt = arrays(num_classes=num_classes)
    cls = tv_datasets.CIFAR10 if kind == "cifar10" else tv_datasets.CIFAR100
    folder = tmp_path / cls.base_folder
    folder.mkdir()
    names = [f"name{i}" for i in range(num_classes)]
    label_key = "labels" if kind == "cifar10" else "fine_labels"

    def batch(xs, ys):
        return {"data": xs.transpose(0, 3, 1, 2).reshape(len(xs), -1), label_key: [int(v) for v in ys]}

    if kind == "cifar10":
        parts = np.array_split(np.arange(len(x)), 5)
        train_list = [
            [f"data_batch_{i + 1}", _pickle(folder / f"data_batch_{i + 1}", batch(x[p], y[p]))]
            for i, p in enumerate(parts)
        ]
        test_list = [["test_batch", _pickle(folder / "test_batch", batch(xt, yt))]]
        meta = {"filename": "batches.meta", "key": "label_names"}
    else:
        train_list = [["train", _pickle(folder / "train", batch(x, y))]]
        test_list = [["test", _pickle(folder / "test", batch(xt, yt))]]
        meta = {"filename": "meta", "key": "fine_label_names"}
    meta["md5"] = _pickle(folder / meta["filename"], {meta["key"]: names})
    monkeypatch.setattr(cls, "train_list", train_list)
    monkeypatch.setattr(cls, "test_list", test_list)
    monkeypatch.setattr(cls, "meta", meta)

    d = data.load(DataConfig(dataset=kind, root=str(tmp_path), download=False), CPU)
    assert_same_images(d.train, x, y)
    assert_same_images(d.test, xt, yt)
    assert d.classes == names and d.num_classes == num_classes


def test_cifar_download_failure_is_a_clear_error(tmp_path, monkeypatch):
    def offline(self):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(tv_datasets.CIFAR10, "download", offline)
    with pytest.raises(UsageError, match=f"could not download CIFAR-10 into data.root={tmp_path}.*offline?"):
        data.load(DataConfig(dataset="cifar10", root=str(tmp_path), download=True), CPU)


def indexed_split(n: int) -> data.Split:
    """Images whose label is their own index, to follow each one through a loader."""
    return data.Split(torch.zeros(n, 3, 32, 32, dtype=torch.uint8), torch.arange(n))


LOADERS = ["torch", "device"]


@pytest.mark.parametrize("kind", LOADERS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_n_ranks_see_per_step_what_one_process_sees(world_size, kind):
    n, batch, epoch = 100, 12, 3
    single = data.train_loader(indexed_split(n), batch, world(0, 1), False, 0, seed=7, kind=kind)
    single.sampler.set_epoch(epoch)
    ranks = []
    for r in range(world_size):
        loader = data.train_loader(
            indexed_split(n), batch // world_size, world(r, world_size), False, 0, seed=7, kind=kind
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
def test_eval_shards_partition_the_test_set(world_size, kind):
    n = 101
    seen = []
    for r in range(world_size):
        loader = data.eval_loader(indexed_split(n), 8, world(r, world_size), 0, kind=kind)
        seen += [i for _, labels in loader for i in labels.tolist()]
    assert sorted(seen) == list(range(n))  # every image exactly once: no padding duplicates


def test_augmentation_crops_within_4px_and_flips_half():
    # Channel 0 holds column + 1, channel 1 row + 1 (0 only in the padding), so each output tells
    # its crop offset and whether it was flipped.
    rows, cols = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    image = torch.stack([cols + 1, rows + 1, torch.zeros_like(rows)]).to(torch.uint8)
    table = data.augmentation_table(2000, seed=0, epoch=1)
    offsets, flips = set(), 0
    for dy, dx, flip in table.tolist():
        out = data.augment(image, dy, dx, flip)
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
    a = data.augmentation_table(100, seed=3, epoch=2)
    assert torch.equal(a, data.augmentation_table(100, seed=3, epoch=2))
    assert not torch.equal(a, data.augmentation_table(100, seed=3, epoch=3))
    assert not torch.equal(a, data.augmentation_table(100, seed=4, epoch=2))


@pytest.mark.parametrize(
    "world_size, workers, kind", [(1, 0, "torch"), (2, 0, "torch"), (3, 2, "torch"), (1, 0, "device"), (3, 0, "device")]
)
def test_an_image_gets_the_same_crop_whatever_the_world_size_workers_or_resume_step(world_size, workers, kind):
    """Rank r of world_size, with loader workers or on the device, started at step 2: each image id
    maps to the same augmented pixels as with the torch loader in one process from the start."""
    n, batch = 36, 6
    split = data.Split(
        torch.randint(0, 256, (n, 3, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8),
        torch.arange(n),
    )

    def images_by_id(world_size: int, start: int, workers: int, kind: str) -> dict[int, torch.Tensor]:
        out = {}
        for r in range(world_size):
            loader = data.train_loader(split, batch // world_size, world(r, world_size), True, workers, 5, kind)
            loader.sampler.set_position(epoch=4, step=start)
            for images, ids in loader:
                out.update(zip(ids.tolist(), images))
        return out

    reference = images_by_id(1, 0, 0, "torch")
    resumed = images_by_id(world_size, 2, workers, kind)
    assert len(reference) == n and len(resumed) == n - 2 * batch
    for i, image in resumed.items():
        assert torch.equal(image, reference[i])


def test_input_fn_normalises_on_the_device():
    d = data.load(DataConfig(dataset="synthetic", synthetic_train=200, synthetic_test=8), CPU)
    x = data.input_fn(d, torch.device("cpu"), channels_last=True)(d.train.images)
    assert x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4)
    assert torch.allclose(x.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-3)


def test_batched_augmentation_is_the_per_image_one():
    images = torch.randint(0, 256, (500, 3, 32, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    table = data.augmentation_table(500, seed=2, epoch=1)
    batched = data.crop_flip(data.pad_hwc(images), torch.arange(len(images)), table)
    assert batched.dtype == torch.uint8 and batched.shape == images.shape
    for i in range(500):
        assert torch.equal(batched[i], data.augment(images[i], *table[i].tolist())), i
    # the table's statistics: offsets 0..8 (at most 4 px each way), all 81 pairs, about half flipped
    big = data.augmentation_table(50_000, seed=0, epoch=1)
    assert big[:, :2].min() == 0 and big[:, :2].max() == 8
    assert len({(int(a), int(b)) for a, b in big[:, :2].unique(dim=0)}) == 81
    assert 0.49 < big[:, 2].float().mean() < 0.51


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_device_loader_covers_each_image_once_per_epoch_and_is_deterministic(world_size):
    n, batch = 96, 12  # 96 = 8 global batches: nothing dropped

    def epoch_ids(seed: int, epoch: int) -> list[list[int]]:
        per_rank = []
        for r in range(world_size):
            loader = data.train_loader(
                indexed_split(n), batch // world_size, world(r, world_size), True, 0, seed, "device"
            )
            loader.sampler.set_position(epoch, 0)
            per_rank.append([i for _, labels in loader for i in labels.tolist()])
        return per_rank

    ids = epoch_ids(seed=3, epoch=1)
    assert sorted(sum(ids, [])) == list(range(n))  # every image once across ranks
    assert all(len(r) == n // world_size for r in ids)  # each rank its equal shard
    assert epoch_ids(seed=3, epoch=1) == ids  # a function of (seed, epoch)
    assert epoch_ids(seed=3, epoch=2) != ids and epoch_ids(seed=4, epoch=1) != ids


def test_device_and_torch_loaders_give_the_same_batches():
    split = data.Split(
        torch.randint(0, 256, (64, 3, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8),
        torch.arange(64),
    )
    batches = {}
    for kind in LOADERS:
        loader = data.train_loader(split, 16, world(1, 2), True, 0, 9, kind)
        loader.sampler.set_position(epoch=2, step=1)
        batches[kind] = list(loader)
    assert len(batches["device"]) == len(batches["torch"]) == 1  # 64 / (2 x 16) = 2 steps, 1 after step 1
    for (a, la), (b, lb) in zip(batches["device"], batches["torch"]):
        assert torch.equal(a, b) and torch.equal(la, lb)
