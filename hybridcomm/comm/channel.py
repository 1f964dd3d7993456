"""The one ordered channel all of a step's communication goes through.

Every rank issues the same sequence of operations (the plan's fixed issue
order), whatever its local timing, so NCCL's tag-less matching pairs the right
buffers and several communicators never deadlock. :class:`HostChannel` (gloo)
runs them in order on a worker thread; :class:`StreamChannel` (CUDA, or the
simulated GPU) queues them on the transport's comm stream, issued by the
transport's :class:`Issuer` thread so that the backward pays only a queue
append. Their place on a gradient's path: docs/ARCHITECTURE.md.

Example (``queue`` queues work on the transport's comm stream and returns its
done event)::

    done = issue_in_order(transport, queue, "all_reduce", timeout=60)
    rt.current_stream().wait_event(done)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from functools import partial
from typing import Callable, Optional

import torch.distributed as dist

from .control import new_group_like
from ..base.errors import HybridCommError, HybridCommTimeout
from ..gpu.runtime import runtime_for
from ..base.timeline import Timeline
from ..config import env
from .transport.base import OrderedTask
from .transport.select import select_transport
from .transport.torch_dist import TorchDistTransport


class Issuer:
    """The thread that issues a transport's work, in submission order.

    One per transport (``issuer_for``), shared by every channel on it and by
    ``all_reduce`` and the DDP hook once it exists: two threads issuing on one
    communicator would interleave differently on each rank (NCCL matches by
    order). A transport with a thread of its own that makes every call on its
    communicator (``CupyNcclTransport.comm_thread``) runs the operations
    there, whole: one hand-off per operation, none per NCCL call. Otherwise a
    thread of the issuer's, bound to the rank's device, lives as long as the
    process (a daemon).
    """

    def __init__(self, transport):
        self.transport = transport
        # the transport's own thread, where it has one that calls its communicator
        self._comm_thread = getattr(transport, "comm_thread", None)
        self._error: Optional[BaseException] = None
        if self._comm_thread is not None:
            return
        self._cv = threading.Condition()
        self._queue: deque = deque()
        self._thread = threading.Thread(target=self._run, name="hybridcomm-issue", daemon=True)
        self._thread.start()

    @property
    def error(self) -> Optional[BaseException]:
        """What stopped the issuing (nothing is issued after a failure)."""
        if self._comm_thread is not None:
            return self.transport.failure
        return self._error

    def submit(self, fn, what: str) -> OrderedTask:
        if self._comm_thread is not None:
            return self._comm_thread.submit_ordered(fn, what)
        issue = OrderedTask(fn, what)
        with self._cv:
            self._queue.append(issue)
            self._cv.notify_all()
        return issue

    def _run(self) -> None:
        self.transport.runtime.bind_thread()
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                issue = self._queue[0]
            try:
                if self._error is not None:
                    raise self._error  # nothing is issued after a failure
                issue.result = issue.fn()
            except BaseException as e:  # noqa: BLE001 - surfaced by the waits
                issue.error = e
                if self._error is None:
                    self._error = e
            with self._cv:
                issue.issued, issue.fn = True, None
                self._queue.popleft()
                self._cv.notify_all()

    def drain(self, timeout: float) -> None:
        """Until everything submitted so far is issued (tests, shutdown)."""
        self.result(self.submit(lambda: None, "drain"), "draining the issue queue", timeout)

    def result(self, issue: OrderedTask, what: str, timeout: float):
        """``issue``'s result once issued (a host wait for the issuing only), or the
        error issuing it raised."""
        if not issue.issued:
            # A backstop only: the transport's watchdog aborts a call blocked on a peer
            # at the timeout, and the issuing thread's error (naming the rank and the
            # step) is what the wait raises.
            limit = 2 * timeout
            if self._comm_thread is not None:
                self._comm_thread.wait_ordered(issue, what, limit)
            else:
                deadline = time.perf_counter() + limit
                with self._cv:
                    while not issue.issued:
                        left = deadline - time.perf_counter()
                        if left <= 0:
                            raise HybridCommTimeout(
                                f"rank {self.transport.rank}: {what} not issued within "
                                f"{limit:g}s (the issuing thread is blocked on a peer?)"
                            )
                        self._cv.wait(min(left, 1.0))
        if issue.error is not None:
            raise issue.error
        return issue.result


_issuers: dict = {}
_issuers_lock = threading.Lock()


def issuer_for(transport, create: bool = True) -> Optional[Issuer]:
    """The transport's issuing thread (made on first use when ``create``)."""
    with _issuers_lock:
        hit = _issuers.get(id(transport))
        if hit is None or hit.transport is not transport:
            if not create:
                return None
            hit = _issuers[id(transport)] = Issuer(transport)
        return hit


