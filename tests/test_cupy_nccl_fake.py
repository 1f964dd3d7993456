"""CupyNcclTransport, the real code, over a recording fake of CuPy's NCCL and CUDA streams.

P simulated ranks run in threads of this process; the fake moves bytes between
their host tensors when a send and a receive match (per pair, in order, no
tags). The real executor runs the real schedules over the transport, so these
tests check exact sums and, call by call, the pointers, counts, dtypes, peers,
grouping and stream order the transport issues.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hybridcomm.executor import execute_async
from fakes.fake_nccl import TORCH_TO_ENUM, FakeNcclWorld
from hybridcomm.algorithms import get_schedule
from hybridcomm.errors import HybridCommError, HybridCommTimeout
from hybridcomm.executor import execute
from hybridcomm.transport.cupy_nccl import CupyNcclTransport, nccl_dtypes

ALGOS = ("ring", "butterfly", "halving_doubling")
TIMEOUT = 10.0


def run_ranks(p, fn):
    """``fn(rank)`` on p threads; the results, re-raising the first error."""
    with ThreadPoolExecutor(p) as ex:
        futures = [ex.submit(fn, r) for r in range(p)]
        return [f.result(timeout=60) for f in futures]


def make_transports(world, stream_ordered=False):
    """One transport per simulated rank. ``stream_ordered=False`` keeps the
    executor on its host-wait path (the fake in non-blocking mode needs it)."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=TIMEOUT))
    ts = run_ranks(world.world_size, lambda r: CupyNcclTransport(
        nccl=world.module(r), streams=world.streams(r), store=store, rank=r,
        world_size=world.world_size))
    for t in ts:
        t.stream_ordered = stream_ordered
    return ts


def inputs(p, n, dtype, seed=0):
    # Small integers: every partial sum is exact in fp16/bf16/fp32, in any order.
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-8, 9, (n,), generator=g).to(dtype) for _ in range(p)]


def group_calls(calls):
    """The NCCL calls between each outermost groupStart/groupEnd, and the calls outside."""
    groups, outside, depth, current = [], [], 0, None
    for c in calls:
        if c.kind == "groupStart":
            depth += 1
            if depth == 1:
                current = (c.group, [])
        elif c.kind == "groupEnd":
            depth -= 1
            if depth == 0:
                assert c.group == current[0]
                groups.append(current)
        elif c.kind in ("send", "recv"):
            (current[1] if depth else outside).append(c)
    return groups, outside


def expected_calls(schedule, buf, scratch):
    """Per step: the (kind, peer, ptr, count, dtype) the transport must issue, in order."""
    isz, dt = buf.element_size(), TORCH_TO_ENUM[buf.dtype]
    steps = []
    for st in schedule.steps:
        calls = [("send", s.peer, buf.data_ptr() + s.start * isz, s.stop - s.start, dt)
                 for s in st.sends]
        offset = 0
        for r in st.recvs:
            if r.reduce:
                ptr = scratch.data_ptr() + offset * isz
                offset += r.stop - r.start
            else:
                ptr = buf.data_ptr() + r.start * isz
            calls.append(("recv", r.peer, ptr, r.stop - r.start, dt))
        steps.append(calls)
    return steps


