"""Run one rank's schedule over a transport, reducing with the kernels.

:func:`execute` runs a schedule: copies land in the caller's buffer, reductions
in a reused scratch buffer and are added in with ``kernels.reduce`` (which
applies the ``avg`` scale on each element's final step); a large buffer is
pipelined in parts. :func:`reduce_operation` (the end of this file) is the one
all-reduce dispatch: every all-reduce in hybridcomm goes through it, and it
picks ``native``, ``ps`` or a schedule, on the host or on the comm stream. Its
place on a gradient's path: docs/ARCHITECTURE.md.

Example::

    transport = select_transport(buf.device, None, timeout=60)
    reduce_now(buf, transport, "ring", scale=1 / transport.world_size, timeout=60)
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..config import env
from ..base import trace
from ..algorithms import (
    ALL_REDUCE,
    REDUCE_SCATTER,
    SCHEDULES,
    Schedule,
    get_phase_schedule,
    get_schedule,
    tail_body,
)
from ..kernels import reduce
from ..plan.cost_model import NATIVE, PS
from .channel import issue_in_order
from .transport import Transport

# Pipeline parts of at least HYBRIDCOMM_PIPELINE_BYTES (default 32 MiB; 0 turns
# pipelining off), at most MAX_PARTS of them. Measured on 4 gloo ranks sharing
# 2 cores (docs/PERFORMANCE.md): every extra message costs ~0.2 ms of CPU in
# wake-ups there, so only very large buffers are cut (64 MiB into 2 parts).
# Where cores are idle (one GPU or host per rank) smaller parts pay off.
MAX_PARTS = 4


class Workspace:
    """Scratch buffers kept per (device, dtype), grown on demand, never shrunk.

    ``alloc(numel, dtype, device)`` makes a buffer (default ``torch.empty``);
    stream-ordered transports pass one that allocates on their comm stream.
    """

    def __init__(self, alloc=None):
        self._alloc = alloc or (lambda n, dt, dev: torch.empty(n, dtype=dt, device=dev))
        self._buffers: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}
        # (device, dtype, numel) -> buffer[:numel], made once (a slice costs ~6K
        # instructions per call); dropped when a buffer grows, so none keeps an old one
        self._slices: Dict[tuple, torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        view = self._slices.get((device, dtype, numel))
        if view is not None:
            return view
        key = (device, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._alloc(numel, dtype, device)
            self._buffers[key] = buf
            self._slices = {k: v for k, v in self._slices.items() if k[:2] != key}
        view = self._slices[(device, dtype, numel)] = buf[:numel]
        return view


def comm_scratch(transport, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Scratch of a stream-ordered transport, allocated on (and only ever used on)
    its comm stream, so the caching allocator never hands it to another stream
    while communication still targets it."""
    ws = getattr(transport, "_scratch", None)
    if ws is None:
        rt = transport.runtime

        def alloc(n, dt, _device):
            with rt.use(transport.stream):
                return rt.empty(n, dt)

        ws = transport._scratch = Workspace(alloc)
    return ws.get(numel, dtype, transport.device)


# One step of one part, as plain integers:
#   sends  ((peer, start, stop), ...)            ranges of the buffer
#   recvs  ((peer, start, stop, slot), ...)      slot: scratch offset, or -1 = straight into buf
#   reds   ((start, stop, slot, final), ...)     add scratch[slot:slot+len] into buf[start:stop]
_PlanStep = Tuple[tuple, tuple, tuple]


class _Plan:
    __slots__ = ("parts", "scratch_numel")

    def __init__(self, parts: List[List[_PlanStep]], scratch_numel: int):
        self.parts, self.scratch_numel = parts, scratch_numel


def _plan_part(schedule: Schedule, base: int, slot0: int) -> Tuple[List[_PlanStep], int]:
    steps = []
    for st in schedule.steps:
        recvs, reds, off = [], [], 0
        for r in st.recvs:
            if r.reduce:
                slot = slot0 + off
                off += r.stop - r.start
                reds.append((base + r.start, base + r.stop, slot, r.final))
                recvs.append((r.peer, base + r.start, base + r.stop, slot))
            else:
                recvs.append((r.peer, base + r.start, base + r.stop, -1))
        sends = tuple((s.peer, base + s.start, base + s.stop) for s in st.sends)
        steps.append((sends, tuple(recvs), tuple(reds)))
    return steps, schedule.scratch_numel


