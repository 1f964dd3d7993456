"""``native`` as a sharded algorithm (issue 40): the process group's own
reduce-scatter and all-gather of a bucket's equal parts, with the usage flags'
tail blocks in a call of their own, over gloo, the simulated CuPy NCCL and the
one-device transport (mailboxes of 1 KiB: every message in several pieces).

Values are small integers, so every sum is exact in any order and dtype; the
average is checked at 2 ranks, where halving is exact too."""

import os

import pytest
import torch

from hybridcomm.algorithms import ALL_GATHER, REDUCE_SCATTER, equal_padding, tail_body
from hybridcomm.comm.executor import reduce_now
from multiproc import run_ranks

TAIL = 8  # elements of a rank's tail block (the flags' copies: a multiple of 8)


def _values(n, rank, dtype):
    return ((torch.arange(n) % 11) + 3 * rank).to(dtype)


def _phases(rank, world, setting, dtype_name):
    if setting != "host":
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    if setting == "one-device":
        os.environ["HYBRIDCOMM_TRANSPORT"] = "one-device"
        os.environ["HYBRIDCOMM_ONE_DEVICE_MAILBOX"] = "1K"
    from hybridcomm.comm.transport.select import select_transport
    from hybridcomm.testing import simgpu

    dtype = getattr(torch, dtype_name)
    transport = select_transport(torch.device("cpu"), None, timeout=60)  # (simulated: the GPU)
    assert transport.kind == {"host": "torch", "simgpu": "cupy"}.get(setting, setting)
    out = {}
    for body in (equal_padding(n, world) for n in (1, 45, 1000)):
        for tail in (0, TAIL):
            for average in (False, True):
                buf = _values(body + world * tail, rank, dtype)
                reduce_now(
                    buf,
                    transport,
                    "native",
                    scale=1.0 / world if average else None,
                    timeout=60,
                    phase=REDUCE_SCATTER,
                    tail=tail,
                )
                scattered = buf.cpu().clone()
                reduce_now(
                    buf, transport, "native", scale=None, timeout=60, phase=ALL_GATHER, tail=tail
                )
                out[(body, tail, average)] = scattered, buf.cpu()
    if setting != "host":
        simgpu.check()
        stats = simgpu.stats()  # (no race; the host syncs are this test's reads)
        assert stats["defects"] == 0, stats
        assert (stats["nccl_ops"] > 0) == (setting == "simgpu"), stats
    return out


def _parts(numel, world, tail):
    """Each rank's parts: its equal part of the body, its block of the tail."""
    body = tail_body(world, numel, tail)
    part = body // world
    return [
        [(r * part, (r + 1) * part)] + ([(body + r * tail, body + (r + 1) * tail)] if tail else [])
        for r in range(world)
    ]


@pytest.mark.parametrize(
    "world,setting,dtype_name",
    [
        (3, "host", "float32"),
        (2, "host", "bfloat16"),
        (2, "simgpu", "float16"),
        (3, "one-device", "bfloat16"),
    ],
)
def test_native_reduce_scatter_then_all_gather_is_the_all_reduce(world, setting, dtype_name):
    dtype = getattr(torch, dtype_name)
    results = run_ranks(world, _phases, setting, dtype_name, timeout=180)
    for (body, tail, average), _ in results[0].items():
        numel = body + world * tail
        whole = sum(_values(numel, r, torch.float64) for r in range(world))
        if average:
            whole = whole / world
        exact = not average or world & (world - 1) == 0
        tol = 0 if exact else torch.finfo(dtype).eps * float(whole.abs().max())
        parts = _parts(numel, world, tail)
        for rank, out in enumerate(results):
            scattered, gathered = out[(body, tail, average)]
            mine = torch.zeros(numel, dtype=torch.bool)
            for a, z in parts[rank]:
                mine[a:z] = True
                got = scattered[a:z].double()
                assert (got - whole[a:z]).abs().max() <= tol, (rank, body, tail, average)
            # the rest of the buffer is this rank's own, as it was
            assert torch.equal(scattered[~mine], _values(numel, rank, dtype)[~mine]), rank
            # the all-gather: every rank's reduced parts, on every rank, the same bits
            assert torch.equal(gathered, results[0][(body, tail, average)][1]), rank
            for r in range(world):
                for a, z in parts[r]:
                    assert torch.equal(gathered[a:z], results[r][(body, tail, average)][0][a:z])
