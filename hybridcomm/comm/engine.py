"""Runs buckets' all-reduces through the one ordered channel, in the plan's issue order.

The bucket group (sync/bucket_group.py) decides when a bucket is ready
(``launch``); the engine submits its segments to the channel only when the
plan's fixed sequence of (bucket, segment) reaches them, so every rank issues
the same sequence whatever its local timing, and ``wait`` makes the trainer
(host or stream) wait for a result. Each operation (which all-reduce, on which
side) is executor.py's :func:`~hybridcomm.comm.executor.reduce_operation`;
top-k, PowerSGD and quantized buckets get one operation of their own here.
docs/ARCHITECTURE.md ("A gradient's path", steps 5-8) has the path.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial
from typing import Callable, List, Optional

from ..algorithms import ALL_REDUCE
from ..plan.cost_model import PS, bytes_sent
from ..base.errors import HybridCommError
from .executor import Workspace, execute, execute_async, reduce_operation
from ..plan.planner import Plan


class CommEngine:
    """Issues buckets' all-reduces through ``channel`` in ``plan.order``.

    Example (the order holds whatever order buckets are launched in)::

        engine = CommEngine(plan, buckets, channel, transport, scale=1 / world, timeout=60)
        engine.launch(1); engine.launch(0)    # issued as plan.order says
        engine.wait(0); engine.wait(1)
    """

    def __init__(
        self,
        plan: Plan,
        buckets: list,
        channel,
        transport,
        *,
        scale: Optional[float],
        timeout: float,
        servers=None,
        timed_ops: bool = False,
    ):
        self.plan, self.buckets, self.channel, self.transport = plan, buckets, channel, transport
        self.scale, self.timeout = scale, timeout
        # ALL_REDUCE, or REDUCE_SCATTER where each rank steps its shard (sync/shard.py)
        self.phase = ALL_REDUCE
        # each operation's time kept for the channel's take_ops (the synchronizer's
        # measured steps; a caller that never takes them leaves them off)
        self.timed_ops = timed_ops
        self.servers = servers  # SummationServers, for buckets planned 'ps'
        uses_ps = [b.index for b in plan.buckets if b.algorithm == PS]
        if uses_ps and (servers is None or channel.stream_ordered):
            raise HybridCommError(
                f"buckets {uses_ps} are planned 'ps' (the summation servers), which "
                + (
                    "needs servers= (hybridcomm.comm.servers.SummationServers)"
                    if servers is None
                    else "runs on the host path only (gloo, CPU tensors), not on the GPU path"
                )
            )
        # A wait slower than slow_after calls on_slow(bucket) once (the stall inspector).
        self.on_slow: Optional[Callable[[int], Optional[str]]] = None
        self.slow_after = 0.0
        # Called with a bucket's index as its launch is issued: in plan order on every
        # rank, so it may post host collectives (the used-parameter agreement).
        self.on_issue: Optional[Callable[[int], None]] = None  # a bucket's first segment goes
        self.on_issued: Optional[Callable[[int], None]] = None  # its last one went
        # Host path: the trainer waits for a round's results once its last operation is
        # issued (nothing left to overlap it with: set by the synchronizer where the step
        # is not deferred), or for every operation issued while ``waits_now`` (the step's
        # own launches): such an operation runs in the issuing thread, after what was
        # issued before it (HostChannel's ``here``), not on the channel's thread.
        self.round_end_waits = False
        self.waits_now = False
        self.round = 0  # passes through plan.order completed
        self.cursor = 0  # position in plan.order
        self.bytes_sent = 0  # by this rank, since the trainer last read it
        n = len(buckets)
        self._launches = [0] * n  # launches so far, per bucket
        self._launched = 0  # their sum
        self._issued = [0] * n  # launches whose every segment is in the channel
        self._issue_seq = [0] * n  # when its last launch went into the channel (a counter)
        self._seq = 0
        self._tickets: List[list] = [[] for _ in range(n)]  # per segment, once submitted
        self._ready = [None] * n  # device path: the gradients are ready (event)
        self._after: List[Optional[Callable[[], None]]] = [None] * n  # launch's own, after it
        self._versions = [0] * n  # the buffer's version counter after our own writes
        self._workspace = Workspace()  # host path scratch (one operation at a time uses it)

    # -- launching ---------------------------------------------------------------------
    def launch(self, index: int, after: Optional[Callable[[], None]] = None) -> None:
        """Bucket ``index`` is ready (its flags set): issue it when the order reaches it.
        ``after``: run behind this launch's reduction, where it runs (the comm stream,
        or the channel's thread), before the launch counts as done. A launch the
        order has not reached waits here (``issued`` tells); every round of the
        order launches every bucket once."""
        b = self.buckets[index]
        if b.topk is not None:  # this rank's message, from the gradients
            b.topk.select(b.grads, b.flags)
        if b.lowrank is not None and b.lowrank.active:  # its first message, likewise
            b.lowrank.compress(b.grads, b.flags)
        elif b.quant is not None:  # on a stream, its messages now (the host path: in the op)
            if self.channel.stream_ordered:
                b.quant.encode(b.grads)
        else:  # sent whole (PowerSGD's exact steps too: "powersgd:4+fp16")
            b.to_wire()
        if self.channel.stream_ordered:
            rt = self.channel.runtime
            self._ready[index] = rt.new_event()
            self._ready[index].record(rt.current_stream())
        self._after[index] = after
        self._launches[index] += 1
        self._launched += 1
        self._tickets[index] = [None] * len(b.spec.segments)
        self._pump()

    def at_round_start(self) -> bool:
        """Whether the next launch is the first of a round of the order."""
        return self._launched == self.round * len(self.buckets)

    def issued(self, index: int) -> bool:
        """Whether bucket ``index``'s last launch is wholly in the channel (then it can
        be waited for; before, its buffer must not be touched: it is still to be sent)."""
        return self._issued[index] == self._launches[index]

    def _pump(self) -> None:
        order = self.plan.order
        while order:
            i, s = order[self.cursor]
            if self._launches[i] <= self.round:
                return  # that bucket is not launched yet: the order waits for it
            last = s == len(self.buckets[i].spec.segments) - 1
            if s == 0 and self.on_issue is not None:
                self.on_issue(i)
            op = self._operation(i, s, last)
            if last:
                self._after[i] = None  # (in the operation now: it holds the buffer's views)
                if self.channel.stream_ordered:
                    op = NotingVersion(op, i, self.buckets[i].buffer, self._versions)
            what, key = f"bucket {i} segment {s}", (self.plan, i, s) if self.timed_ops else None
            if self.waits_now or (self.round_end_waits and self.cursor + 1 == len(order)):
                self._tickets[i][s] = self.channel.submit(op, what, key, **self._here(i))
            else:
                self._tickets[i][s] = self.channel.submit(op, what, key)
            if last:
                self._issued[i] += 1
                self._seq += 1
                self._issue_seq[i] = self._seq
                if self.on_issued is not None:
                    self.on_issued(i)
            self.cursor += 1
            if self.cursor == len(order):
                self.cursor, self.round = 0, self.round + 1

    @contextlib.contextmanager
    def waited_at_once(self, on: bool = True):
        """What is issued inside is waited for as soon as it is (``waits_now``)."""
        self.waits_now = on
        try:
            yield
        finally:
            self.waits_now = False

    def _here(self, index: int) -> dict:
        """The host channel's options for an operation the trainer waits for next
        (none on a stream: its issue never blocks the trainer)."""
        if self.channel.stream_ordered:
            return {}
        slow = self.on_slow
        return dict(
            here=True,
            on_slow=None if slow is None else partial(slow, index),
            slow_after=self.slow_after,
        )

    def _operation(self, index: int, s: int, last: bool):
        b = self.buckets[index]
        if b.topk is not None:
            return self._sparse_operation(index)
        if b.lowrank is not None and b.lowrank.active:
            return self._lowrank_operation(index)
        if b.quant is not None:
            return self._quantized_operation(index)
        if self.channel.stream_ordered:  # (it waits for this launch's own ready event)
            op, sent = self._dense_operation(index, s, last)
        elif self._after[index] is not None and last:  # (this launch's own)
            op, sent = self._dense_operation(index, s, last)
        else:  # the host path's is the same every launch: built once per buffer
            key = (s, self.phase, self.scale)
            built = b.operations.get(key)
            if built is None:
                built = b.operations[key] = self._dense_operation(index, s, last)
            op, sent = built
        self.bytes_sent += sent
        return op

    def _dense_operation(self, index: int, s: int, last: bool):
        """Segment ``s`` of bucket ``index``'s reduction (or its phase), and the bytes
        this rank sends for it."""
        b = self.buckets[index]
        a, z = b.spec.segments[s]
        seg = b.comm[a:z]
        world = self.transport.world_size
        sent = bytes_sent(b.spec.algorithm, seg.numel() * seg.element_size(), world)
        sent = int(sent if self.phase == ALL_REDUCE else sent / 2)  # (one half)
        label = (
            f"bucket {index} ({b.spec.algorithm}, segment {s + 1}/{len(b.spec.segments)}, "
            f"{seg.numel() * seg.element_size()} bytes)"
        )
        after = None
        ordered = self.channel.stream_ordered
        extra = self._after[index] if last else None
        if last and (b.wire is not None or not ordered or extra is not None):
            # (on a stream nothing to do without a wire copy or a part to copy: no kernel)
            # The bucket's tensors, not the bucket or the engine: a kept operation makes no
            # reference cycle, so a re-plan's old buckets are freed at once.
            after = BucketAfter(
                index,
                buffer=b.buffer,
                wire=b.wire,
                extra=extra,
                versions=None if ordered else self._versions,
            )
        op = reduce_operation(
            seg,
            self.transport,
            b.spec.algorithm,
            scale=self.scale,
            phase=self.phase,
            tail=b.spec.tail if last else 0,
            timeout=self.timeout,
            label=label,
            range_id=index,
            ready=self._ready[index],
            workspace=self._workspace,
            stream_ordered=ordered,
            after=after,
            reserved=True,  # bucket memory: recorded when allocated
            servers=self.servers,
        )
        return op, sent

    def _sparse_operation(self, index: int):
        """A top-k bucket: all-gather the ranks' messages, sum them into the bucket."""
        b = self.buckets[index]
        topk = b.topk
        self.bytes_sent += topk.bytes_sent
        op = TopkReduction(
            index,
            b,
            self.transport,
            scale=self.scale,
            timeout=self.timeout,
            ready=self._ready[index],
            versions=self._versions,
        )
        return op.issue if self.channel.stream_ordered else op.run

    def _lowrank_operation(self, index: int):
        """A PowerSGD bucket: all-reduce P, project, all-reduce Q, decode (powersgd.py);
        sums both times (the average is decode's)."""
        b = self.buckets[index]
        lr, algo, world = b.lowrank, b.spec.algorithm, self.transport.world_size
        p_numel, q_numel = lr.bytes_sent_numel
        self.bytes_sent += int(
            bytes_sent(algo, 4 * p_numel, world) + bytes_sent(algo, 4 * q_numel, world)
        )
        op = LowRankReduction(
            index,
            b,
            self.transport,
            scale=self.scale,
            timeout=self.timeout,
            ready=self._ready[index],
            versions=self._versions,
            ordered=self.channel.stream_ordered,
            workspace=self._workspace,
            servers=self.servers,
        )
        return op.issue if self.channel.stream_ordered else op.run

    def _quantized_operation(self, index: int):
        """A quantized bucket: exchange the chunks, sum this rank's, gather the
        averages, decode them into the bucket (quantized.py)."""
        b = self.buckets[index]
        quant, scale = b.quant, self.scale
        self.bytes_sent += quant.bytes_sent
        label = f"bucket {index} ({quant.bits}-bit, {quant.bytes_sent} bytes sent)"

        if self.channel.stream_ordered:

            def queued():
                start, _ = execute_async(
                    quant.exchange,
                    quant.exchanged,
                    self.transport,
                    ready=self._ready[index],
                    timed=True,
                    reserved=True,
                )
                with self.transport.stream_context():
                    quant.reduce_own(scale)
                execute_async(  # (behind the sum: it is on the comm stream too)
                    quant.gather,
                    quant.gathered,
                    self.transport,
                    ready=self.transport.record_event(),
                    reserved=True,
                )
                with self.transport.stream_context():
                    quant.decode(b.grads)
                done = self.transport.runtime.new_event(timing=True)
                done.record(self.transport.stream)
                self.transport.watch(done, self.timeout, label)
                return start, done

            return queued

        def hosted():  # host path
            # quantized here, on the channel's thread: the trainer goes on meanwhile (the
            # bucket's buffer is not written before its wait)
            quant.encode(b.grads)
            execute(quant.exchange, quant.exchanged, self.transport, timeout=self.timeout)
            quant.reduce_own(scale)
            execute(quant.gather, quant.gathered, self.transport, timeout=self.timeout)
            quant.decode(b.grads)
            self._versions[index] = b.buffer._version

        return hosted

    # -- waiting -----------------------------------------------------------------------
    def wait(self, index: int) -> float:
        """Bucket ``index``'s last launch is reduced and usable (host: done; device:
        the trainer's stream waits for it); the seconds the host waited."""
        tickets = self._tickets[index]
        if not tickets:
            return 0.0
        if not self.issued(index):
            missing = self.plan.order[self.cursor]
            raise HybridCommError(
                f"internal error: bucket {index} is needed before its turn in "
                f"the issue order (waiting on bucket {missing[0]})"
            )
        t0 = time.perf_counter()
        slow = self.on_slow
        self.channel.wait(
            tickets[-1],
            f"bucket {index}",
            on_slow=None if slow is None else partial(slow, index),
            slow_after=self.slow_after,
        )
        return time.perf_counter() - t0

    def done_with(self, index: int, other: int) -> bool:
        """Whether bucket ``index``'s last launch is done once ``other``'s is: on the
        device path, issued no later on the one comm stream (FIFO); on the host
        path, done already."""
        if not self.channel.stream_ordered:
            return self.done(index)
        return not self._tickets[index] or (
            self.issued(index)
            and self.issued(other)
            and self._issue_seq[index] <= self._issue_seq[other]
        )

    def issue_seq(self, index: int) -> int:
        """When bucket ``index``'s last launch went into the channel (larger: later)."""
        return self._issue_seq[index]

    def done(self, index: int) -> bool:
        """Whether bucket ``index``'s last launch has finished (never blocks, never a
        host sync: a completed-ticket count, or an event query)."""
        tickets = self._tickets[index]
        return not tickets or (self.issued(index) and self.channel.done(tickets[-1]))

    def version(self, index: int) -> int:
        """The bucket buffer's version counter right after the engine's own writes:
        anything higher when the result is read means someone else wrote to it."""
        return self._versions[index]

    def close(self) -> None:
        self.channel.close()


