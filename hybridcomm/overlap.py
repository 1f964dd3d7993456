"""The overlap engine: bucket buffers, and one comm thread per lane.

The training thread packs gradients into a bucket's buffer as backward
produces them and *launches* the bucket when it is complete; each lane's
thread all-reduces its buckets in the plan's fixed order (so every rank
issues the same operations in the same order, whatever the local timing),
and the training thread *waits* on a bucket only where it needs the result.
On CPU the lanes are Python threads over gloo (which releases the GIL while
it moves bytes); each lane has its own process group, so the two never
share a communicator. On GPUs with CuPy NCCL (a stream-ordered transport)
the lane thread only *queues* each bucket on its lane's CUDA stream, after
the gradients' ready event, and the trainer's stream waits on the bucket's
done event: no host synchronization on the data path.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .algorithms import get_schedule
from .cost_model import NATIVE
from .errors import HybridCommError, HybridCommTimeout
from . import trace
from .executor import Workspace, execute, execute_async
from .planner import LANES, Bucket, Plan
from .timeline import Timeline
from .transport.select import select_transport


class BucketState:
    """One bucket's buffer and progress. ``launched``/``completed`` count
    iterations; the bucket is in flight while ``completed < launched``."""

    __slots__ = ("bucket", "params", "buffer", "views", "flags", "packed", "launched",
                 "completed", "armed", "pending_update", "hyper", "ready", "done")

    def __init__(self, bucket: Bucket, params: List[torch.nn.Parameter], dtype, device):
        self.bucket, self.params = bucket, params
        self.buffer = torch.zeros(bucket.numel + len(params), dtype=dtype, device=device)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.flags = self.buffer[offset:]  # > 0 after the sum: some rank had a gradient
        self.packed = set()  # params packed for the current iteration
        self.launched = self.completed = 0
        self.armed = False  # launched this iteration, result not yet consumed
        self.pending_update = False  # forward mode: reduced, not yet applied
        self.hyper = None  # optimizer hyper-parameters at the step() that deferred the update
        self.ready = self.done = None  # CUDA events (stream-ordered transports only)

    @property
    def in_flight(self) -> bool:
        return self.completed < self.launched

    def pack(self, i: int) -> None:
        """Copy parameter i's gradient in (or zeros and flag 0 if it has none)."""
        g = self.params[i].grad
        if g is None:
            self.views[i].zero_()
            self.flags[i] = 0
        else:
            self.views[i].copy_(g)
            self.flags[i] = 1
        self.packed.add(i)

    def used(self) -> List[int]:
        """Indices of the parameters some rank had a gradient for."""
        return [i for i, f in enumerate(self.flags.tolist()) if f > 0]


class CommEngine:
    """Runs the plan's buckets on per-lane threads; launch() and wait() from the trainer.

    Example::

        >>> engine = CommEngine(plan, states, groups, scale=1 / world, timeout=300)
        >>> engine.launch(states[0]); engine.wait(states[0])
    """

    def __init__(self, plan: Plan, states: List[BucketState], groups: Dict[str, object], *,
                 scale: Optional[float], timeout: float, timeline: Optional[Timeline] = None):
        self.plan, self.states, self.scale, self.timeout = plan, states, scale, timeout
        self.timeline = timeline or Timeline(enabled=False)
        self.cond = threading.Condition()
        self.error: Optional[BaseException] = None
        self.closed = False
        self.busy_s = 0.0  # comm time of finished operations (read and reset by the trainer)
        self.threads = []
        self.streams = None  # set when the lanes' transport is stream-ordered
        device = states[0].buffer.device if states else torch.device("cpu")
        for lane in LANES:
            order = [states[b.index] for b in plan.lane_order(lane)]
            if order:
                transport = select_transport(device, groups[lane])
                if getattr(transport, "stream_ordered", False):
                    self.streams = transport.streams
                t = threading.Thread(target=self._run_lane, args=(lane, order, transport),
                                     name=f"hybridcomm-{lane}", daemon=True)
                t.start()
                self.threads.append(t)

    def launch(self, state: BucketState) -> None:
        state.armed = True
        if self.streams is not None:  # the packed gradients are ready at this point of compute
            state.ready = self.streams.new_event()
            state.ready.record(self.streams.current_stream())
        with self.cond:
            state.launched += 1
            self.cond.notify_all()

    def wait(self, state: BucketState) -> float:
        """Block until the bucket's all-reduce is done; return the seconds waited."""
        if not state.in_flight and self.error is None:
            return 0.0
        t0 = time.perf_counter()
        deadline = t0 + self.timeout
        with self.cond:
            while state.in_flight:
                if self.error is not None:
                    raise HybridCommError(f"communication failed: {self.error}") from self.error
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise HybridCommTimeout(
                        f"bucket {state.bucket.index} ({state.bucket.algorithm}, "
                        f"{state.bucket.nbytes} bytes) not reduced within {self.timeout}s")
                self.cond.wait(min(left, 1.0))
        if state.done is not None:  # GPU: the trainer's stream waits, not the host
            self.streams.current_stream().wait_event(state.done)
        t1 = time.perf_counter()
        self.timeline.add(f"wait bucket {state.bucket.index}", "wait", t0, t1)
        return t1 - t0

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        for t in self.threads:
            t.join(timeout=5)

    def _native(self, seg: torch.Tensor, group) -> None:
        # Every rank gets the same bits back (gloo and NCCL copy each reduced
        # chunk around), and scales them the same way.
        work = dist.all_reduce(seg, group=group, async_op=True)
        if not work.wait(timeout=timedelta(seconds=self.timeout)):
            raise HybridCommTimeout(f"native all_reduce of {seg.numel()} elements did not "
                                    f"complete within {self.timeout}s")
        if self.scale is not None:
            seg.mul_(self.scale)

    def _run_lane(self, lane: str, order: List[BucketState], transport):
        workspace = Workspace()
        ordered = getattr(transport, "stream_ordered", False)
        rank, world = transport.rank, transport.world_size
        try:
            while True:
                for state in order:
                    with self.cond:
                        while not (state.in_flight or self.closed):
                            self.cond.wait()
                        if self.closed:
                            return
                    b = state.bucket
                    t0 = time.perf_counter()
                    with trace.bucket_range(b.index, b.algorithm, b.nbytes, world):
                        for start, stop in b.segments:
                            seg = state.buffer[start:stop]
                            if b.algorithm == NATIVE:  # the group's own all_reduce
                                self._native(seg, transport.group)
                                continue
                            schedule = get_schedule(b.algorithm, rank, world, seg.numel())
                            scratch = workspace.get(schedule.scratch_numel, seg.dtype, seg.device)
                            if ordered:  # queue on the lane's stream after the gradients
                                state.done = execute_async(schedule, seg, transport,
                                                           scale=self.scale, scratch=scratch,
                                                           ready=state.ready, timeout=self.timeout)
                            else:
                                execute(schedule, seg, transport, scale=self.scale,
                                        scratch=scratch, timeout=self.timeout)
                    t1 = time.perf_counter()
                    self.timeline.add(f"allreduce bucket {b.index}", f"comm/{lane}", t0, t1,
                                      algorithm=b.algorithm, bytes=b.nbytes)
                    with self.cond:
                        self.busy_s += t1 - t0
                        state.completed += 1
                        self.cond.notify_all()
        except BaseException as e:  # surfaced to the trainer on its next wait
            with self.cond:
                self.error = e
                self.cond.notify_all()
