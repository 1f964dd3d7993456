"""The simulated CUDA runtime: every check it makes is shown to fire on a broken
variant (a mutation test) and to stay quiet on the correct one.

Each scenario runs in forked rank processes with HYBRIDCOMM_SIMULATE_GPU=1
(the simulator watches its thread's torch calls for the rest of the process).
"""

import os
import time

import pytest
import torch

from multiproc import run_ranks


def _sim(rank, world, scenario, *args):
    os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    os.environ.setdefault("HYBRIDCOMM_SIM_DEADLOCK_S", "3")
    from hybridcomm.testing import simgpu

    rt = simgpu.runtime()
    try:
        out = scenario(rank, world, rt, simgpu, *args)
    except simgpu.SimError as e:
        return ("SimError", str(e))
    return ("ok", out, [str(e) for e in simgpu.errors()])


def run(world, scenario, *args, timeout=90):
    return run_ranks(world, _sim, scenario, *args, timeout=timeout)


# --- streams, events, host syncs --------------------------------------------------------


def _after_current(rt, stream):
    """``stream`` waits for what the current stream has queued so far."""
    ev = rt.new_event()
    ev.record(rt.current_stream())
    stream.wait_event(ev)


def _late_and_ordered(rank, world, rt, simgpu):
    """Work on a side stream completes late; an event orders the host after it."""
    side = rt.new_stream()
    buf = rt.empty(1000, torch.float32)
    buf.zero_()
    _after_current(rt, side)
    from hybridcomm.kernels import reduce

    with rt.use(side):
        reduce(buf, torch.ones(1000))  # enqueued: runs when the stream gets to it
    done = rt.new_event()
    done.record(side)
    right_after = done.query()
    rt.current_stream().wait_event(done)
    total = buf.sum().item()  # a host read, ordered after the event
    stats = simgpu.stats()
    return right_after, total, stats["kernel_launches"], stats["host_syncs"]


def test_streams_run_late_and_events_order_them():
    ((status, (right_after, total, launches, syncs), errors),) = run(1, _late_and_ordered)
    assert status == "ok" and errors == []
    assert right_after is False  # the kernel had not run when the host went on
    assert total == 1000.0 and launches == 1 and syncs == 1


def _untimed_elapsed(rank, world, rt, simgpu, timing):
    start, end = rt.new_event(timing=timing), rt.new_event(timing=timing)
    start.record(rt.current_stream())
    end.record(rt.current_stream())
    end.synchronize()
    return start.elapsed_time(end) >= 0


@pytest.mark.parametrize("timing", [True, False])
def test_elapsed_time_needs_events_made_with_timing(timing):
    """As CUDA: elapsed_time() on an event made with timing disabled fails."""
    (result,) = run(1, _untimed_elapsed, timing)
    if timing:
        assert result[0] == "ok" and result[1] is True, result
    else:
        assert result[0] == "SimError" and "without timing" in result[1], result


def _host_read_before_event(rank, world, rt, simgpu, wait):
    side = rt.new_stream()
    buf = rt.empty(1000, torch.float32)
    buf.zero_()
    _after_current(rt, side)
    from hybridcomm.kernels import reduce

    with rt.use(side):
        reduce(buf, torch.ones(1000))
    if wait:
        rt.current_stream().wait_event(side.record_event())
    return buf.tolist()[0]


@pytest.mark.parametrize("wait", [True, False])
def test_a_host_read_before_the_event_is_a_race(wait):
    result = run(1, _host_read_before_event, wait)[0]
    if wait:
        assert result[0] == "ok" and result[1] == 1.0
    else:
        assert result[0] == "SimError"
        assert "race" in result[1] and "host tolist()" in result[1] and "reduce" in result[1]


def _cross_stream_kernel_without_wait(rank, world, rt, simgpu, wait):
    a, b = rt.new_stream(), rt.new_stream()
    buf = rt.empty(256, torch.float32)
    src = rt.empty(256, torch.float32)
    from hybridcomm.kernels import reduce

    with rt.use(a):
        src.fill_(1)
        reduce(buf, src)  # writes buf on a
    if wait:
        b.wait_event(a.record_event())
    with rt.use(b):
        reduce(src, buf)  # reads buf on b
    rt.synchronize()
    simgpu.check()
    return "done"


