"""Datasets (cifar10/cifar100 through torchvision, an .npz file, synthetic), read once into one form,
uint8 images (N, 3, 32, 32) and int64 labels with class names, and checked on the way in: a file that
lies is a UsageError naming the array, the value and its index. CIFAR in data.root: ddp/cifar.py.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import math
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddp import cifar, files
from ddp.config import DataConfig
from ddp.devices import World
from ddp.errors import UsageError, first_line, out_of_memory

CHUNK = 4096  # images counted (statistics) or drawn (synthetic) at a time: 12 MB of uint8, 100 MB of int64


@dataclass
class Split:
    images: torch.Tensor  # (N, 3, 32, 32) uint8, CHW
    labels: torch.Tensor  # (N,) int64


@dataclass
class Data:
    train: Split
    test: Split
    classes: list[str]
    mean: tuple[float, float, float]  # per channel, of the train split, on the 0..1 scale
    std: tuple[float, float, float]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @functools.cached_property
    def digest(self) -> tuple[int, int, str]:
        """(training images, test images, a digest of the classes, the labels and each image): exact integers, so
        alike on any machine. Each image's 3,072 bytes as 384 int64, summed (wrapping): 40 ms for CIFAR-10 (1 s as
        a sum of its uint8). Once a run: the ranks compare it (alike), a checkpoint keeps it."""
        splits = (self.train, self.test)
        words = [s.images.reshape(len(s.images), -1).view(torch.int64) for s in splits]
        labels = [s.labels.numpy().tobytes() for s in splits]
        found = [self.classes, *labels, *(w.sum(1).numpy().tobytes() for w in words)]
        return len(self.train.labels), len(self.test.labels), hashlib.sha256(repr(found).encode()).hexdigest()


def _split(images_hwc: np.ndarray, labels: np.ndarray) -> Split:
    images = torch.from_numpy(np.ascontiguousarray(images_hwc)).permute(0, 3, 1, 2).contiguous()
    return Split(images, torch.as_tensor(np.asarray(labels), dtype=torch.int64))


def _check_names(names: list[str], path: str) -> None:
    """Each class a name of its own: the per-class table, the charts and TensorBoard tell the classes by name (two
    "cat" rows, one chart of the two), and a blank name is no row at all."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if not name.strip():
            raise UsageError(f"data.path={path}: classes[{i}] is {name!r}, no name: give each class one")
        if name in seen:
            raise UsageError(f"data.path={path}: classes[{seen[name]}] and classes[{i}] are both {name!r}: give "
                             "each class a name of its own")  # fmt: skip
        seen[name] = i


