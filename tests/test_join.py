"""Uneven inputs (issue 39): ranks that run out of data join, and shadow the
others' reductions until every rank has, as with DDP's ``model.join()``.

Each case trains the same model on the same per-rank batches with DDP's join
and with hybridcomm's, in one process group, and compares the final
parameters (DDP leaves every rank with a last joiner's). Rank r is r batches
short, or one rank has no batch at all; the plan has two buckets and is
re-made at step 3, after a rank joined (its measured steps are 3)."""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join, JoinHook, Joinable
from torch.distributed.optim import ZeroRedundancyOptimizer

import hybridcomm
from multiproc import run_ranks

EPS32 = torch.finfo(torch.float32).eps
LR = 0.1
SHORT = [4, 3, 2]  # rank r is r batches short
ONE_EMPTY = [3, 0, 2]  # rank 1 has no batch at all


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches(rank, counts, micro=1):
    g = torch.Generator().manual_seed(100 + rank)
    return [
        [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(micro)]
        for _ in range(counts[rank])
    ]


def _loss(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ddp(rank, counts, divide, micro=1):
    """DDP's join; micro-batches in one forward and their losses summed (their
    gradients add up as hybridcomm's accumulated passes do; DDP's join expects
    one forward per step)."""
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    with ddp.join(divide_by_initial_world_size=divide):
        for batch in _batches(rank, counts, micro):
            opt.zero_grad()
            out = ddp(torch.cat([x for x, _ in batch])).split(len(batch[0][0]))
            sum(nn.functional.mse_loss(o, y) for o, (_, y) in zip(out, batch)).backward()
            opt.step()
    return _flat(model)


def _hybridcomm(rank, counts, divide, overlap, micro=1, compression=None, torch_join=False):
    model = _model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        model=model,
        overlap=overlap,
        fusion_bytes=200,
        cost_model="default",
        compression=compression,
        measure_iters=3,
        timeout=30,
    )
    context = (
        Join([opt], divide_by_initial_world_size=divide)
        if torch_join
        else opt.join(divide_by_initial_world_size=divide)
    )
    with context:
        for batch in _batches(rank, counts, micro):
            opt.zero_grad()
            for i, (x, y) in enumerate(batch):
                if i < len(batch) - 1:
                    with opt.no_sync():
                        _loss(model, x, y).backward()
                else:
                    _loss(model, x, y).backward()
            opt.step()
    params = _flat(model)
    momentum = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    steps = opt.state_dict()["hybridcomm"]["steps"]
    total = torch.tensor([float(rank)])
    hybridcomm.all_reduce(total)  # a collective after the loop finds every rank there
    # one more step on every rank: they go on together
    x, y = _batches(rank, [1, 1, 1])[0][0]
    opt.zero_grad()
    _loss(model, x, y).backward()
    opt.step()
    opt.synchronize()
    after = _flat(model)
    opt.close()
    return {
        "params": params,
        "momentum": momentum,
        "steps": steps,
        "sum": total.item(),
        "after": after,
    }


CASES = [
    (counts, divide, overlap)
    for counts in (SHORT, ONE_EMPTY)
    for divide in (True, False)
    for overlap in ("forward", "backward", "none")
]


def _against_ddp(rank, world, simulate):
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    out = {}
    for counts, divide, overlap in CASES:
        key = (str(counts), divide, overlap)
        out[key] = (_ddp(rank, counts, divide), _hybridcomm(rank, counts, divide, overlap))
    out["accumulation+fp16"] = (
        _ddp(rank, SHORT, True, micro=2),
        _hybridcomm(rank, SHORT, True, "forward", micro=2, compression="fp16"),
    )
    out["torch Join"] = (
        _ddp(rank, ONE_EMPTY, True),
        _hybridcomm(rank, ONE_EMPTY, True, "backward", torch_join=True),
    )
    return out


