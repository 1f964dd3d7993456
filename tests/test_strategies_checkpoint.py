"""Local SGD and ADMM resume exactly from a checkpoint rank 0 alone writes, taken
between two averages (when the ranks' models differ): each rank continues
bitwise as in the run that never stopped. The state holds every rank's own
parameters, duals and optimizer state. The averaging plan comes from a saved
calibration (as a job with one has): the start-up probe could pick another
algorithm in the resumed run, and with 3 ranks another algorithm sums in
another order (a different last bit)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridcomm.strategies import ADMM, LocalSGD
from multiproc import run_ranks
from optim_models import batch, flat, make_model, shard

STEPS, AT = 9, 4  # local SGD's period 3 and ADMM's 3 local steps: AT is mid-period


def _build(kind, path):
    from hybridcomm.comm import calibration
    from hybridcomm.plan.cost_model import CostModel

    model_file = path + ".cost_model.json"
    if dist.get_rank() == 0 and not os.path.exists(model_file):
        calibration.save(CostModel(5e-5, 1e-9, 1e-10), model_file)
    dist.barrier()
    os.environ["HYBRIDCOMM_COST_MODEL"] = model_file
    torch.manual_seed(0)
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "local_sgd":
        return model, LocalSGD(
            base, model, period=3, average_state=True, warmup_steps=2, timeout=60
        )
    return model, ADMM(base, model, rho=0.1, local_steps=3, timeout=60)


def _run(model, opt, rank, world, first, last):
    for s in range(first, last):
        x, y = batch(s)
        opt.zero_grad()
        F.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()


def _straight(rank, world, kind, path):
    model, opt = _build(kind, path)
    _run(model, opt, rank, world, 0, AT)
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    if rank == 0:
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()
    _run(model, opt, rank, world, AT, STEPS)
    return flat(model.parameters())


def _resumed(rank, world, kind, path):
    model, opt = _build(kind, path)
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    _run(model, opt, rank, world, AT, STEPS)
    return flat(model.parameters())


@pytest.mark.parametrize("kind", ["local_sgd", "admm"])
def test_a_strategy_resumes_bitwise_from_a_mid_period_checkpoint(tmp_path, kind):
    path = str(tmp_path / "ckpt.pt")
    want = run_ranks(3, _straight, kind, path, timeout=180)
    got = run_ranks(3, _resumed, kind, path, timeout=180)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"rank {rank}: max diff {(g - w).abs().max():.3g}"
