"""The overlap engine: bucket buffers, their lifecycle, and the one ordered channel.

A bucket goes through one explicit :class:`Phase` per iteration::

    IDLE --gradient ready--> FILLING --all ready / backward ends--> IN_FLIGHT
    IN_FLIGHT --step() (backward mode)--> IDLE           (reduced gradients consumed)
    IN_FLIGHT --step() (forward mode)--> PENDING --first use next forward--> IDLE

Launching a bucket packs its gradients into its buffer (one kernel launch)
and queues its segments on the **channel** as the plan's fixed issue order
reaches them: every rank issues the same (bucket, segment) sequence,
whatever its local timing. Two channels:

* :class:`HostChannel` (CPU, gloo): one worker thread runs the operations in
  order (gloo releases the GIL while it moves bytes); the trainer blocks on a
  bucket only where it needs the result, with the timeout.
* :class:`StreamChannel` (CUDA, or the simulated GPU): the trainer thread
  itself queues each operation on the transport's comm stream, after the
  gradients' ready event; the trainer's stream waits on the bucket's done
  event. No host thread, no host synchronization on the data path.
"""
from __future__ import annotations

import enum
import threading
import time
from collections import deque
from typing import Callable, List, Optional

import torch

from . import trace
from .algorithms import get_schedule
from .cost_model import NATIVE, bytes_sent
from .errors import HybridCommError, HybridCommTimeout
from .executor import Workspace, execute, execute_async, execute_native
from .kernels import pack
from .planner import Bucket, Plan
from .timeline import Timeline


class Phase(enum.Enum):
    IDLE = "idle"  # buffer free; nothing of this iteration in it
    FILLING = "filling"  # some of this iteration's gradients are ready
    IN_FLIGHT = "in flight"  # packed and queued on the channel; result not consumed
    PENDING = "pending"  # forward mode: step() accepted it; applied at the first use


class BucketState:
    """One bucket's buffer, views and phase.

    ``buffer`` holds the gradients (in the wire dtype), then one usage flag per
    parameter (summed across ranks: > 0 where some rank had a gradient).
    """

    __slots__ = ("bucket", "params", "buffer", "views", "flags", "phase", "ready", "complete",
                 "launches", "tickets", "ready_event", "hyper", "launched_at", "topk")

    def __init__(self, bucket: Bucket, params: List[torch.nn.Parameter], dtype: torch.dtype,
                 alloc: Callable[[int, torch.dtype], torch.Tensor]):
        self.bucket, self.params = bucket, params
        self.buffer = alloc(bucket.numel + len(params), dtype)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.flags = self.buffer[offset:]
        self.phase = Phase.IDLE
        self.ready: set = set()  # positions whose gradient backward produced this iteration
        self.complete = False  # packed with a gradient for every parameter
        self.launches = 0  # iterations launched so far
        self.tickets: list = []  # per segment: the channel's handle, once queued
        self.ready_event = None  # device path: the packed gradients are ready
        self.hyper = None  # forward mode: hyper-parameters at the deferring step()
        self.launched_at = 0.0
        self.topk = None  # compression.TopK when the plan sparsifies this bucket

    @property
    def all_ready(self) -> bool:
        """Backward has produced every gradient of the bucket: launch it."""
        return len(self.ready) == len(self.params)

    def pack(self) -> None:
        """``p.grad`` of every parameter into the buffer (one launch), flag 1 where
        there is one (as a single process's optimizer would see them)."""
        grads, dsts, missing = [], [], []
        for pos, p in enumerate(self.params):
            g = p.grad
            if g is None:
                missing.append(pos)
                continue
            if g.is_sparse:
                raise HybridCommError(
                    f"bucket {self.bucket.index}: parameter #{self.bucket.params[pos]} got a "
                    "sparse gradient, which hybridcomm does not reduce")
            if g.data_ptr() == self.views[pos].data_ptr():
                continue  # p.grad is already this view (backward mode wrote it there)
            grads.append(g if g.is_contiguous() else g.contiguous())
            dsts.append(self.views[pos])
        if grads:
            if len(dsts) == len(self.params) and not missing:
                pack(grads, self.buffer[:self.bucket.numel])
            else:
                for g, v in zip(grads, dsts):
                    pack([g], v.view(-1))
        for pos in missing:
            self.views[pos].zero_()
        self.complete = not missing
        if not missing:
            self.flags.fill_(1)
        else:
            for pos in range(len(self.params)):
                self.flags[pos:pos + 1].fill_(0 if pos in missing else 1)

    def used(self) -> List[int]:
        """Positions some rank had a gradient for. Reads the flags back from the
        device (a host sync) only when this rank lacked one of its gradients: with
        all of them, every flag is > 0 after the sum."""
        if self.complete:
            return list(range(len(self.params)))
        return [i for i, f in enumerate(self.flags.tolist()) if f > 0]


