"""The engine on its own: the host channel, the fixed issue order whatever order the
buckets are launched in, and the buckets' memory layout (each .grad a view)."""

import threading
import time

import pytest
import torch

from hybridcomm.sync.buckets import GradBucket
from hybridcomm.comm.channel import HostChannel
from hybridcomm.comm.engine import CommEngine
from hybridcomm.base.errors import HybridCommError, HybridCommTimeout
from hybridcomm.plan.planner import ALIGN_BYTES, Bucket, Plan

pytestmark = pytest.mark.fast  # in this process alone (tests/tiers.py)


def test_host_channel_runs_in_submission_order_and_reports_failures():
    ch = HostChannel(timeout=5)
    seen = []
    tickets = [
        ch.submit(lambda i=i: (time.sleep(0.01 * (3 - i)), seen.append(i)), f"op {i}")
        for i in range(3)
    ]
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
    started = threading.Event()
    t = ch.submit(lambda: (started.set(), time.sleep(2)), "slow")
    assert started.wait(5)  # (running on the channel's thread, so the wait cannot take it)
    t0 = time.monotonic()
    with pytest.raises(HybridCommTimeout, match="bucket 3 not reduced within 0.3s"):
        ch.wait(t, "bucket 3")
    assert time.monotonic() - t0 < 1.5


def test_an_operation_waited_for_at_once_runs_in_its_caller_after_what_came_before(monkeypatch):
    ch = HostChannel(timeout=5)
    ran = []
    here = ch.submit(lambda: ran.append(threading.current_thread()), "op", here=True)
    assert ch.done(here) and ran == [threading.current_thread()]  # no hand-off
    # behind an operation still running on the channel's thread: after it, still here
    slow = ch.submit(lambda: (time.sleep(0.2), ran.append("slow")), "slow op")
    after = ch.submit(lambda: ran.append(threading.current_thread()), "op", here=True)
    assert ch.done(slow) and ch.done(after)
    assert ran[1] == "slow" and ran[2] is threading.current_thread()
    ch.close()
    monkeypatch.setenv("HYBRIDCOMM_HOST_HERE", "0")  # off: the channel's thread runs it all
    ch = HostChannel(timeout=5)
    ch.wait(ch.submit(lambda: ran.append(threading.current_thread()), "op", here=True), "op")
    assert ran[3] is not threading.current_thread()
    ch.close()


class _LateWorker(HostChannel):
    """A channel whose thread wakes late (as it may on a busy machine)."""

    def _run(self):
        time.sleep(0.5)
        super()._run()


def test_a_wait_runs_an_operation_the_channel_has_not_started_in_its_caller(monkeypatch):
    ch = _LateWorker(timeout=5)
    ran = []
    first = ch.submit(lambda: ran.append(("first", threading.current_thread())), "op 0")
    second = ch.submit(lambda: ran.append(("second", threading.current_thread())), "op 1")
    t0 = time.monotonic()
    ch.wait(second, "bucket 1")  # both not started: this thread runs them, in order
    assert time.monotonic() - t0 < 0.4 and ch.done(first)
    assert ran == [("first", threading.current_thread()), ("second", threading.current_thread())]
    bad = ch.submit(lambda: 1 / 0, "the bad op")
    with pytest.raises(HybridCommError, match="failed at the bad op.*division by zero"):
        ch.wait(bad, "bucket 2")  # run here, and failing as on the channel's thread
    ch.close()
    ch, notes = _LateWorker(timeout=5), []  # watched as a wait would be: once
    slow = ch.submit(lambda: time.sleep(0.8), "slow op")
    ch.wait(
        slow, "bucket 3", on_slow=lambda: notes.append(threading.current_thread()), slow_after=0.1
    )
    assert len(notes) == 1 and notes[0] is not threading.current_thread()
    ch.close()
    monkeypatch.setenv("HYBRIDCOMM_HOST_HERE", "0")  # off: the channel's thread runs it
    ch = _LateWorker(timeout=5)
    ch.wait(ch.submit(lambda: ran.append(("off", threading.current_thread())), "op"), "op")
    assert ran[-1][1] is not threading.current_thread()
    ch.close()


def test_an_operation_run_in_its_caller_is_watched_as_a_wait_would_be():
    """The stall inspector's call: once, when it has run ``slow_after`` seconds, from
    the idle channel thread; its note ends the failure's message."""
    ch = HostChannel(timeout=5)
    notes = []

    def on_slow():
        notes.append(threading.current_thread())
        return "rank 1 is behind"

    ch.submit(lambda: time.sleep(0.05), "quick", here=True, on_slow=on_slow, slow_after=0.3)
    ch.submit(lambda: time.sleep(0.6), "slow", here=True, on_slow=on_slow, slow_after=0.1)
    assert len(notes) == 1 and notes[0] is not threading.current_thread()
    bad = ch.submit(
        lambda: (time.sleep(0.6), 1 / 0), "bad", here=True, on_slow=on_slow, slow_after=0.1
    )
    with pytest.raises(
        HybridCommError,
        match=r"failed at bad.*division by zero \(rank 1 is "
        r"behind\)",
    ):
        ch.wait(bad, "bucket 0")
    assert len(notes) == 2