@pytest.mark.parametrize("wait", [True, False])
def test_a_kernel_on_another_stream_without_an_event_is_a_race(wait):
    result = run(1, _cross_stream_kernel_without_wait, wait)[0]
    if wait:
        assert result[:2] == ("ok", "done") and result[2] == []
    else:
        assert result[0] == "SimError" and "race" in result[1]
        # it names both operations and their streams
        assert result[1].count("reduce") >= 2 and "stream" in result[1]


def _h2d_copies(rank, world, rt, simgpu):
    """Host syncs of copies into device memory, one kind of source at a time."""
    dev = rt.empty(8, torch.float32)
    dev.zero_()
    made_on_device = torch.zeros(8, device=rt.device)  # device= given: device memory on a GPU
    host = torch.zeros(8)  # no device: pageable host memory
    host[[1, 3]] = 1
    counts = {}
    for name, copy in (
        ("pageable", lambda: dev.copy_(host)),
        ("pageable view", lambda: dev[:4].copy_(host[:4])),
        ("made from host", lambda: dev.copy_(host.float() * 2)),
        ("pageable non_blocking", lambda: dev.copy_(host, non_blocking=True)),
        ("device", lambda: dev.copy_(made_on_device)),
        ("made from device", lambda: dev.copy_(made_on_device + 1)),
        ("device to host", lambda: host.copy_(dev)),
        ("host to host", lambda: host.copy_(host.float() * 2)),
        ("fill", lambda: dev[2:5].fill_(1)),
    ):
        before = simgpu.stats()["host_syncs"]
        copy()
        counts[name] = simgpu.stats()["host_syncs"] - before
    return counts


def test_a_copy_between_pageable_host_memory_and_the_device_is_a_host_sync():
    """ATen copies between host and device with memcpy_and_sync (the stream
    synchronized) unless non_blocking with the host side pinned (no pinned memory
    exists without CUDA); a copy between device tensors, or a fill, is queued."""
    ((status, counts, errors),) = run(1, _h2d_copies)
    assert status == "ok" and errors == [], (status, errors)
    assert counts == {
        "pageable": 1,
        "pageable view": 1,
        "made from host": 1,
        "pageable non_blocking": 1,
        "device": 0,
        "made from device": 0,
        "device to host": 1,
        "host to host": 0,
        "fill": 0,
    }, counts


# --- the allocator ----------------------------------------------------------------------


def _reuse(rank, world, rt, simgpu, record):
    slow = rt.new_stream()
    scratch = rt.empty(4096, torch.float32)  # allocated on the default stream
    scratch.zero_()
    out = rt.empty(4096, torch.float32)
    _after_current(rt, slow)
    from hybridcomm.kernels import reduce

    with rt.use(slow):
        for _ in range(20):  # long queue: the last use of scratch runs late
            reduce(out, scratch)
    if record:
        rt.record_stream(scratch, slow)
    del scratch  # back to the pool of the default stream
    again = rt.empty(4096, torch.float32)  # same size, same stream: the same block if free
    again.fill_(7)
    rt.synchronize()
    simgpu.check()
    return "done"


@pytest.mark.parametrize("record", [True, False])
def test_reusing_a_block_used_on_another_stream_needs_record_stream(record):
    result = run(1, _reuse, record)[0]
    if record:
        assert result[:2] == ("ok", "done") and result[2] == []
    else:
        assert result[0] == "SimError"
        assert "allocator" in result[1] and "record_stream" in result[1]


def _user_memory_recorded(rank, world, rt, simgpu):
    """A user tensor given to record_stream, then work queued on that stream, then
    the tensor dropped: whether the simulator still holds it while that work runs,
    and once the stream is idle."""
    import gc
    import weakref

    side = rt.new_stream()
    user = torch.zeros(1000)  # not from the simulated allocator (a DDP bucket, say)
    rt.record_stream(user, side)
    with rt.use(side):
        simgpu.sleep(1.0)  # queued after record_stream, before the free
    ref = weakref.ref(user)
    del user
    gc.collect()
    time.sleep(0.2)  # whatever was queued before record_stream has run by now
    rt.record_stream(torch.zeros(1), side)  # the next call lets go of what is done
    held_while_busy = ref() is not None
    side.synchronize()
    rt.record_stream(torch.zeros(1), side)
    gc.collect()
    return held_while_busy, ref() is None


def test_user_memory_given_to_record_stream_outlives_the_work_queued_before_its_free():
    """The caching allocator reuses a block only after the work its recorded streams
    had queued when it was freed: memory DDP made is held as long."""
    ((status, (held_while_busy, freed_when_idle), errors),) = run(1, _user_memory_recorded)
    assert status == "ok" and errors == []
    assert held_while_busy and freed_when_idle


