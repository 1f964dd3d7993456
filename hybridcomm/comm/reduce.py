"""The one all-reduce dispatch: which operation reduces a flat buffer, on which side.

Every all-reduce in hybridcomm goes through :func:`reduce_operation`: the
engine's buckets, the DDP hook's, ``hybridcomm.all_reduce`` and the
calibration probe (both through :func:`reduce_now`). It picks the transport's
own all-reduce (``native``), the summation servers (``ps``) or an algorithm's
schedule, and the side it runs on: blocking on the host (gloo) or queued on
the comm stream (NCCL, the simulated GPU).

Example::

    >>> transport = select_transport(buf.device, None, timeout=60)
    >>> reduce_now(buf, transport, "ring", scale=1 / transport.world_size, timeout=60)
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from ..algorithms import get_schedule
from ..base import trace
from ..plan.cost_model import NATIVE, PS
from .executor import Workspace, execute, execute_async, execute_native
from .issuer import issue_in_order

_NO_RANGE = contextlib.nullcontext()


def _range(range_id: Optional[str], algorithm: str, nbytes: int, world: int):
    return _NO_RANGE if range_id is None else trace.bucket_range(range_id, algorithm, nbytes, world)


def reduce_now(buf: torch.Tensor, transport, algorithm: str, *, scale: Optional[float],
               timeout: float, topology=None, what: Optional[str] = None) -> None:
    """All-reduce the flat ``buf`` in place now: blocking on the host path; on a
    stream-ordered transport queued in its issue order after the caller's work,
    with the caller's stream waiting for the result (no host synchronization)."""
    what = what or f"all_reduce ({algorithm}, {buf.numel() * buf.element_size()} bytes)"
    if not transport.stream_ordered:
        reduce_operation(buf, transport, algorithm, scale=scale, timeout=timeout, label=None,
                         range_id=None, stream_ordered=False, topology=topology)()
        return
    rt = transport.runtime
    ready = rt.new_event()
    ready.record(rt.current_stream())
    operation = reduce_operation(buf, transport, algorithm, scale=scale, timeout=timeout,
                                 label=None, range_id=None, ready=ready, stream_ordered=True,
                                 timed=False, topology=topology)
    done = issue_in_order(transport, operation, what, timeout)
    if done is not None:
        rt.current_stream().wait_event(done)


def reduce_operation(buf: torch.Tensor, transport, algorithm: str, *, scale: Optional[float],
                     timeout: float, label: Optional[str], range_id: Optional[str] = "",
                     ready=None, workspace: Optional[Workspace] = None, stream_ordered: bool,
                     timed: bool = True, after: Optional[Callable[[], None]] = None,
                     reserved: bool = False, servers=None, topology=None) -> Callable:
    """A channel operation that all-reduces the flat ``buf`` in place with ``algorithm``.

    Host channel: the returned function runs the reduction (blocking) on the
    channel's thread. Stream channel: it queues the reduction on the comm stream
    (after ``ready``) and returns ``(start, done)`` timing events. ``after`` (a
    function) runs once the reduction is done, on the same side (thread or
    comm stream). ``scale``: 1/P for an average. ``range_id`` names the profiler
    range ("bucket <range_id> ...", None: no range). ``reserved``: ``buf`` was recorded on the
    comm stream when allocated (no record_stream per call). ``servers``: the
    job's :class:`~hybridcomm.comm.servers.SummationServers`, for ``ps`` (host path only).
    ``topology``: the :class:`~hybridcomm.algorithms.Topology` of the
    topology-aware schedules (hierarchical, torus2d).
    """
    world, rank = transport.world_size, transport.rank
    nbytes = buf.numel() * buf.element_size()
    if algorithm == PS:
        return _ps_operation(buf, servers, scale, after, range_id, world, nbytes)
    if algorithm == NATIVE:
        def native():
            with _range(range_id, algorithm, nbytes, world):
                out = execute_native(buf, transport, average=scale is not None, ready=ready,
                                     timeout=timeout, label=label, timed=stream_ordered and timed,
                                     reserved=reserved)
            return _then(transport, out, after, stream_ordered, timeout, label)
        return native
    schedule = get_schedule(algorithm, rank, world, buf.numel(), topology)
    if stream_ordered:
        def queued():
            with _range(range_id, algorithm, nbytes, world):
                out = execute_async(schedule, buf, transport, scale=scale, ready=ready,
                                    timeout=timeout, label=label, timed=timed, reserved=reserved)
            return _then(transport, out, after, True, timeout, label)
        return queued

    def hosted():  # host path
        scratch = workspace.get(schedule.scratch_numel, buf.dtype, buf.device) \
            if workspace is not None else None
        with _range(range_id, algorithm, nbytes, world):
            execute(schedule, buf, transport, scale=scale, scratch=scratch, timeout=timeout)
        if after is not None:
            after()
    return hosted


def _ps_operation(buf, servers, scale, after, range_id, world: int, nbytes: int):
    """``ps``: the buffer through the summation servers, on the channel's thread
    (host path only: :class:`CommEngine` refuses a ``ps`` plan elsewhere)."""
    def hosted():
        with _range(range_id, PS, nbytes, world):
            servers.all_reduce(buf, op="sum" if scale is None else "avg")
        if after is not None:
            after()
    return hosted


def _then(transport, out, after, stream_ordered: bool, timeout: float, label: str):
    """Run ``after`` behind the reduction: on the comm stream (a new done event
    covers it) or on the host thread."""
    if after is None:
        return out
    if not stream_ordered:
        after()
        return out
    start, _ = out
    with transport.stream_context():
        after()
    done = transport.runtime.new_event(timing=True)
    done.record(transport.stream)
    transport.watch(done, timeout, label)
    return start, done
