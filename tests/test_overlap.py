"""The overlap engine on its own: the host channel, the bucket lifecycle, and the
fixed issue order whatever order the buckets are launched in."""
import time

import pytest
import torch

from hybridcomm.errors import HybridCommError, HybridCommTimeout
from hybridcomm.overlap import BucketState, CommEngine, HostChannel, Phase
from hybridcomm.planner import Bucket, Plan


def test_host_channel_runs_in_submission_order_and_reports_failures():
    ch = HostChannel(timeout=5)
    seen = []
    tickets = [ch.submit(lambda i=i: (time.sleep(0.01 * (3 - i)), seen.append(i)), f"op {i}")
               for i in range(3)]
    assert ch.wait(tickets[-1], "op 2") >= 0 and seen == [0, 1, 2]
    assert ch.take_busy() > 0 and ch.take_busy() == 0  # read once
    bad = ch.submit(lambda: 1 / 0, "the bad op")
    with pytest.raises(HybridCommError, match="failed at the bad op.*division by zero"):
        ch.wait(bad, "bucket 7")
    assert ch.failure is not None
    with pytest.raises(HybridCommError, match="closed"):
        ch.submit(lambda: None, "after")  # a failed channel takes nothing more


def test_host_channel_wait_honours_the_timeout():
    ch = HostChannel(timeout=0.3)
    t = ch.submit(lambda: time.sleep(2), "slow")
    t0 = time.monotonic()
    with pytest.raises(HybridCommTimeout, match="bucket 3 not reduced within 0.3s"):
        ch.wait(t, "bucket 3")
    assert time.monotonic() - t0 < 1.5


class _Recording:
    """A channel that runs nothing and remembers what was submitted, in order."""

    stream_ordered = False

    def __init__(self):
        self.log = []

    def submit(self, fn, what):
        self.log.append(what)
        return len(self.log)

    def wait(self, ticket, what):
        return 0.0

    def take_busy(self):
        return 0.0

    def close(self):
        pass


class _Transport:
    rank, world_size = 0, 2


def _states(plan, params):
    return [BucketState(b, [params[i] for i in b.params], torch.float32,
                        lambda n, dt: torch.zeros(n, dtype=dt)) for b in plan.buckets]


def test_the_issue_order_is_the_plans_whatever_the_launch_order():
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    for p in params:
        p.grad = torch.ones(4)
    buckets = [Bucket(i, [f"l{i}"], [i], 4, 16, "ring", 0.0, segments=[(0, 3), (3, 5)])
               for i in range(3)]
    order = [(2, 0), (0, 0), (2, 1), (0, 1), (1, 0), (1, 1)]  # what rank 0 planned for all
    plan = Plan(2, "hybrid", buckets, order)
    states = _states(plan, params)
    ch = _Recording()
    engine = CommEngine(plan, states, ch, _Transport(), scale=None, timeout=5)
    for i in (0, 1):  # launched in another order than issued: nothing may jump the queue
        engine.launch(states[i])
    assert ch.log == []  # (2, 0) comes first, and bucket 2 is not launched yet
    engine.launch(states[2])
    assert ch.log == [f"bucket {b} segment {s}" for b, s in order]
    assert all(st.phase is Phase.IN_FLIGHT for st in states)
    # the next iteration issues the same sequence again, from the start
    for st in states:
        st.phase = Phase.IDLE
    for i in (2, 1, 0):
        engine.launch(states[i])
    assert ch.log[6:] == ch.log[:6]


def test_waiting_for_a_bucket_before_its_turn_is_an_error_not_a_hang():
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
    buckets = [Bucket(i, [f"l{i}"], [i], 2, 8, "ring", 0.0, segments=[(0, 3)]) for i in range(2)]
    plan = Plan(2, "hybrid", buckets, [(1, 0), (0, 0)])
    states = _states(plan, params)
    engine = CommEngine(plan, states, _Recording(), _Transport(), scale=None, timeout=5)
    engine.launch(states[0])  # queued behind bucket 1, which was never launched
    with pytest.raises(HybridCommError, match="before its turn"):
        engine.wait(states[0])


def test_pack_takes_what_one_process_would_see():
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    params[0].grad = torch.tensor([1.0, 2.0, 3.0])
    params[2].grad = torch.tensor([4.0, 5.0, 6.0])  # params[1]: no gradient (unused)
    b = Bucket(0, ["l"], [0, 1, 2], 9, 36, "ring", 0.0, segments=[(0, 12)])
    st = BucketState(b, params, torch.float32, lambda n, dt: torch.full((n,), 7.0, dtype=dt))
    st.pack()
    assert st.buffer.tolist() == [1, 2, 3, 0, 0, 0, 4, 5, 6, 1, 0, 1]  # grads, then flags
    assert not st.complete  # this rank lacked one: the flags must be read after the sum
    params[1].grad = torch.ones(3)
    st.pack()
    assert st.complete and st.used() == [0, 1, 2]  # all present: nothing read back