def num_parts(schedule: Schedule, element_size: int) -> int:  # host path
    """How many pipelined parts ``execute`` cuts this schedule's buffer into.

    Each part is all-reduced by its own schedule of the same algorithm, the parts
    interleaved: every part's first step is posted, then per step and part, wait,
    reduce, post its next step at once, so the others' transfers are in flight
    while one part is reduced (no step-wide barrier). Every rank issues in the
    same (step, part) order and each part's messages to a peer keep the
    schedule's order, so pairs match without tags (NCCL) as with them (gloo)."""
    part_bytes = env.get("HYBRIDCOMM_PIPELINE_BYTES")
    if part_bytes <= 0 or schedule.algorithm not in SCHEDULES or schedule.world_size < 2:
        return 1
    parts = max(1, min(MAX_PARTS, schedule.numel * element_size // part_bytes))
    # Every part at least P elements: no empty transfer is dropped from any
    # part, so all parts have the same steps and the (step, part) order holds.
    return max(1, min(parts, schedule.numel // schedule.world_size))


_plans: "OrderedDict[tuple, Tuple[Schedule, _Plan]]" = OrderedDict()
_plans_lock = threading.Lock()
_PLAN_CACHE = 256


def _plan(schedule: Schedule, parts: int) -> _Plan:
    """The index arithmetic of (``schedule``, ``parts``), computed once and cached
    (integer ranges only, never tensors: the cache keeps no user buffer alive)."""
    key = (id(schedule), parts)
    with _plans_lock:
        hit = _plans.get(key)
        if hit is not None and hit[0] is schedule:
            _plans.move_to_end(key)
            return hit[1]
    if parts == 1:
        steps, scratch = _plan_part(schedule, 0, 0)
        plan = _Plan([steps], scratch)
    else:
        out, slot = [], 0
        for k in range(parts):
            lo = k * schedule.numel // parts
            hi = (k + 1) * schedule.numel // parts
            sub = get_schedule(
                schedule.algorithm,
                schedule.rank,
                schedule.world_size,
                hi - lo,
                topology=schedule.topology,
            )
            steps, scratch = _plan_part(sub, lo, slot)
            out.append(steps)
            slot += scratch
        plan = _Plan(out, slot)
    with _plans_lock:
        _plans[key] = (schedule, plan)  # holding the schedule keeps its id unique
        while len(_plans) > _PLAN_CACHE:
            _plans.popitem(last=False)
    return plan


_local = threading.local()  # per-thread scratch when the caller's is too small


def _scratch(
    numel: int,
    like: torch.Tensor,  # host path
    given: Optional[torch.Tensor],
) -> torch.Tensor:
    if (
        given is not None
        and given.numel() >= numel
        and given.dtype == like.dtype
        and given.device == like.device
    ):
        return given
    ws = getattr(_local, "workspace", None)
    if ws is None:
        ws = _local.workspace = Workspace()
    return ws.get(numel, like.dtype, like.device)


def execute(
    schedule: Schedule,
    buf: torch.Tensor,
    transport: Transport,
    *,
    scale: float | None = None,
    scratch: torch.Tensor | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """All-reduce the 1-D contiguous ``buf`` in place by running ``schedule``.

    ``scale`` multiplies each element once, when its final value is produced
    (1/P gives an average). Host-ordered transports: blocks until done;
    ``scratch`` should hold ``schedule.scratch_numel`` elements of ``buf``'s
    dtype (if None or too small, a per-thread workspace is used).
    Stream-ordered transports: queued (:func:`execute_async`), and the
    caller's current stream waits for the result; the host goes on.

    Example::

        >>> from hybridcomm.comm.transport import TorchDistTransport
        >>> buf = torch.ones(4)
        >>> s = get_schedule("ring", rank, world, buf.numel())
        >>> execute(s, buf, TorchDistTransport(), scale=1 / world, timeout=60)
        tensor([1., 1., 1., 1.])
    """
    if schedule.numel != buf.numel():
        raise ValueError(f"schedule is for {schedule.numel} elements, buffer has {buf.numel()}")
    if transport.stream_ordered:
        done = execute_async(schedule, buf, transport, scale=scale, timeout=timeout)
        transport.runtime.current_stream().wait_event(done)
        return buf
    return _execute_on_host(schedule, buf, transport, scale=scale, scratch=scratch, timeout=timeout)


def _execute_on_host(schedule, buf, transport, *, scale, scratch, timeout):  # host path
    """:func:`execute` over a host-ordered transport (gloo): blocks until done."""
    if schedule.world_size == 1:
        if scale is not None and scale != 1:
            buf.mul_(scale)
        return buf
    plan = _plan(schedule, num_parts(schedule, buf.element_size()))
    scratch = _scratch(plan.scratch_numel, buf, scratch)
    exchange = transport.exchange
    parts = plan.parts
    if len(parts) == 1:
        for step in parts[0]:
            pending = _post_step(step, buf, scratch, exchange)
            _finish_step(step, pending, buf, scratch, scale=scale, timeout=timeout)
        return buf
    # Pipelined: (step, part) order on every rank; a part's next step is posted
    # as soon as its current one is reduced. Parts of one schedule have equal
    # step counts (the same algorithm at the same rank and world size).
    pending = [_post_step(steps[0], buf, scratch, exchange) if steps else None for steps in parts]
    nsteps = max(len(steps) for steps in parts)
    for i in range(nsteps):
        for k, steps in enumerate(parts):
            if i >= len(steps):
                continue
            _finish_step(steps[i], pending[k], buf, scratch, scale=scale, timeout=timeout)
            pending[k] = (
                _post_step(steps[i + 1], buf, scratch, exchange) if i + 1 < len(steps) else None
            )
    return buf


def _post_step(step: _PlanStep, buf, scratch, exchange):  # host path
    """One step's sends and receives, posted together (``exchange``: the transport's);
    a receive that reduces lands in ``scratch``, a copy straight in ``buf``."""
    sends, recvs, _ = step
    return exchange(
        [(p, buf[a:b]) for p, a, b in sends],
        [(p, buf[a:b] if s < 0 else scratch[s : s + b - a]) for p, a, b, s in recvs],
    )


def _finish_step(step: _PlanStep, pending, buf, scratch, *, scale, timeout) -> None:  # host path
    """Wait for one posted step (``pending``), then add what it received into ``buf``
    (``scale`` applied where an element's value is final)."""
    pending.wait(timeout)
    for a, b, s, final in step[2]:
        reduce(buf[a:b], scratch[s : s + b - a], scale=scale if final else None)


def _enter(transport, buf: torch.Tensor, *, ready, timed: bool, reserved: bool = False):
    """The comm stream waits for ``ready`` (default: the caller's stream as it is
    now), and ``buf``'s memory stays reserved until the comm stream is done
    (``reserved``: it already is, recorded on the comm stream when allocated, as
    the optimizer's buckets are: no per-call record_stream). With ``timed``, a
    timing event marks where the work itself starts."""
    rt = transport.runtime
    if ready is None:
        ready = rt.new_event()
        ready.record(rt.current_stream())
    transport.wait_event(ready)
    if not reserved:
        rt.record_stream(buf, transport.stream)
    if timed:
        start = rt.new_event(timing=True)
        start.record(transport.stream)
        return start
    return None


def _leave(transport, start, *, what: str, timeout: float | None, after=None):
    """The done event (with ``start``: both), recorded behind ``after`` (queued on the
    comm stream first: one event covers both), its watchdog armed."""
    if after is not None:
        with transport.stream_context():
            after()
    if start is None:
        done = transport.record_event()
    else:
        done = transport.runtime.new_event(timing=True)
        done.record(transport.stream)
    if timeout is not None:
        transport.watch(done, timeout, what)
    return done if start is None else (start, done)


def execute_async(
    schedule: Schedule,
    buf: torch.Tensor,
    transport,
    *,
    scale: float | None = None,
    ready=None,
    timeout: float | None = None,
    label: str | None = None,
    timed: bool = False,
    reserved: bool = False,
    after: Optional[Callable[[], None]] = None,
):
    """Queue the whole schedule on a stream-ordered transport's comm stream and
    return the event that completes with it (and with ``after``, queued behind it).

    The comm stream first waits for ``ready`` (e.g. the gradients' event;
    default: the caller's current stream as it is now). Each step's NCCL group
    and then its reductions go on the comm stream, in stream order, with
    scratch the transport owns on that stream: no host synchronization
    anywhere. ``timeout`` arms the transport's watchdog (abort, then
    HybridCommTimeout on the next call, instead of a hang). A consumer makes
    its stream wait: ``stream.wait_event(done)``. With ``timed``, returns
    ``(start, done)`` timing events instead (``start.elapsed_time(done)`` once
    both completed: the communication's own time, without the wait for ready).
    """
    if schedule.numel != buf.numel():
        raise ValueError(f"schedule is for {schedule.numel} elements, buffer has {buf.numel()}")
    start = _enter(transport, buf, ready=ready, timed=timed, reserved=reserved)
    with transport.stream_context():
        if schedule.world_size > 1:
            plan = _plan(schedule, 1)  # one part: steps on one stream run in turn anyway
            scratch = comm_scratch(transport, plan.scratch_numel, buf.dtype)
            nsteps, itemsize, exchange = len(schedule.steps), buf.element_size(), transport.exchange
            for i, (sends, recvs, reds) in enumerate(plan.parts[0]):
                with trace.step_range(
                    schedule.algorithm, i, nsteps=nsteps, step=schedule.steps[i], itemsize=itemsize
                ):
                    exchange(
                        [(p, buf[a:b]) for p, a, b in sends],
                        [
                            (p, buf[a:b] if s < 0 else scratch[s : s + b - a])
                            for p, a, b, s in recvs
                        ],
                        label=(schedule.algorithm, i),
                    )
                    for a, b, s, final in reds:
                        reduce(buf[a:b], scratch[s : s + b - a], scale=scale if final else None)
        elif scale is not None and scale != 1:
            buf.mul_(scale)
    return _leave(
        transport,
        start,
        what=label or f"{schedule.algorithm} all-reduce of {buf.numel()} x {buf.dtype}",
        timeout=timeout,
        after=after,
    )


def execute_native(
    buf: torch.Tensor,
    transport,
    *,
    average: bool,
    ready=None,
    timeout: float | None = None,
    label: str | None = None,
    timed: bool = False,
    reserved: bool = False,
    phase: str = ALL_REDUCE,
    tail: int = 0,
    after: Optional[Callable[[], None]] = None,
):
    """The transport's own all-reduce (``native``: gloo's or NCCL's) of ``buf``, or
    its own reduce-scatter or all-gather (``phase``, sharded optimizer state): each
    rank's equal part of the body, then of the ``tail`` (a block a rank,
    ``algorithms.tail_body``), in a call each.

    Host-ordered: blocks (with ``timeout``) and returns None. Stream-ordered:
    queued on the comm stream after ``ready``, like :func:`execute_async`, and
    returns its done event (``(start, done)`` with ``timed``), behind ``after``.
    """
    if not transport.stream_ordered:
        _native_calls(buf, transport, average=average, phase=phase, tail=tail, timeout=timeout)
        return None
    start = _enter(transport, buf, ready=ready, timed=timed, reserved=reserved)
    _native_calls(buf, transport, average=average, phase=phase, tail=tail)
    return _leave(
        transport,
        start,
        what=label or f"native {phase} of {buf.numel()} x {buf.dtype}",
        timeout=timeout,
        after=after,
    )


def _native_calls(
    buf: torch.Tensor, transport, *, average: bool, phase: str, tail: int, **timeout
) -> None:
    """The transport's own collective for ``phase`` (``timeout``: the host path's)."""
    if phase == ALL_REDUCE:
        transport.all_reduce(buf, average=average, **timeout)
        return
    body = tail_body(transport.world_size, buf.numel(), tail)
    for part in (buf[:body], buf[body:]) if tail else (buf,):
        if phase == REDUCE_SCATTER:
            transport.reduce_scatter(part, average=average, **timeout)
        else:
            transport.all_gather(part, **timeout)


# ---- the one all-reduce dispatch ----------------------------------------------------------
_NO_RANGE = contextlib.nullcontext()


def _range(range_id: Optional[str], algorithm: str, nbytes: int, world: int):
    return _NO_RANGE if range_id is None else trace.bucket_range(range_id, algorithm, nbytes, world)


def reduce_now(
    buf: torch.Tensor,
    transport,
    algorithm: str,
    *,
    scale: Optional[float],
    timeout: float,
    topology=None,
    what: Optional[str] = None,
    phase: str = ALL_REDUCE,
    tail: int = 0,
) -> None:
    """All-reduce (or one ``phase`` of it) the flat ``buf`` in place now: blocking on
    the host path; on a stream-ordered transport queued in its issue order after the
    caller's work, with the caller's stream waiting for the result (no host
    synchronization)."""
    what = what or f"{phase} ({algorithm}, {buf.numel() * buf.element_size()} bytes)"
    if not transport.stream_ordered:
        reduce_operation(
            buf,
            transport,
            algorithm,
            scale=scale,
            timeout=timeout,
            label=None,
            range_id=None,
            stream_ordered=False,
            topology=topology,
            phase=phase,
            tail=tail,
        )()
        return
    rt = transport.runtime
    ready = rt.new_event()
    ready.record(rt.current_stream())
    operation = reduce_operation(
        buf,
        transport,
        algorithm,
        scale=scale,
        timeout=timeout,
        label=None,
        range_id=None,
        ready=ready,
        stream_ordered=True,
        timed=False,
        topology=topology,
        phase=phase,
        tail=tail,
    )
    done = issue_in_order(transport, operation, what, timeout)
    if done is not None:
        rt.current_stream().wait_event(done)


def reduce_operation(
    buf: torch.Tensor,
    transport,
    algorithm: str,
    *,
    scale: Optional[float],
    timeout: float,
    label: Optional[str],
    range_id: Optional[str] = "",
    ready=None,
    workspace: Optional[Workspace] = None,
    stream_ordered: bool,
    timed: bool = True,
    after: Optional[Callable[[], None]] = None,
    reserved: bool = False,
    servers=None,
    topology=None,
    phase: str = ALL_REDUCE,
    tail: int = 0,
) -> Callable:
    """A channel operation that all-reduces the flat ``buf`` in place with ``algorithm``.

    Host channel: the returned operation (:class:`HostReduction`) runs the reduction
    (blocking) on the channel's thread. Stream channel: it (:class:`QueuedReduction`)
    queues the reduction on the comm stream (after ``ready``) and returns
    ``(start, done)`` timing events. ``after`` (a
    function) runs once the reduction is done, on the same side (thread or
    comm stream). ``scale``: 1/P for an average. ``range_id`` names the profiler
    range ("bucket <range_id> ...", None: no range). ``reserved``: ``buf`` was recorded on the
    comm stream when allocated (no record_stream per call). ``servers``: the
    job's :class:`~hybridcomm.comm.servers.SummationServers`, for ``ps`` (host path only).
    ``topology``: the :class:`~hybridcomm.algorithms.Topology` of the
    topology-aware schedules (hierarchical, torus2d). ``phase``: the whole
    all-reduce, or its reduce-scatter or all-gather alone (sharded optimizer
    state; the algorithms in ``PHASED``), with ``tail`` elements a rank at the end
    of ``buf`` that each rank gets whole (``algorithms.tail_body``: the usage
    flags' copies).
    """
    if algorithm == PS:
        return ServerReduction(
            buf, transport, servers=servers, scale=scale, after=after, range_id=range_id
        )
    if algorithm == NATIVE:
        return NativeReduction(
            buf,
            transport,
            average=scale is not None,
            ready=ready,
            timeout=timeout,
            label=label,
            timed=stream_ordered and timed,
            reserved=reserved,
            phase=phase,
            tail=tail,
            stream_ordered=stream_ordered,
            after=after,
            range_id=range_id,
        )
    world, rank = transport.world_size, transport.rank
    schedule = (
        get_schedule(algorithm, rank, world, buf.numel(), topology=topology)
        if phase == ALL_REDUCE
        else get_phase_schedule(phase, algorithm, rank, world, numel=buf.numel(), tail=tail)
    )
    if stream_ordered:
        return QueuedReduction(
            schedule,
            buf,
            transport,
            scale=scale,
            ready=ready,
            timeout=timeout,
            label=label,
            timed=timed,
            reserved=reserved,
            after=after,
            range_id=range_id,
        )
    return HostReduction(
        schedule,
        buf,
        transport,
        scale=scale,
        timeout=timeout,
        workspace=workspace,
        after=after,
        range_id=range_id,
    )


# The operations reduce_operation returns: objects whose method is the step a stack trace
# shows (``HostReduction.run``, ``QueuedReduction.issue``), called as functions by the
# channel. What they need is worked out once, where they are made: the engine keeps a
# host path's operation per bucket buffer and runs it every step.
class _Reduction:
    """An operation's buffer and transport, what runs after it (on the same side: the
    channel's thread or the comm stream) and its profiler range ("bucket <range_id>
    ...", none where ``range_id`` is None)."""

    __slots__ = ("buf", "transport", "after", "range_id", "algorithm", "nbytes", "world")

    def __init__(self, buf, transport, algorithm: str, *, after, range_id):
        self.buf, self.transport, self.algorithm = buf, transport, algorithm
        self.after, self.range_id = after, range_id
        self.nbytes = buf.numel() * buf.element_size()
        self.world = transport.world_size


class HostReduction(_Reduction):
    """The host path's all-reduce (or phase) of ``buf`` by ``schedule``: run (blocking)
    on the channel's thread, or in its caller; then ``after``."""

    __slots__ = ("schedule", "scale", "timeout", "workspace", "scratch_numel", "dtype", "device")

    def __init__(self, schedule, buf, transport, *, scale, timeout, workspace, after, range_id):
        super().__init__(buf, transport, schedule.algorithm, after=after, range_id=range_id)
        self.schedule, self.scale, self.timeout = schedule, scale, timeout
        self.workspace = workspace
        self.scratch_numel, self.dtype, self.device = schedule.scratch_numel, buf.dtype, buf.device

    def run(self) -> None:
        workspace = self.workspace
        scratch = (
            workspace.get(self.scratch_numel, self.dtype, self.device)
            if workspace is not None
            else None
        )
        with _range(self.range_id, self.algorithm, self.nbytes, self.world):
            execute(
                self.schedule,
                self.buf,
                self.transport,
                scale=self.scale,
                scratch=scratch,
                timeout=self.timeout,
            )
        if self.after is not None:
            self.after()

    __call__ = run  # (the channel calls its operations)


class QueuedReduction(_Reduction):
    """The stream path's all-reduce (or phase) of ``buf`` by ``schedule``: issued on
    the comm stream after ``ready``, ``after`` queued behind it; returns ``(start,
    done)`` timing events (the done event alone unless ``timed``)."""

    __slots__ = ("schedule", "scale", "ready", "timeout", "label", "timed", "reserved")

    def __init__(
        self,
        schedule,
        buf,
        transport,
        *,
        scale,
        ready,
        timeout,
        label,
        timed,
        reserved,
        after,
        range_id,
    ):
        super().__init__(buf, transport, schedule.algorithm, after=after, range_id=range_id)
        self.schedule, self.scale, self.ready, self.timeout = schedule, scale, ready, timeout
        self.label, self.timed, self.reserved = label, timed, reserved

    def issue(self):
        with _range(self.range_id, self.algorithm, self.nbytes, self.world):
            return execute_async(
                self.schedule,
                self.buf,
                self.transport,
                scale=self.scale,
                ready=self.ready,
                timeout=self.timeout,
                label=self.label,
                timed=self.timed,
                reserved=self.reserved,
                after=self.after,
            )

    __call__ = issue  # (the channel calls its operations)


class NativeReduction(_Reduction):
    """``native``: the transport's own all-reduce (or reduce-scatter, all-gather) of
    ``buf`` (:func:`execute_native`); on a stream ``after`` queued behind it, on the
    host run after it."""

    __slots__ = (
        "average",
        "ready",
        "timeout",
        "label",
        "timed",
        "reserved",
        "phase",
        "tail",
        "stream_ordered",
    )

    def __init__(
        self,
        buf,
        transport,
        *,
        average,
        ready,
        timeout,
        label,
        timed,
        reserved,
        phase,
        tail,
        stream_ordered,
        after,
        range_id,
    ):
        super().__init__(buf, transport, NATIVE, after=after, range_id=range_id)
        self.average, self.ready, self.timeout, self.label = average, ready, timeout, label
        self.timed, self.reserved, self.phase, self.tail = timed, reserved, phase, tail
        self.stream_ordered = stream_ordered

    def run(self):
        ordered, after = self.stream_ordered, self.after
        with _range(self.range_id, self.algorithm, self.nbytes, self.world):
            out = execute_native(
                self.buf,
                self.transport,
                average=self.average,
                ready=self.ready,
                timeout=self.timeout,
                label=self.label,
                timed=self.timed,
                reserved=self.reserved,
                phase=self.phase,
                tail=self.tail,
                after=after if ordered else None,
            )
        if after is not None and not ordered:
            after()
        return out

    __call__ = run  # (the channel calls its operations)


class ServerReduction(_Reduction):
    """``ps``: ``buf`` through the summation servers, on the channel's thread (host path
    only: :class:`~hybridcomm.comm.engine.CommEngine` refuses a ``ps`` plan elsewhere)."""

    __slots__ = ("servers", "op")

    def __init__(self, buf, transport, *, servers, scale, after, range_id):
        super().__init__(buf, transport, PS, after=after, range_id=range_id)
        self.servers, self.op = servers, "sum" if scale is None else "avg"

    def run(self) -> None:
        with _range(self.range_id, self.algorithm, self.nbytes, self.world):
            self.servers.all_reduce(self.buf, op=self.op)
        if self.after is not None:
            self.after()

    __call__ = run  # (the channel calls its operations)