def issue_in_order(transport, fn, what: str, timeout: float):
    """``fn()`` (which queues work on ``transport``'s stream), in the transport's issue
    order: on its issuing thread when it has one (the caller waits for the issue,
    not for the device), else right here."""
    issuer = issuer_for(transport, create=False)
    if issuer is None:
        return fn()
    return issuer.result(issuer.submit(fn, what), what, timeout)


class HostChannel:  # host path
    """CPU: one worker thread runs the submitted operations in submission order
    (gloo releases the GIL while it moves bytes); the trainer blocks on one only
    where it needs the result, with the timeout.
    ``inline``: they run at once, in the caller (a group of one rank, whose
    operations communicate nothing: a thread would only cost a hand-off each).

    An operation submitted ``here`` (its caller waits for it at once, with
    nothing left to overlap it with) runs in the caller's thread once what was
    submitted before it is done, so the order holds: two thread hand-offs and
    the worker's fight for the GIL with a trainer running torch ops cost more
    than the operation on 2 ranks sharing 2 cores (docs/PERFORMANCE.md).
    So does an operation the worker has not started when its caller waits for
    it (forward mode's, at the next forward's first read). Meanwhile the idle
    worker keeps the wait's watch: past ``slow_after`` it calls ``on_slow()``
    once, as a waiting trainer would. ``HYBRIDCOMM_HOST_HERE=0`` sends every
    operation to the worker.

    Example::

        >>> ch = HostChannel(timeout=60)
        >>> t = ch.submit(lambda: None, "bucket 0")
        >>> ch.wait(t, "bucket 0") < 60             # seconds waited
        True
        >>> ch.close()
    """

    stream_ordered = False

    def __init__(
        self, timeout: float, timeline: Optional[Timeline] = None, *, inline: bool = False
    ):
        self.timeout = timeout
        self.timeline = timeline or Timeline(enabled=False)
        self._cv = threading.Condition()
        self._queue: deque = deque()
        self._submitted = self._completed = 0
        self._running = False  # an operation is running (in the worker or a caller)
        self._error: Optional[BaseException] = None
        self._failed_what = ""
        self._closed = False
        self._busy_s = 0.0  # comm time of finished operations, until take_busy()
        self._ops: list = []  # (key, seconds) of finished keyed operations, until take_ops()
        self._inline = inline
        self._here_ok = env.get("HYBRIDCOMM_HOST_HERE")
        # the operation running in its caller: [t0, on_slow, slow_after], and the note
        # on_slow returned for it (kept for the message of its failure)
        self._here: Optional[list] = None
        self._here_note: Optional[str] = None
        self._watch_s: Optional[float] = None  # how often the idle worker looks (None: never)
        self._thread = None
        if not inline:
            self._thread = threading.Thread(
                target=self._run, name="hybridcomm-channel", daemon=True
            )
            self._thread.start()

    def submit(
        self,
        fn: Callable[[], None],
        what: str,
        key=None,
        *,
        here: bool = False,
        on_slow=None,
        slow_after: float = 0.0,
    ) -> int:
        """Queue ``fn``; its ticket. With a ``key``, its duration is kept for
        :meth:`take_ops`. ``here``: the caller waits for it next, so it runs in
        the caller, after what was submitted before it (waited for first, as the
        caller would wait for it anyway; ``on_slow`` and ``slow_after`` as
        :meth:`wait` takes them, also for the worker's watch)."""
        here = here and self._here_ok and not self._inline
        if here and self._completed < self._submitted:
            self.wait(self._submitted, what, on_slow, slow_after)
        with self._cv:
            if self._closed:
                raise HybridCommError("the communication channel is closed")
            self._submitted += 1
            self._queue.append((self._submitted, fn, what, key))
            if self._inline:
                self._run_next()
            elif here and self._completed == self._submitted - 1:  # (else: another thread's)
                self._run_here(on_slow, slow_after)
            else:
                self._cv.notify_all()
            return self._submitted

    def _run_here(self, on_slow, slow_after: float) -> list:
        """Run the next queued operation in the calling thread (lock held), watched by
        the idle worker; what it watched with (its ``on_slow`` is None once called)."""
        here = self._here = [time.perf_counter(), on_slow, slow_after]
        self._here_note = None
        if on_slow is not None and self._watch_s is None:
            # From now on the idle worker looks this often (no wake-up per operation:
            # a thread woken beside the trainer costs what running here saves)
            self._watch_s = max(slow_after / 4, 1e-3)
            self._cv.notify_all()
        try:
            self._run_next()
        finally:
            self._here = None
            if self._error is None:  # (kept for a failure's message only)
                self._here_note = None
            if self._queue:  # (submitted meanwhile by another thread)
                self._cv.notify_all()
        return here

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

    def take_ops(self) -> list:
        """``(key, seconds)`` of each keyed operation finished since the last call."""
        with self._cv:
            ops, self._ops = self._ops, []
            return ops

    @staticmethod
    def take_exposed() -> float:
        """The host path measures its waits itself (the seconds ``wait`` returns)."""
        return 0.0

    def wait(self, ticket: int, what: str, on_slow=None, slow_after: float = 0.0) -> float:
        """Block until operation ``ticket`` is done; the seconds waited. ``on_slow()``
        is called once (without the channel's lock) if it takes over ``slow_after``;
        what it returns (who the wait is for) ends the timeout's message."""
        t0 = time.perf_counter()
        deadline = t0 + self.timeout
        note = None
        with self._cv:
            while self._completed < ticket:
                if (
                    self._queue
                    and self._queue[0][0] <= ticket
                    and not self._running
                    and self._here is None
                    and self._here_ok
                    and not self._inline
                ):
                    # Not started yet, and this thread waits for it: run it here (the
                    # worker's wake-up, and then this thread's, would cost more)
                    if self._run_here(on_slow, slow_after)[1] is None:
                        on_slow = None  # (the worker's watch called it)
                    continue
                if on_slow is not None and time.perf_counter() - t0 > slow_after:
                    self._cv.release()
                    try:
                        note = on_slow()
                    finally:
                        self._cv.acquire()
                    on_slow = None
                    continue
                if self._error is not None:
                    kind = (
                        HybridCommTimeout
                        if isinstance(self._error, HybridCommTimeout)
                        else HybridCommError
                    )
                    note = note or self._here_note
                    raise kind(
                        f"{what}: communication failed at {self._failed_what}: "
                        f"{self._error}" + (f" ({note})" if note else "")
                    ) from self._error
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise HybridCommTimeout(
                        f"{what} not reduced within {self.timeout:g}s "
                        + (f"({note})" if note else "(a peer dead or stalled?)")
                    )
                self._cv.wait(min(left, 1.0))
        return time.perf_counter() - t0

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout)

    def _run(self) -> None:
        with self._cv:
            while True:
                # (nothing runs beside an operation running in its caller)
                while (not self._queue or self._here is not None) and not self._closed:
                    self._watch_here()
                if not self._queue:
                    return
                self._run_next()
                if self._error is not None:
                    return

    def _watch_here(self) -> None:
        """Wait for work (lock held), looking every ``_watch_s``: once an operation
        running in its caller has run ``slow_after`` seconds, call its ``on_slow``."""
        here = self._here
        if here is None or here[1] is None or time.perf_counter() - here[0] < here[2]:
            self._cv.wait(self._watch_s)
            return
        on_slow, here[1] = here[1], None
        self._cv.release()
        try:
            note = on_slow()
        except Exception:  # noqa: BLE001 - the stall inspector never raises; a watch never breaks
            note = None
        finally:
            self._cv.acquire()
        if self._here is here:  # (still running, or failed: its message takes the note)
            self._here_note = note

    def _run_next(self) -> None:
        """Run the next queued operation (caller holds the lock, released while it runs)."""
        ticket, fn, what, key = self._queue.popleft()
        self._running = True
        self._cv.release()
        t0 = time.perf_counter()
        try:
            fn()
        except BaseException as e:  # surfaced to the trainer on its next wait
            self._cv.acquire()
            self._running = False
            self._error, self._failed_what = e, what
            self._queue.clear()
            self._closed = True
            self._cv.notify_all()
            return
        t1 = time.perf_counter()
        self.timeline.add(what, "comm/channel", t0, t1)
        self._cv.acquire()
        self._running = False
        self._busy_s += t1 - t0
        if key is not None:
            self._ops.append((key, t1 - t0))
        self._completed = ticket
        self._cv.notify_all()


