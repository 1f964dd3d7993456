"""A simulated CUDA runtime, so the production GPU path runs (and fails) on CPU.

With ``HYBRIDCOMM_SIMULATE_GPU=1``, ``hybridcomm.gpu.runtime.runtime_for`` gives
CPU tensors :class:`SimRuntime`, and everything above it (the CuPy NCCL
transport, the executor's stream-ordered path, the channel, the Triton launch
path) runs unchanged. Only the bottom layer is simulated, with the semantics
that make GPU bugs show: streams that run late on worker threads, events
ordered by vector clocks, a race detector, a caching allocator, NCCL
(:class:`SimNccl`) with matched sends and a kernel limit, CUDA IPC, counted
host syncs, per-thread devices. A defect is a :class:`SimError`, raised on the
trainer thread at its next host operation (or by :func:`check`); :func:`stats`
returns the counters. docs/GPU.md ("The simulated CUDA runtime") says what it
models and what not.

Usage (in each rank process: the simulator watches that process for good)::

    os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"   # before hybridcomm makes a runtime
    opt = hybridcomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          model=model)          # the GPU path, on CPU
    simgpu.reset_stats(); train(3); assert simgpu.stats()["host_syncs"] == 0
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import mmap
import os
import pickle
import random
import tempfile
import threading
import time
import uuid
import weakref
from collections import deque
from typing import Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from ..config import env
from ..sync.pending import is_pending, resolve
from ..base.tensor_access import collect, reads_data, written

__all__ = [
    "SimError",
    "SimRuntime",
    "SimStream",
    "SimEvent",
    "SimNccl",
    "runtime",
    "stats",
    "reset_stats",
    "errors",
    "check",
    "configure",
    "sleep",
]


class SimError(AssertionError):
    """A GPU defect the simulator found: a race, an unsafe reuse, a deadlock..."""


# --------------------------------------------------------------------------- memory ranges


def _span(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """[lo, hi) bytes a tensor's elements occupy (strides included), None if empty."""
    if t.numel() == 0:
        return None
    lo = t.data_ptr()
    extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return lo, lo + extent * t.element_size()


class _Access:
    __slots__ = ("lo", "hi", "write", "stream", "seq", "op")

    def __init__(self, lo, hi, write, stream, seq, op):
        self.lo, self.hi, self.write, self.stream, self.seq, self.op = (
            lo,
            hi,
            write,
            stream,
            seq,
            op,
        )


def _ordered(stream_id: int, seq: int, vc: Dict[int, int]) -> bool:
    """Whether position ``seq`` of stream ``stream_id`` happens before clock ``vc``."""
    return vc.get(stream_id, 0) >= seq


# --------------------------------------------------------------------------- operations


class _Op:
    """One queued stream operation."""

    __slots__ = (
        "kind",
        "name",
        "stream",
        "seq",
        "vc",
        "fn",
        "ranges",
        "wait_for",
        "calls",
        "started",
        "ticket",
    )

    def __init__(self, kind, name, stream, fn=None, ranges=(), wait_for=None, calls=None):
        self.kind, self.name, self.stream, self.fn = kind, name, stream, fn
        self.ranges = ranges  # [(lo, hi, write)]
        self.wait_for = wait_for  # (stream, seq) for "wait"
        self.calls = calls  # NCCL calls for "nccl"
        self.seq, self.vc, self.started, self.ticket = 0, None, False, 0

    def describe(self) -> str:
        return f"{self.name} (stream {self.stream.name}, op #{self.seq})"


class SimStream:
    """A simulated CUDA stream: a FIFO of operations run late by a worker thread."""

    _ids = itertools.count(1)

    def __init__(self, device: "_Device", priority: int = 0, name: Optional[str] = None):
        device.touch()
        self.device, self.priority = device, priority
        self.id = next(SimStream._ids)
        self.name = name or f"s{self.id}"
        self.cuda_stream = 0x5000 + self.id  # the handle NCCL calls take
        self._queue: deque = deque()
        self._seq = 0  # operations issued (host-inline ones included)
        self._done = 0  # operations completed
        self._vc: Dict[int, int] = {}  # what this stream's next operation is ordered after
        self._rng = random.Random(device.seed * 7919 + self.id)
        self._worker: Optional[threading.Thread] = None
        device.streams[self.cuda_stream] = self

    def __repr__(self):
        return f"<SimStream {self.name} prio={self.priority}>"

    # -- issuing (host side) --------------------------------------------------------------
    def _issue(self, op: _Op) -> _Op:
        dev = self.device
        with dev.cv:
            self._seq += 1
            op.seq = self._seq
            op.vc = dict(self._vc)
            op.vc[self.id] = op.seq
            self._queue.append(op)
            dev.stats["stream_ops"] += 1
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, daemon=True, name=f"simgpu-{self.name}"
                )
                self._worker.start()
            dev.cv.notify_all()
        return op

    def wait_event(self, event: "SimEvent") -> None:
        """Later operations of this stream wait for the event's recorded position."""
        self.device.touch()
        _count(self.device, "stream_waits")
        if hasattr(event, "wait_on"):  # another process's shared event (SimOpenedEvent)
            event.wait_on(self)
            return
        with self.device.cv:
            if event._stream is None:
                return  # never recorded: nothing to wait for (as CUDA)
            for k, v in event._vc.items():
                if self._vc.get(k, 0) < v:
                    self._vc[k] = v
            target = (event._stream, event._seq)
        self._issue(
            _Op("wait", f"wait_event({event._stream.name} #{target[1]})", self, wait_for=target)
        )

    def wait_stream(self, other: "SimStream") -> None:
        ev = SimEvent(self.device)
        ev.record(other)
        self.wait_event(ev)

    def record_event(self, event: Optional["SimEvent"] = None) -> "SimEvent":
        event = event or SimEvent(self.device)
        event.record(self)
        return event

    def query(self) -> bool:
        self.device.touch()
        with self.device.cv:
            return self._done >= self._seq

    def synchronize(self) -> None:
        dev = self.device
        dev.touch()
        dev.count_sync()
        dev.drain(self)

    # -- running (worker side) ------------------------------------------------------------
    def _run(self) -> None:
        dev = self.device
        while True:
            with dev.cv:
                while not self._queue and not dev.closed:
                    dev.cv.wait()
                if dev.closed:
                    return
                op = self._queue[0]
            if dev.delay_s:
                time.sleep(self._rng.uniform(0, dev.delay_s))
            try:
                dev.execute(op)
            except BaseException as e:  # a simulator bug must not kill the stream silently
                dev.report(SimError(f"{op.describe()} failed in the simulator: {e!r}"))
            with dev.cv:
                self._queue.popleft()
                self._done = op.seq
                dev.cv.notify_all()


class SimEvent:
    """A simulated ``torch.cuda.Event``: a recorded position in a stream."""

    def __init__(self, device: "_Device", _internal: bool = False, timing: bool = False):
        if not _internal:
            device.touch()
            _count(device, "events")
        self._internal = _internal  # the simulator's own (allocator): not counted
        self.device = device
        self.timing = timing  # torch.cuda.Event(enable_timing=...)
        self._stream: Optional[SimStream] = None
        self._seq = 0
        self._vc: Dict[int, int] = {}
        self._when: Optional[float] = None  # when the stream reached the record

    def elapsed_time(self, end: "SimEvent") -> float:
        """Milliseconds from this event to ``end``, both timed and completed (as CUDA
        requires)."""
        if not (self.timing and end.timing):
            raise SimError(
                "elapsed_time() on an event made without timing (CUDA raises "
                "cudaErrorInvalidResourceHandle): new_event(timing=True)"
            )
        if self._when is None or end._when is None:
            raise SimError(
                "elapsed_time() on an event that has not completed (CUDA raises cudaErrorNotReady)"
            )
        return (end._when - self._when) * 1e3

    def record(self, stream: Optional[SimStream] = None) -> None:
        stream = stream or self.device.current_stream()
        op = _Op("record", "record_event", stream, fn=self)
        with self.device.cv:
            if not self._internal:
                self.device.stats["event_records"] += 1
            self._when = None
            stream._issue(op)
            self._stream, self._seq, self._vc = stream, op.seq, op.vc

    def query(self) -> bool:
        self.device.touch()
        with self.device.cv:
            if not self._internal:  # a watchdog's polls depend on time, not on the step
                watchdog = "watchdog" in threading.current_thread().name
                self.device.stats["watchdog_queries" if watchdog else "event_queries"] += 1
            return self._stream is None or self._stream._done >= self._seq

    def synchronize(self) -> None:
        dev = self.device
        dev.touch()
        dev.count_sync()
        with dev.cv:
            while self._stream is not None and self._stream._done < self._seq and not dev.closed:
                dev.cv.wait(0.1)

    def wait(self, stream: Optional[SimStream] = None) -> None:
        (stream or self.device.current_stream()).wait_event(self)