def _npz(cfg: DataConfig, parts: tuple[str, ...]) -> dict[str, Split | list[str] | None]:
    """The splits `parts` of data.path and its `classes` (None when the file has none), checked."""
    if not cfg.path:
        raise UsageError("data.dataset=npz needs data.path=FILE.npz (x_train, y_train, x_test, y_test)")
    path = Path(cfg.path)
    if path.is_dir():
        raise UsageError(f"data.path={cfg.path} is a directory: name the .npz file")
    if not path.is_file():
        odd = "not a regular file (a pipe or a device: every rank and the launch file's check read it; save it to one)"
        link = f" ({to_nothing})" if (to_nothing := files.link_to_nothing(path)) else ""
        raise UsageError(f"data.path={cfg.path}: " + (odd if files.existing(path) else f"no such file{link}"))
    try:
        path.open("rb").close()  # else zipfile.is_zipfile says False for a file it may not read
    except OSError as e:
        raise UsageError(f"data.path={cfg.path}: cannot read it ({e.strerror})") from None
    if not zipfile.is_zipfile(path):  # np.load would take a .npy, and a zip cut short is a BadZipFile traceback
        raise UsageError(f"data.path={cfg.path}: not an .npz file (np.savez's zip of arrays): a .npy, or cut short?")
    wanted = [f"{xy}_{part}" for part in parts for xy in "xy"]
    try:  # only the arrays asked for: evaluating reads no training images
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in wanted if k not in z.files]
            arrays = {k: z[k] for k in [*wanted, "classes"] if k in z.files and not missing}
    except Exception as e:  # a damaged array in it, or Python objects: whatever it holds, it is not readable data
        raise UsageError(f"data.path={cfg.path}: not a readable .npz file ({first_line(e, typed=True)})") from None
    if missing:
        raise UsageError(f"data.path={cfg.path}: missing arrays {', '.join(missing)}")
    found: dict[str, Split | list[str] | None] = {"classes": None}
    if "classes" in arrays:
        if arrays["classes"].ndim != 1:
            raise UsageError(
                f"data.path={cfg.path}: classes must be a list of names, got shape {arrays['classes'].shape}"
            )
        names = arrays["classes"]  # bytes (np.array([b"cat", ...]), an HDF5 file's strings): their text, not "b'cat'"
        found["classes"] = [c.decode(errors="replace") if isinstance(c, bytes) else str(c) for c in names]
        _check_names(found["classes"], cfg.path)
    for part in parts:
        x, y = arrays[f"x_{part}"], arrays[f"y_{part}"]
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != (32, 32, 3):
            raise UsageError(f"data.path={cfg.path}: x_{part} must be uint8 (N, 32, 32, 3), got {x.dtype} {x.shape}"
                             f"{_layout_fix(x)}")  # fmt: skip
        if y.ndim != 1 or len(y) != len(x):
            one_hot = y.ndim == 2 and len(y) == len(x) and y.shape[1] > 1  # (N, classes): a row a label
            raise UsageError(
                f"data.path={cfg.path}: y_{part} has shape {y.shape} but x_{part} holds {len(x)} images: "
                "one label per image, (N,)" + ("; one-hot rows (or scores): y.argmax(axis=1)" if one_hot else "")
            )
        if len(x) == 0:
            raise UsageError(f"data.path={cfg.path}: x_{part} and y_{part} are empty: the {part} split has no images")
        found[part] = _split(x, _class_indices(cfg.path, f"y_{part}", y))
    return found


def _layout_fix(x: np.ndarray) -> str:
    """For images in another common layout: how to write them as this loader reads them ("" for none)."""
    fixes, values = [], x[np.isfinite(x)] if x.dtype.kind == "f" else x
    if x.ndim == 4 and x.shape[1] in (1, 3) and x.shape[2:] == (32, 32):
        fixes.append("channels first: x.transpose(0, 2, 3, 1)")
    if x.ndim == 3 and x.shape[1:] == (32, 32):
        fixes.append("one channel: np.repeat(x[..., None], 3, axis=3)")
    if values.size and x.dtype.kind == "f" and values.min() >= 0 and values.max() <= 1:
        fixes.append("floats in [0, 1]: (x * 255).round().astype(np.uint8)")
    elif values.size and x.dtype.kind in "fiu" and x.dtype != np.uint8 and values.min() >= 0 and values.max() <= 255:
        fixes.append("values 0-255: x.astype(np.uint8)")
    return "; " + " and ".join(fixes) if fixes else ""


def _class_indices(path: str, name: str, y: np.ndarray) -> np.ndarray:
    """Labels as int64, refused unless every one is a whole number (3.0 is 3; 2.5 and NaN are not) that
    int64 holds (a uint64 or float past it would wrap, and the error name a number the file lacks)."""
    if y.dtype.kind in "ib":
        return y.astype(np.int64)  # int64 holds every signed integer and bool
    if y.dtype.kind not in "uf":
        raise UsageError(f"data.path={path}: {name} must hold class indices (integers), not {y.dtype}")
    bad = np.flatnonzero(~np.isfinite(y) | (y != np.round(y)))  # none in unsigned integers
    if len(bad):
        raise UsageError(
            f"data.path={path}: {name}[{bad[0]}] = {y[bad[0]].item()!r} is not a class index (a whole number)"
        )
    huge = np.flatnonzero(np.abs(y) > 2**62)  # past any class count, in int64
    if len(huge):
        raise UsageError(f"data.path={path}: {name}[{huge[0]}] = {y[huge[0]].item()!r} is not a class index")
    return y.astype(np.int64)


