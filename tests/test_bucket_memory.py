"""What a bucket holds beyond its gradients, as the debug line reports it."""

import logging

import torch
from multiproc import run_ranks

from hybridcomm.comm.compression import TopK
from hybridcomm.plan.planner import Bucket
from hybridcomm.sync.bucket_group import memory_beyond_gradients
from hybridcomm.sync.buckets import GradBucket


def _alloc(n, dt):
    return torch.empty(n, dtype=dt)


def _bucket(wire=None):
    ps = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    return GradBucket(Bucket(0, ["l"], [0, 1], 5, 20, "ring", 0.0), ps, torch.float32, wire, _alloc)


def test_padding_and_flags_are_all_a_plain_bucket_adds():
    b = _bucket()
    # views at element offsets 0 and 4 (16-byte aligned): one fp32 element of padding
    assert b.offsets == [0, 4]
    assert memory_beyond_gradients(b) == {"padding": 4, "flags": 8}


def test_the_wire_copy_and_top_k_state_are_counted():
    b = _bucket(torch.float16)
    assert memory_beyond_gradients(b)["wire copy"] == (6 + 2) * 2
    b = _bucket()
    b.topk = TopK(b.grads.numel(), 2, 0.5, rank=0, world=4, momentum=0.9, alloc=_alloc)
    extra = memory_beyond_gradients(b)
    assert extra["top-k residual"] == extra["top-k velocity"] == 6 * 4
    assert extra["top-k gathered"] == 4 * b.topk.seg * 4


def _debug_lines(rank, world):
    import hybridcomm

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("hybridcomm")
    logger.addHandler(Keep())
    logger.setLevel(logging.DEBUG)
    model = torch.nn.Linear(4, 2)
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, cost_model="default", timeout=30
    )
    opt.close()
    return [line for line in lines if "bytes of gradients" in line]


def test_the_debug_line_names_each_bucket():
    # in a rank process: a process group made in pytest's own process would be
    # inherited by every rank forked after it
    (lines,) = run_ranks(1, _debug_lines)
    assert lines and all("flags" in line for line in lines), lines