# A bucket's operations, as the channel runs (host) or issues (stream) them: objects whose
# method is the step a stack trace shows. They hold the bucket's tensors and the engine's
# version list, never the engine (nor, where kept in ``GradBucket.operations``, the bucket):
# a kept operation makes no reference cycle, so a re-plan's old buckets are freed at once.
class BucketAfter:
    """What follows bucket ``index``'s last segment, where its reduction runs (the
    channel's thread, or queued on the comm stream): the wire copy back into the
    buffer, the launch's own ``extra`` (shard.py's part kept), and on the host path
    (``versions``) the buffer's version noted: our own writes are done by then."""

    __slots__ = ("index", "buffer", "wire", "extra", "versions")

    def __init__(self, index: int, *, buffer, wire, extra, versions):
        self.index, self.buffer, self.wire = index, buffer, wire
        self.extra, self.versions = extra, versions

    def run(self) -> None:
        if self.wire is not None:
            self.buffer.copy_(self.wire)  # (GradBucket.from_wire)
        if self.extra is not None:
            self.extra()
        if self.versions is not None:
            self.versions[self.index] = self.buffer._version

    __call__ = run


class NotingVersion:
    """The stream path's last segment of bucket ``index``: ``operation`` issued, then the
    buffer's version counter noted: our own writes are issued by then (on whichever
    thread issues; the trainer reads it only after waiting). The buffer as launched:
    the bucket may have released it since (shard.py)."""

    __slots__ = ("operation", "index", "buffer", "versions")

    def __init__(self, operation, index: int, buffer, versions: list):
        self.operation, self.index, self.buffer, self.versions = operation, index, buffer, versions

    def issue(self):
        out = self.operation()
        self.versions[self.index] = self.buffer._version
        return out

    __call__ = issue


