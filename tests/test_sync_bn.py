"""ddp/sync_bn.py: GlooSyncBatchNorm on N gloo ranks computes what one nn.BatchNorm computes on the
whole batch (outputs, every gradient, running statistics), and keeps BatchNorm's checkpoint keys.
The end-to-end equivalence under torchrun is in tests/test_equivalence.py."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ddp import devices, distributed, models, sync_bn

SHAPE = (12, 3, 5, 4)  # N, C, H, W
# The ranks are forked from one server process that imported torch and ddp once: spawned, each
# imported them itself (about 2 s of CPU each on the 2-core test machine, 15 of them). The server
# runs no torch code and never initialises CUDA, so a fork may (the GPU test has not yet run so on a
# GPU). Not this module: the server does not get pytest's sys.path; each rank imports it, torch loaded.
mp.set_forkserver_preload(["torch", "torch.distributed", "ddp.devices", "ddp.distributed", "ddp.models", "ddp.sync_bn"])


def spawn(worker, *args, nprocs: int, within_s: float = 120.0) -> None:
    """The ranks run to their end, or fail the test after within_s: a rank that hung was waited for without end."""
    ranks = mp.start_processes(worker, args=args, nprocs=nprocs, start_method="forkserver", join=False)
    deadline = time.monotonic() + within_s
    while not ranks.join(timeout=1.0):
        if time.monotonic() > deadline:
            hung = [p.pid for p in ranks.processes if p.is_alive()]
            for p in ranks.processes:
                p.kill()
            pytest.fail(f"ranks {hung} still ran after {within_s:.0f} s (killed)")


def leave_group() -> None:
    """dist.destroy_process_group, as ddp/distributed.py leaves: after GLOO_PAUSE_S on a torch before 2.8, whose gloo
    could deadlock there (a rank of this module hung 10 minutes in it under torch 2.4.1, the suite waiting on it)."""
    time.sleep(distributed.GLOO_PAUSE_S)
    dist.destroy_process_group()


def full_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=g) * 3 + 1
    probe = torch.randn(SHAPE, generator=g)  # loss = sum(y * probe): every output element matters
    return x, probe


def reference(momentum):
    """One process, one nn.BatchNorm2d, the whole batch, two steps (the running stats move twice)."""
    torch.manual_seed(1)
    bn = nn.BatchNorm2d(SHAPE[1], momentum=momentum)
    nn.init.normal_(bn.weight)
    nn.init.normal_(bn.bias)
    x, probe = full_batch()
    x.requires_grad_(True)
    for _ in range(2):
        y = bn(x)
    (y * probe).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": bn.weight.grad, "db": bn.bias.grad, **bn.state_dict()}


def rank_worker(rank, world_size, init_file, sizes, momentum, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(1)
        bn = nn.BatchNorm2d(SHAPE[1], momentum=momentum)
        nn.init.normal_(bn.weight)
        nn.init.normal_(bn.bias)
        model = sync_bn.convert(nn.Sequential(bn), torch.device("cpu"))
        assert isinstance(model[0], sync_bn.GlooSyncBatchNorm) and model[0].weight is bn.weight
        x, probe = full_batch()
        start = sum(sizes[:rank])
        x = x[start : start + sizes[rank]].clone().requires_grad_(True)
        for _ in range(2):
            y = model(x)
        (y * probe[start : start + sizes[rank]]).sum().backward()
        grads = torch.cat([bn.weight.grad, bn.bias.grad])
        dist.all_reduce(grads)  # the parameters' gradients summed over ranks, as DDP would
        dw, db = grads.split(SHAPE[1])
        torch.save({"y": y.detach(), "dx": x.grad, "dw": dw, "db": db, **model[0].state_dict()}, f"{out}/{rank}.pt")
    finally:
        leave_group()


@pytest.mark.parametrize(
    "sizes, momentum",
    [((6, 6), 0.1), ((5, 7), 0.1), ((1, 4, 7), None)],
    ids=["even", "uneven", "3-ranks-cumulative-average"],
)
def test_n_ranks_compute_what_one_batchnorm_computes_on_the_whole_batch(sizes, momentum, tmp_path):
    spawn(rank_worker, len(sizes), tmp_path / "init", sizes, momentum, tmp_path, nprocs=len(sizes))
    want = reference(momentum)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(len(sizes))]
    for key in ("y", "dx"):
        torch.testing.assert_close(torch.cat([r[key] for r in ranks]), want[key], rtol=1e-5, atol=1e-5)
    for r in ranks:
        for key in ("dw", "db", "running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(r[key], want[key], rtol=1e-5, atol=1e-5, msg=key)


def test_outside_a_process_group_and_in_eval_mode_it_is_plain_batchnorm():
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(3)
    synced = sync_bn.convert(nn.Sequential(nn.BatchNorm2d(3)), torch.device("cpu"))
    synced.load_state_dict(nn.Sequential(plain).state_dict())
    x = torch.randn(SHAPE)
    torch.testing.assert_close(synced(x), plain(x), rtol=0, atol=0)
    synced.eval(), plain.eval()
    torch.testing.assert_close(synced(x), plain(x), rtol=0, atol=0)


def test_the_checkpoint_keys_are_batchnorms_so_it_loads_into_the_plain_model():
    plain = models.build("small", 10)
    synced = sync_bn.convert(models.build("small", 10), torch.device("cpu"))
    assert any(isinstance(m, sync_bn.GlooSyncBatchNorm) for m in synced.modules())
    assert not any(isinstance(m, sync_bn.GlooSyncBatchNorm) for m in plain.modules())
    plain.load_state_dict(synced.state_dict(), strict=True)
    assert synced.state_dict().keys() == plain.state_dict().keys()


def gpu_worker(rank, world_size, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        x, probe = full_batch()
        half = SHAPE[0] // world_size
        part = slice(rank * half, (rank + 1) * half)
        results = {}
        for name, device in (("gloo", "cpu"), ("torch", "cuda")):
            torch.manual_seed(1)
            model = sync_bn.convert(nn.Sequential(nn.BatchNorm2d(SHAPE[1])), torch.device(device)).to(device)
            xi = x[part].clone().to(device).requires_grad_(True)
            y = model(xi)
            (y * probe[part].to(device)).sum().backward()
            results[name] = {
                "y": y.detach().cpu(),
                "dx": xi.grad.cpu(),
                **{k: v.cpu() for k, v in model.state_dict().items()},
            }
        torch.save(results, f"{out}/{rank}.pt")
    finally:
        leave_group()


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch's nn.SyncBatchNorm refuses CPU tensors"
)
def test_gloo_sync_batchnorm_matches_torchs_sync_batchnorm_on_a_gpu(tmp_path):
    """Two ranks on one GPU, over gloo (which, unlike nccl, lets two ranks share it)."""
    spawn(gpu_worker, 2, tmp_path / "init", tmp_path, nprocs=2)
    for rank in range(2):
        r = torch.load(tmp_path / f"{rank}.pt")
        for key in r["gloo"]:
            torch.testing.assert_close(r["gloo"][key], r["torch"][key], rtol=1e-4, atol=1e-5, msg=key)


def ddp_worker(rank, world_size, init_file, model_name, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = sync_bn.convert(models.build(model_name, 10).double(), torch.device("cpu"))
        wrapped = nn.parallel.DistributedDataParallel(model)
        x, y = float64_batch()
        part = slice(rank * 16 // world_size, (rank + 1) * 16 // world_size)
        nn.functional.cross_entropy(wrapped(x[part]), y[part]).backward()  # DDP averages the ranks' gradients
        if rank == 0:
            torch.save(
                {f"grad of {n}": p.grad for n, p in model.named_parameters()} | model.state_dict(), f"{out}/ddp.pt"
            )
        del wrapped
    finally:
        leave_group()


def float64_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 10, (16,), generator=g)


@pytest.mark.parametrize("model_name", ["small", "resnet18"])
def test_in_float64_a_ddp_step_with_sync_bn_is_the_one_process_step(model_name, tmp_path):
    """The whole net, through DDP: gradients and running statistics of 2 ranks equal one process's
    to float64 rounding (~1e-14), so the float32 differences of tests/test_equivalence.py are
    rounding, not a different computation."""
    torch.manual_seed(0)
    model = models.build(model_name, 10).double()
    x, y = float64_batch()
    nn.functional.cross_entropy(model(x), y).backward()
    want = {f"grad of {n}": p.grad for n, p in model.named_parameters()} | model.state_dict()
    spawn(ddp_worker, 2, tmp_path / "init", model_name, tmp_path, nprocs=2)
    got = torch.load(tmp_path / "ddp.pt")
    worst = max(
        ((got[k] - v).abs().max() / (1 + v.abs().max())).item() for k, v in want.items() if v.is_floating_point()
    )
    assert worst < 1e-12, worst


def buffers_worker(rank, world_size, init_file, how, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        bn = nn.BatchNorm2d(2)
        bn.running_mean.fill_(float(rank))
        bn.running_var.fill_(float(rank + 1))
        bn.num_batches_tracked.fill_(10 * rank)
        world = devices.World(rank, rank, world_size, torch.device("cpu"), "ddp")
        distributed.sync_buffers(bn, world, how)
        torch.save(bn.state_dict(), f"{out}/{rank}.pt")
    finally:
        leave_group()


@pytest.mark.parametrize("how, mean, var", [("broadcast", 0.0, 1.0), ("reduce", 1.0, 2.0)])
def test_dist_bn_broadcasts_rank_0s_statistics_or_averages_them(how, mean, var, tmp_path):
    """train.dist_bn: 3 ranks with running means 0, 1, 2 (variances 1, 2, 3) before evaluating."""
    spawn(buffers_worker, 3, tmp_path / "init", how, tmp_path, nprocs=3)
    for rank in range(3):
        state = torch.load(tmp_path / f"{rank}.pt")
        assert state["running_mean"].tolist() == [mean, mean] and state["running_var"].tolist() == [var, var]
        assert int(state["num_batches_tracked"]) == 0  # a count is not averaged: rank 0's
