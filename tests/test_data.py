"""Datasets (ddp/datasets.py): every kind read into one form, and files that lie refused with the reason."""

import hashlib
import pickle
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import BIN, REPO, TRAIN, clean_env
from torchvision import datasets as tv_datasets

from ddp import cifar, datasets, loaders, models
from ddp.config import DataConfig
from ddp.devices import World
from ddp.errors import UsageError

CPU = World(0, 0, 1, torch.device("cpu"), "none")


def arrays(n_train: int = 60, n_test: int = 25, num_classes: int = 10, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, (n_train, 32, 32, 3), dtype=np.uint8),
        rng.integers(0, num_classes, n_train),
        rng.integers(0, 256, (n_test, 32, 32, 3), dtype=np.uint8),
        rng.integers(0, num_classes, n_test),
    )


def assert_same_images(split: datasets.Split, x_hwc: np.ndarray, y: np.ndarray) -> None:
    assert split.images.dtype == torch.uint8 and split.images.shape == (len(x_hwc), 3, 32, 32)
    assert torch.equal(split.images, torch.from_numpy(x_hwc).permute(0, 3, 1, 2))
    assert split.labels.tolist() == list(y)


def test_synthetic_is_fixed_and_shaped(tmp_path):
    cfg = DataConfig(dataset="synthetic", synthetic_train=50, synthetic_test=7)
    a, b = datasets.read(cfg, CPU), datasets.read(cfg, CPU)
    assert a.train.images.shape == (50, 3, 32, 32) and a.test.labels.shape == (7,)
    assert torch.equal(a.train.images, b.train.images) and a.num_classes == 10


def test_npz_with_and_without_class_names(tmp_path):
    x, y, xt, yt = arrays()
    path = tmp_path / "d.npz"
    np.savez(path, x_train=x, y_train=y, x_test=xt, y_test=yt, classes=np.array([f"c{i}" for i in range(10)]))
    d = datasets.read(DataConfig(dataset="npz", path=str(path)), CPU)
    assert_same_images(d.train, x, y)
    assert_same_images(d.test, xt, yt)
    assert d.classes == [f"c{i}" for i in range(10)]
    np.savez(path, x_train=x, y_train=y, x_test=xt, y_test=yt)
    assert datasets.read(DataConfig(dataset="npz", path=str(path)), CPU).classes == [str(i) for i in range(10)]
    names = np.array([f"c{i}".encode() for i in range(9)] + [b"caf\xc3\xa9"])  # bytes: they were "b'c0'"
    np.savez(path, x_train=x, y_train=y, x_test=xt, y_test=yt, classes=names)
    named = datasets.read(DataConfig(dataset="npz", path=str(path)), CPU).classes
    assert named == [f"c{i}" for i in range(9)] + ["café"]