# --- devices ----------------------------------------------------------------------------


def _helper_thread(rank, world, rt, simgpu, bind):
    import threading

    ev = rt.new_event()
    ev.record(rt.current_stream())

    def watch():
        if bind:
            rt.bind_thread()
        ev.query()

    t = threading.Thread(target=watch)
    t.start()
    t.join()
    return [str(e) for e in simgpu.errors()]


@pytest.mark.parametrize("bind", [True, False])
def test_a_helper_thread_must_bind_to_the_ranks_device(bind):
    results = run(2, _helper_thread, bind)
    errors = results[1][1]  # rank 1's GPU is 1; a fresh thread's current device is 0
    if bind:
        assert errors == []
    else:
        assert len(errors) == 1 and "context on GPU 0" in errors[0] and "GPU is 1" in errors[0]


# --- NCCL -------------------------------------------------------------------------------


def _comm(rt, simgpu, world, rank, name):
    import torch.distributed as dist

    from hybridcomm.comm.transport.cupy_nccl import unique_id_bytes

    nccl = rt.nccl()
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set(name, unique_id_bytes(nccl.get_unique_id()))
    uid = bytes(store.get(name))
    from hybridcomm.comm.transport.cupy_nccl import make_communicator

    return nccl, make_communicator(nccl, world, uid, rank)


def _opposite_orders(rank, world, rt, simgpu, opposite):
    nccl, c1 = _comm(rt, simgpu, world, rank, "c1")
    _, c2 = _comm(rt, simgpu, world, rank, "c2")
    s1, s2 = rt.new_stream(), rt.new_stream()
    a, b = rt.empty(64, torch.float32), rt.empty(64, torch.float32)
    peer = 1 - rank
    order = [(c1, s1, a), (c2, s2, b)]

    def groups():  # one send+recv group per communicator, own stream
        for comm, stream, buf in order:
            nccl.groupStart()
            comm.send(buf.data_ptr(), 32, nccl.NCCL_FLOAT32, peer, rt.handle(stream))
            comm.recv(buf.data_ptr() + 128, 32, nccl.NCCL_FLOAT32, peer, rt.handle(stream))
            nccl.groupEnd()

    # NCCL connects on first use, in groupEnd, waiting for the peer: first uses in
    # opposite orders would deadlock the hosts already. Connect both in one order.
    groups()
    s1.synchronize()
    s2.synchronize()
    if opposite and rank == 1:
        order.reverse()
    groups()
    # Wait for what is being tested: both done, or a deadlock reported (3 s in).
    deadline = time.monotonic() + 60
    while (
        time.monotonic() < deadline
        and not (s1.query() and s2.query())
        and not any("deadlock" in str(e) for e in simgpu.errors())
    ):
        time.sleep(0.05)
    return s1.query() and s2.query(), [str(e) for e in simgpu.errors()]


@pytest.mark.parametrize("opposite", [False, True])
def test_communicators_in_opposite_orders_deadlock_with_one_kernel_slot(opposite):
    import re

    for status, (finished, errors) in [(r[0], r[1]) for r in run(2, _opposite_orders, opposite)]:
        assert status == "ok"
        if opposite:  # each rank names both communicators in its report
            deadlocks = [e for e in errors if "deadlock" in e]
            assert len(deadlocks) == 1, errors
            assert len(set(re.findall(r"comm-[0-9a-f]{6}", deadlocks[0]))) == 2
        else:
            assert finished and errors == []


def _first_use(rank, world, rt, simgpu):
    """NCCL connects on first use: groupEnd blocks the host until the peer posts its
    side; a connected pair does not wait; an abort from another thread unblocks it."""
    import threading

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    nccl, c1 = _comm(rt, simgpu, world, rank, "f1")
    _, c2 = _comm(rt, simgpu, world, rank, "f2")
    s = rt.new_stream()
    buf = rt.empty(64, torch.float32)
    peer = 1 - rank

    def group(comm):
        t0 = time.monotonic()
        nccl.groupStart()
        comm.send(buf.data_ptr(), 32, nccl.NCCL_FLOAT32, peer, rt.handle(s))
        comm.recv(buf.data_ptr() + 128, 32, nccl.NCCL_FLOAT32, peer, rt.handle(s))
        nccl.groupEnd()
        return time.monotonic() - t0

    if rank == 1:
        time.sleep(1.0)  # late to its first group
        group(c1)
        group(c1)
        store.wait(["first-use/done"])  # never posts on c2
        s.synchronize()
        return None
    first, again = group(c1), group(c1)
    threading.Timer(0.5, c2.abort).start()
    t0 = time.monotonic()
    try:
        group(c2)
        status = None
    except nccl.NcclError as e:
        status = e.status
    aborted_after = time.monotonic() - t0
    store.set("first-use/done", "1")
    s.synchronize()
    return first, again, status, aborted_after


