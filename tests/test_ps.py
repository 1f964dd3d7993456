"""Parameter-server-assisted all-reduce (hybridcomm/comm/servers.py): W workers and K
summation servers as real gloo processes. Integer-valued inputs, so every sum
is exact in every dtype: each worker must hold exactly the sum (or mean), and
all workers the same bits."""

import pytest
import torch

import hybridcomm.comm.servers as ps
from multiproc import run_ranks

SIZES = [0, 1, 2, 7, 1000]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _inputs(worker):
    return [
        (torch.arange(n, dtype=torch.float64) % 17 - 8 + worker).to(dt)
        for n in SIZES
        for dt in DTYPES
    ]


def _want(workers, op):
    total = [
        sum((torch.arange(n, dtype=torch.float64) % 17 - 8 + w) for w in range(workers))
        for n in SIZES
        for _ in DTYPES
    ]
    if op == "avg":
        total = [t / workers for t in total]
    return [t.to(dt) for t, dt in zip(total, [dt for _ in SIZES for dt in DTYPES])]


def _run(rank, world, servers, op, chunk_bytes=256 << 10):
    role = ps.split_world(servers)
    if role.is_server:
        return "server", ps.serve(role, timeout=60)
    srv = ps.SummationServers(role, timeout=60, chunk_bytes=chunk_bytes)
    tensors = _inputs(rank)
    for t in tensors:
        srv.all_reduce(t, op=op)
    srv.close()
    return "worker", tensors


@pytest.mark.parametrize("workers,servers", [(w, k) for w in range(2, 7) for k in (1, 2, 3)])
def test_every_worker_gets_the_exact_sum_bitwise_equal(workers, servers):
    results = run_ranks(workers + servers, _run, servers, "sum", timeout=120)
    want = _want(workers, "sum")
    outs = [r[1] for r in results if r[0] == "worker"]
    assert len(outs) == workers
    for out in outs:
        for got, w in zip(out, want):
            assert got.dtype == w.dtype and torch.equal(got, w)
    # every partition non-empty for the big tensors: each server summed some
    assert all(r[1] > 0 for r in results if r[0] == "server")


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_partitions_moved_in_many_small_chunks_are_still_exact(op):
    """12-byte chunks: a partition of 1000 elements is hundreds of pipelined chunks
    (and the avg of 4 workers is exact on integer values + 1.5: a multiple of 1/4)."""
    results = run_ranks(4 + 2, _run, 2, op, 12, timeout=120)
    want = _want(4, op)
    for status, out in results[:4]:
        for got, w in zip(out, want):
            assert got.dtype == w.dtype and torch.equal(got, w)


def test_avg_and_a_non_contiguous_tensor():
    def run(rank, world):
        role = ps.split_world(2)
        if role.is_server:
            return ps.serve(role, timeout=60)
        srv = ps.SummationServers(role, timeout=60)
        t = torch.full((6, 4), float(rank + 1)).t()  # not contiguous
        srv.all_reduce(t, op="avg")
        srv.close()
        return t

    results = run_ranks(5, run, timeout=120)
    for t in results[:3]:
        assert torch.equal(t, torch.full((4, 6), 2.0))  # (1 + 2 + 3) / 3


def _mismatch(rank, world):
    role = ps.split_world(1)
    try:
        if role.is_server:
            ps.serve(role, timeout=30)
        else:
            srv = ps.SummationServers(role, timeout=30)
            srv.all_reduce(torch.zeros(3 + rank))  # the workers disagree on the size
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return str(e)
    return "no error"


def test_workers_that_push_different_sizes_are_named_by_the_server():
    msgs = run_ranks(3, _mismatch, timeout=120, allow_errors=True)
    assert "pushed different partitions" in msgs[2], msgs
    assert all(m != "no error" for m in msgs[:2]), msgs  # the workers time out, not hang


def test_split_world_rejects_bad_counts():
    def run(rank, world):
        with pytest.raises(ValueError, match="num_servers must be in"):
            ps.split_world(2)
        return True

    assert run_ranks(2, run, timeout=60) == [True, True]
