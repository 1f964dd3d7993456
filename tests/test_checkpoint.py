"""A checkpoint taken at step k and loaded in fresh processes continues bitwise as
the run that never stopped: the parameters, the optimizer's state, and
hybridcomm's own (the agreed plan, so every bucket is reduced by the same
algorithm in the same order; the step count). Rank 0 writes it atomically,
and ``torch.load(weights_only=True)`` reads it. Top-k's error feedback is
each rank's own: with it, every rank saves its own optimizer state too. 3 ranks, so the plan's
algorithms matter to the bits (with 2, a + b is the same sum in any order)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hybridcomm
from multiproc import run_ranks
from optim_models import batch, flat, make_model, shard

STEPS, AT = 8, 5  # the checkpoint after the measured steps and the re-plan


def _build(overlap):
    """``overlap``, or "topk": backward mode with top-k compression (its residuals
    and momentum live in the optimizer's state)."""
    torch.manual_seed(0)
    model = make_model()
    extra = {"compression": "topk:0.3"} if overlap == "topk" else {}
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model=model,
        overlap="backward" if overlap == "topk" else overlap,
        measure_iters=2,
        timeout=60,
        fusion_bytes=0,
        **extra,
    )
    return model, opt


def _steps(model, opt, rank, world, first, last):
    for s in range(first, last):
        x, y = batch(s)
        opt.zero_grad()
        F.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()


def _write(path, state):
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # a reader never sees half a file


def _save(path, model, opt, overlap):
    if dist.get_rank() == 0:  # opt.state_dict() on one rank alone: no collective
        _write(path, {"model": model.state_dict(), "opt": opt.state_dict()})
    if overlap == "topk":
        _write(f"{path}.rank{dist.get_rank()}", opt.state_dict())
    dist.barrier()


def _uninterrupted(rank, world, overlap, path):
    model, opt = _build(overlap)
    _steps(model, opt, rank, world, 0, AT)
    _save(path, model, opt, overlap)
    plan = str(opt.plan)
    _steps(model, opt, rank, world, AT, STEPS)
    opt.synchronize()
    opt.close()
    return flat(model.parameters()), plan


def _resumed(rank, world, overlap, path):
    model, opt = _build(overlap)
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(
        state["opt"] if overlap != "topk" else torch.load(f"{path}.rank{rank}", weights_only=True)
    )
    plan = str(opt.plan)
    _steps(model, opt, rank, world, AT, STEPS)
    opt.synchronize()
    opt.close()
    return flat(model.parameters()), plan


@pytest.mark.parametrize("overlap", ["forward", "backward", "none", "topk"])
def test_a_resumed_run_ends_bitwise_where_the_uninterrupted_one_does(tmp_path, overlap):
    path = str(tmp_path / "ckpt.pt")
    straight = run_ranks(3, _uninterrupted, overlap, path, timeout=180)
    resumed = run_ranks(3, _resumed, overlap, path, timeout=180)
    for (want, plan_then), (got, plan_now) in zip(straight, resumed):
        assert plan_now == plan_then  # the checkpoint's plan, not a fresh start-up one
        assert torch.equal(got, want), f"max diff {(got - want).abs().max():.3g}"


def _other_world(rank, world, path):
    model, opt = _build("backward")
    opt.load_state_dict(torch.load(path, weights_only=True)["opt"])
    n = len(opt.plan.buckets)
    _steps(model, opt, rank, world, AT, AT + 2)
    opt.close()
    return n, opt.plan.world_size


def test_a_checkpoint_from_another_world_size_re_plans(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    run_ranks(3, _uninterrupted, "backward", path, timeout=180)
    for n, world in run_ranks(2, _other_world, path, timeout=180):
        assert n > 0 and world == 2