def test_group_end_blocks_on_first_use_until_the_peer_posts_or_an_abort():
    (status, (first, again, error, aborted_after), errors), _ = run(2, _first_use)
    # The abort from another thread overlaps the blocked groupEnd: it unblocks it (as
    # NCCL's abort flag does) and is reported, the one communicator used by two threads
    assert status == "ok" and len(errors) == 1, errors
    assert "abort() on thread 'Thread-" in errors[0] and "inside groupEnd()" in errors[0]
    assert "two threads at once" in errors[0]
    assert first > 0.8  # waited for rank 1's first group (posted 1 s late)
    assert again < 0.5  # connected: queued without waiting
    assert error == 3 and 0.4 < aborted_after < 3  # ncclInternalError once aborted


def _mismatched_sizes(rank, world, rt, simgpu):
    nccl, comm = _comm(rt, simgpu, world, rank, "m")
    s = rt.new_stream()
    buf = rt.empty(64, torch.float32)
    n = 16 if rank == 0 else 8  # rank 1 expects another size: issue orders differ
    nccl.groupStart()
    comm.send(buf.data_ptr(), n, nccl.NCCL_FLOAT32, 1 - rank, rt.handle(s))
    comm.recv(buf.data_ptr() + 128, n, nccl.NCCL_FLOAT32, 1 - rank, rt.handle(s))
    nccl.groupEnd()
    s.synchronize()
    try:
        comm.check_async_error()
    except nccl.NcclError as e:
        return "async error", str(e), [str(x) for x in simgpu.errors()]
    return "no error", "", []


def test_a_size_mismatch_is_an_async_error_and_a_report():
    for status, (what, _, errors) in [(r[0], r[1]) for r in run(2, _mismatched_sizes)]:
        assert status == "ok" and what == "async error"
        assert any("different orders" in e for e in errors)


def _unique_id_style(rank, world, rt, simgpu):
    import hybridcomm

    t = torch.full((10,), float(rank + 1))
    hybridcomm.all_reduce(t, algorithm="ring", timeout=30)
    return t.tolist()


@pytest.mark.parametrize("style", ["bytes", "tuple"])
def test_both_cupy_unique_id_styles(style, monkeypatch):
    monkeypatch.setenv("HYBRIDCOMM_SIM_CUPY_UID", style)  # 14: bytes; 13: tuple of signed chars
    for status, values, errors in run(3, _unique_id_style):
        assert status == "ok" and errors == [] and values == [6.0] * 10


def _signed_chars_only(rank, world, rt, simgpu):
    try:  # CuPy 13's communicator copies the tuple into a char[128]
        rt.nccl().NcclCommunicator(1, tuple(bytes(range(0, 256, 2))), 0)
    except OverflowError as e:
        return str(e)
    return "accepted"


def test_cupy13_style_ids_must_be_signed_chars(monkeypatch):
    monkeypatch.setenv("HYBRIDCOMM_SIM_CUPY_UID", "tuple")
    ((status, message, errors),) = run(1, _signed_chars_only)
    assert status == "ok" and "convert to char" in message


def _use_after_free(rank, world, rt, simgpu):
    nccl, comm = _comm(rt, simgpu, world, rank, "u")
    comm.check_async_error()  # alive: fine
    comm.abort()
    try:
        comm.check_async_error()
        status = None
    except nccl.NcclError as e:
        status = e.status
    comm.abort()
    return status, [str(e) for e in simgpu.errors()]


def test_a_communicator_used_after_its_abort_is_reported():
    """ncclCommAbort frees the communicator: an async-error query after it (the
    watchdog's, racing an abort on another thread) or a second abort is reported."""
    for status, (error, errors) in [(r[0], r[1]) for r in run(2, _use_after_free)]:
        assert status == "ok" and error is not None
        assert len(errors) == 2, errors
        assert "check_async_error() on a communicator already aborted" in errors[0]
        assert "abort() on a communicator already aborted" in errors[1]