class HostChannel:  # host path
    """CPU: one worker thread runs the submitted operations in submission order.

    Example::

        >>> ch = HostChannel(timeout=60)
        >>> t = ch.submit(lambda: None, "bucket 0")
        >>> ch.wait(t, "bucket 0") < 60             # seconds waited
        True
        >>> ch.close()
    """

    stream_ordered = False

    def __init__(self, timeout: float, timeline: Optional[Timeline] = None):
        self.timeout = timeout
        self.timeline = timeline or Timeline(enabled=False)
        self._cv = threading.Condition()
        self._queue: deque = deque()
        self._submitted = self._completed = 0
        self._error: Optional[BaseException] = None
        self._failed_what = ""
        self._closed = False
        self._busy_s = 0.0  # comm time of finished operations, until take_busy()
        self._thread = threading.Thread(target=self._run, name="hybridcomm-channel", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None], what: str) -> int:
        with self._cv:
            if self._closed:
                raise HybridCommError("the communication channel is closed")
            self._submitted += 1
            self._queue.append((self._submitted, fn, what))
            self._cv.notify_all()
            return self._submitted

    def done(self, ticket: int) -> bool:
        with self._cv:
            return self._completed >= ticket

    @property
    def failure(self) -> Optional[BaseException]:
        """The error that stopped the channel, if any."""
        return self._error

    def take_busy(self) -> float:
        """Seconds of communication finished since the last call."""
        with self._cv:
            busy, self._busy_s = self._busy_s, 0.0
            return busy

    def wait(self, ticket: int, what: str) -> float:
        """Block until operation ``ticket`` is done; the seconds waited."""
        t0 = time.perf_counter()
        deadline = t0 + self.timeout
        with self._cv:
            while self._completed < ticket:
                if self._error is not None:
                    kind = HybridCommTimeout if isinstance(self._error, HybridCommTimeout) \
                        else HybridCommError
                    raise kind(f"{what}: communication failed at {self._failed_what}: "
                               f"{self._error}") from self._error
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise HybridCommTimeout(f"{what} not reduced within {self.timeout:g}s "
                                            "(a peer dead or stalled?)")
                self._cv.wait(min(left, 1.0))
        return time.perf_counter() - t0

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=self.timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                ticket, fn, what = self._queue.popleft()
            t0 = time.perf_counter()
            try:
                fn()
            except BaseException as e:  # surfaced to the trainer on its next wait
                with self._cv:
                    self._error, self._failed_what = e, what
                    self._queue.clear()
                    self._closed = True
                    self._cv.notify_all()
                return
            t1 = time.perf_counter()
            self.timeline.add(what, "comm/channel", t0, t1)
            with self._cv:
                self._busy_s += t1 - t0
                self._completed = ticket
                self._cv.notify_all()


class StreamChannel:
    """GPU (or simulated): operations are queued on the transport's comm stream by
    the caller's thread, in submission order; handles are done events."""

    stream_ordered = True

    def __init__(self, transport, timeline: Optional[Timeline] = None):
        self.transport = transport
        self.runtime = transport.runtime
        self.timeline = timeline or Timeline(enabled=False)
        self._timed: deque = deque()  # (start, done, what) timing events not yet harvested
        self._anchor = None
        if self.timeline.enabled:
            # One host sync, only when tracing: a comm-stream event at a known host
            # time places every later event on the host's clock.
            self._anchor = self.runtime.new_event(timing=True)
            self._anchor.record(transport.stream)
            self._anchor.synchronize()
            self._anchor_s = time.perf_counter()

    def submit(self, fn: Callable[[], object], what: str):
        """``fn`` queues the work and returns its ``(start, done)`` timing events."""
        self._raise_failure()
        start, done = fn()
        self._timed.append((start, done, what))
        return done

    def take_busy(self) -> float:
        """Seconds the comm stream spent on operations completed since the last call,
        from timing events read only once complete (never a host sync)."""
        busy = 0.0
        while self._timed and self._timed[0][1].query():
            start, done, what = self._timed.popleft()
            busy += start.elapsed_time(done) * 1e-3
            if self._anchor is not None:
                t0 = self._anchor_s + self._anchor.elapsed_time(start) * 1e-3
                self.timeline.add(what, "comm/stream", t0, t0 + start.elapsed_time(done) * 1e-3)
        return busy

    def done(self, event) -> bool:
        return event.query()

    def wait(self, event, what: str) -> float:
        """The trainer's current stream waits for ``event``; the host goes on."""
        self._raise_failure()
        self.runtime.current_stream().wait_event(event)
        return 0.0

    @property
    def failure(self) -> Optional[BaseException]:
        """The error that aborted the transport (watchdog), if any."""
        return getattr(self.transport, "failure", None)

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        pass


