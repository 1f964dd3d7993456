"""hierarchical and torus2d through the executor over the NCCL fake: sends and
receives matched per pair in FIFO order without tags, several peers in one
step (a rank of a short node runs several rings side by side), on the host-wait
path and on the stream-ordered path where each group blocks until its peers
post their matches."""
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fakes.fake_nccl import FakeNcclWorld
from hybridcomm.algorithms import Topology, get_schedule
from hybridcomm.executor import execute, execute_async
from hybridcomm.transport.cupy_nccl import CupyNcclTransport

TIMEOUT = 10.0
CASES = [("hierarchical", Topology(node_size=2)), ("hierarchical", Topology(node_size=3)),
         ("torus2d", Topology(grid=(3, 3))), ("torus2d", None)]


def run_ranks(p, fn):
    with ThreadPoolExecutor(p) as ex:
        return [f.result(timeout=60) for f in [ex.submit(fn, r) for r in range(p)]]


def transports(world, stream_ordered):
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=TIMEOUT))
    ts = run_ranks(world.world_size, lambda r: CupyNcclTransport(
        nccl=world.module(r), streams=world.streams(r), store=store, rank=r,
        world_size=world.world_size))
    for t in ts:
        t.stream_ordered = stream_ordered
    return ts


@pytest.mark.parametrize("algorithm,topo", CASES)
@pytest.mark.parametrize("p", [7, 8])
@pytest.mark.parametrize("stream_ordered", [False, True])
def test_exact_over_fifo_without_tags(algorithm, topo, p, stream_ordered):
    n = 1001
    world = FakeNcclWorld(p, blocking=stream_ordered)
    ts = transports(world, stream_ordered)
    g = torch.Generator().manual_seed(p)
    bufs = [torch.randint(-8, 9, (n,), generator=g).float() for _ in range(p)]
    want = torch.stack(bufs).sum(0) * 0.25  # exact: small integers times a power of two
    scheds = [get_schedule(algorithm, r, p, n, topo) for r in range(p)]

    def rank(r):
        if not stream_ordered:
            return execute(scheds[r], bufs[r], ts[r], scale=0.25, timeout=TIMEOUT)
        done = execute_async(scheds[r], bufs[r], ts[r], scale=0.25, timeout=TIMEOUT)
        ts[r].streams.current_stream().wait_event(done)
        return done.query()

    run_ranks(p, rank)
    assert world.errors == [] and world.unmatched() == {}
    for r in range(p):
        assert torch.equal(bufs[r], want), f"rank {r}"
