"""A bucket's life (sync/bucket_group.py's diagram) on two thread ranks over the fake
network: the production bucket group, engine and host channel, only the wire faked
(tests/fakes). The wire can be held, so a bucket is seen in flight: issued, not
done, its buffer not to be written. Every figure is exact (small integers)."""

import threading
import time

import pytest
import torch

from fakes.buckets import bucket_group, close_all, plan_of
from fakes.network import FakeNetwork, run_ranks
from hybridcomm.base.errors import HybridCommError
from hybridcomm.sync.bucket_group import Phase

pytestmark = pytest.mark.fast


@pytest.fixture(autouse=True)
def _closed():
    yield
    close_all()  # (every channel thread ended, also where a rank failed)


SIZES = [[3, 5], [4]]  # bucket 0: two parameters, bucket 1: one
ORDER = [(1, 0), (0, 0)]  # the plan issues bucket 1 first


def _grad(rank, index, n):
    return torch.arange(n, dtype=torch.float32) + 10 * index + rank + 1


def _expected(world, index, n, scale=1.0):
    return sum(_grad(r, index, n) for r in range(world)) * scale


def _fill(group, s, rank):
    """Backward's gradients, in tensors of autograd's own (``.grad`` was None)."""
    for pos, p in enumerate(s.bucket.params):
        p.grad = _grad(rank, s.bucket.spec.params[pos], p.numel())


def _check(group, world, scale=1.0):
    for s in group.states:
        assert s.phase is Phase.IDLE
        for pos, p in enumerate(s.bucket.params):
            assert p.grad is s.bucket.views[pos]  # the reduced gradient, in place
            want = _expected(world, s.bucket.spec.params[pos], p.numel(), scale)
            assert torch.equal(p.grad, want), (s.index, pos)


def test_a_bucket_waits_for_its_turn_then_is_in_flight_until_the_wire_completes():
    net, world = FakeNetwork(2), 2
    plan = plan_of(world, SIZES, order=ORDER)
    both_in_flight = threading.Barrier(3)
    released = threading.Barrier(3)
    net.hold()

    def rank_fn(rank):
        g = bucket_group(net.transport(rank), plan, SIZES)
        s0, s1 = g.states
        assert (s0.phase, s1.phase) == (Phase.IDLE, Phase.IDLE)
        assert g.open(s0, apply_pending=None) and s0.phase is Phase.ACCUMULATING
        _fill(g, s0, rank)
        g.launch(s0, pass_id=1)
        # bucket 1 comes first in the issue order: bucket 0 is launched, not issued
        assert s0.phase is Phase.LAUNCHED and not g.engine.issued(0)
        assert s0.armed  # its parameters' pre-hooks guard it (wants_guard)
        g.open(s1, apply_pending=None)
        _fill(g, s1, rank)
        g.launch(s1, pass_id=1)
        # both issued now, in the plan's order, and held on the wire
        assert (s0.phase, s1.phase) == (Phase.IN_FLIGHT, Phase.IN_FLIGHT)
        assert g.engine.issue_seq(1) < g.engine.issue_seq(0)
        assert not g.engine.done(0) and not g.engine.done(1)
        assert g.running() == [s0.bucket.spec.layers, s1.bucket.spec.layers]
        both_in_flight.wait(10)
        released.wait(10)
        g.consume(s1)
        g.consume(s0)
        _check(g, world)
        assert not s0.armed and not s1.armed
        g.close()

    result = {}

    def run():
        try:
            run_ranks(world, rank_fn)
        except BaseException as e:  # (re-raised in the test's thread)
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    try:
        both_in_flight.wait(20)
        net.release()
        released.wait(20)
    finally:
        net.release()
        t.join(30)
    if "error" in result:
        raise result["error"]


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_ranks_launching_in_different_orders_still_issue_in_the_plans(op):
    """Each rank's backward finishes its buckets in its own order; the engine issues
    the plan's order on every rank, so the pairs match on a wire without tags."""
    world = 3
    net = FakeNetwork(world)
    sizes = [[3, 5], [4], [7]]
    plan = plan_of(world, sizes, order=[(2, 0), (0, 0), (1, 0)])

    def rank_fn(rank):
        g = bucket_group(net.transport(rank), plan, sizes, op=op)
        for _ in range(2):  # two steps: the second round issues the same sequence
            order = list(g.states) if rank % 2 == 0 else list(reversed(g.states))
            for s in order:
                g.open(s, apply_pending=None)
                _fill(g, s, rank)  # (after zero_grad: .grad None, autograd's own tensors)
                g.launch(s, pass_id=1)
            for s in g.states:
                g.consume(s)
            _check(g, world, scale=1.0 if op == "sum" else 1.0 / world)
            for s in g.states:  # zero_grad(): .grad None again
                for p in s.bucket.params:
                    p.grad = None
        g.close()

    run_ranks(world, rank_fn)