class TopkReduction:
    """A top-k bucket's operation (made per launch): all-gather the ranks' messages
    (compression.py's schedule), then sum them into the bucket (``decode``)."""

    __slots__ = ("index", "bucket", "transport", "scale", "timeout", "ready", "versions")

    def __init__(self, index: int, bucket, transport, *, scale, timeout, ready, versions):
        self.index, self.bucket, self.transport = index, bucket, transport
        self.scale, self.timeout, self.ready, self.versions = scale, timeout, ready, versions

    def issue(self):  # stream path
        b, transport = self.bucket, self.transport
        topk = b.topk
        start, _ = execute_async(
            topk.schedule, topk.gathered, transport, ready=self.ready, timed=True, reserved=True
        )
        with transport.stream_context():
            topk.decode(b.grads, b.flags, self.scale)
        done = transport.runtime.new_event(timing=True)
        done.record(transport.stream)
        label = (
            f"bucket {self.index} (topk, {topk.k} of {b.spec.numel}, {topk.bytes_sent} bytes sent)"
        )
        transport.watch(done, self.timeout, label)
        return start, done

    def run(self) -> None:  # host path
        b = self.bucket
        topk = b.topk
        execute(topk.schedule, topk.gathered, self.transport, timeout=self.timeout)
        topk.decode(b.grads, b.flags, self.scale)
        self.versions[self.index] = b.buffer._version