def check_calls(world, rank, transport, schedule, buf, scratch, *, foreign=True):
    calls = world.calls[rank]
    comm = transport.stream.name
    groups, outside = group_calls(calls)
    assert outside == [], "every NCCL call must be inside a group"
    assert len({g for g, _ in groups}) == len(groups), "one group per step"
    got = [[(c.kind, c.peer, c.ptr, c.count, c.dtype) for c in group] for _, group in groups]
    assert got == expected_calls(schedule, buf, scratch)
    for _, group in groups:
        for c in group:
            assert c.stream == comm and c.group is not None
    # Stream order around each group: the comm stream waits for the caller's
    # stream first (when called from it); a done event is recorded after.
    kinds = [(c.kind, c.args.get("stream")) for c in calls if c.kind != "NcclCommunicator"]
    per_step = []
    for c in kinds:
        if c[0] in ("send", "recv", "record_stream"):
            continue
        per_step.append(c)
    if foreign:
        unit = [("record", "compute"), ("wait_event", comm), ("groupStart", None),
                ("groupEnd", None), ("record", comm)]
    else:
        unit = [("groupStart", None), ("groupEnd", None), ("record", comm)]
    assert per_step == unit * len(schedule.steps)
    if foreign:  # the allocator must hold the memory until the comm stream is done
        n_rs = sum(1 for c in calls if c.kind == "record_stream")
        assert n_rs == sum(len(s.sends) + len(s.recvs) for s in schedule.steps)
        assert all(c.stream == comm for c in calls if c.kind == "record_stream")
    # Event ids: the wait is on the event just recorded on the compute stream.
    rec = [c for c in calls if c.kind in ("record", "wait_event")]
    for a, b in zip(rec, rec[1:]):
        if b.kind == "wait_event":
            assert a.kind == "record" and a.stream == "compute" and a.event == b.event


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", [1, 7, 64, 1001])
def test_executor_over_cupy_transport_exact(algorithm, p, n):
    dtype = torch.float32
    world = FakeNcclWorld(p)
    ts = make_transports(world)
    bufs = inputs(p, n, dtype, seed=p * 1000 + n)
    want = torch.stack(bufs).sum(0)
    scheds = [get_schedule(algorithm, r, p, n) for r in range(p)]
    scratch = [torch.empty(s.scratch_numel, dtype=dtype) for s in scheds]
    run_ranks(p, lambda r: execute(scheds[r], bufs[r], ts[r], scratch=scratch[r],
                                   timeout=TIMEOUT))
    assert world.errors == [] and world.unmatched() == {}
    for r in range(p):
        assert torch.equal(bufs[r], want), f"rank {r}"
        check_calls(world, r, ts[r], scheds[r], bufs[r], scratch[r])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("algorithm", ALGOS)
def test_dtypes_and_avg(dtype, algorithm):
    p, n = 6, 333
    world = FakeNcclWorld(p)
    ts = make_transports(world)
    bufs = inputs(p, n, dtype, seed=7)
    want = torch.stack([b.float() for b in bufs]).sum(0)
    scheds = [get_schedule(algorithm, r, p, n) for r in range(p)]
    run_ranks(p, lambda r: execute(scheds[r], bufs[r], ts[r], scale=0.5, timeout=TIMEOUT))
    for r in range(p):
        # scale 1/2 of an integer sum is exact in every dtype here.
        assert torch.equal(bufs[r], (want * 0.5).to(dtype))
        assert torch.equal(bufs[r], bufs[0])  # bitwise identical on every rank
    sends = [c for c in world.calls[0] if c.kind == "send"]
    assert sends and all(c.dtype == TORCH_TO_ENUM[dtype] for c in sends)


@pytest.mark.parametrize("algorithm", ALGOS)
def test_pipelined_executor_over_cupy_transport(monkeypatch, algorithm):
    """The executor's pipelined host path keeps several groups in flight per rank."""
    from hybridcomm import executor

    monkeypatch.setattr(executor, "PIPELINE_BYTES", 64)
    p, n = 5, 1000
    world = FakeNcclWorld(p)
    ts = make_transports(world)
    bufs = inputs(p, n, torch.float32, seed=11)
    want = torch.stack(bufs).sum(0)
    scheds = [get_schedule(algorithm, r, p, n) for r in range(p)]
    assert executor.num_parts(scheds[0], 4) > 1
    run_ranks(p, lambda r: execute(scheds[r], bufs[r], ts[r], timeout=TIMEOUT))
    assert world.errors == [] and world.unmatched() == {}
    for r in range(p):
        assert torch.equal(bufs[r], want)
        assert group_calls(world.calls[r])[1] == []