def check_labels(where: str, name: str, labels: torch.Tensor, count: int, named: bool) -> None:
    """Every label a class index: 0 <= label < count. `named`: the count is that of the class names that came
    with the data (or the checkpoint), not counted from the labels."""
    bad = torch.nonzero((labels < 0) | (labels >= count)).flatten()
    if len(bad):
        i = int(bad[0])
        what = f"{count} classes" + (" (names given)" if named else "")
        raise UsageError(f"{where}: {name}[{i}] = {int(labels[i])}, but there are {what}: labels are 0..{count - 1}")


def check_counted_classes(where: str, train: Split, test: Split, count: int) -> None:
    """Without a `classes` array the class count is the largest label + 1; a class in between that
    no training image has means that largest label is a lie (one stray 12 among 0..9), not a class. The first
    six missing only: a label of 2**40 had a list of as many classes made (killed for memory)."""
    present = set(train.labels.unique().tolist())
    missing = list(itertools.islice((c for c in range(count) if c not in present), 6))
    if missing:
        name, labels = ("y_train", train.labels) if int(train.labels.max()) == count - 1 else ("y_test", test.labels)
        i = int(torch.nonzero(labels == count - 1).flatten()[0])
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise UsageError(
            f"{where}: {name}[{i}] = {count - 1}, but no training image has class {shown}: without a `classes` "
            f"array the class count is the largest label + 1 ({count}); fix the label, or add `classes` to the file"
        )


