"""torchrun --standalone --nproc_per_node=2 tests/model_worker.py OUT.json

Each model added with the recipe toolbox, built for 100 classes with dropout, wrapped by
distributed.wrap and trained one SGD step on 2 different images per rank; rank 0 writes, per model,
the logits' shape, whether the ranks' weights are equal after the step, and whether they changed."""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from ddp import config, devices, distributed, models


def main(out: str) -> None:
    cfg = config.load(None, [])
    world = devices.resolve(cfg.run)
    report = {}
    with distributed.setup(world, timeout_s=120) as world:
        for name in ("preact_resnet18", "wrn16_8", "wrn28_10"):
            torch.manual_seed(0)  # the same initial weights on every rank
            model = models.build(name, 100, dropout=0.3)
            before = [p.detach().clone() for p in model.parameters()]
            wrapped = distributed.wrap(model, world, cfg.ddp)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(world.rank))  # per rank
            logits = wrapped(x)
            nn.functional.cross_entropy(logits, torch.tensor([world.rank, 99])).backward()
            optimizer.step()
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            every = [torch.empty_like(flat) for _ in range(world.world_size)]
            dist.all_gather(every, flat)
            changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            report[name] = {
                "logits": list(logits.shape),
                "replicas_equal": all(torch.equal(every[0], t) for t in every),
                "changed": changed,
            }
            del wrapped
        if world.is_main:
            with open(out, "w") as f:
                json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