def test_offset_views_send_by_pointer_no_copy():
    """A view deep inside a bigger tensor is sent from its own address."""
    world = FakeNcclWorld(2)
    t0, t1 = make_transports(world)
    big0 = torch.arange(100, dtype=torch.float32)
    big1 = torch.zeros(100, dtype=torch.float32)
    view0, view1 = big0[37:50], big1[60:73]
    run_ranks(2, lambda r: (t0.exchange([(1, view0)], []) if r == 0
                            else t1.exchange([], [(0, view1)])).wait(TIMEOUT))
    assert torch.equal(big1[60:73], big0[37:50]) and big1[:60].eq(0).all()
    send = next(c for c in world.calls[0] if c.kind == "send")
    assert send.ptr == big0.data_ptr() + 37 * 4 and send.count == 13


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("p", [3, 4])
def test_stream_ordered_path_no_host_wait(algorithm, p):
    """On the comm stream: no per-step waits at all; the consumer waits on one event."""
    n = 50
    world = FakeNcclWorld(p, blocking=True)  # the stream runs each group to completion
    ts = make_transports(world, stream_ordered=True)
    bufs = inputs(p, n, torch.float32, seed=3)
    want = torch.stack(bufs).sum(0) * 0.25  # exact: small integers times a power of two
    scheds = [get_schedule(algorithm, r, p, n) for r in range(p)]
    scratch = [torch.empty(s.scratch_numel) for s in scheds]

    def rank(r):
        streams = ts[r].streams
        done = execute_async(scheds[r], bufs[r], ts[r], scratch=scratch[r], scale=0.25)
        streams.current_stream().wait_event(done)
        return done.query()

    assert all(run_ranks(p, rank))
    for r in range(p):
        assert torch.equal(bufs[r], want)
        calls = world.calls[r]
        waits = [c for c in calls if c.kind == "wait_event"]
        # one wait of comm on the grads, one of compute on the result
        assert [(c.stream) for c in waits] == [ts[r].stream.name, "compute"]
        # the buffer is held for the comm stream once (the allocator must not reuse it)
        rs = [c for c in calls if c.kind == "record_stream"]
        assert len(rs) == 1 and rs[0].stream == ts[r].stream.name
        groups, outside = group_calls(calls)
        assert not outside
        got = [[(c.kind, c.peer, c.ptr, c.count, c.dtype) for c in g] for _, g in groups]
        assert got == expected_calls(scheds[r], bufs[r], scratch[r])


def test_unique_id_shared_through_store_one_per_communicator():
    world = FakeNcclWorld(3)
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=TIMEOUT))

    def make(r):
        mod, streams = world.module(r), world.streams(r)
        return [CupyNcclTransport(nccl=mod, streams=streams, store=store, rank=r, world_size=3)
                for _ in range(2)]  # two lanes on the same group

    run_ranks(3, make)
    assert len(world.unique_ids) == 2  # made on rank 0 only, once per communicator
    for r in range(3):
        uids = [c.uid for c in world.calls[r] if c.kind == "NcclCommunicator"]
        assert uids == world.unique_ids


def test_timeout_aborts_and_names_rank_step_peer():
    world = FakeNcclWorld(2)
    t0, _ = make_transports(world)  # rank 1 never posts anything
    buf = torch.ones(8)
    pending = t0.exchange([(1, buf[:4])], [(1, buf[4:])], label="ring step 0")
    with pytest.raises(HybridCommTimeout) as e:
        pending.wait(timeout=0.2)
    msg = str(e.value)
    assert "rank 0" in msg and "ring step 0" in msg and "to rank 1" in msg and "from rank 1" in msg
    assert [c.kind for c in world.calls[0]].count("abort") == 1
    with pytest.raises(HybridCommError, match="aborted"):
        t0.exchange([(1, buf[:4])], [])


def test_timeout_through_executor():
    world = FakeNcclWorld(3)
    ts = make_transports(world)
    sched = get_schedule("ring", 0, 3, 30)
    with pytest.raises(HybridCommTimeout, match="rank 0"):
        execute(sched, torch.ones(30), ts[0], timeout=0.2)


def test_async_error_aborts_with_clear_error():
    world = FakeNcclWorld(2)
    t0, _ = make_transports(world)
    pending = t0.exchange([], [(1, torch.empty(4))])
    world.async_error[0] = 6
    with pytest.raises(HybridCommError, match="NCCL error") as e:
        pending.wait(timeout=5.0)
    assert not isinstance(e.value, HybridCommTimeout)
    assert "abort" in [c.kind for c in world.calls[0]]