class LowRankReduction:
    """A PowerSGD bucket's operation (made per launch): all-reduce P, project, all-reduce
    Q, decode (powersgd.py), each all-reduce (a sum) by the bucket's algorithm, on
    the stream (``ordered``) or on the host."""

    __slots__ = (
        "index",
        "bucket",
        "transport",
        "scale",
        "ready",
        "versions",
        "ordered",
        "options",
    )

    def __init__(
        self,
        index: int,
        bucket,
        transport,
        *,
        scale,
        timeout,
        ready,
        versions,
        ordered: bool,
        workspace,
        servers,
    ):
        self.index, self.bucket, self.transport = index, bucket, transport
        self.scale, self.ready, self.versions, self.ordered = scale, ready, versions, ordered
        lr, algo = bucket.lowrank, bucket.spec.algorithm
        p_numel, q_numel = lr.bytes_sent_numel
        label = f"bucket {index} (powersgd rank {lr.rank}, {algo}, {4 * (p_numel + q_numel)} bytes)"
        # reduce_operation's options, the same for both factors
        self.options = dict(
            scale=None,
            timeout=timeout,
            label=label,
            range_id=index,
            workspace=workspace,
            stream_ordered=ordered,
            reserved=True,
            servers=servers,
        )

    def _reduction(self, buf, ready=None, after=None):
        """The all-reduce of one factor."""
        return reduce_operation(
            buf,
            self.transport,
            self.bucket.spec.algorithm,
            ready=ready,
            after=after,
            **self.options,
        )

    def decode(self) -> None:
        b = self.bucket
        b.lowrank.decode(b.grads, b.flags, self.scale)

    def issue(self):  # stream path
        lr = self.bucket.lowrank
        start, projected = self._reduction(lr.p, self.ready, lr.project)()
        _, done = self._reduction(lr.q, projected, self.decode)()
        return start, done

    def run(self) -> None:  # host path
        lr = self.bucket.lowrank
        self._reduction(lr.p)()
        lr.project()
        self._reduction(lr.q)()
        self.decode()
        self.versions[self.index] = self.bucket.buffer._version
