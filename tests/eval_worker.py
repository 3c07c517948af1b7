"""Evaluates a checkpoint on the synthetic test set with however many ranks torchrun starts.

    torchrun --standalone --nproc_per_node=W tests/eval_worker.py CHECKPOINT OUT.json [overrides]

Rank 0 writes the summed per-class (correct, total). Used by test_ddp to check that evaluation is
exact for world sizes that do not divide the test set."""

import json
import sys

from ddp import checkpoint, config, datasets, devices, distributed, loaders, metrics, models


def evaluate(path: str, out: str, overrides: list[str]) -> None:
    """All DDP objects live in here, so they are freed before the process group is destroyed
    (gloo objects that outlive it abort the process at interpreter exit)."""
    cfg = config.load(None, overrides)
    world = devices.resolve(cfg.run)
    with distributed.setup(world, timeout_s=60) as world:
        data = datasets.read(cfg.data, world)
        model = models.build(cfg.model.name, data.num_classes)
        model.load_state_dict(checkpoint.load(path)["model"])
        wrapped = distributed.wrap(model, world, cfg.ddp)
        loader = loaders.eval_loader(data.test, 16, world, workers=0)
        to_input = loaders.input_fn(data.mean, data.std, world.device, channels_last=False)
        module = distributed.for_eval(wrapped)
        confusion = metrics.confusion_matrix(module, loader, to_input, data.num_classes, world, None)
        correct, total = confusion.diag(), confusion.sum(dim=1)
        if world.is_main:
            with open(out, "w") as f:
                json.dump({"correct": correct.tolist(), "total": total.tolist(), "world_size": world.world_size}, f)
        del wrapped


if __name__ == "__main__":
    evaluate(sys.argv[1], sys.argv[2], sys.argv[3:])
