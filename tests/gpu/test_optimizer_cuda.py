"""DistributedOptimizer on real GPUs (NCCL through CuPy, comm stream): every
overlap mode gives one process's numbers (within 64 fp32 eps: IEEE fp32 pinned
in the ranks and the reference, as shards of 2-6 samples under TF32 or cuDNN
would round unlike the 12-sample batch), bitwise identical on every rank.
One rank per GPU over NCCL with 2+ GPUs, else 4 ranks on one GPU over the
one-device transport (``gpu_common.placement``)."""

import os

import pytest
import torch
import torch.nn as nn

from gpu_common import ieee_fp32, placement, skip_if_interpreting
from hybridcomm.tools.launch import launch

STEPS = 4


def _rank(rank, world, overlap):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from optim_models import batch, make_model, shard

    import hybridcomm

    ieee_fp32()  # TF32 keeps 10 mantissa bits (~5e-4 relative); the tolerance is 7.6e-6
    dev = torch.device("cuda", torch.cuda.current_device())
    model = make_model().to(dev)
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model=model,
        overlap=overlap,
        fusion_bytes=0,
        measure_iters=2,
        timeout=120,
    )
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(
            model(shard(x, rank, world).to(dev)), shard(y, rank, world).to(dev)
        ).backward()
        opt.step()
    opt.synchronize()
    out = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    opt.close()
    return out


@pytest.mark.parametrize("overlap", ["forward", "backward", "none"])
def test_training_on_gpus_matches_one_process(ieee, overlap):
    skip_if_interpreting()
    from optim_models import batch, flat, make_model

    # ranks that split the 12-sample batch evenly: as many as there are GPUs, or 4 on one
    n = torch.cuda.device_count()
    world = max(w for w in (2, 3, 4, 6) if w <= n) if n >= 2 else 4
    how, _ = placement(world)
    results = launch(_rank, world, overlap, start_method="spawn", timeout=600, **how)
    model = make_model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
        opt.step()
    ref = flat(model.parameters()).cpu()
    tol = 64 * torch.finfo(torch.float32).eps
    assert torch.allclose(results[0], ref, rtol=tol, atol=tol)
    assert all(torch.equal(r, results[0]) for r in results)