# --------------------------------------------------------------------------- allocator


class _Block:
    __slots__ = (
        "id",
        "storage",
        "lo",
        "nbytes",
        "stream",
        "uses",
        "live",
        "free_events",
        "accesses",
    )

    def __init__(self, bid, nbytes, stream):
        self.id, self.nbytes, self.stream = bid, nbytes, stream
        self.storage = torch.empty(nbytes, dtype=torch.uint8)
        self.lo = self.storage.data_ptr()
        self.uses: set = set()  # streams given with record_stream
        self.live = True
        self.free_events: List[SimEvent] = []
        self.accesses: List[_Access] = []  # executed accesses (the race detector's shadow)


class _ForeignBlock(_Block):
    """Memory the allocator did not hand out, tracked for races (``_Allocator.track``):
    live for good, so never in a pool."""

    __slots__ = ()

    def __init__(self, bid, storage: torch.Tensor):  # pylint: disable=super-init-not-called
        self.id, self.nbytes, self.stream = bid, storage.numel(), None
        self.storage, self.lo = storage, storage.data_ptr()
        self.uses, self.live, self.free_events, self.accesses = set(), True, [], []


class _Allocator:
    """Blocks pooled per allocation stream, as torch's CUDA caching allocator:
    ``record_stream`` defers reuse until the other stream's work is done; a block
    handed out again before work of a stream it was used on without
    ``record_stream`` is reported."""

    ROUND = 512

    def __init__(self, device: "_Device"):
        self.device = device
        self.blocks: List[_Block] = []
        self._ids = itertools.count(1)
        self._freed: deque = deque()  # blocks whose tensor died, not yet returned to the pool

    def block_of(self, ptr: int) -> Optional[_Block]:
        for b in self.blocks:
            if b.lo <= ptr < b.lo + b.nbytes:
                return b
        return None

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        dev = self.device
        dev.touch()
        stream = dev.current_stream()
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = max(self.ROUND, -(-numel * itemsize // self.ROUND) * self.ROUND)
        with dev.cv:
            self._return_freed()
            free = [
                b
                for b in self.blocks
                if not b.live
                and b.stream is stream
                and b.nbytes >= nbytes
                and all(e.query() for e in b.free_events)
            ]
            block = min(free, key=lambda b: b.nbytes) if free else None
            if block is not None:
                self._check_reuse(block, stream)
                block.live, block.uses, block.free_events, block.accesses = True, set(), [], []
            else:
                block = _Block(next(self._ids), nbytes, stream)
                self.blocks.append(block)
            dev.stats["allocations"] += 1
        _tls.host_depth += 1  # the simulator's own bookkeeping, not host work
        try:
            t = torch.empty(0, dtype=dtype).set_(block.storage.untyped_storage(), 0, (numel,), (1,))
        finally:
            _tls.host_depth -= 1
        weakref.finalize(t, self._free, block)
        return t

    def _check_reuse(self, block: _Block, stream: SimStream) -> None:
        """The block goes back to ``stream``: any access by another stream that was
        not given with record_stream, and is not ordered before now, is a bug."""
        dev = self.device
        now = dict(stream._vc)
        now[stream.id] = stream._seq
        for a in block.accesses:
            if a.stream is stream or a.stream in block.uses or _ordered(a.stream.id, a.seq, now):
                continue
            dev.report(
                SimError(
                    f"allocator: block #{block.id} ({block.nbytes} bytes, allocated on stream "
                    f"{stream.name}) was handed out again while {a.op} on stream {a.stream.name} "
                    f"may still {'write' if a.write else 'read'} it: that stream used the block "
                    f"without record_stream, and its work is not ordered before the reuse"
                )
            )
            return
        for s in dev.streams.values():
            if s is stream:
                continue
            for op in list(s._queue):
                for lo, hi, w in op.ranges:
                    if lo < block.lo + block.nbytes and block.lo < hi and s not in block.uses:
                        dev.report(
                            SimError(
                                f"allocator: block #{block.id} handed out again on stream "
                                f"{stream.name} while queued {op.describe()} still uses it "
                                f"(no record_stream)"
                            )
                        )
                        return

    def _free(self, block: _Block) -> None:
        """The block's tensor died (a weakref finalizer: the garbage collector runs it on
        any thread, maybe inside another lock, so it must never block or take one):
        queued; the next allocation returns it to the pool."""
        self._freed.append(block)

    def _return_freed(self) -> None:
        """Freed blocks back to the pool, each reusable once the work of the streams it
        was recorded on (record_stream) up to now is done (caller holds ``cv``)."""
        while self._freed:
            block = self._freed.popleft()
            block.live = False
            block.free_events = []
            for s in block.uses:
                ev = SimEvent(self.device, _internal=True)
                ev.record(s)
                block.free_events.append(ev)

    def track(self, tensor: torch.Tensor) -> None:
        """Race-check ``tensor``'s memory from now on though this allocator did not
        hand it out (a DDP bucket the reducer made): a block over its storage, never
        pooled, that holds the storage so its addresses are not reused while tracked."""
        span = _span(tensor)
        if span is None or self.block_of(span[0]) is not None:
            return
        _tls.host_depth += 1  # the simulator's own bookkeeping, not host work
        try:
            storage = tensor.untyped_storage()
            whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        finally:
            _tls.host_depth -= 1
        with self.device.cv:
            self.blocks.append(_ForeignBlock(next(self._ids), whole))

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        span = _span(tensor)
        if span is None:
            return
        block = self.block_of(span[0])
        if block is None:  # memory not from this allocator (a user tensor): keep it alive
            self.device.keep_alive(tensor, stream)
        elif stream is not block.stream:
            block.uses.add(stream)


# --------------------------------------------------------------------------- the device

_SYNC_FUNCS = {
    "tolist",
    "item",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "numpy",
    "__array__",
    "cpu",
    "equal",
    "nonzero",
    "allclose",
}


def _never() -> bool:
    return False


# Whether dynamo traces the caller. Compiled code runs its graph's operators without
# torch-function modes, so the simulator sees none of them: their reads and writes are
# not checked for races, and they run at once, not after the current stream's queued
# work (what they read, the library's host calls wrote after draining it). The
# library's calls a compiled graph makes eagerly (its hooks, forward mode's operator)
# are watched as ever.
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or _never


class _HostMode(TorchFunctionMode):
    """Sees the trainer thread's torch calls: counts host syncs, checks races. A host
    op is appended to the thread's current stream: it runs once the stream has
    drained, as a kernel would."""

    def __init__(self, device: "_Device"):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _compiling():  # dynamo traces this mode: a compiled graph's ops are not seen
            return func(*args, **kwargs)
        dev = self.device
        if getattr(_tls, "host_depth", 0):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if not reads_data(name, args):
            return func(*args, **kwargs)
        dev.raise_pending()
        tensors = collect(kwargs, collect(args, []))
        for t in tensors:
            # Forward mode's deferred update (hybridcomm/sync/pending.py) is host work done as
            # the host reaches this call, before the call's own kernel is queued: on a
            # GPU the host does not wait for the stream there, so neither may its stamps
            if is_pending(t):
                resolve(t)
        if tensors:
            if name in _SYNC_FUNCS or (name == "copy_" and _syncing_copy(dev, args, kwargs)):
                dev.count_sync()
            dev.host_op(name, tensors, written(name, args, kwargs))
        out = func(*args, **kwargs)
        _note_host_made(name, tensors, kwargs, out)
        return out


# Factories that make a tensor in host memory unless given a device. The
# simulated device's tensors are CPU tensors too, so "host" is what a watched
# thread made this way (device= given: device memory on a GPU), or made from
# host tensors only.
_HOST_FACTORIES = frozenset(
    {
        "zeros",
        "ones",
        "empty",
        "full",
        "tensor",
        "as_tensor",
        "arange",
        "linspace",
        "rand",
        "randn",
        "randint",
        "eye",
        "from_numpy",
    }
)
_HOST = "_hc_sim_host"


def _is_host(t: torch.Tensor) -> bool:
    base = t._base
    return getattr(t, _HOST, False) or (base is not None and getattr(base, _HOST, False))


def _note_host_made(name: str, tensors: list, kwargs: dict, out) -> None:
    """Mark ``out`` as pageable host memory when the call made it there."""
    if not isinstance(out, torch.Tensor):
        return
    if (not tensors and name in _HOST_FACTORIES and kwargs.get("device") is None) or (
        tensors and all(_is_host(t) for t in tensors)
    ):
        try:
            setattr(out, _HOST, True)
        except (AttributeError, RuntimeError):  # a tensor type without attributes: not known
            pass


def _syncing_copy(dev: "_Device", args, kwargs) -> bool:
    """``dst.copy_(src)`` between host and device memory: ATen copies with
    ``memcpy_and_sync`` (a stream sync) unless ``non_blocking`` with the host side
    pinned."""
    if len(args) < 2 or not isinstance(args[1], torch.Tensor):
        return False
    dst, src = args[0], args[1]
    host = src if _is_host(src) else dst if _is_host(dst) else None
    device = dst if host is src else src
    span = _span(device)
    if host is None or span is None or dev.allocator.block_of(span[0]) is None:
        return False
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    return not (non_blocking and host.is_pinned())


class _TLS(threading.local):
    def __init__(self):
        self.device_index = 0  # torch's default on a fresh thread
        self.current: Dict[int, SimStream] = {}
        self.host_depth = 0
        self.active = False
        self.group: Optional[list] = None


_tls = _TLS()


class _Device:
    """One simulated GPU: this process's device (rank ``index``). A thread that uses
    the runtime without binding to it creates a "context" on another device,
    which is reported."""

    def __init__(
        self,
        index: int,
        *,
        delay_s: float,
        seed: int,
        nccl_kernels: int,
        uid_style: str,
        deadlock_s: float,
    ):
        self.index = index
        self.delay_s, self.seed = delay_s, seed
        self.nccl_kernels, self.uid_style, self.deadlock_s = nccl_kernels, uid_style, deadlock_s
        self.cv = threading.Condition(threading.RLock())
        self.closed = False
        self.streams: Dict[int, SimStream] = {}
        self.contexts = {index}
        self.stats = _zero_stats()
        self.errors: List[SimError] = []
        self._raised = 0
        self._alive: List[Tuple[torch.Tensor, SimStream]] = []
        self.allocator = _Allocator(self)
        self.nccl_running: List[Tuple[str, str, float]] = []  # (comm, stream, since)
        self.nccl_waiting: List[Tuple[str, str, float]] = []
        # NCCL kernels start in issue order across streams while slots are limited:
        # with one connection every stream feeds one hardware queue.
        self.nccl_tickets = itertools.count(1)
        self.nccl_unstarted: set = set()
        self.default = SimStream(self, 0, "default")

    # -- bookkeeping ----------------------------------------------------------------------
    def touch(self) -> None:
        """A runtime call on this thread: it uses (creates a context on) its current device."""
        idx = _tls.device_index
        if idx not in self.contexts:
            self.contexts.add(idx)
            self.report(
                SimError(
                    f"thread {threading.current_thread().name!r} used the CUDA runtime with "
                    f"current device {idx}, creating a context on GPU {idx} (this rank's GPU is "
                    f"{self.index}; ~300-500 MB wasted): bind the thread to its device first"
                )
            )

    def count_sync(self) -> None:
        with self.cv:
            self.stats["host_syncs"] += 1

    def report(self, error: SimError) -> None:
        with self.cv:
            if any(str(e) == str(error) for e in self.errors):
                return  # the same finding from the other side of it
            self.errors.append(error)
            self.stats["defects"] += 1
            self.cv.notify_all()

    def raise_pending(self) -> None:
        with self.cv:
            if len(self.errors) > self._raised:
                err = self.errors[self._raised]
                self._raised = len(self.errors)
                raise err

    def keep_alive(self, tensor: torch.Tensor, stream: SimStream) -> None:
        """record_stream on memory not from the simulated allocator: hold it until a
        later call finds the stream idle. The caching allocator keeps a block for the
        work queued before its *free*; the work comes after this call, so an event
        recorded now would let it go early (NCCL then writes freed memory)."""
        with self.cv:
            self._alive = [(t, s) for t, s in self._alive if s._done < s._seq]
            self._alive.append((tensor, stream))

    def current_stream(self) -> SimStream:
        return _tls.current.get(self.index) or self.default

    def drain(self, stream: SimStream) -> None:
        with self.cv:
            while stream._done < stream._seq and not self.closed:
                self.cv.wait(0.1)

    # -- races ----------------------------------------------------------------------------
    def _conflicts(self, ranges, stream: SimStream, vc: Dict[int, int], what: str) -> List[str]:
        """Accesses that clash with ``ranges`` by an operation at clock ``vc``."""
        found = []
        for lo, hi, write in ranges:
            block = self.allocator.block_of(lo)
            if block is not None:
                for a in block.accesses:
                    if a.stream is stream or not (a.lo < hi and lo < a.hi):
                        continue
                    if (a.write or write) and not _ordered(a.stream.id, a.seq, vc):
                        found.append(
                            f"{what} {'writes' if write else 'reads'} bytes "
                            f"[{lo - block.lo}, {hi - block.lo}) of block #{block.id} "
                            f"that {a.op} on stream {a.stream.name} "
                            f"{'wrote' if a.write else 'read'}"
                        )
            for s in self.streams.values():
                if s is stream:
                    continue
                for op in s._queue:
                    if op.started and op.kind != "nccl":
                        continue
                    for olo, ohi, ow in op.ranges:
                        if (
                            olo < hi
                            and lo < ohi
                            and (ow or write)
                            and op.vc.get(stream.id, 0) < vc.get(stream.id, 0)
                        ):
                            found.append(
                                f"{what} {'writes' if write else 'reads'} memory "
                                f"that queued {op.describe()} "
                                f"{'writes' if ow else 'reads'}"
                            )
        return found

    def _record(self, ranges, stream: SimStream, seq: int, vc, name: str) -> None:
        for lo, hi, write in ranges:
            block = self.allocator.block_of(lo)
            if block is None:
                continue
            if write:  # a later ordered write covers earlier accesses: forget them
                block.accesses = [
                    a
                    for a in block.accesses
                    if not (
                        lo <= a.lo
                        and a.hi <= hi
                        and (a.stream is stream or _ordered(a.stream.id, a.seq, vc))
                    )
                ]
            block.accesses.append(_Access(lo, hi, write, stream, seq=seq, op=name))

    def host_op(self, name: str, tensors: list, written: list) -> None:
        """A torch call on the host: appended to the thread's current stream (it
        runs once the stream has drained, as a kernel queued there would)."""
        stream = self.current_stream()
        wid = {id(t) for t in written}
        ranges = []
        for t in tensors:
            span = _span(t)
            if span is not None:
                ranges.append((span[0], span[1], id(t) in wid))
        if not ranges:
            return
        with self.cv:
            while stream._done < stream._seq and not self.closed:
                self.cv.wait(0.1)
            vc = dict(stream._vc)
            vc[stream.id] = stream._seq + 1
            clashes = self._conflicts(ranges, stream, vc, f"host {name}()")
            if clashes:
                self.stats["defects"] += 1
                raise SimError(
                    "race: " + clashes[0] + ", with no event or stream order between them"
                )
            if any(self.allocator.block_of(lo) for lo, _, _ in ranges):
                stream._seq += 1
                stream._done = stream._seq
                self._record(ranges, stream, stream._seq, vc, name=f"host {name}()")

    # -- executing operations (worker threads) --------------------------------------------
    def execute(self, op: _Op) -> None:
        if op.kind == "wait":
            target, seq = op.wait_for
            with self.cv:
                while target._done < seq and not self.closed:
                    self.cv.wait(0.1)
            return
        if op.kind == "record":
            op.fn._when = time.perf_counter()
            return
        if op.kind == "nccl":
            self._run_nccl(op)
            return
        with self.cv:
            clashes = self._begin(op)
        self._report_race(clashes)
        op.fn()

    def _begin(self, op: _Op) -> list:
        """Mark ``op`` started and check its accesses against unordered ones
        (caller holds ``cv``); returns the clashes found."""
        op.started = True
        clashes = self._conflicts(op.ranges, op.stream, op.vc, op.describe())
        self._record(op.ranges, op.stream, op.seq, op.vc, name=op.describe())
        return clashes

    def _report_race(self, clashes: list) -> None:
        if clashes:
            self.report(
                SimError("race: " + clashes[0] + ", with no event or stream order between them")
            )

    def launch(self, name: str, fn, args: tuple, kwargs: dict, reads, writes) -> None:
        """The Triton launch path: enqueue ``fn(*args, **kwargs)`` (the kernel's
        reference) on the current stream; it runs when the stream reaches it."""
        self.touch()
        stream = self.current_stream()
        ranges = [(s[0], s[1], False) for s in map(_span, reads) if s] + [
            (s[0], s[1], True) for s in map(_span, writes) if s
        ]
        held = [_detach_arg(a, self.allocator) for a in args]
        kheld = {k: _detach_arg(v, self.allocator) for k, v in kwargs.items()}

        def run():
            fn(*[_attach_arg(a) for a in held], **{k: _attach_arg(v) for k, v in kheld.items()})

        with self.cv:
            self.stats["kernel_launches"] += 1
            key = f"launches:{name}"  # per kernel: exact counts in tests
            self.stats[key] = self.stats.get(key, 0) + 1
        stream._issue(_Op("kernel", name, stream, fn=run, ranges=ranges))

    # -- NCCL -----------------------------------------------------------------------------
    def _run_nccl(self, op: _Op) -> None:
        comms = sorted({c.name for c, *_ in op.calls})
        label = f"{'+'.join(comms)} on stream {op.stream.name}"
        t0 = time.monotonic()
        reported = False
        with self.cv:
            self.nccl_waiting.append((label, op.stream.name, t0))
            while self.nccl_kernels and (
                len(self.nccl_running) >= self.nccl_kernels or min(self.nccl_unstarted) != op.ticket
            ):
                if not reported and time.monotonic() - t0 > self.deadlock_s:
                    reported = True
                    self._report_deadlock(label)
                if self.closed or any(c.aborted for c, *_ in op.calls):
                    self.nccl_waiting.remove((label, op.stream.name, t0))
                    self.nccl_unstarted.discard(op.ticket)
                    self.cv.notify_all()
                    return
                self.cv.wait(0.05)
            self.nccl_waiting.remove((label, op.stream.name, t0))
            self.nccl_unstarted.discard(op.ticket)
            entry = (label, op.stream.name, time.monotonic())
            self.nccl_running.append(entry)
            clashes = self._begin(op)
        self._report_race(clashes)
        # The bytes move on a helper thread that blocks in gloo; this stream waits
        # for it, for an abort (NCCL's abort releases a stuck kernel: the stream
        # goes on, the data is garbage), or reports a suspected deadlock.
        finished = threading.Event()
        failure: list = []

        def move():
            try:
                _transfer(self, op, label)
            except BaseException as e:
                failure.append(e)
            finally:
                finished.set()

        threading.Thread(target=move, daemon=True, name=f"simgpu-nccl-{op.stream.name}").start()
        comms = {c for c, *_ in op.calls}
        try:
            while not finished.wait(0.01):
                if any(c.aborted for c in comms) or self.closed:
                    break
                if not reported and time.monotonic() - entry[2] > self.deadlock_s:
                    reported = True
                    with self.cv:
                        if self.nccl_waiting:
                            self._report_deadlock(label)
                        else:
                            self.report(
                                SimError(
                                    f"NCCL {label} waited {self.deadlock_s:.0f}s for its peers: a "
                                    "peer never posted the matching operation (dead, or issuing "
                                    "in another order)"
                                )
                            )
            if failure and not any(c.aborted for c in comms):
                for c in comms:
                    c.async_error = ERROR_REMOTE
                self.report(SimError(f"NCCL {label} failed: {failure[0]!r}"))
        finally:
            with self.cv:
                self.nccl_running.remove(entry)
                self.cv.notify_all()

    def _report_deadlock(self, label: str) -> None:
        running = (
            ", ".join(
                f"{c} (running for {time.monotonic() - t:.1f}s, waiting for peers)"
                for c, _, t in self.nccl_running
            )
            or "none"
        )
        waiting = ", ".join(c for c, _, _ in self.nccl_waiting)
        self.report(
            SimError(
                f"NCCL deadlock on GPU {self.index}: kernels waiting for one of "
                f"{self.nccl_kernels} kernel slot(s): {waiting}; holding them: {running}. "
                "Communicators used in different orders on different ranks deadlock when their "
                "kernels cannot all be resident at once"
            )
        )


def _zero_stats() -> Dict[str, int]:
    return {
        "nccl_ops": 0,
        "kernel_launches": 0,
        "host_syncs": 0,
        "stream_ops": 0,
        "allocations": 0,
        "defects": 0,
        "events": 0,
        "event_records": 0,
        "event_queries": 0,
        "watchdog_queries": 0,
        "stream_waits": 0,
    }


def _count(dev: "_Device", key: str) -> None:
    with dev.cv:
        dev.stats[key] += 1


class _Held:
    """A kernel argument in simulated device memory, held by address only (as a GPU
    kernel holds a pointer): the launch does not keep the memory alive."""

    __slots__ = ("block", "offset", "size", "stride", "dtype")

    def __init__(self, block, offset, size, stride, dtype):
        self.block, self.offset, self.size, self.stride, self.dtype = (
            block,
            offset,
            size,
            stride,
            dtype,
        )


def _detach_arg(a, allocator: _Allocator):
    if isinstance(a, torch.Tensor) and a.numel() > 0:
        block = allocator.block_of(a.data_ptr())
        if block is not None:
            return _Held(block, a.data_ptr() - block.lo, tuple(a.shape), a.stride(), dtype=a.dtype)
    if isinstance(a, (list, tuple)):
        return type(a)(_detach_arg(x, allocator) for x in a)
    return a


def _attach_arg(a):
    if isinstance(a, _Held):
        item = torch.empty((), dtype=a.dtype).element_size()
        return torch.empty(0, dtype=a.dtype).set_(
            a.block.storage.untyped_storage(), a.offset // item, a.size, a.stride
        )
    if isinstance(a, (list, tuple)):
        return type(a)(_attach_arg(x) for x in a)
    return a


# --------------------------------------------------------------------------- NCCL over gloo

NCCL_TYPES = {
    "NCCL_INT8": 0,
    "NCCL_UINT8": 1,
    "NCCL_INT32": 2,
    "NCCL_UINT32": 3,
    "NCCL_INT64": 4,
    "NCCL_UINT64": 5,
    "NCCL_FLOAT16": 6,
    "NCCL_FLOAT32": 7,
    "NCCL_FLOAT64": 8,
    "NCCL_BFLOAT16": 9,
}
_TORCH_OF = {
    0: torch.int8,
    1: torch.uint8,
    2: torch.int32,
    4: torch.int64,
    6: torch.float16,
    7: torch.float32,
    8: torch.float64,
    9: torch.bfloat16,
}
NCCL_OPS = {"NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4}
ERROR_INTERNAL = 3  # ncclInternalError: what a call blocked in set-up returns once aborted
ERROR_INVALID_USAGE = 5
ERROR_REMOTE = 6
_TAG_BASE = 0x20000000  # far above gloo's collective tags
_CONNECT_TAG_BASE = 0x30000000  # connection set-up messages (clear of _TAG_BASE's range)


class SimNcclError(RuntimeError):
    def __init__(self, status: int, msg: str = ""):
        super().__init__(f"NCCL error {status}: {msg}")
        self.status = status

    def __reduce__(self):
        return (type(self), (self.status,))


def _alias(ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over device memory at ``ptr`` (what an NCCL kernel touches)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def _wait_works(works) -> None:
    """Block until gloo finishes (a timed wait would close the pair for good)."""
    for w in works:
        w.wait()


def _transfer(device: _Device, op: _Op, label: str) -> None:
    """Move the bytes of one NCCL kernel (a group of calls) over gloo."""
    import torch.distributed as dist

    sends, recvs, works = [], [], []
    for comm, kind, ptr, count, dtype, peer, extra in op.calls:
        if comm.aborted:
            continue
        if kind == "send":
            nbytes = count * _TORCH_OF[dtype].itemsize
            hdr = torch.tensor([count, dtype, comm.rank], dtype=torch.int64)
            gp = comm.global_ranks[peer]
            works.append(dist.isend(hdr, gp, tag=comm.tag))
            if nbytes:
                works.append(dist.isend(_alias(ptr, nbytes), gp, tag=comm.tag))
            sends.append(hdr)
        elif kind == "recv":
            recvs.append((comm, ptr, count, dtype, peer))
    _receive(device, recvs)
    _wait_works(works)
    for comm, kind, ptr, count, dtype, peer, extra in op.calls:
        if kind in COLLECTIVES and not comm.aborted:
            _collective(comm, kind, ptr, extra[0], count=count, dtype=dtype, redop=extra[1])


def _receive(device, recvs) -> None:
    import torch.distributed as dist

    for comm, ptr, count, dtype, peer in recvs:
        gp = comm.global_ranks[peer]
        hdr = torch.empty(3, dtype=torch.int64)
        _wait_works([dist.irecv(hdr, gp, tag=comm.tag)])
        scount, sdtype, _ = hdr.tolist()
        nbytes = scount * _TORCH_OF[sdtype].itemsize
        mismatch = (scount, sdtype) != (count, dtype)
        if mismatch:
            comm.async_error = ERROR_INVALID_USAGE
            device.report(
                SimError(
                    f"NCCL {comm.name}: rank {comm.rank} posted a receive of {count} x type {dtype} "
                    f"from rank {peer}, which sent {scount} x type {sdtype} (the two ranks issue "
                    "their operations in different orders)"
                )
            )
        if nbytes:
            dst = torch.empty(nbytes, dtype=torch.uint8) if mismatch else _alias(ptr, nbytes)
            _wait_works([dist.irecv(dst, gp, tag=comm.tag)])


# NCCL's collectives: each rank's send buffer goes to every rank ("count" is the
# receive count of a reduce-scatter and the send count of an all-gather, as NCCL's)
COLLECTIVES = ("allreduce", "reducescatter", "allgather")


def _collective(comm, kind, sendptr, recvptr, count, dtype, redop) -> None:
    """Every rank gets every send buffer; a reduction sums them in rank order:
    identical bits everywhere. A header first, so ranks running different
    collectives (issue orders that differ) are reported, not fed to gloo as a
    size mismatch."""
    import torch.distributed as dist

    tdtype = _TORCH_OF[dtype]
    sent = count * comm.size_ if kind == "reducescatter" else count
    nbytes = sent * tdtype.itemsize
    mine = _alias(sendptr, nbytes).clone() if nbytes else torch.empty(0, dtype=torch.uint8)
    code = COLLECTIVES.index(kind)
    hdr = torch.tensor([count, dtype, comm.rank, code], dtype=torch.int64)
    peers = [r for r in range(comm.size_) if r != comm.rank]
    works = []
    for r in peers:
        works.append(dist.isend(hdr, comm.global_ranks[r], tag=comm.tag + 1))
        if nbytes:
            works.append(dist.isend(mine, comm.global_ranks[r], tag=comm.tag + 1))
    parts: List[Optional[torch.Tensor]] = [None] * comm.size_
    parts[comm.rank] = mine
    ok = True
    for r in peers:
        theirs = torch.empty(4, dtype=torch.int64)
        _wait_works([dist.irecv(theirs, comm.global_ranks[r], tag=comm.tag + 1)])
        rcount, rdtype, _, rcode = theirs.tolist()
        rsent = rcount * comm.size_ if COLLECTIVES[rcode] == "reducescatter" else rcount
        rbytes = rsent * _TORCH_OF[rdtype].itemsize
        parts[r] = torch.empty(rbytes, dtype=torch.uint8)
        if rbytes:
            _wait_works([dist.irecv(parts[r], comm.global_ranks[r], tag=comm.tag + 1)])
        if (rcount, rdtype, rcode) != (count, dtype, code):
            ok = False
            comm.async_error = ERROR_INVALID_USAGE
            comm.module.device.report(
                SimError(
                    f"NCCL {comm.name}: rank {comm.rank} runs {kind} of {count} x type {dtype} "
                    f"while rank {r} runs {COLLECTIVES[rcode]} of {rcount} x type {rdtype} (the "
                    "ranks issue their operations in different orders)"
                )
            )
    _wait_works(works)
    if not ok or not nbytes:
        return
    if kind == "allgather":
        _alias(recvptr, nbytes * comm.size_).copy_(torch.cat(parts))
        return
    acc = torch.zeros(sent, dtype=torch.float64 if tdtype == torch.float64 else torch.float32)
    for p in parts:
        acc += p.view(tdtype).to(acc.dtype)
    if redop == NCCL_OPS["NCCL_AVG"]:
        acc /= comm.size_
    if kind == "reducescatter":
        acc = acc[comm.rank * count : (comm.rank + 1) * count]
    _alias(recvptr, count * tdtype.itemsize).view(tdtype).copy_(acc)


class _CommUsers:
    """The threads inside calls on one simulated communicator. NCCL calls on one
    communicator must not overlap from two threads: CuPy's communicators are
    blocking, and an ``ncclCommAbort`` racing a ``groupEnd`` (or a send) on another
    thread frees what that call still uses. An overlap is reported, naming both."""

    def __init__(self, comm: "SimNcclCommunicator"):
        self.comm, self.lock = comm, threading.Lock()
        self.inside: Dict[int, Tuple[str, str]] = {}  # thread ident: (thread name, call)

    @contextlib.contextmanager
    def entered(self, what: str):
        me, name = threading.get_ident(), threading.current_thread().name
        with self.lock:
            others = [v for k, v in self.inside.items() if k != me]
            outer = me not in self.inside
            if outer:
                self.inside[me] = (name, what)
        if others:
            c = self.comm
            c.module.device.report(
                SimError(
                    f"NCCL {c.name}: rank {c.rank}: {what}() on thread {name!r} while thread "
                    f"{others[0][0]!r} is inside {others[0][1]}(): one communicator used by two "
                    "threads at once (NCCL calls on a communicator are not thread-safe)"
                )
            )
        try:
            yield
        finally:
            if outer:
                with self.lock:
                    del self.inside[me]


class SimNcclCommunicator:
    """``cupy.cuda.nccl.NcclCommunicator``, simulated (one rank's side; unique ids as
    CuPy 14's ``bytes`` or CuPy 13's ``tuple``). NCCL connects on first use: the
    ``groupEnd`` (or lone call) that first uses a connection to a peer blocks the
    host until the peer posts its side, and fails once the communicator is
    aborted from another thread (as ``ncclCommAbort`` unblocks NCCL's set-up)."""

    def __init__(self, module: "SimNccl", ndev: int, commId, rank: int):
        dev = module.device
        dev.touch()
        if dev.uid_style == "bytes" and not isinstance(commId, bytes):
            raise TypeError(
                f"Argument 'commId' has incorrect type (expected bytes, got "
                f"{type(commId).__name__})"
            )
        if dev.uid_style == "tuple" and not isinstance(commId, tuple):
            raise TypeError(
                f"Argument 'commId' has incorrect type (expected tuple, got "
                f"{type(commId).__name__})"
            )
        if dev.uid_style == "tuple" and not all(-128 <= x <= 127 for x in commId):
            # CuPy 13 copies the tuple into NCCL's ``char internal[128]``: Cython's
            # conversion to a (signed) char refuses anything outside -128..127
            raise OverflowError("value too large to convert to char")
        uid = commId if isinstance(commId, bytes) else bytes(x & 0xFF for x in commId)
        if len(uid) != 128:
            raise SimNcclError(ERROR_INVALID_USAGE, "unique id must be 128 bytes")
        import torch.distributed as dist

        digest = hashlib.sha256(uid).digest()
        self.module, self.rank, self.size_ = module, rank, ndev
        self.name = f"comm-{digest[:3].hex()}"
        self.tag = _TAG_BASE + (int.from_bytes(digest[:3], "little") << 1)
        self.connect_tag = _CONNECT_TAG_BASE + (int.from_bytes(digest[:3], "little") << 2)
        self.connected: set = set()  # ("send" | "recv" | "coll", peer): set up on first use
        self.aborted = self.destroyed = False
        self.users = _CommUsers(self)
        self.async_error = 0
        store = dist.distributed_c10d._get_default_store()
        key = f"hybridcomm-simnccl/{digest.hex()}"
        store.set(f"{key}/{rank}", str(dist.get_rank()))
        self.global_ranks = [int(store.get(f"{key}/{r}")) for r in range(ndev)]
        self.device_index = _tls.device_index

    # -- calls ----------------------------------------------------------------------------
    def _call(self, kind, ptr, count, datatype, peer, stream, extra=None, ranges=()):
        if self.aborted or self.destroyed:
            raise SimNcclError(ERROR_INVALID_USAGE, f"{self.name} was aborted or destroyed")
        if kind in ("send", "recv") and not (0 <= peer < self.size_ and peer != self.rank):
            raise SimNcclError(ERROR_INVALID_USAGE, f"invalid peer {peer}")
        dev = self.module.device
        dev.touch()
        s = dev.streams.get(stream)
        if s is None:
            raise SimNcclError(ERROR_INVALID_USAGE, f"unknown stream handle {stream:#x}")
        with dev.cv:
            dev.stats["nccl_ops"] += 1
        call = (self, kind, ptr, count, datatype, peer, extra)
        with self.users.entered(kind):
            if _tls.group is not None:
                _tls.group.append((s, call, ranges))
            else:  # outside a group NCCL makes the call a group of one: it connects the same way
                self.module._connect([call])
                self.module._launch(s, [call], list(ranges))

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        n = count * _TORCH_OF[datatype].itemsize
        self._call(
            "send",
            sendbuf,
            count,
            datatype,
            peer=peer,
            stream=stream,
            ranges=[(sendbuf, sendbuf + n, False)] if n else [],
        )

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        n = count * _TORCH_OF[datatype].itemsize
        self._call(
            "recv",
            recvbuf,
            count,
            datatype,
            peer=peer,
            stream=stream,
            ranges=[(recvbuf, recvbuf + n, True)] if n else [],
        )

    def allReduce(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int
    ) -> None:
        n = count * _TORCH_OF[datatype].itemsize
        ranges = [(sendbuf, sendbuf + n, False), (recvbuf, recvbuf + n, True)] if n else []
        self._call(
            "allreduce",
            sendbuf,
            count,
            datatype,
            peer=-1,
            stream=stream,
            extra=(recvbuf, op),
            ranges=ranges,
        )

    def reduceScatter(
        self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int
    ) -> None:
        n = recvcount * _TORCH_OF[datatype].itemsize
        ranges = (
            [(sendbuf, sendbuf + n * self.size_, False), (recvbuf, recvbuf + n, True)] if n else []
        )
        self._call(
            "reducescatter",
            sendbuf,
            recvcount,
            datatype,
            peer=-1,
            stream=stream,
            extra=(recvbuf, op),
            ranges=ranges,
        )

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        n = count * _TORCH_OF[datatype].itemsize
        ranges = (
            [(sendbuf, sendbuf + n, False), (recvbuf, recvbuf + n * self.size_, True)] if n else []
        )
        self._call(
            "allgather",
            sendbuf,
            count,
            datatype,
            peer=-1,
            stream=stream,
            extra=(recvbuf, None),
            ranges=ranges,
        )

    # -- state ----------------------------------------------------------------------------
    def check_async_error(self) -> None:
        with self.users.entered("check_async_error"):
            self._check_async_error()

    def _check_async_error(self) -> None:
        if self._freed("check_async_error"):
            raise SimNcclError(ERROR_INVALID_USAGE, f"{self.name} was aborted or destroyed")
        if self.async_error:
            raise SimNcclError(self.async_error, f"{self.name}: asynchronous error")

    def inject_async_error(self, status: int = ERROR_REMOTE) -> None:
        """Tests: make the next check_async_error() fail as a remote error would."""
        self.async_error = status

    def abort(self) -> None:
        with self.users.entered("abort"):  # still unblocks a groupEnd elsewhere, as NCCL's flag
            self._abort()

    def _abort(self) -> None:
        if self._freed("abort"):
            return
        self.aborted = True
        with self.module.device.cv:
            self.module.device.cv.notify_all()

    def destroy(self) -> None:
        with self.users.entered("destroy"):
            self._destroy()

    def _destroy(self) -> None:
        if self._freed("destroy"):
            return
        self.destroyed = True

    def _freed(self, what: str) -> bool:
        """``ncclCommAbort`` and ``ncclCommDestroy`` free the communicator: a later
        call on it (an async-error query racing an abort on another thread, a second
        abort) is a use after free, reported."""
        if not (self.aborted or self.destroyed):
            return False
        self.module.device.report(
            SimError(
                f"NCCL {self.name}: rank {self.rank} called {what}() on a communicator already "
                f"{'aborted' if self.aborted else 'destroyed'} (a use after free: abort, destroy "
                "and the async-error query must not race, and nothing may follow them)"
            )
        )
        return True

    def rank_id(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.size_

    def device_id(self) -> int:
        return self.device_index


class SimNccl:
    """A stand-in for the ``cupy.cuda.nccl`` module, bound to one simulated device."""

    available = True
    NcclError = SimNcclError

    def __init__(self, device: _Device):
        self.device = device
        for k, v in {**NCCL_TYPES, **NCCL_OPS}.items():
            setattr(self, k, v)
        self.NCCL_FLOAT, self.NCCL_HALF, self.NCCL_DOUBLE = 7, 6, 8
        module = self

        class NcclCommunicator(SimNcclCommunicator):
            def __init__(self, ndev, commId, rank):
                super().__init__(module, ndev, commId, rank)

        self.NcclCommunicator = NcclCommunicator

    def get_unique_id(self):
        uid = os.urandom(128)
        if self.device.uid_style == "bytes":
            return uid
        return tuple(b - 256 if b > 127 else b for b in uid)  # CuPy 13: signed chars

    @staticmethod
    def get_version() -> int:
        return 23203

    def groupStart(self) -> None:
        if _tls.group is not None:
            raise SimNcclError(ERROR_INVALID_USAGE, "nested groupStart")
        _tls.group = []

    def groupEnd(self) -> None:
        calls, _tls.group = _tls.group, None
        if calls is None:
            raise SimNcclError(ERROR_INVALID_USAGE, "groupEnd without groupStart")
        with contextlib.ExitStack() as inside:  # every communicator of the group is in use
            for comm in dict.fromkeys(call[0] for _, call, _ in calls):
                inside.enter_context(comm.users.entered("groupEnd"))
            self._group_end(calls)

    def _group_end(self, calls) -> None:
        self._connect([call for _, call, _ in calls])
        by_stream: Dict[SimStream, tuple] = {}
        for s, call, ranges in calls:
            entry = by_stream.setdefault(s, ([], []))
            entry[0].append(call)
            entry[1].extend(ranges)
        for s, (cs, rs) in by_stream.items():
            self._launch(s, cs, rs)

    def _connect(self, calls) -> None:
        """Connection set-up on first use, on the calling host thread, as NCCL's
        ``ncclGroupEnd`` does it (a call outside a group is a group of one).

        NCCL connects lazily: the first send to (receive from) a peer marks the
        connection (``p2pTaskAppend`` -> ``ncclGroupCommPreconnect``), and the
        blocking ``groupLaunch`` sets it up before any kernel is queued
        (``ncclP2PPreconnectFunc`` -> ``ncclTransportP2pSetup``: ``bootstrapSend``
        then ``bootstrapRecv`` with that peer); a collective connects its
        algorithm's peers the same way (``ncclCollPreconnect``). So the host call
        does not return until each new peer has posted its side, i.e. reached its
        own matching operation. ``ncclCommAbort`` on another thread sets the abort
        flag that the set-up's socket loops poll (``ncclSocketAccept`` /
        ``checkAbort``): the blocked call then returns ``ncclInternalError``,
        modelled here as a ``SimNcclError(ERROR_INTERNAL)``.
        """
        new: Dict[SimNcclCommunicator, list] = {}
        for comm, kind, _ptr, _count, _dtype, peer, _extra in calls:
            if kind in COLLECTIVES:
                keys = [(("coll", q), q) for q in range(comm.size_) if q != comm.rank]
            else:
                keys = [((kind, peer), peer)]
            for key, q in keys:
                todo = new.setdefault(comm, [])
                if key not in comm.connected and all(k != key for k, _ in todo):
                    todo.append((key, q))
        for comm, todo in new.items():
            if todo:
                self._handshake(comm, todo)

    def _handshake(self, comm: SimNcclCommunicator, todo: list) -> None:
        """Block until every peer in ``todo`` posts its side of the connection."""
        # My send connection to p pairs with p's receive connection from me:
        # a message on the tag of my side's direction, an answer on the other's.
        tags = {"send": (0, 1), "recv": (1, 0), "coll": (2, 2)}
        peers = sorted({q for _, q in todo})
        what = (
            f"NCCL {comm.name}: rank {comm.rank} connecting to rank"
            f"{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}"
        )
        if comm.aborted or comm.destroyed:
            raise SimNcclError(ERROR_INTERNAL, f"{what}: the communicator was aborted")
        finished = threading.Event()
        failure: list = []

        def run():
            import torch.distributed as dist

            try:
                works, answers = [], []
                for (kind, q), _ in todo:
                    out, back = tags[kind]
                    gp = comm.global_ranks[q]
                    works.append(
                        dist.isend(
                            torch.tensor([comm.rank, out], dtype=torch.int64),
                            gp,
                            tag=comm.connect_tag + out,
                        )
                    )
                    answers.append((torch.empty(2, dtype=torch.int64), gp, comm.connect_tag + back))
                for buf, gp, tag in answers:
                    _wait_works([dist.irecv(buf, gp, tag=tag)])
                _wait_works(works)
            except BaseException as e:
                failure.append(e)
            finally:
                finished.set()

        threading.Thread(target=run, daemon=True, name=f"simgpu-connect-{comm.name}").start()
        dev, t0, reported = self.device, time.monotonic(), False
        while not finished.wait(0.01):
            if comm.aborted or dev.closed:
                raise SimNcclError(
                    ERROR_INTERNAL,
                    f"{what}: the communicator was aborted while "
                    "groupEnd waited for the peers to connect",
                )
            if not reported and time.monotonic() - t0 > dev.deadlock_s:
                reported = True
                dev.report(
                    SimError(
                        f"{what}: groupEnd has blocked the host {dev.deadlock_s:.0f}s setting up "
                        "connections (NCCL connects on first use): a peer never posted its matching "
                        "operation (dead, or issuing in another order)"
                    )
                )
        if failure:
            raise SimNcclError(ERROR_REMOTE, f"{what}: connection set-up failed: {failure[0]!r}")
        if comm.aborted:
            raise SimNcclError(ERROR_INTERNAL, f"{what}: the communicator was aborted")
        comm.connected.update(key for key, _ in todo)

    def _launch(self, stream: SimStream, calls, ranges) -> None:
        names = "+".join(sorted({c[0].name for c in calls}))
        kinds = ",".join(c[1] for c in calls)
        op = _Op("nccl", f"NCCL {names} [{kinds}]", stream, ranges=ranges, calls=calls)
        dev = self.device
        with dev.cv:
            op.ticket = next(dev.nccl_tickets)
            dev.nccl_unstarted.add(op.ticket)
            stream._issue(op)


# --------------------------------------------------------------------------- CUDA IPC
# CUDA IPC, simulated: memory and events shared by the rank processes of one
# simulated GPU (``hybridcomm.gpu.ipc.CudaIpc``'s interface).
#
# Shared memory is a file in ``/dev/shm`` mapped by every process. A shared event
# is two counters in such a file: how many times its owner has *recorded* it
# (bumped on the host at ``record``) and how many of those records its stream
# has *reached* (set by the stream's worker when it runs the record). A peer's
# ``stream.wait_event(e)`` reads the record count at the call, as CUDA takes the
# event's latest record, and queues a wait until the owner's stream has reached
# that record: a wait that comes before the record it needs waits for nothing,
# as on a GPU. The race detector does not see across processes; the transport's
# ordering there is checked by the results (exact sums under random stream
# delays) and by mutations that drop a wait.

_DIR = (
    "/dev/shm"
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    else tempfile.gettempdir()
)


def _map(path: str, nbytes: int, create: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, max(nbytes, 8))
        return mmap.mmap(fd, max(nbytes, 8))
    finally:
        os.close(fd)


def _tensor(mm: mmap.mmap, nbytes: int) -> torch.Tensor:
    _tls.host_depth += 1  # the simulator's own bookkeeping, not work on a stream
    try:
        return (
            torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
    finally:
        _tls.host_depth -= 1


class _SharedCounters:
    """[recorded, reached] of one shared event, in shared memory."""

    def __init__(self, mm: mmap.mmap):
        self.mm = mm
        self.values = (ctypes.c_int64 * 2).from_buffer(mm)


class SimSharedEvent(SimEvent):
    """The owner's side of a shared event: records as any event, and publishes it."""

    def __init__(self, device, counters: _SharedCounters):
        super().__init__(device)
        self.counters = counters

    def record(self, stream=None) -> None:
        stream = stream or self.device.current_stream()
        super().record(stream)
        c = self.counters.values
        n = c[0] + 1
        c[0] = n

        def reached():
            c[1] = n

        stream._issue(_Op("kernel", "shared event reached", stream, fn=reached))


class SimOpenedEvent:
    """A peer's shared event, opened here: streams may only wait on it."""

    def __init__(self, device, counters: _SharedCounters):
        self.device, self.counters = device, counters

    def wait_on(self, stream: SimStream) -> None:
        """``stream.wait_event(self)``: wait for the owner's latest record so far."""
        c = self.counters.values
        target = c[0]
        if target == 0:
            return  # never recorded: nothing to wait for (as CUDA)
        dev = self.device

        def wait():
            while c[1] < target and not dev.closed:
                time.sleep(20e-6)

        stream._issue(_Op("kernel", f"wait shared event #{target}", stream, fn=wait))


class SimIpc:
    """Shared memory and events between the rank processes of one simulated GPU."""

    def __init__(self, device):
        self.device = device
        self._maps = []  # keep every mapping alive as long as this runtime

    def _new(self, nbytes: int) -> Tuple[mmap.mmap, bytes]:
        path = os.path.join(_DIR, f"hybridcomm-simipc-{os.getpid()}-{uuid.uuid4().hex}")
        mm = _map(path, nbytes, create=True)
        self._maps.append(mm)
        return mm, pickle.dumps((path, nbytes))

    def _open(self, handle: bytes) -> Tuple[mmap.mmap, int]:
        path, nbytes = pickle.loads(handle)
        mm = _map(path, nbytes, create=False)
        self._maps.append(mm)
        return mm, nbytes

    def buffer(self, nbytes: int) -> Tuple[torch.Tensor, bytes]:
        mm, handle = self._new(nbytes)
        return _tensor(mm, nbytes), handle

    def open_buffer(self, handle: bytes) -> torch.Tensor:
        mm, nbytes = self._open(handle)
        return _tensor(mm, nbytes)

    def event(self):
        mm, handle = self._new(16)
        return SimSharedEvent(self.device, _SharedCounters(mm)), handle

    def open_event(self, handle: bytes) -> SimOpenedEvent:
        mm, _ = self._open(handle)
        return SimOpenedEvent(self.device, _SharedCounters(mm))

    @staticmethod
    def forget(handle: bytes) -> None:
        """Every peer has mapped it: remove the file (the mappings stay)."""
        path, _ = pickle.loads(handle)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------- the runtime


class SimRuntime:
    """The runtime interface of ``hybridcomm.gpu.runtime.CudaRuntime``, simulated."""

    simulated = True
    reports_writes = True  # expect_write checks each in-place add: the hooks keep calling it

    def __init__(self, device: _Device):
        self._dev = device
        self.device = torch.device("cpu")
        self.index = device.index
        self._nccl = SimNccl(device)
        self._ipc = None

    def new_stream(self, priority: int = 0) -> SimStream:
        return SimStream(self._dev, priority, name=f"p{priority}-{next(_stream_names)}")

    def current_stream(self) -> SimStream:
        self._dev.touch()
        return self._dev.current_stream()

    def new_event(self, timing: bool = False) -> SimEvent:
        return SimEvent(self._dev, timing=timing)

    @contextlib.contextmanager
    def use(self, stream: SimStream):
        """torch.cuda.stream(s): ``s`` current, on its device, for the block."""
        prev_dev = _tls.device_index
        self._dev.touch()  # querying the current device's stream uses the runtime there
        prev = _tls.current.get(stream.device.index)
        _tls.device_index = stream.device.index
        _tls.current[stream.device.index] = stream
        try:
            yield stream
        finally:
            if prev is None:
                _tls.current.pop(stream.device.index, None)
            else:
                _tls.current[stream.device.index] = prev
            _tls.device_index = prev_dev

    @staticmethod
    def handle(stream: SimStream) -> int:
        return stream.cuda_stream

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        self._dev.touch()
        self._dev.allocator.record_stream(tensor, stream)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._dev.allocator.empty(numel, dtype)

    def bind_thread(self) -> None:
        """torch.cuda.set_device(rank's device) on this thread."""
        _tls.device_index = self._dev.index
        _enter_thread(self._dev)

    def synchronize(self) -> None:
        dev = self._dev
        dev.touch()
        dev.count_sync()
        for s in list(dev.streams.values()):
            dev.drain(s)

    @contextlib.contextmanager
    def watched(self):
        """Host torch calls inside are device work on the current stream. The
        autograd engine runs gradient hooks without torch-function modes, so the
        library's hooks enter this to stay under the simulator's watch."""
        from torch.overrides import _get_current_function_mode_stack

        if any(isinstance(m, _HostMode) for m in _get_current_function_mode_stack()):
            yield
            return
        with _HostMode(self._dev):
            yield

    def expect_write(self, tensor: torch.Tensor) -> None:
        """Autograd's AccumulateGrad is about to add into ``tensor`` in place, or DDP's
        reducer has copied gradients into it (C++ the watch cannot see): a write on
        the current stream, checked for races and run after the stream's queued
        work, as its kernel would. Memory not from the allocator is tracked from
        now on."""
        self._dev.touch()
        self._dev.allocator.track(tensor)
        self._dev.host_op("AccumulateGrad", [tensor], [tensor])

    def stream_future(self, value, stream: SimStream) -> torch.futures.Future:
        """What ``torch.futures.Future(devices=[cuda])`` set with ``stream`` current
        gives DDP: its wait makes the waiter's stream wait for ``stream``'s work so
        far. A CPU tensor's future knows no streams, so here it completes when
        ``stream`` gets there (DDP's wait, in C++, waits on the host), and the
        current stream waits for that point (the stream wait, made at once)."""
        dev = self._dev
        dev.touch()
        fut: torch.futures.Future = torch.futures.Future()
        ev = SimEvent(dev)
        ev.record(stream)
        dev.current_stream().wait_event(ev)
        stream._issue(_Op("kernel", "future", stream, fn=lambda: fut.set_result(value)))
        return fut

    @contextlib.contextmanager
    def host_region(self):
        """Code that runs on the host in production too (control-plane collectives
        over gloo): not device work, not host syncs."""
        _tls.host_depth += 1
        try:
            yield
        finally:
            _tls.host_depth -= 1

    def nccl(self) -> SimNccl:
        return self._nccl

    def stream_of(self, handle: int) -> SimStream:
        """The stream behind a raw handle (what NCCL-style calls are given)."""
        return self._dev.streams[handle]

    @staticmethod
    def at(ptr: int, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` of simulated device memory at ``ptr`` (no copy)."""
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        _tls.host_depth += 1  # the simulator's own bookkeeping, not host work
        try:
            return _alias(ptr, nbytes)
        finally:
            _tls.host_depth -= 1

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A device-to-device copy queued on the current stream (run late, as a
        ``cudaMemcpyAsync`` would; its reads and writes race-checked)."""
        self._dev.launch("copy", lambda d, s: d.copy_(s), (dst, src), {}, reads=[src], writes=[dst])

    def ipc(self):
        """Memory and events shared with the other rank processes (CUDA IPC, below)."""
        if self._ipc is None:
            self._ipc = SimIpc(self._dev)
        return self._ipc

    @staticmethod
    def communicator_device():
        return contextlib.nullcontext()


_stream_names = itertools.count(1)
_device: Optional[_Device] = None
_runtime: Optional[SimRuntime] = None
_lock = threading.Lock()
_config: Dict[str, object] = {}


def configure(**overrides) -> None:
    """Tests: override the environment's settings (delay_s, seed, nccl_kernels,
    uid_style, deadlock_s) for the device made next (call before :func:`runtime`)."""
    _config.update(overrides)


def _device_index() -> int:
    local = os.environ.get("LOCAL_RANK")
    if local is not None:
        return int(local)
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _enter_thread(device: _Device) -> None:
    """Watch this thread's torch calls (host ops, syncs) and route its kernel launches."""
    if not _tls.active:
        _tls.active = True
        _HostMode(device).__enter__()  # for the thread's lifetime


def runtime() -> SimRuntime:
    """This process's simulated runtime (made on first use; the calling thread is
    bound to the rank's simulated GPU and watched)."""
    global _device, _runtime
    with _lock:
        if _runtime is None:
            cfg = dict(
                delay_s=env.get("HYBRIDCOMM_SIM_DELAY_US") * 1e-6,
                seed=env.get("HYBRIDCOMM_SIM_SEED"),
                nccl_kernels=env.get("HYBRIDCOMM_SIM_NCCL_KERNELS"),
                uid_style=env.get("HYBRIDCOMM_SIM_CUPY_UID"),
                deadlock_s=env.get("HYBRIDCOMM_SIM_DEADLOCK_S"),
            )
            cfg.update(_config)
            index = _device_index()
            cfg["seed"] = int(cfg["seed"]) * 1009 + index
            _tls.device_index = index
            _device = _Device(index, **cfg)
            _runtime = SimRuntime(_device)
            from ..kernels import _triton

            _triton.set_launch_hook(_launch_hook)
        if not _tls.active:
            _tls.device_index = _device.index
            _enter_thread(_device)
        return _runtime


def _launch_hook(name, fn, args, kwargs, reads, writes) -> bool:
    """kernels' launch seam: simulated on threads that use the simulated runtime."""
    if _device is None or not _tls.active:
        return False
    _device.launch(name, fn, args, kwargs, reads=reads, writes=writes)
    return True


def stats() -> Dict[str, int]:
    """Counters since the last :func:`reset_stats`: ``nccl_ops``, ``kernel_launches``,
    ``host_syncs``, ``stream_ops``, ``allocations``, ``defects``, ``events`` (made),
    ``event_records``, ``event_queries`` (``watchdog_queries`` apart: they follow the
    clock), ``stream_waits``, and ``launches:<kernel>`` per kernel launched
    (``launches:pack``, ...). The simulator's own events are not counted."""
    if _device is None:
        return _zero_stats()
    with _device.cv:
        return dict(_device.stats)


def reset_stats() -> None:
    if _device is not None:
        with _device.cv:
            _device.stats = _zero_stats()


def errors() -> List[SimError]:
    """Every defect found so far (raised or not)."""
    if _device is None:
        return []
    with _device.cv:
        return list(_device.errors)


def check() -> None:
    """Raise the first defect found and not yet raised."""
    if _device is not None:
        _device.raise_pending()


def sleep(seconds: float) -> None:
    """A kernel that keeps the current stream busy for ``seconds`` while the host
    goes on (``torch.cuda._sleep``'s analogue): the host runs ahead of its stream
    until a host op, a sync or an event's wait catches up with it."""
    rt = runtime()
    stream = rt.current_stream()
    with _device.cv:
        _device.stats["kernel_launches"] += 1
    stream._issue(_Op("kernel", "sleep", stream, fn=lambda: time.sleep(seconds)))


def synchronize() -> None:
    """Wait for every simulated stream (counted as a host sync)."""
    if _runtime is not None:
        _runtime.synchronize()