def _check(results, key, rtol, steps):
    """Every rank ends with DDP's last joiner's parameters, the same momentum and
    step count, and stays in step after the join."""
    ref = results[0][key][0]
    for rank, r in enumerate(results):
        ddp, got = r[key]
        assert torch.equal(ddp, ref), (key, "DDP's ranks differ")
        assert torch.allclose(got["params"], ref, rtol=rtol, atol=rtol), (
            key,
            rank,
            (got["params"] - ref).abs().max().item(),
        )
        for field in ("params", "momentum", "after"):
            assert torch.equal(got[field], results[0][key][1][field]), (key, rank, field)
        assert got["steps"] == steps, (key, rank, got["steps"])  # a joined rank counts them
        assert got["sum"] == sum(range(len(results))), (key, rank)


@pytest.mark.parametrize("simulate", [False, True], ids=["host", "simgpu"])
def test_join_gives_ddps_join_numbers_in_every_mode(simulate):
    results = run_ranks(3, _against_ddp, simulate, timeout=300)
    for counts, divide, overlap in CASES:
        _check(results, (str(counts), divide, overlap), 64 * EPS32, max(counts))
    # fp16 on the wire: each gradient rounded once to fp16 before the sum, so
    # each update is off by at most fp16's eps relative to its size
    _check(results, "accumulation+fp16", torch.finfo(torch.float16).eps, max(SHORT))
    _check(results, "torch Join", 64 * EPS32, max(ONE_EMPTY))
    # the cases can fail: the two divisors give different numbers
    first = results[0]
    assert not torch.allclose(
        first[(str(SHORT), True, "forward")][0],
        first[(str(SHORT), False, "forward")][0],
        rtol=1e-4,
        atol=1e-4,
    )


def _throws(rank, world):
    model = _model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model=model,
        overlap="backward",
        fusion_bytes=200,
        cost_model="default",
        timeout=30,
    )
    t0, error, steps = time.monotonic(), None, 0
    try:
        with opt.join(throw_on_early_termination=True):
            for ((x, y),) in _batches(rank, SHORT):
                opt.zero_grad()
                _loss(model, x, y).backward()
                opt.step()
                steps += 1
    except RuntimeError as e:
        error = str(e)
    total = torch.ones(1)
    hybridcomm.all_reduce(total)  # nothing was left in flight
    opt.close()
    return error, steps, time.monotonic() - t0, total.item()


def test_throw_on_early_termination_raises_on_every_rank_with_nothing_in_flight():
    for rank, (error, steps, seconds, total) in enumerate(run_ranks(3, _throws, timeout=120)):
        assert error is not None and ("exhausted" in error), (rank, error)
        assert steps == 2, (rank, steps)  # the third step raised, before any reduction
        assert seconds < 20 and total == 3, (rank, seconds, total)


class _Other(Joinable):
    def __init__(self):
        super().__init__()

    def join_hook(self, **kwargs):
        return JoinHook()

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return dist.group.WORLD


def _refusals(rank, world):
    """Each combination a join cannot shadow: its error, on every rank."""

    def refused(inner, model, join):
        opt = hybridcomm.DistributedOptimizer(
            inner, model=model, overlap="backward", cost_model="default", timeout=30
        )
        try:
            join(opt)
            return None
        except hybridcomm.HybridCommError as e:
            return str(e)
        finally:
            opt.close()

    model, sparse = _model(), nn.Embedding(10, 3, sparse=True)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=LR)
    sharded = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(_model().parameters(), lr=LR),
        shard="optimizer",
        cost_model="default",
        timeout=30,
    )
    try:
        sharded.join()
        shard_error = None
    except hybridcomm.HybridCommError as e:
        shard_error = str(e)
    sharded.close()
    return [
        refused(
            torch.optim.SGD(model.parameters(), lr=LR), model, lambda opt: Join([_Other(), opt])
        ),
        refused(zero, model, lambda opt: opt.join()),
        refused(torch.optim.SGD(sparse.parameters(), lr=LR), sparse, lambda opt: opt.join()),
        shard_error,
    ]


def test_what_a_join_cannot_shadow_is_refused_on_every_rank():
    for errors in run_ranks(2, _refusals, timeout=120):
        first, zero, sparse, shard = errors
        assert shard is not None and "with shard='optimizer'" in shard, shard
        assert first is not None and "must come first in Join" in first, first
        assert zero is not None and "ZeroRedundancyOptimizer" in zero, zero
        assert sparse is not None and "sparse gradients ('weight')" in sparse, sparse