class CommEngine:
    """Launches buckets through the channel in the plan's fixed order: a bucket's
    segments are submitted when the order reaches them and the bucket is launched
    (``launch``), and ``wait`` makes the trainer (host or stream) wait for one."""

    def __init__(self, plan: Plan, states: List[BucketState], channel, transport, *,
                 scale: Optional[float], timeout: float):
        self.plan, self.states, self.channel, self.transport = plan, states, channel, transport
        self.scale, self.timeout = scale, timeout
        self.round = 0  # passes through plan.order completed
        self.cursor = 0  # position in plan.order
        self.bytes_sent = 0  # by this rank, since the trainer last read it
        self._workspace = Workspace()  # host path scratch (the worker thread's alone)

    def launch(self, st: BucketState) -> None:
        """All of ``st``'s gradients are ready: pack, then queue as the order reaches it."""
        st.pack()
        if st.topk is not None:  # this rank's message, from the packed gradients
            st.topk.select(st.buffer[:st.bucket.numel], st.flags)
        if self.channel.stream_ordered:
            rt = self.channel.runtime
            st.ready_event = rt.new_event()
            st.ready_event.record(rt.current_stream())
        st.phase = Phase.IN_FLIGHT
        st.launches += 1
        st.tickets = [None] * len(st.bucket.segments)
        st.launched_at = time.perf_counter()
        self._pump()

    def _pump(self) -> None:
        order = self.plan.order
        while order:
            b, s = order[self.cursor]
            st = self.states[b]
            if st.launches <= self.round:
                return  # that bucket is not launched yet: the order waits for it
            st.tickets[s] = self.channel.submit(self._operation(st, s),
                                                f"bucket {b} segment {s}")
            self.cursor += 1
            if self.cursor == len(order):
                self.cursor, self.round = 0, self.round + 1

    def _operation(self, st: BucketState, s: int):
        b = st.bucket
        a, z = b.segments[s]
        seg = st.buffer[a:z]
        world, rank = self.transport.world_size, self.transport.rank
        if st.topk is not None:
            return self._sparse_operation(st)
        self.bytes_sent += int(bytes_sent(b.algorithm, seg.numel() * seg.element_size(), world))
        what = f"bucket {b.index} ({b.algorithm}, segment {s + 1}/{len(b.segments)}, " \
               f"{seg.numel() * seg.element_size()} bytes)"
        if b.algorithm == NATIVE:
            avg = self.scale is not None

            def native():
                with trace.bucket_range(b.index, b.algorithm, b.nbytes, world):
                    return execute_native(seg, self.transport, average=avg,
                                          ready=st.ready_event, timeout=self.timeout, label=what,
                                          timed=self.channel.stream_ordered)
            return native
        schedule = get_schedule(b.algorithm, rank, world, seg.numel())
        if self.channel.stream_ordered:
            def queued():
                with trace.bucket_range(b.index, b.algorithm, b.nbytes, world):
                    return execute_async(schedule, seg, self.transport, scale=self.scale,
                                         ready=st.ready_event, timeout=self.timeout, label=what,
                                         timed=True)
            return queued

        def hosted():  # host path
            scratch = self._workspace.get(schedule.scratch_numel, seg.dtype, seg.device)
            with trace.bucket_range(b.index, b.algorithm, b.nbytes, world):
                execute(schedule, seg, self.transport, scale=self.scale, scratch=scratch,
                        timeout=self.timeout)
        return hosted

    def _sparse_operation(self, st: BucketState):
        """A top-k bucket: all-gather the ranks' messages, sum them into the bucket."""
        topk, b = st.topk, st.bucket
        self.bytes_sent += topk.bytes_sent
        what = f"bucket {b.index} (topk, {topk.k} of {b.numel}, {topk.bytes_sent} bytes sent)"
        grads, flags = st.buffer[:b.numel], st.flags

        if self.channel.stream_ordered:
            def queued():
                start, _ = execute_async(topk.schedule, topk.gathered, self.transport,
                                         ready=st.ready_event, timed=True)
                with self.transport.stream_context():
                    topk.decode(grads, flags, self.scale)
                done = self.transport.runtime.new_event(timing=True)
                done.record(self.transport.stream)
                self.transport.watch(done, self.timeout, what)
                return start, done
            return queued

        def hosted():  # host path
            execute(topk.schedule, topk.gathered, self.transport, timeout=self.timeout)
            topk.decode(grads, flags, self.scale)
        return hosted

    def wait(self, st: BucketState) -> float:
        """The reduced bucket is usable (host: done; device: the trainer's stream
        waits for it); the seconds the host waited."""
        if st.phase not in (Phase.IN_FLIGHT, Phase.PENDING):
            return 0.0
        if any(t is None for t in st.tickets):
            missing = self.plan.order[self.cursor]
            raise HybridCommError(f"internal error: bucket {st.bucket.index} is needed before "
                                  f"its turn in the issue order (waiting on bucket {missing[0]})")
        return self.channel.wait(st.tickets[-1], f"bucket {st.bucket.index}")

    def close(self) -> None:
        self.channel.close()