class _Recording:
    """A channel that runs nothing and remembers what was submitted, in order."""

    stream_ordered = False

    def __init__(self):
        self.log, self.keys = [], []

    def submit(self, fn, what, key=None):
        self.log.append(what)
        self.keys.append(key)
        return len(self.log)

    def wait(self, ticket, what):
        return 0.0

    def take_busy(self):
        return 0.0

    def close(self):
        pass


class _Transport:
    rank, world_size = 0, 2


def _buckets(plan, params):
    return [
        GradBucket(
            b,
            [params[i] for i in b.params],
            torch.float32,
            None,
            lambda n, dt: torch.empty(n, dtype=dt),
        )
        for b in plan.buckets
    ]


def test_the_issue_order_is_the_plans_whatever_the_launch_order():
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    buckets = [
        Bucket(i, [f"l{i}"], [i], 4, 16, "ring", 0.0, segments=[(0, 3), (3, 5)]) for i in range(3)
    ]
    order = [(2, 0), (0, 0), (2, 1), (0, 1), (1, 0), (1, 1)]  # what rank 0 planned for all
    plan = Plan(2, "hybrid", buckets, order)
    ch = _Recording()
    engine = CommEngine(plan, _buckets(plan, params), ch, _Transport(), scale=None, timeout=5)
    for i in (0, 1):  # launched in another order than issued: nothing may jump the queue
        engine.launch(i)
    assert ch.log == []  # (2, 0) comes first, and bucket 2 is not launched yet
    assert not engine.issued(0) and not engine.issued(1)
    engine.launch(2)
    assert ch.log == [f"bucket {b} segment {s}" for b, s in order]
    assert all(engine.issued(i) for i in range(3))
    # the next round issues the same sequence again, from the start
    for i in (2, 1, 0):
        engine.launch(i)
    assert ch.log[6:] == ch.log[:6]


def test_operations_are_keyed_for_timing_only_when_asked():
    """The synchronizer takes each operation's time every step; an engine whose
    owner never takes them (the averager's) must not have the channel keep them."""
    params = [torch.nn.Parameter(torch.ones(2))]
    plan = Plan(
        2, "hybrid", [Bucket(0, ["l0"], [0], 2, 8, "ring", 0.0, segments=[(0, 3)])], [(0, 0)]
    )
    for timed, want in ((False, [None]), (True, [(plan, 0, 0)])):
        ch = _Recording()
        CommEngine(
            plan, _buckets(plan, params), ch, _Transport(), scale=None, timeout=5, timed_ops=timed
        ).launch(0)
        assert ch.keys == want


def test_waiting_for_a_bucket_before_its_turn_is_an_error_not_a_hang():
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
    buckets = [Bucket(i, [f"l{i}"], [i], 2, 8, "ring", 0.0, segments=[(0, 3)]) for i in range(2)]
    plan = Plan(2, "hybrid", buckets, [(1, 0), (0, 0)])
    engine = CommEngine(
        plan, _buckets(plan, params), _Recording(), _Transport(), scale=None, timeout=5
    )
    engine.launch(0)  # queued behind bucket 1, which was never launched
    with pytest.raises(HybridCommError, match="before its turn"):
        engine.wait(0)


def test_each_grad_is_an_aligned_view_of_one_buffer_with_the_flags_after():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 1, 33)]
    spec = Bucket(0, ["l"], [0, 1, 2], 37, 148, "ring", 0.0)
    b = GradBucket(spec, params, torch.float32, None, lambda n, dt: torch.full((n,), 7.0))
    step = ALIGN_BYTES // 4
    assert b.offsets == [0, step, 2 * step]
    assert b.buffer.numel() == 2 * step + 33 + 3 and b.buffer.eq(0).all()  # zeroed, padding too
    for pos, p in enumerate(params):
        b.bind(pos)
        assert p.grad is b.views[pos] and b.holds(pos)
        assert p.grad.data_ptr() == b.buffer.data_ptr() + 4 * b.offsets[pos]
    params[0].grad.add_(torch.tensor([1.0, 2.0, 3.0]))  # autograd's in-place accumulation
    assert b.buffer[:3].tolist() == [1, 2, 3]
    b.set_flags({0, 2})
    assert b.flags.tolist() == [1, 0, 1]
    assert b.used() == [0, 2]
    b.set_flags({0, 1, 2})
    assert b.used() == [0, 1, 2]
    b.zero([0])
    assert b.views[0].eq(0).all() and b.flags.tolist() == [1, 1, 1]


def test_a_wire_dtype_is_a_second_buffer_cast_in_and_out():
    params = [torch.nn.Parameter(torch.zeros(5))]
    spec = Bucket(0, ["l"], [0], 5, 10, "ring", 0.0)
    b = GradBucket(
        spec, params, torch.float32, torch.float16, lambda n, dt: torch.empty(n, dtype=dt)
    )
    assert b.comm.dtype == torch.float16 and b.buffer.dtype == torch.float32
    b.views[0].copy_(torch.tensor([1.0, 2.0, 3.0, 4.0, 1 / 3]))
    b.set_flags({0})
    b.to_wire()
    b.wire.mul_(2)
    b.from_wire()
    assert b.views[0][:4].tolist() == [2, 4, 6, 8] and b.flags.tolist() == [2]
    assert b.views[0][4].item() == torch.tensor(2 / 3, dtype=torch.float16).item()