def test_a_rank_issuing_in_another_order_is_caught_on_the_wire():
    """The broken variant of the test above: rank 1 planned its own order. The fake
    pairs its first message with rank 0's, meant for another bucket, and says so."""
    net = FakeNetwork(2)

    def rank_fn(rank):
        order = ORDER if rank == 0 else list(reversed(ORDER))
        g = bucket_group(net.transport(rank), plan_of(2, SIZES, order=order), SIZES, timeout=5)
        for s in g.states:
            g.open(s, apply_pending=None)
            _fill(g, s, rank)
            g.launch(s, pass_id=1)
        for s in g.states:
            g.consume(s)

    with pytest.raises(AssertionError, match="different orders"):
        run_ranks(2, rank_fn)


def test_a_gradient_written_in_place_before_it_is_consumed_is_refused():
    """A reduced bucket not yet consumed is still the library's: a write into a
    ``.grad`` then (``p.grad.zero_()``, ``zero_grad(set_to_none=False)`` after
    backward) is an error naming the bucket, not a wrong number trained on."""
    net = FakeNetwork(2)
    plan = plan_of(2, SIZES, order=ORDER)

    def rank_fn(rank):
        g = bucket_group(net.transport(rank), plan, SIZES)
        for s in g.states:
            g.open(s, apply_pending=None)
            _fill(g, s, rank)
            g.launch(s, pass_id=1)
        deadline = time.monotonic() + 10
        while not (g.engine.done(0) and g.engine.done(1)) and time.monotonic() < deadline:
            time.sleep(0.001)  # (done() never blocks: the channel's completed count)
        if rank == 0:
            g.states[0].bucket.params[1].grad.add_(1.0)  # in place, not consumed yet
        g.consume(g.states[1])  # not written: fine
        if rank == 0:
            with pytest.raises(HybridCommError, match="bucket 0 .*written in place"):
                g.consume(g.states[0])
        else:
            g.consume(g.states[0])
        g.close()

    run_ranks(2, rank_fn)


def test_a_gradient_after_the_launch_reopens_the_bucket_for_a_whole_round():
    """A late gradient (a second backward pass) for a bucket whose launch waits for
    its turn: the bucket is not written (its launch may go any moment); it is marked
    for another round, which launches every bucket again."""
    net = FakeNetwork(1)
    plan = plan_of(1, SIZES, order=ORDER)
    g = bucket_group(net.transport(0), plan, SIZES)
    s0, s1 = g.states
    g.open(s0, apply_pending=None)
    _fill(g, s0, 0)
    g.launch(s0, pass_id=1)
    assert s0.phase is Phase.LAUNCHED
    assert g.open(s0, apply_pending=None) is False and s0.reopened and g.needs_round()
    g.zero_in_place()  # zero_grad(set_to_none=False) now: separate zeros, the launch kept
    assert all(p.grad is not v for p, v in zip(s0.bucket.params, s0.bucket.views))
    assert all(p.grad.eq(0).all() for p in s0.bucket.params)
    g.close()


def test_only_the_diagrams_edges_are_taken():
    net = FakeNetwork(1)
    g = bucket_group(net.transport(0), plan_of(1, SIZES), SIZES)
    s0 = g.states[0]
    with pytest.raises(HybridCommError, match="cannot go from idle to in flight"):
        g.to(s0, Phase.IN_FLIGHT)
    with pytest.raises(HybridCommError, match="launched from idle"):
        g.launch(s0, pass_id=1)
    g.close()
