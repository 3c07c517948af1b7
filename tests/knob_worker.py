"""What the `ddp:` settings and gradient accumulation make DDP do, seen from inside a real torchrun job.

torchrun --standalone --nproc_per_node=2 tests/knob_worker.py OUT.json [PROBES]
    PROBES: a JSON object, {name: [section.key=value, ...]}, else PROBES below (tests/test_ddp_knobs.py's, and
    bench/group_exits.py's). For each probe in turn, in the one
    process group: two optimizer steps of a new small net, wrapped by distributed.wrap with that
    probe's ddp: settings and run in its train.grad_accum_steps micro-batches
    (distributed.micro_batches); rank 0 writes what happened (buckets, all-reduces per step,
    gradient dtype and storage, buffers) to OUT.json, {name: report}. One job for every probe: with
    a torchrun launch per probe, tests/test_ddp_knobs.py took 51-54 s on the 2-core test machine,
    26-27 s so.
torchrun --standalone --nproc_per_node=2 tests/knob_worker.py --unused-parameter [ddp/train.py arguments]
    ddp/train.py itself, with model.name=tutorial replaced by a net that has a layer it never uses.
"""

import hashlib
import json
import sys

import torch
from torch import nn

from ddp import cli, config, devices, distributed, models, train

# Every probe in one torchrun job: each builds and wraps its own net.
PROBES = {
    "default": [],
    "torch's reducer": ["ddp.comm_hook=none"],
    "small buckets": ["ddp.bucket_cap_mb=0.05", "ddp.gradient_as_bucket_view=false", "ddp.broadcast_buffers=false"],
    "accum 2": ["train.grad_accum_steps=2"],
    "accum 4": ["train.grad_accum_steps=4"],
    "fp16": ["ddp.comm_hook=fp16"],
    "bf16": ["ddp.comm_hook=bf16"],
}


def probe(out: str, probes: dict[str, list[str]]) -> None:
    configs = {name: config.load(None, overrides) for name, overrides in probes.items()}
    world = devices.resolve(config.load(None, []).run)
    with distributed.setup(world, timeout_s=60) as world:
        report = {name: run_steps(cfg, world) for name, cfg in configs.items()}
        if world.is_main:
            with open(out, "w") as f:
                json.dump(report, f)


def run_steps(cfg, world) -> dict:
    torch.manual_seed(0)
    model = models.build("small", 10)
    wrapped = distributed.wrap(model, world, cfg.ddp)
    bn = model[0][1]
    bn.running_mean.fill_(float(world.rank))  # rank-local buffers: does DDP make them rank 0's?
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accum = cfg.train.grad_accum_steps
    x = torch.randn(8 * accum, 3, 32, 32, generator=torch.Generator().manual_seed(1))  # the same on every rank
    y = torch.arange(8 * accum) % 10
    per_step = []
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace:  # counts them
            for micro, xs, ys in zip(distributed.micro_batches(wrapped, accum), x.chunk(accum), y.chunk(accum)):
                with micro:
                    nn.functional.cross_entropy(wrapped(xs), ys).backward()
        # the dispatcher's op, on this thread: gloo's own event, on its worker thread, was missing from the last
        # step's trace with torch 2.11, and from every one of torch's own reducer with 2.4
        per_step.append(sum(e.name == "c10d::allreduce_" for e in trace.events()))
        grads = [p.grad for p in model.parameters()]
        optimizer.step()
    info = wrapped._get_ddp_logging_data()
    report = {
        "allreduces_per_step": per_step,
        "bucket_sizes": [int(s) for s in str(info.get("rebuilt_bucket_sizes") or info["bucket_sizes"]).split(",")],
        "grads_are_bucket_views": all(g._is_view() for g in grads),
        "grads_sha256": hashlib.sha256(torch.cat([g.flatten() for g in grads]).numpy().tobytes()).hexdigest(),
        "comm_hook": str(info.get("comm_hook", "")),
        "grads_fp16_exact": all(bool((g == g.half().float()).all()) for g in grads),
        "grads_bf16_exact": all(bool((g == g.bfloat16().float()).all()) for g in grads),
        "running_means": distributed.gather_objects(bn.running_mean[0].item(), world),
        "static_graph": bool(wrapped.static_graph),
    }
    del wrapped
    return report


class WithUnusedLayer(models.TutorialNet):
    def __init__(self, num_classes: int = 10, dropout: float = 0.0):
        super().__init__(num_classes, dropout)
        self.never_used = nn.Linear(4, 4)


if __name__ == "__main__":
    if sys.argv[1] == "--unused-parameter":
        models.MODELS["tutorial"] = WithUnusedLayer
        cli.leave(train.cli(sys.argv[2:]))
    probe(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else PROBES)
    cli.leave(0)  # as ddp/train.py exits
