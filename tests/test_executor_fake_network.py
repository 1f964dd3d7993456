"""The executor over the fake network (tests/fakes/network.py): every algorithm's
schedule run by its index plans, scratch and pipelined parts, the native
collectives, and the reduce-scatter and all-gather phases, at world sizes 1-8 with
ranks as threads. Exact: small-integer inputs sum exactly in any order, so every
element is checked for equality and every rank for the same bits. The fake
matches as NCCL does (per pair, FIFO, no tags) and moves bytes only when a side
waits, so each check below is also shown to fail on a broken variant."""

import pytest
import torch

from fakes.network import FakeNetwork, FakeNetworkError, run_ranks
from hybridcomm.algorithms import (
    ALGORITHMS,
    ALL_GATHER,
    REDUCE_SCATTER,
    get_phase_schedule,
    get_schedule,
)
from hybridcomm.base.errors import HybridCommTimeout
from hybridcomm.comm.executor import execute, reduce_operation
from hybridcomm.plan.cost_model import NATIVE

pytestmark = pytest.mark.fast

WORLDS = [1, 2, 3, 4, 5, 7, 8]
LENGTHS = [0, 1, 7, 101, 4099]


def _inputs(world, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-64, 65, (n,), generator=g).to(dtype) for _ in range(world)]


def _all_reduce(world, algorithm, inputs, scale=None, timeout=20.0):
    net = FakeNetwork(world)

    def rank_fn(rank):
        buf = inputs[rank].clone()
        s = get_schedule(algorithm, rank, world, buf.numel())
        execute(s, buf, net.transport(rank), scale=scale, timeout=timeout)
        return buf

    return run_ranks(world, rank_fn)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world", WORLDS)
def test_every_schedule_sums_exactly_and_alike_on_every_rank(algorithm, world):
    for n in LENGTHS:
        inputs = _inputs(world, n, torch.float32, seed=world * 1000 + n)
        expected = torch.stack(inputs).sum(0)
        out = _all_reduce(world, algorithm, inputs)
        for rank, buf in enumerate(out):
            assert torch.equal(buf, expected), (algorithm, world, n, rank)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_sum_exactly_and_the_average_is_scaled_once(dtype):
    world, n = 4, 257
    inputs = _inputs(world, n, dtype, seed=3)
    expected = torch.stack([t.double() for t in inputs]).sum(0)
    for algorithm in ("ring", "butterfly", "halving_doubling"):
        out = _all_reduce(world, algorithm, inputs)
        assert all(torch.equal(b.double(), expected) for b in out), algorithm
        avg = _all_reduce(world, algorithm, inputs, scale=1 / world)
        assert all(torch.equal(b, avg[0]) for b in avg), algorithm  # the same bits everywhere
        # each element scaled once, when its final value is made (not once per step)
        torch.testing.assert_close(avg[0].double(), expected / world, rtol=1e-2, atol=1e-2)


def test_pipelined_parts_sum_exactly(monkeypatch):
    """Buffers cut into parts that run interleaved (each part's next step posted as
    soon as its own reduction is done): the same sums, in (step, part) order on every
    rank, so that pairs still match without tags."""
    monkeypatch.setenv("HYBRIDCOMM_PIPELINE_BYTES", "4K")
    world, n = 4, 4 * 1024 + 13  # 16 KiB of fp32: 4 parts
    inputs = _inputs(world, n, torch.float32, seed=11)
    expected = torch.stack(inputs).sum(0)
    for algorithm in ("ring", "halving_doubling"):
        out = _all_reduce(world, algorithm, inputs)
        assert all(torch.equal(b, expected) for b in out), algorithm


@pytest.mark.parametrize("world", [2, 3, 4])
def test_native_and_the_phases_through_the_one_dispatch(world):
    """``reduce_operation`` (the dispatch every all-reduce goes through) for
    ``native``, and a reduce-scatter then an all-gather: the all-reduce again."""
    n = 24 * world
    inputs = _inputs(world, n, torch.float32, seed=world)
    expected = torch.stack(inputs).sum(0)
    net = FakeNetwork(world)

    def rank_fn(rank):
        t = net.transport(rank)
        native = inputs[rank].clone()
        reduce_operation(
            native, t, NATIVE, scale=None, timeout=10, label=None, stream_ordered=False
        )()
        phased = inputs[rank].clone()
        for phase in (REDUCE_SCATTER, ALL_GATHER):
            s = get_phase_schedule(phase, "ring", rank, world, n, 0)
            execute(s, phased, t, timeout=10)
        return native, phased

    for native, phased in run_ranks(world, rank_fn):
        assert torch.equal(native, expected) and torch.equal(phased, expected)


def test_two_ranks_issuing_in_different_orders_are_caught():
    """The invariant the plan's fixed issue order keeps: rank 1 reduces its two
    buffers in the other order. Without tags its first message meets rank 0's
    first, meant for the other buffer: a size mismatch, named."""
    net = FakeNetwork(2)

    def rank_fn(rank):
        a, b = torch.ones(8), torch.ones(24)
        order = [a, b] if rank == 0 else [b, a]
        for buf in order:
            execute(get_schedule("ring", rank, 2, buf.numel()), buf, net.transport(rank), timeout=5)

    with pytest.raises(
        AssertionError, match="rank [01] failed: FakeNetworkError.*different orders"
    ):
        run_ranks(2, rank_fn)


def test_equal_sizes_in_different_orders_give_wrong_sums_not_a_silent_pass():
    """Equal sizes pair without an error, as on NCCL: the data lands in the wrong
    buffer. The fake does not hide it (a tagged network would deliver by tag)."""
    net = FakeNetwork(2)

    def rank_fn(rank):
        a, b = torch.full((8,), 1.0 + rank), torch.full((8,), 10.0 + rank)
        for buf in [a, b] if rank == 0 else [b, a]:
            execute(get_schedule("butterfly", rank, 2, 8), buf, net.transport(rank), timeout=5)
        return a, b

    (a0, b0), (a1, b1) = run_ranks(2, rank_fn)
    assert not (torch.equal(a0, torch.full((8,), 3.0)) and torch.equal(b0, torch.full((8,), 21.0)))


def test_bytes_move_when_a_side_waits_not_when_posted():
    """Completion on demand: what a sender writes between post and wait is what
    arrives; while the wire is held, nothing arrives at all."""
    net = FakeNetwork(2)
    sent, got = torch.zeros(4), torch.zeros(4)
    p0 = net.transport(0).exchange([(1, sent)], [])
    p1 = net.transport(1).exchange([], [(0, got)])
    sent.fill_(7.0)  # after posting: a real network may still read it
    assert got.eq(0).all()  # posted, not yet waited for: nothing moved
    net.hold()
    with pytest.raises(HybridCommTimeout):
        p1.wait(0.05)
    net.release()
    p1.wait(1)
    p0.wait(1)
    assert got.eq(7).all()


def test_a_rank_that_never_posts_is_a_timeout_naming_it():
    net = FakeNetwork(3)
    pending = net.transport(0).exchange([], [(2, torch.empty(3))])
    with pytest.raises(HybridCommTimeout, match="rank 2 never posted its send"):
        pending.wait(0.05)


def test_mismatched_collectives_are_named():
    net = FakeNetwork(2)

    def rank_fn(rank):
        net.transport(rank).all_reduce(torch.ones(4 if rank == 0 else 6), average=False, timeout=5)

    with pytest.raises(AssertionError, match="FakeNetworkError.*all_reduce of 16 B"):
        run_ranks(2, rank_fn)
    assert issubclass(FakeNetworkError, Exception)