# Completed timing events are read (queried) when taken, at the end of a step, or
# once this many are queued: a few queries per operation, whatever the caller.
_HARVEST_AT = 8


class StreamChannel:
    """GPU (or simulated): operations are queued on the transport's comm stream in
    submission order, by the caller's thread or (``issue_thread=True``) by the
    transport's :class:`Issuer`; handles are done events (or tickets that lead
    to them).

    Example (``queue_bucket_0`` queues its work on the comm stream and returns its
    ``(start, done)`` events, as ``executor.reduce_operation``'s do)::

        ch = StreamChannel(transport, issue_thread=True, timeout=60)
        ticket = ch.submit(queue_bucket_0, "bucket 0")   # returns at once
        ch.wait(ticket, "bucket 0")     # the current stream waits for it
    """

    stream_ordered = True

    def __init__(
        self,
        transport,
        timeline: Optional[Timeline] = None,
        *,
        issue_thread: bool = False,
        timeout: float = 300.0,
    ):
        self.transport = transport
        self.runtime = transport.runtime
        self.timeline = timeline or Timeline(enabled=False)
        self.timeout = timeout
        self._timed: deque = deque()  # (start, done, what, key) timing events not yet harvested
        self._ops: list = []  # (key, seconds) of harvested keyed operations, until take_ops()
        self._busy_s = 0.0  # seconds of harvested operations, until take_busy()
        self._waits: deque = deque()  # (where the trainer waited, done) not yet harvested
        self._exposed_s = 0.0  # harvested from _waits, until take_exposed()
        self._lock = threading.Lock()  # _timed: appended by the issuing thread
        self._issuer = issuer_for(transport) if issue_thread else None
        self._anchor = None
        if self.timeline.enabled:
            # One host sync, only when tracing: a comm-stream event at a known host
            # time places every later event on the host's clock.
            self._anchor = self.runtime.new_event(timing=True)
            self._anchor.record(transport.stream)
            self._anchor.synchronize()
            self._anchor_s = time.perf_counter()

    def submit(self, fn: Callable[[], object], what: str, key=None):
        """``fn`` queues the work and returns its ``(start, done)`` timing events;
        returns the done event (inline) or a ticket (threaded). With a ``key``, its
        duration is kept for :meth:`take_ops`."""
        self._raise_failure()
        issue = partial(self._issue, fn, what, key)  # (no frame of its own in a stack)
        if self._issuer is None:  # here, unless the transport has an issuing thread
            return issue_in_order(self.transport, issue, what, self.timeout)
        return self._issuer.submit(issue, what)

    def _issue(self, fn, what: str, key):
        start, done = fn()
        with self._lock:
            if len(self._timed) >= _HARVEST_AT:  # a caller that never takes them (the
                self._harvest_timed()  # averager) keeps few; the optimizer takes each step
            self._timed.append((start, done, what, key))
        return done

    def _harvest_timed(self) -> None:
        """Completed operations' timing events into ``_busy_s`` and ``_ops`` (with
        ``_lock`` held; events are read only once complete: never a host sync)."""
        while self._timed and self._timed[0][1].query():
            start, done, what, key = self._timed.popleft()
            seconds = start.elapsed_time(done) * 1e-3
            self._busy_s += seconds
            if key is not None:
                self._ops.append((key, seconds))
            if self._anchor is not None:
                t0 = self._anchor_s + self._anchor.elapsed_time(start) * 1e-3
                self.timeline.add(what, "comm/stream", t0, t0 + seconds)

    def take_busy(self) -> float:
        """Seconds the comm stream spent on operations completed since the last call,
        from timing events read only once complete (never a host sync)."""
        with self._lock:
            self._harvest_timed()
            busy, self._busy_s = self._busy_s, 0.0
        return busy

    def take_ops(self) -> list:
        """``(key, seconds)`` of each keyed operation whose timing events
        :meth:`take_busy` has read (on the GPU's clock) since the last call."""
        with self._lock:
            ops, self._ops = self._ops, []
        return ops

    def done(self, handle) -> bool:
        """Whether the operation has finished (an error counts: the wait raises it)."""
        if isinstance(handle, OrderedTask):
            return handle.issued and (handle.error is not None or handle.result.query())
        return handle.query()

    def wait(self, handle, what: str, on_slow=None, slow_after: float = 0.0) -> float:
        """The trainer's current stream waits for the operation; the host goes on (so
        ``on_slow`` never fires here: the transport's watchdog bounds the wait)."""
        self._raise_failure()
        event = (
            self._issuer.result(handle, what, self.timeout)
            if isinstance(handle, OrderedTask)
            else handle
        )
        stream = self.runtime.current_stream()
        point = self.runtime.new_event(timing=True)  # where the trainer's stream waits
        point.record(stream)
        stream.wait_event(event)
        if len(self._waits) >= _HARVEST_AT:  # (the optimizer takes them each step)
            self._harvest_waits()
        self._waits.append((point, event))
        return 0.0

    def _harvest_waits(self) -> None:
        while self._waits and self._waits[0][0].query() and self._waits[0][1].query():
            point, done = self._waits.popleft()
            self._exposed_s += max(0.0, point.elapsed_time(done) * 1e-3)

    def take_exposed(self) -> float:
        """Seconds the trainer's stream stood waiting for communication, on the GPU's
        clock, since the last call: for each wait whose events have completed, how
        long the operation finished after the trainer reached the wait (event
        queries only, never a host sync; a wait still in progress counts later)."""
        self._harvest_waits()
        exposed, self._exposed_s = self._exposed_s, 0.0
        return exposed

    @property
    def failure(self) -> Optional[BaseException]:
        """The error that aborted the transport (watchdog), or stopped the issuing."""
        return getattr(self.transport, "failure", None) or (
            self._issuer.error if self._issuer is not None else None
        )

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """Nothing to stop: the issuer is the transport's (what this channel
        submitted is issued in order, before anything submitted later)."""


def open_channel(
    device,
    group,
    timeout: float,
    timeline: Optional[Timeline] = None,
    *,
    issue_thread: bool = False,
):
    """``(transport, channel)`` for tensors on ``device`` over ``group``: on a GPU (or
    the simulated one) the transport's comm stream (issued from a thread of the
    channel's with ``issue_thread``); on the CPU a gloo group of its own (so the
    user's collectives never interleave) and a worker thread. A group of one rank
    communicates nothing: its operations are issued (or run) in the caller, as
    they come, without a thread's hand-off."""
    alone = dist.get_world_size(group) == 1
    if runtime_for(device) is not None:
        transport = select_transport(device, group, timeout=timeout)
        return transport, StreamChannel(
            transport, timeline, issue_thread=issue_thread and not alone, timeout=timeout
        )
    transport = TorchDistTransport(new_group_like(group, timeout))
    return transport, HostChannel(timeout, timeline, inline=alone)