def test_channel_statistics_are_exact_counted_a_few_images_at_a_time_and_synthetic_images_drawn_so_are_unchanged(
    monkeypatch,
):
    """The statistics were float64 images (8 bytes a pixel: 1.2 GB for CIFAR-10's training split, peak 1.87 GB
    to read 176 MB of uint8), and synthetic images int64 noise (3.5 GB for 60,000). Both now go CHUNK images at a
    time (here 7, so a chunk is cut short): the statistics agree with float64's to 1e-12 (they are exact integer
    sums), and the synthetic images are those drawn in one go."""
    monkeypatch.setattr(datasets, "CHUNK", 7)
    images = torch.randint(0, 256, (30, 3, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    images[:, 2] = torch.tensor([0, 255]).repeat(15 * 1024).reshape(30, 32, 32)  # half 0, half 255
    mean, std = datasets.channel_statistics("here", images)
    pixels = images.double() / 255
    assert mean == pytest.approx(pixels.mean(dim=(0, 2, 3)).tolist(), rel=1e-12, abs=0)
    assert std == pytest.approx(pixels.std(dim=(0, 2, 3)).tolist(), rel=1e-12, abs=0)
    n = 30 * 1024
    assert mean[2] == 0.5 and std[2] == (n / (n - 1) / 4) ** 0.5  # exact: no rounding on the way

    cfg = DataConfig(dataset="synthetic", synthetic_train=30, synthetic_test=9, synthetic_classes=4)
    data = datasets.read(cfg, CPU)
    g = torch.Generator().manual_seed(1234)  # the draws of one go, as before
    colours = torch.randint(0, 256, (4, 3, 1, 1), generator=g)
    for split, count in ((data.train, 30), (data.test, 9)):
        labels = torch.randint(0, 4, (count,), generator=g)
        noise = torch.randint(0, 256, (count, 3, 32, 32), generator=g)
        assert torch.equal(split.labels, labels) and torch.equal(split.images, ((colours[labels] + noise) // 2).byte())


def test_a_channel_of_one_value_is_centred_not_divided_by_zero_and_one_colour_everywhere_is_refused(tmp_path):
    """Grey images stored as RGB with the colours left 0: before, their std of 0 made every input NaN and the run
    stopped as "training diverged: try a lower optim.lr". Images all of one colour are a file written wrong."""
    x, y, xt, yt = arrays()
    x[..., 1:] = 0  # green and blue unused
    path = tmp_path / "grey.npz"
    np.savez(path, x_train=x, y_train=y, x_test=xt, y_test=yt)
    d = datasets.read(DataConfig(dataset="npz", path=str(path)), CPU)
    assert d.std[1:] == (1.0, 1.0) and d.mean[1:] == (0.0, 0.0) and 0.25 < d.std[0] < 0.35
    assert torch.isfinite(loaders.input_fn(d.mean, d.std, CPU.device, False)(d.test.images)).all()
    np.savez(path, x_train=np.full_like(x, 7), y_train=y, x_test=xt, y_test=yt)
    with pytest.raises(UsageError, match=r"grey.npz: every pixel of every training image is the same colour \(7, 7, 7"):
        datasets.read(DataConfig(dataset="npz", path=str(path)), CPU)


def test_training_images_of_one_class_are_refused(tmp_path):
    """Before: "1 classes", a loss of 0 from the first step and a test accuracy of 100% or 0%."""
    x, _, xt, yt = arrays()
    path = tmp_path / "one.npz"
    named = {"classes": list("abcdefghij")}
    for y, names, shown in ((np.zeros(len(x)), {}, "'0'"), (np.full(len(x), 3), named, "'d'")):
        np.savez(path, x_train=x, y_train=y, x_test=xt, y_test=yt, **names)
        with pytest.raises(UsageError, match=f"one.npz: every training image is of class {shown}: a classifier"):
            datasets.read(DataConfig(dataset="npz", path=str(path)), CPU)


def test_npz_mistakes_name_data_path(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x_train=np.zeros((2, 32, 32, 3), np.uint8), y_train=np.zeros(2))
    with pytest.raises(UsageError, match=f"data.path={path}: missing arrays x_test, y_test"):
        datasets.read(DataConfig(dataset="npz", path=str(path)), CPU)
    whole = (tmp_path / "d.npz").read_bytes()
    np.save(tmp_path / "a.npy", np.zeros(3))
    one = {"y_train": [0], "x_test": [0], "y_test": [0]}
    np.savez_compressed(tmp_path / "damaged.npz", x_train=np.zeros(50_000, np.uint8), **one)
    damaged = bytearray((tmp_path / "damaged.npz").read_bytes())
    damaged[100:110] = b"x" * 10  # inside the compressed array; the zip's directory at the end is whole
    for name, content, why in [
        ("junk.npz", b"not a zip", "not an .npz file"),
        ("cut.npz", whole[: len(whole) // 2], "not an .npz file"),  # a copy that stopped: was a BadZipFile traceback
        ("a.npy", (tmp_path / "a.npy").read_bytes(), "not an .npz file"),  # was a TypeError traceback
        ("damaged.npz", bytes(damaged), "not a readable .npz file \\(error: Error -3 while decompressing"),
    ]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UsageError, match=f"^data.path={tmp_path / name}: {why}"):
            datasets.read(DataConfig(dataset="npz", path=str(tmp_path / name)), CPU)


@pytest.mark.parametrize(
    "images, fix",
    [
        (np.zeros((2, 3, 32, 32), np.uint8), r"; channels first: x.transpose\(0, 2, 3, 1\)$"),
        (np.full((2, 32, 32, 3), 0.5, np.float32), r"; floats in \[0, 1\]: \(x \* 255\).round\(\).astype\(np.uint8\)$"),
        (np.full((2, 3, 32, 32), 0.5), r"; channels first: .* and floats in \[0, 1\]: "),  # (torch's ToTensor)
        (np.full((2, 32, 32, 3), 200, np.int64), r"; values 0-255: x.astype\(np.uint8\)$"),
        (np.zeros((2, 32, 32), np.uint8), r"; one channel: np.repeat\(x\[..., None\], 3, axis=3\)$"),
        (np.full((2, 32, 32, 3), np.nan, np.float32), r"float32 \(2, 32, 32, 3\)$"),  # no fix for NaNs
        (np.full((2, 32, 32, 3), 300.0), r"float64 \(2, 32, 32, 3\)$"),  # nor for values past 255
    ],
)
def test_images_in_another_common_layout_are_refused_with_how_to_write_them(tmp_path, images, fix):
    """Images as torch's ToTensor leaves them (channels first, floats in [0, 1]), as integers of another type, or
    with one channel: the line said what it wanted and what it got; it also says how to write them now."""
    path = tmp_path / "d.npz"
    np.savez(path, x_train=images, y_train=np.zeros(2, np.int64), x_test=images, y_test=np.zeros(2, np.int64))
    with pytest.raises(UsageError, match=f"^data.path={path}: x_train must be uint8 \\(N, 32, 32, 3\\), got .*{fix}"):
        datasets.read(DataConfig(dataset="npz", path=str(path)), CPU)


@pytest.mark.parametrize("labels, fix", [(np.eye(10)[[1, 2]], "; one-hot rows (or scores): y.argmax(axis=1)"),
                                         (np.zeros((3,)), ""), (np.zeros((2, 1)), "")])  # fmt: skip
def test_labels_one_hot_or_of_another_count_are_refused_and_one_hot_ones_with_how_to_write_them(tmp_path, labels, fix):
    """Labels as Keras keeps them (a one-hot row an image) said what was wanted and what came; they now also say how
    to write them. A count that is not the images', or one column, has no such fix."""
    path, images = tmp_path / "d.npz", np.zeros((2, 32, 32, 3), np.uint8)
    np.savez(path, x_train=images, y_train=labels, x_test=images, y_test=np.zeros(2, np.int64))
    with pytest.raises(UsageError) as refused:
        datasets.read(DataConfig(dataset="npz", path=str(path)), CPU)
    assert str(refused.value) == (f"data.path={path}: y_train has shape {labels.shape} but x_train holds 2 images: one "
                                  f"label per image, (N,){fix}")  # fmt: skip


def test_evaluating_on_data_whose_class_names_are_not_the_models_is_refused():
    """A model's class 3 is not "cat" of data that names its classes in another order: the accuracy would be
    of nothing (was computed without a word). Names made up from indices (data without names) are no names. The
    line says where they part: 5 classes against the model's 10 read as the same four names and "...", twice."""
    cfg = DataConfig(dataset="synthetic", synthetic_test=20)  # classes named class0 .. class9
    for data, model, why in [
        (cfg, list("abcdefghij"), "class 0 'class0', the model 'a' (class0, class1, class2, class3, ...; the model "
         "a, b, c, d, ...)"),
        (DataConfig(dataset="synthetic", synthetic_classes=5), [f"class{i}" for i in range(10)], "5 classes (class0, "
         "class1, class2, class3, ...), the model 10 (class0, class1, class2, class3, ...)"),  # was alike: 4 each
    ]:  # fmt: skip
        with pytest.raises(UsageError) as raised:
            datasets.read_test(data, CPU, model)
        assert str(raised.value).startswith(f"data.dataset=synthetic names {why}: a label would mean another class")
    for classes in ([f"class{i}" for i in range(10)], [str(i) for i in range(10)]):
        assert len(datasets.read_test(cfg, CPU, classes).labels) == 20


def test_evaluating_a_model_on_cifar_of_another_class_count_is_refused_before_a_download(tmp_path):
    """A CIFAR-10 model with data.dataset=cifar100: refused from the count alone, before CIFAR-100 (161 MB) is
    looked for or downloaded (was: downloaded, then refused by its names)."""
    cfg = DataConfig(dataset="cifar100", root=str(tmp_path), download=True)
    with pytest.raises(UsageError) as raised:
        datasets.read_test(cfg, CPU, ["airplane", "automobile", "bird", *(f"c{i}" for i in range(7))])
    assert str(raised.value) == ("data.dataset=cifar100 has 100 classes, the model 10 (airplane, automobile, bird, c0, "
                                 "...): a label would mean another class; evaluate on data of the model's classes, in "
                                 "its order")  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_empty_split_is_an_error():
    with pytest.raises(UsageError, match="the test split is empty"):
        datasets.read(DataConfig(dataset="synthetic", synthetic_test=0), CPU)


def npz(tmp_path, **changes) -> str:
    """A valid .npz of 60 train and 25 test images with 10 named classes, changed by `changes` (an
    array, or None to leave it out)."""
    x, y, xt, yt = arrays()
    found = {"x_train": x, "y_train": y, "x_test": xt, "y_test": yt, "classes": np.array([f"c{i}" for i in range(10)])}
    found.update(changes)
    path = tmp_path / "lying.npz"
    np.savez(path, **{k: v for k, v in found.items() if v is not None})
    return str(path)


def set_at(array: np.ndarray, index: int, value, dtype=None) -> np.ndarray:
    out = array.astype(dtype or array.dtype)
    out[index] = value
    return out


_, Y, _, YT = arrays()
LIES = {
    "label-too-big": ({"y_train": set_at(Y, 5, 12)}, r"y_train\[5\] = 12, but there are 10 classes \(names given\)"),
    "label-negative": (
        {"y_test": set_at(YT, 3, -1)},
        r"y_test\[3\] = -1, but there are 10 classes \(names given\): labels are 0..9",
    ),
    "stray-label-no-names": (
        {"y_train": set_at(Y, 5, 12), "classes": None},
        r"y_train\[5\] = 12, but no training image has class 10, 11: without a `classes` array",
    ),
    "stray-test-label-no-names": (
        {"y_test": set_at(YT, 4, 10), "classes": None},
        r"y_test\[4\] = 10, but no training image has class 10",
    ),
    "label-2**40-no-names": (  # its 2**40 + 1 classes were listed: killed for memory (21 GB here)
        {"y_train": set_at(Y, 3, 2**40), "classes": None},
        r"y_train\[3\] = 1099511627776, but no training image has class 10, 11, 12, 13, 14, \.\.\.: without",
    ),
    "negative-no-names": ({"y_train": set_at(Y, 0, -2), "classes": None}, r"y_train\[0\] = -2, but there are"),
    "all-negative-no-names": (  # said as itself, not as classes no training image has (the count's check)
        {"y_train": np.full(60, -1), "classes": None},
        r"y_train\[0\] = -1, but there are 10 classes: labels are 0..9",
    ),
    "labels-too-few": ({"y_train": Y[:-1]}, r"y_train has shape \(59,\) but x_train holds 60 images"),
    "labels-2d": ({"y_test": YT[:, None]}, r"y_test has shape \(25, 1\) but x_test holds 25 images"),
    "empty-train": (
        {"x_train": np.zeros((0, 32, 32, 3), np.uint8), "y_train": np.zeros(0, np.int64)},
        "x_train and y_train are empty: the train split has no images",
    ),
    "empty-test": (
        {"x_test": np.zeros((0, 32, 32, 3), np.uint8), "y_test": np.zeros(0, np.int64)},
        "x_test and y_test are empty: the test split has no images",
    ),
    "classes-too-few": ({"classes": np.array(["cat", "dog", "ship"])}, r"y_\w+\[\d+\] = \d, but there are 3 classes"),
    "classes-2d": ({"classes": np.array([["a", "b"], ["c", "d"]])}, r"classes must be a list of names"),
    "label-not-whole": ({"y_train": set_at(Y, 7, 2.5, np.float64)}, r"y_train\[7\] = 2.5 is not a class index"),
    "label-nan": ({"y_test": set_at(YT, 2, np.nan, np.float32)}, r"y_test\[2\] = nan is not a class index"),
    "label-past-int64": (  # read as int64 it would wrap to a negative number the file does not hold
        {"y_train": set_at(Y, 1, 2**63 + 6, np.uint64)},
        r"y_train\[1\] = 9223372036854775814 is not a class index",
    ),
    "label-huge-float": ({"y_test": set_at(YT, 0, -1e30, np.float64)}, r"y_test\[0\] = -1e\+30 is not a class index"),
    "labels-text": ({"y_train": Y.astype(str)}, r"y_train must hold class indices \(integers\), not <U"),
    "classes-named-twice": (  # two "cat" rows in the per-class table, one TensorBoard chart of the two
        {"classes": np.array([f"c{i}" for i in range(9)] + ["c3"])},
        r"classes\[3\] and classes\[9\] are both 'c3': give each class a name of its own",
    ),
    "class-without-a-name": ({"classes": np.array([f"c{i}" for i in range(9)] + [" "])}, r"classes\[9\] is ' '"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_file_that_lies_is_refused_with_the_array_the_value_and_where(lie, tmp_path):
    changes, message = LIES[lie]
    path = npz(tmp_path, **changes)
    with pytest.raises(UsageError, match=f"data.path={path}: " + message):
        datasets.read(DataConfig(dataset="npz", path=path), CPU)


def test_labels_stored_as_whole_floats_are_class_indices(tmp_path):
    d = datasets.read(DataConfig(dataset="npz", path=npz(tmp_path, y_train=Y.astype(np.float32))), CPU)
    assert d.train.labels.dtype == torch.int64 and d.train.labels.tolist() == Y.tolist()


def test_the_test_split_alone_is_enough_for_evaluation(tmp_path):
    """A checkpoint's classes and statistics stand in for the training set."""
    path = npz(tmp_path, x_train=None, y_train=None, classes=None)
    test = datasets.read_test(DataConfig(dataset="npz", path=path), CPU, [f"c{i}" for i in range(10)])
    assert test.labels.tolist() == YT.tolist()
    with pytest.raises(UsageError, match=r"y_test\[\d+\] = \d, but there are 2 classes \(names given\)"):
        datasets.read_test(DataConfig(dataset="npz", path=path), CPU, ["a", "b"])
    with pytest.raises(UsageError, match="missing arrays x_train, y_train"):
        datasets.read(DataConfig(dataset="npz", path=path), CPU)


def test_real_cifar10_subset(subset):
    d = datasets.read(DataConfig(dataset="npz", path=str(subset)), CPU)
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

    d = datasets.read(DataConfig(dataset=kind, root=str(tmp_path), download=False), CPU)
    assert_same_images(d.train, x, y)
    assert_same_images(d.test, xt, yt)
    assert d.classes == names and d.num_classes == num_classes


def cifar10_copy(root: Path, monkeypatch) -> list[str]:
    """A small CIFAR-10 in torchvision's layout under root (one training batch), its md5 sums made torchvision's
    own; returns the class names."""
    x, y, xt, yt = arrays()
    folder, names = root / tv_datasets.CIFAR10.base_folder, [f"name{i}" for i in range(10)]
    folder.mkdir(parents=True)
    md5 = {f: _pickle(folder / f, {"data": a.transpose(0, 3, 1, 2).reshape(len(a), -1), "labels": [int(v) for v in b]})
           for f, (a, b) in {"data_batch_1": (x, y), "test_batch": (xt, yt)}.items()}  # fmt: skip
    monkeypatch.setattr(tv_datasets.CIFAR10, "train_list", [["data_batch_1", md5["data_batch_1"]]])
    monkeypatch.setattr(tv_datasets.CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
    meta = {
        "filename": "batches.meta",
        "key": "label_names",
        "md5": _pickle(folder / "batches.meta", {"label_names": names}),
    }
    monkeypatch.setattr(tv_datasets.CIFAR10, "meta", meta)
    return names


def test_a_cifar_copy_that_is_not_whole_says_what_is_wrong_and_what_brings_it(tmp_path, monkeypatch):
    """Each was "CIFAR-10 not found in data.root": a copy with a file altered and one missing, data.root naming
    cifar-10-batches-py/ itself, the archive not unpacked (data.download=true unpacks it: no download is made,
    the URL refuses), data.root naming the archive ("is a file, not a directory"), the archive cut short; a file
    this user may not read was a PermissionError traceback."""
    root, cls = tmp_path / "data", tv_datasets.CIFAR10
    names, folder, archive = cifar10_copy(root, monkeypatch), root / cls.base_folder, root / cls.filename
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    monkeypatch.setattr(cls, "tgz_md5", hashlib.md5(archive.read_bytes()).hexdigest())
    monkeypatch.setattr(cls, "url", "http://127.0.0.1:9/cifar-10-python.tar.gz")  # nothing listens: a download fails

    def refused(where: Path, message: str) -> None:
        with pytest.raises(cifar.DataMissing) as raised:
            datasets.read(DataConfig(root=str(where), download=False), CPU)
        assert str(raised.value) == message

    (folder / "data_batch_1").write_bytes((folder / "data_batch_1").read_bytes()[:-1])
    (folder / "test_batch").unlink()
    refused(root, f"CIFAR-10 in data.root={root} is incomplete or damaged: in cifar-10-batches-py/, data_batch_1, "
            "test_batch missing or not the files torchvision knows (by their md5); copy it again, or set "
            "data.download=true to fetch it")  # fmt: skip
    refused(folder, f"data.root={folder} is cifar-10-batches-py/ itself: name the directory that holds it, "
            f"data.root={root}")  # fmt: skip
    shutil.rmtree(folder)
    refused(root, f"data.root={root} holds cifar-10-python.tar.gz, not unpacked: tar xzf {archive} -C {root}, or set "
            "data.download=true (it unpacks it, without a download)")  # fmt: skip
    with pytest.raises(UsageError) as raised:  # make train DATA=the archive
        datasets.read(DataConfig(root=str(archive), download=False), CPU)
    assert str(raised.value) == (f"data.root={archive} is cifar-10-python.tar.gz itself: name the directory that "
                                 f"holds it, data.root={root}, and set data.download=true to unpack it "
                                 "there")  # fmt: skip
    assert datasets.read(DataConfig(root=str(root), download=True), CPU).classes == names
    shutil.rmtree(folder)
    archive.write_bytes(archive.read_bytes()[:100])
    refused(root, f"data.root={root} holds cifar-10-python.tar.gz, but not the whole archive (not the md5 torchvision "
            "knows): a download cut short? Set data.download=true to fetch it again, or copy it again")  # fmt: skip

    def unreadable(path, md5=None):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(tv_datasets.cifar, "check_integrity", unreadable)
    with pytest.raises(UsageError, match=f"^cannot read CIFAR-10 in data.root={root}: {root}/cifar-10-batches-py/"
                       r"data_batch_1 \(Permission denied\)$"):  # fmt: skip
        datasets.read(DataConfig(root=str(root), download=False), CPU)


@pytest.mark.parametrize("broken", ["missing", "built for another torch"])
def test_a_torchvision_that_does_not_import_is_one_line_for_cifar_and_resnet18(broken, tmp_path, monkeypatch):
    """PyPI's CUDA torchvision against a CPU torch fails in its import ("operator torchvision::nms does not
    exist"), and a venv may lack it: CIFAR and ResNet-18 (the default model) say so and what to install."""
    monkeypatch.delitem(sys.modules, "torchvision")
    if broken == "missing":
        monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision`: ModuleNotFoundError
    else:
        (tmp_path / "torchvision").mkdir()
        (tmp_path / "torchvision" / "__init__.py").write_text(
            'raise RuntimeError("operator torchvision::nms does not exist")'
        )
        monkeypatch.syspath_prepend(str(tmp_path))
    why = "ModuleNotFoundError: import of torchvision halted" if broken == "missing" else "RuntimeError: operator"
    for what, needs in [
        (lambda: datasets.read(DataConfig(dataset="cifar100", root=str(tmp_path)), CPU), "data.dataset=cifar100"),
        (lambda: models.build("resnet18", 10), "model.name=resnet18"),
    ]:
        with pytest.raises(UsageError, match=f"^{needs} needs torchvision, and it does not import \\({why}.*"
                           f"install the torchvision built for this torch {re.escape(torch.__version__)}"):  # fmt: skip
            what()


def test_two_runs_downloading_into_one_data_root_take_turns(tmp_path, monkeypatch, capsys):
    """torchvision writes the archive in place: two runs downloading into one data.root at once (the jobs of a
    sweep) wrote over each other's file. Now the second waits for the first and then finds the data (here two
    threads, each a run's local rank 0, and a download that takes 0.5 s)."""
    names = [f"name{i}" for i in range(10)]
    x, y, xt, yt = arrays()
    server = tmp_path / "server"
    server.mkdir()
    files = {"data_batch_1": (x, y), "test_batch": (xt, yt)}
    md5 = {f: _pickle(server / f, {"data": a.transpose(0, 3, 1, 2).reshape(len(a), -1), "labels": [int(v) for v in b]})
           for f, (a, b) in files.items()}  # fmt: skip
    md5["batches.meta"] = _pickle(server / "batches.meta", {"label_names": names})
    cls = tv_datasets.CIFAR10
    monkeypatch.setattr(cls, "train_list", [["data_batch_1", md5["data_batch_1"]]])
    monkeypatch.setattr(cls, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(cls, "meta", {"filename": "batches.meta", "key": "label_names", "md5": md5["batches.meta"]})
    downloading, most, calls = [0], [0], []

    def download(self):  # as torchvision's: nothing if the files are whole, else written in place, over some time
        if self._check_integrity():
            return
        downloading[0] += 1
        most[0] = max(most[0], downloading[0])
        calls.append(1)
        folder = Path(self.root) / cls.base_folder
        folder.mkdir(parents=True, exist_ok=True)
        time.sleep(0.5)
        for f in md5:
            (folder / f).write_bytes((server / f).read_bytes())
        downloading[0] -= 1

    monkeypatch.setattr(cls, "download", download)
    root, results = tmp_path / "data", []
    runs = [threading.Thread(target=lambda: results.append(datasets.read(DataConfig(root=str(root)), CPU)))
            for _ in range(2)]  # fmt: skip
    for run in runs:
        run.start()
    for run in runs:
        run.join(timeout=60)
    assert most[0] == 1 and len(calls) == 1, (most, calls)  # one download at a time, and the second not needed
    assert len(results) == 2 and all(r.classes == names and len(r.train.labels) == len(y) for r in results)
    assert f"waiting for another run's download of CIFAR-10 into data.root={root}" in capsys.readouterr().err


def test_cifar_download_failure_is_a_clear_error(tmp_path, monkeypatch):
    def offline(self):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(tv_datasets.CIFAR10, "download", offline)
    with pytest.raises(UsageError, match=f"could not download CIFAR-10 into data.root={tmp_path}.*offline?"):
        datasets.read(DataConfig(dataset="cifar10", root=str(tmp_path), download=True), CPU)
    # A damaged copy there (a file cut short, or missing) was said to be missing: "put the torchvision copy in it"
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"cut short")
    with pytest.raises(UsageError) as raised:
        datasets.read(DataConfig(dataset="cifar10", root=str(tmp_path), download=True), CPU)
    assert str(raised.value).endswith(f"offline? CIFAR-10 in data.root={tmp_path} is incomplete or damaged: in "
                                      "cifar-10-batches-py/, data_batch_1, data_batch_2, data_batch_3, data_batch_4, "
                                      "data_batch_5, test_batch, batches.meta missing or not the files torchvision "
                                      "knows (by their md5); copy it again"), raised.value  # fmt: skip


def test_a_download_that_stalls_fails_in_bounded_time(tmp_path, monkeypatch):
    """CIFAR's address accepts the connection and then sends nothing (a proxy or firewall that hangs): torchvision's
    request has no timeout, so local rank 0 waited for good. Now each connect and read waits DOWNLOAD_STALL_S
    (60 s; 0.5 here), and the run stops with the download's one line; the process's socket timeout is put back."""
    with socket.socket() as silent:  # listens (the kernel accepts) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setattr(tv_datasets.CIFAR10, "url", f"http://127.0.0.1:{silent.getsockname()[1]}/c.tar.gz")
        monkeypatch.setattr(cifar, "DOWNLOAD_STALL_S", 0.5)
        start = time.monotonic()
        with pytest.raises(UsageError, match=f"could not download CIFAR-10 into data.root={tmp_path} .*timed out"):
            datasets.read(DataConfig(dataset="cifar10", root=str(tmp_path), download=True), CPU)
    assert time.monotonic() - start < 10 and socket.getdefaulttimeout() is None


def test_a_machine_with_other_code_settings_or_data_stops_every_rank_before_training(tmp_path):
    """Two machines, each with its own checkout, command line and copy of the data at data.path (node-local disks):
    the second's has a line more in ddp/optim.py, optim.lr=0.2 typed there and one pixel of one image off. It
    trained its own way without a word; now every rank stops before the first step, exit 2, with all three. Two
    torchrun agents as two nodes; the second sees its own files (tmpfs and bind mounts of its own)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "true"]).returncode != 0:
        pytest.skip("needs `unshare --mount` (root, util-linux) to give one 'node' its own files")
    x, y, xt, yt = arrays()
    copy = tmp_path / "copy"
    copy.mkdir()
    np.savez(copy / "data.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    brighter = x.copy()
    brighter[7, 0, 0, 0] = brighter[7, 0, 0, 0] ^ 1  # one pixel of one image
    np.savez(tmp_path / "other.npz", x_train=brighter, y_train=y, x_test=xt, y_test=yt)
    code = tmp_path / "code"
    shutil.copytree(REPO / "ddp", code, ignore=shutil.ignore_patterns("__pycache__"))
    with open(code / "optim.py", "a") as f:
        f.write("# changed on this machine only\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    rdzv = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
    run = [str(TRAIN), f"run.out_dir={tmp_path / 'run'}", "data.dataset=npz", f"data.path={copy / 'data.npz'}",
           "data.workers=0", "model.name=small", "train.batch_size=20", "train.epochs=1"]  # fmt: skip
    torchrun = str(BIN / "torchrun")
    host = subprocess.Popen([torchrun, *rdzv, "--rdzv_conf=is_host=true", *run], cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    own = (f'mount -t tmpfs none "{copy}" && cp "{tmp_path / "other.npz"}" "{copy / "data.npz"}" && '
           f'mount --bind "{code}" "{REPO / "ddp"}" && exec "$@"')  # fmt: skip
    other = subprocess.run(["unshare", "--mount", "bash", "-c", own, "node1", torchrun, *rdzv,
                            "--rdzv_conf=is_host=false", *run, "optim.lr=0.2"], cwd=REPO, env=clean_env(),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    out, err = host.communicate(timeout=120)
    name = socket.gethostname()
    said = (f"error: rank 1 on {name} has other ddp-cifar code (ddp/optim.py); other settings (optim.lr=0.2 against "
            f"0.1); other data (data.path={copy / 'data.npz'}: other images or labels) than rank 0 on {name}: every "
            "machine must run the same checkout, settings and data")  # fmt: skip
    assert host.returncode != 0 and other.returncode != 0, out + err + other.stdout + other.stderr
    assert said in err and said in other.stderr, err + other.stderr
    assert not list((tmp_path / "run" / "checkpoints").glob("*.pt"))