def test_order_mismatch_between_ranks_is_caught():
    """Rank 0 reduces bucket A then B, rank 1 B then A: NCCL would match the wrong
    messages (no tags). The fake matches the same way, so it is an error, not a pass."""
    p = 2
    world = FakeNcclWorld(p)
    ts = make_transports(world)
    a = [torch.ones(6) for _ in range(p)]
    b = [torch.ones(10) for _ in range(p)]

    def rank(r):
        order = [(a[r], 6), (b[r], 10)] if r == 0 else [(b[r], 10), (a[r], 6)]
        for buf, n in order:
            execute(get_schedule("ring", r, p, n), buf, ts[r], timeout=2.0)

    with pytest.raises(HybridCommError):
        run_ranks(p, rank)
    assert world.errors, "the fake must record the mismatched match"


@pytest.mark.parametrize("bad", ["peer", "self", "dtype", "contig", "device"])
def test_invalid_transfers_rejected_before_any_call(bad):
    world = FakeNcclWorld(2)
    t0, _ = make_transports(world)
    t = torch.ones(8)
    if bad == "peer":
        sends = [(2, t)]
    elif bad == "self":
        sends = [(0, t)]
    elif bad == "dtype":
        sends = [(1, torch.ones(4, dtype=torch.complex64))]
    elif bad == "contig":
        sends = [(1, torch.ones(4, 4).t()[0])]
    else:
        sends = [(1, torch.ones(4, device="meta"))]
    before = len(world.calls[0])
    with pytest.raises(HybridCommError, match="rank 0"):
        t0.exchange([(1, t[:2])] + sends, [])
    assert world.calls[0][before:] == []  # nothing half-issued


def test_dtype_map_matches_nccl_enums():
    world = FakeNcclWorld(1)
    assert nccl_dtypes(world.module(0)) == TORCH_TO_ENUM


def test_thread_safety_of_serials():
    """Transports for different groups made concurrently get distinct store keys."""
    world = FakeNcclWorld(1)
    store = dist.HashStore()
    barrier = threading.Barrier(4)

    def make(_):
        barrier.wait()
        return CupyNcclTransport(nccl=world.module(0), streams=world.streams(0), store=store,
                                 rank=0, world_size=1)

    run_ranks(4, make)
    assert store.num_keys() == 4


def test_watchdog_aborts_a_hung_stream_ordered_step():
    """The stream path never waits on the host: the watchdog turns a hang into an error."""
    world = FakeNcclWorld(2)  # non-blocking: rank 1 never posts, the step stays pending
    t0, _ = make_transports(world)
    t0.WATCHDOG_PERIOD_S = 0.01
    sched = get_schedule("ring", 0, 2, 8)
    done = execute_async(sched, torch.ones(8), t0, scratch=torch.empty(sched.scratch_numel),
                         timeout=0.1)
    deadline = time.monotonic() + 5
    while "abort" not in [c.kind for c in world.calls[0]] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "abort" in [c.kind for c in world.calls[0]]
    assert done.query()  # abort released the pending work
    with pytest.raises(HybridCommTimeout, match="rank 0: ring all-reduce of 8 x torch.float32 did not complete"):
        t0.exchange([(1, torch.ones(2))], [])


def test_watchdog_quiet_when_work_completes():
    world = FakeNcclWorld(2, blocking=True)
    ts = make_transports(world)
    scheds = [get_schedule("butterfly", r, 2, 6) for r in range(2)]
    bufs = [torch.ones(6), torch.ones(6)]
    run_ranks(2, lambda r: execute_async(scheds[r], bufs[r], ts[r],
                                         scratch=torch.empty(scheds[r].scratch_numel),
                                         timeout=0.2))
    time.sleep(0.4)
    assert all("abort" not in [c.kind for c in world.calls[r]] for r in range(2))
    assert all(torch.equal(b, torch.full((6,), 2.0)) for b in bufs)
    for t in ts:
        t.close()
