"""What a user reads about the plan: logged once at INFO (a re-plan that decides
nothing new at DEBUG), every column explained in the printed plan, one verdict
line on rank 0 after the measured steps, and one log prefix."""

import logging

import torch
import torch.nn.functional as F

import hybridcomm
from multiproc import run_ranks
from optim_models import batch, make_model, shard


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append((record.levelno, record.getMessage()))


def _train(rank, world):
    keep = _Keep()
    log = logging.getLogger("hybridcomm")
    log.addHandler(keep)
    log.setLevel(logging.DEBUG)
    try:
        model = make_model()
        # One algorithm, no split, backward mode: the measured re-plan decides nothing new
        opt = hybridcomm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            overlap="backward",
            strategy="ring",
            split_bytes=0,
            measure_iters=2,
            timeout=60,
        )
        for s in range(4):
            x, y = batch(s)
            opt.zero_grad()
            F.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        printed = str(opt.plan)
        opt.close()
    finally:
        log.removeHandler(keep)
        log.setLevel(logging.INFO)
    return keep.records, printed


def test_the_plan_is_logged_once_and_explained_and_rank_0_gives_a_verdict():
    results = run_ranks(2, _train)
    for rank, (records, printed) in enumerate(results):
        info_plans = [
            m for level, m in records if level == logging.INFO and "hybridcomm plan:" in m
        ]
        verdicts = [
            m for level, m in records if level == logging.INFO and "each step all-reduces" in m
        ]
        assert len(info_plans) == (1 if rank == 0 else 0), info_plans
        assert any(
            "re-planned after 2 steps (the same decisions" in m
            for level, m in records
            if level == logging.DEBUG
        )
        assert len(verdicts) == (1 if rank == 0 else 0)
        if rank == 0:
            assert "hidden" in verdicts[0] and "DDP's default" in verdicts[0]
        for column in (
            "bytes =",
            "algorithm =",
            "pred(us) =",
            "window(us) =",
            "need =",
            "segs =",
            "issue order =",
        ):
            assert column in printed


def test_the_stderr_lines_carry_one_prefix():
    from hybridcomm.config.logs import _Formatter

    record = logging.LogRecord("hybridcomm", logging.INFO, __file__, 1, "hybridcomm: x", None, None)
    record.rank = 0
    assert _Formatter("[hybridcomm r%(rank)s] %(message)s").format(record) == "[hybridcomm r0] x"
