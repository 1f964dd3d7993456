"""k steps on P ranks == k steps of one process on the whole batch, every mode and strategy."""

import pytest
import torch
import torch.nn as nn

import hybridcomm
from multiproc import run_ranks
from optim_models import (
    batch,
    flat,
    make_model,
    make_optimizer,
    make_scheduler,
    shard,
    train_single,
)

STEPS = 4
# Summation order differs from one process (per-rank means, then the all-reduce),
# so allow a few fp32 roundings per step, scaled by the values' size.
RTOL = ATOL = 64 * torch.finfo(torch.float32).eps


def _train(rank, world, combos):
    out = {}
    for opt_name, overlap, strategy in combos:
        model = make_model()
        base = make_optimizer(opt_name, model.parameters())
        opt = hybridcomm.DistributedOptimizer(
            base, model=model, strategy=strategy, overlap=overlap, measure_iters=2, timeout=60
        )
        sched = make_scheduler(opt_name, opt)
        assert isinstance(opt, type(base))
        for s in range(STEPS):
            x, y = batch(s)
            opt.zero_grad()
            nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
            if sched:
                sched.step()
        opt.synchronize()
        out[(opt_name, overlap, strategy)] = flat(model.parameters())
        opt.close()
    return out


COMBOS = [
    (o, m, s)
    for o in ("sgd", "adam", "adamw")
    for m in ("forward", "backward", "none")
    for s in ("hybrid", "native") + hybridcomm.ALGORITHMS
    if s == "hybrid" or m == "backward"
]


@pytest.mark.timeout(180)  # every mode and algorithm
@pytest.mark.parametrize("world", [2, 3])
def test_same_parameters_as_one_process(world):
    results = run_ranks(world, _train, COMBOS, timeout=300)
    for combo in COMBOS:
        ref = flat(train_single(combo[0], STEPS))
        got = results[0][combo]
        assert torch.allclose(got, ref, rtol=RTOL, atol=ATOL), (
            f"{combo}: max diff {(got - ref).abs().max():.3g}"
        )
        for rank in range(1, world):
            assert torch.equal(results[rank][combo], got), (
                f"{combo}: rank {rank} differs from rank 0"
            )