def _synthetic(cfg: DataConfig) -> tuple[Split, Split, list[str]]:
    """Learnable noise: each class has its own colour, each image is that colour plus as much
    uniform per-pixel noise. Fixed seed: every rank and run sees the same images, whatever run.seed."""
    g = torch.Generator().manual_seed(1234)
    num_classes = cfg.synthetic_classes
    colours = torch.randint(0, 256, (num_classes, 3, 1, 1), generator=g)

    def make(n: int) -> Split:
        images = torch.empty(n, 3, 32, 32, dtype=torch.uint8)  # first: too many fail here, before any draw
        labels = torch.randint(0, num_classes, (n,), generator=g)
        for part, some in zip(images.split(CHUNK), labels.split(CHUNK)):  # int64 noise a part at a time (was 8
            noise = torch.randint(0, 256, part.shape, generator=g)  # bytes a pixel at once): the same draws, in order
            part.copy_((colours[some] + noise) // 2)
        return Split(images, labels)

    train, test = make(cfg.synthetic_train), make(cfg.synthetic_test)
    return train, test, [f"class{i}" for i in range(num_classes)]


def _torchvision(cfg: DataConfig, world: World) -> tuple[Split, Split, list[str]]:
    """CIFAR-10/100 from data.root (ddp/cifar.py: found, downloaded, waited for), in this module's form."""
    (train_images, train_labels), (test_images, test_labels), classes = cifar.read(cfg, world)
    return _split(train_images, train_labels), _split(test_images, test_labels), classes


def _read_parts(cfg: DataConfig, world: World, parts: tuple[str, ...]) -> tuple[Split | None, Split, list[str] | None]:
    """(train or None, test, class names or None when the data has none)."""
    with _in_memory(_where(cfg)):
        if cfg.dataset == "npz":
            found = _npz(cfg, parts)
            return found.get("train"), found["test"], found["classes"]
        return _synthetic(cfg) if cfg.dataset == "synthetic" else _torchvision(cfg, world)


@contextlib.contextmanager
def _in_memory(where: str) -> Iterator[None]:
    """Data too large for this machine's memory (data.synthetic_train=1e8, a huge .npz): one line that says
    so, not out of memory's advice for a training step (a smaller train.batch_size)."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        raise UsageError(f"{where}: the data does not fit in this machine's memory ({first_line(e)})") from None


def _where(cfg: DataConfig) -> str:
    return f"data.path={cfg.path}" if cfg.dataset == "npz" else f"data.dataset={cfg.dataset}"


def read(cfg: DataConfig, world: World) -> Data:
    """The training and test splits, checked, with the training split's per-channel statistics."""
    train, test, classes = _read_parts(cfg, world, ("train", "test"))
    for name, split in (("train", train), ("test", test)):
        if len(split.labels) == 0:
            raise UsageError(f"{_where(cfg)}: the {name} split is empty")
    named = classes is not None
    count = len(classes) if classes is not None else int(max(train.labels.max(), test.labels.max())) + 1
    for name, split in (("train", train), ("test", test)):  # a negative label first: it is no count's fault
        check_labels(_where(cfg), f"y_{name}", split.labels, count, named)
    present = train.labels.unique()
    if len(present) < 2:  # a loss of 0 from the first step: nothing is learned
        only = classes[int(present[0])] if classes is not None else str(int(present[0]))
        raise UsageError(f"{_where(cfg)}: every training image is of class {only!r}: a classifier "
                         "learns from two classes or more")  # fmt: skip
    if classes is None:  # class indices 0..the largest label, each in the training split
        check_counted_classes(_where(cfg), train, test, count)
        classes = [str(i) for i in range(count)]
    mean, std = channel_statistics(_where(cfg), train.images)
    return Data(train, test, classes, mean, std)


def channel_statistics(where: str, images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each channel's mean and standard deviation over uint8 `images` (N, C, H, W), in [0, 1], from each channel's
    count of each of the 256 values: exact integer sums, and a few MB at a time where the images as float64 were 8
    bytes a pixel (1.2 GB for CIFAR-10's 50,000, on every rank at once). A channel of one value (a grey image's
    unused colour) is centred, not divided by its std of 0 (every input NaN, the loss too: "training diverged");
    training images of one value in every channel are an error: nothing to learn."""
    counts = torch.zeros(images.shape[1], 256, dtype=torch.int64)
    for chunk in images.split(CHUNK):
        for c, channel in enumerate(chunk.unbind(1)):
            counts[c] += torch.bincount(channel.reshape(-1), minlength=256)
    values = torch.arange(256)
    n = len(images) * images[0, 0].numel()  # pixels a channel
    sums, squares = (counts * values).sum(1).tolist(), (counts * values * values).sum(1).tolist()
    mean = tuple(s / (n * 255) for s in sums)
    std = tuple(math.sqrt((n * q - s * s) / (n * (n - 1))) / 255 for s, q in zip(sums, squares))  # unbiased
    if not any(s > 0 for s in std):
        colour = ", ".join(f"{m * 255:.0f}" for m in mean)
        raise UsageError(f"{where}: every pixel of every training image is the same colour ({colour}): nothing to "
                         "learn from; was the file written right?")  # fmt: skip
    return mean, tuple(s if s > 0 else 1.0 for s in std)


def _some(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _unlike(data: list[str], model: list[str]) -> str:
    """Where the data's class names and the model's part: their counts, or the first class that differs."""
    if len(data) != len(model):
        return f"{len(data)} classes ({_some(data)}), the model {len(model)} ({_some(model)})"
    i = next(i for i, (ours, theirs) in enumerate(zip(data, model)) if ours != theirs)
    return f"class {i} {data[i]!r}, the model {model[i]!r} ({_some(data)}; the model {_some(model)})"


def read_test(cfg: DataConfig, world: World, classes: list[str]) -> Split:
    """The test split alone, its labels checked against a trained model's classes: evaluating a
    checkpoint needs no training images (their statistics are in the checkpoint)."""
    if (count := cifar.CLASS_COUNTS.get(cfg.dataset, len(classes))) != len(classes):  # before a download of it
        raise UsageError(f"{_where(cfg)} has {count} classes, the model {len(classes)} ({_some(classes)}): a label "
                         "would mean another class; evaluate on data of the model's classes, in its order")  # fmt: skip
    _, test, named = _read_parts(cfg, world, ("test",))
    if len(test.labels) == 0:
        raise UsageError(f"{_where(cfg)}: the test split is empty")
    if named and classes != named and classes != [str(i) for i in range(len(classes))]:  # both have names
        raise UsageError(
            f"{_where(cfg)} names {_unlike(named, classes)}: a label would mean another class; evaluate on data of "
            "the model's classes, in its order"
        )
    check_labels(_where(cfg), "y_test", test.labels, len(classes), named=True)
    return test
