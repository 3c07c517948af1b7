"""DDP through the real torchrun on CPU with gloo: training, logs, checkpoints, resume, exactness."""

import json
import shutil

import pytest
import torch
from conftest import REPO, TINY, TRAIN, metrics, ok, python, torchrun

from ddp import config, datasets, loaders, models
from ddp.devices import World
from ddp.metrics import confusion_matrix


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """One 2-process DDP run of the tiny job, shared by the tests that read what it left."""
    out = tmp_path_factory.mktemp("ddp")
    proc = ok(torchrun(2, str(TRAIN), f"run.out_dir={out}", *TINY))
    return out, proc


def test_torchrun_trains_and_rank0_logs(ddp_run):
    out, proc = ddp_run
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == [1, 2]
    for r in rows:
        assert (r["world_size"], r["parallel"], r["device"], r["test_images"]) == (2, "ddp", "cpu", 101)
        assert {"train_loss", "test_acc", "per_class_acc", "images_per_s", "train_s", "seconds"} <= r.keys()
        assert len(r["per_class_acc"]) == 10 and r["images_per_s"] > 0
        assert 0 < r["train_s"] < r["seconds"]  # the training's seconds; the evaluation's come on top
        assert abs(r["images_per_s"] * r["train_s"] - 256) < 1e-6  # TINY's 256 images, over both ranks
    assert rows[-1]["test_acc"] > 0.5  # chance is 0.1
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert proc.stdout.count("epoch 2/2") == 1  # rank 0 alone prints
    assert config.load(str(out / "config.yaml")).run.out_dir == str(out)


def test_ddp_checkpoint_loads_on_cpu_into_a_plain_model(ddp_run):
    out, _ = ddp_run
    state = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert (state["epoch"], state["world_size"]) == (2, 2)
    assert {"optimizer", "scheduler", "config", "metrics", "versions"} <= state.keys()
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])
    model = models.build("small", 10)
    model.load_state_dict(state["model"])  # strict: every key matches a plain model
    # The plain model is the model the run evaluated: same accuracy, computed here in one process.
    cfg = config.load(str(out / "config.yaml"))
    cpu = World(0, 0, 1, torch.device("cpu"), "none")
    d = datasets.read(cfg.data, cpu)
    to_input = loaders.input_fn(d.mean, d.std, cpu.device, channels_last=False)
    confusion = confusion_matrix(model, loaders.eval_loader(d.test, 50, cpu, 0), to_input, 10, cpu, None)
    correct, total = confusion.diag(), confusion.sum(dim=1)
    assert correct.sum().item() / total.sum().item() == metrics(out)[-1]["test_acc"]


def test_a_second_run_resumes_at_the_next_epoch_in_another_world_size(ddp_run, tmp_path):
    out, _ = ddp_run
    shutil.copytree(out, tmp_path, dirs_exist_ok=True)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 3, "train_lo')  # a crash during the next epoch's log line
    proc = ok(python(str(TRAIN), f"run.out_dir={tmp_path}", *TINY, "train.epochs=3"))
    assert "2 epoch(s) + 0 step(s) done (global step 16); saved at world_size 2, now 1" in proc.stdout
    assert "epoch 1/3" not in proc.stdout and "epoch 3/3" in proc.stdout
    rows = metrics(tmp_path)
    assert [r["epoch"] for r in rows] == [1, 2, 3] and rows[2]["world_size"] == 1
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 3


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_evaluation_counts_each_image_once(ddp_run, world_size, tmp_path):
    out, _ = ddp_run
    data_args = [a for a in TINY if a.startswith(("data.", "model."))]
    result = tmp_path / "eval.json"
    ok(
        torchrun(
            world_size,
            str(REPO / "tests" / "eval_worker.py"),
            str(out / "checkpoints" / "last.pt"),
            str(result),
            *data_args,
        )
    )
    got = json.loads(result.read_text())
    cfg = config.load(None, data_args)
    labels = datasets.read(cfg.data, World(0, 0, 1, torch.device("cpu"), "none")).test.labels
    assert got["world_size"] == world_size
    assert got["total"] == torch.bincount(labels, minlength=10).tolist()  # 101 images, each once
    assert sum(got["correct"]) / 101 == metrics(out)[-1]["test_acc"]  # = the accuracy one run reported


def test_ddp_equals_one_process(tmp_path):
    """2 ranks x 16 images against 1 process x 32 for 16 steps: same weights. Deterministic setup:
    no BatchNorm (tutorial net), no augmentation, the same sampler permutation."""
    args = [
        "data.dataset=synthetic", "data.synthetic_train=256", "data.synthetic_test=16", "data.workers=0",
        "data.augment=false", "model.name=tutorial", "train.batch_size=32", "train.epochs=2",
        "optim.lr=0.05", "optim.warmup_epochs=0",
    ]  # fmt: skip
    ok(torchrun(2, str(TRAIN), f"run.out_dir={tmp_path / 'ddp'}", *args))
    ok(python(str(TRAIN), f"run.out_dir={tmp_path / 'one'}", *args))
    ddp = torch.load(tmp_path / "ddp" / "checkpoints" / "last.pt", weights_only=True)["model"]
    one = torch.load(tmp_path / "one" / "checkpoints" / "last.pt", weights_only=True)["model"]
    torch.manual_seed(0)
    init = models.build("tutorial", 10).state_dict()  # what both started from (run.seed=0)
    for key in one:
        assert (ddp[key] - one[key]).abs().max().item() <= 1e-6, key
    assert max((one[k] - init[k]).abs().max().item() for k in one) > 1e-2  # and training did move them


def test_a_failure_on_rank_0_after_the_rendezvous_stops_every_rank(tmp_path):
    """out_dir is a path under a file: rank 0 cannot write, the other rank must not wait for it."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = torchrun(2, str(TRAIN), f"run.out_dir={blocker / 'run'}", *TINY, "run.timeout_s=60", timeout=120)
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if line.startswith("error: cannot write to run.out_dir")]
    assert len(said) == 1  # rank 0 says why; both exit 2 (torchrun's box repeats it as the root cause)
    assert "exitcode  : 2" in proc.stderr
    assert f'File "{REPO / "ddp"}' not in proc.stderr  # torchrun prints its own traceback; none is ours


def test_the_process_group_is_gone_when_training_returns(tmp_path):
    """No gloo thread survives main: a group kept alive past destroy_process_group (e.g. by importing
    torch._dynamo while it exists) lets its threads race the interpreter's exit and abort it."""
    ok(torchrun(2, str(REPO / "tests" / "group_worker.py"), str(tmp_path), *TINY, "train.epochs=1"))
    for rank in (0, 1):
        threads = json.loads((tmp_path / f"threads-{rank}.json").read_text())
        assert not [t for t in threads if t.startswith(("pt_gloo", "gloo"))], (rank, threads)
