"""The stall inspector: one rank skips a backward pass, so its buckets run a step
behind; at the last step the other rank waits for a bucket that will never
come. Before its timeout, that rank's warning names the rank behind and both
ranks' launch counts, and the wait still ends in HybridCommTimeout."""

import logging
import os
import re
import time

import pytest
import torch
import torch.nn.functional as F

import hybridcomm
from multiproc import run_ranks
from optim_models import batch, make_model, shard

STEPS, SKIP_AT = 4, 2


def _skipper(rank, world):
    os.environ["HYBRIDCOMM_STALL_WARN"] = "2"
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("hybridcomm").addHandler(Keep())
    torch.manual_seed(0)
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model=model,
        overlap="backward",
        timeout=10,
        measure_iters=1,
        cost_model="default",
    )  # re-planned before the skip
    error, t0 = None, time.perf_counter()
    try:
        for s in range(STEPS):
            x, y = batch(s)
            opt.zero_grad()
            loss = F.mse_loss(model(shard(x, rank, world)), shard(y, rank, world))
            if not (rank == 1 and s == SKIP_AT):  # rank 1 skips this backward
                loss.backward()
            opt.step()
    except hybridcomm.HybridCommError as e:
        error = f"{type(e).__name__}: {e}"
    waited = time.perf_counter() - t0
    if rank == 1:
        time.sleep(13)  # stay (connections open) while rank 0 waits out its timeout
    return error, waited, [line for line in lines if "stall" in line]


@pytest.mark.timeout(180)  # waits for the stall report
def test_a_rank_that_skipped_a_backward_is_named_before_the_timeout():
    (error0, waited0, stalls0), (error1, _, _) = run_ranks(2, _skipper, timeout=120)
    assert error1 is None  # the rank behind never waits: it just runs a step late
    assert error0 is not None and error0.startswith("HybridCommTimeout"), error0
    assert waited0 < 30  # the timeout (10 s) ends it, not a hang
    assert stalls0, "no stall warning"
    assert "rank 1 has launched" in stalls0[0] and "this rank (rank 0)" in stalls0[0], stalls0
    assert "rank 1 has launched" in error0  # the timeout says it too


QUICK_STEPS = 8


def _one_more_step(rank, world):
    """Rank 0 runs QUICK_STEPS fast steps and stops (its connections open); rank 1
    runs one step more, whose buckets wait for rank 0 until the timeout."""
    os.environ["HYBRIDCOMM_STALL_WARN"] = "4"
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("hybridcomm").addHandler(Keep())
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model=model,
        overlap="backward",
        timeout=6,
        measure_iters=1,
        cost_model="default",
    )
    error = None
    try:
        for s in range(QUICK_STEPS + (rank == 1)):
            x, y = batch(s)
            opt.zero_grad()
            F.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
    except hybridcomm.HybridCommError as e:
        error = f"{type(e).__name__}: {e}"
    if rank == 0:
        time.sleep(9)  # stay (connections open) while rank 1 waits out its timeout
    return error, [line for line in lines if "stall" in line]


def test_the_stall_report_names_the_step_a_rank_really_stopped_at():
    """Progress is published at every step: rank 0's last numbers are those of its
    last step, however fast its steps ran (not those of a step seconds before)."""
    (error0, _), (error1, stalls1) = run_ranks(2, _one_more_step, timeout=120)
    assert error0 is None
    assert error1 is not None and error1.startswith("HybridCommTimeout"), error1
    assert stalls1, "no stall warning"
    for text in (stalls1[0], error1):
        theirs = re.search(r"rank 0 has launched (\d+) buckets in all after (\d+) steps", text)
        mine = re.search(r"this rank \(rank 1\) has launched (\d+) buckets after (\d+) steps", text)
        assert theirs and mine, text
        assert int(theirs.group(2)) == int(mine.group(2)) == QUICK_STEPS, text
        assert 0 < int(theirs.group(1)) < int(mine.group(1)), text  # one step's buckets short
