"""A recording fake of ``cupy.cuda.nccl`` and of the CUDA stream/event layer.

P simulated ranks live in one process (one thread each). "Device pointers"
are the addresses of host torch tensors (``data_ptr()``); when a send and a
receive match, the fake moves the bytes between those host tensors with
``ctypes.memmove``. Matching is per (src, dst) pair, first-in first-out, with
no tags, as NCCL does it: if two ranks issue their steps in different orders,
data lands in the wrong place, sizes mismatch (recorded in ``world.errors``)
or the ranks wait forever (the transport's timeout fires).

Every call is recorded per rank (``world.calls[rank]``): NCCL calls with their
pointer, count, dtype enum, peer, stream handle and enclosing group, and the
stream/event calls (record, wait_event, record_stream) with the stream's name,
so tests check the arithmetic and the ordering the transport promises.

Two execution models:

* ``blocking=False`` (default): ``groupEnd`` posts the group and returns at
  once, like NCCL; completion shows through events. Valid while the caller
  waits for each step on the host before touching the buffers again (the
  executor's host-wait path). A peer that never posts leaves the event
  pending: the timeout path.
* ``blocking=True``: ``groupEnd`` returns when the group has completed, i.e.
  the stream runs each call to completion before the host goes on. This is
  how stream-ordered work (a reduce kernel queued after the receive on the
  same stream) looks when the "kernels" run on the host.

Only the subset of the CuPy API the transport uses exists here; the real
module is checked to have every name (tests/test_cupy_nccl_api.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

# ncclDataType_t values (nccl.h), written out here independently of the
# transport's map so a wrong entry there shows up as a wrong dtype here.
NCCL_ENUMS = {
    "NCCL_INT8": 0, "NCCL_CHAR": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_INT": 2,
    "NCCL_UINT32": 3, "NCCL_INT64": 4, "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_HALF": 6,
    "NCCL_FLOAT32": 7, "NCCL_FLOAT": 7, "NCCL_FLOAT64": 8, "NCCL_DOUBLE": 8, "NCCL_BFLOAT16": 9,
}
ITEMSIZE = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}
TORCH_TO_ENUM = {torch.float32: 7, torch.float16: 6, torch.bfloat16: 9, torch.float64: 8,
                 torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4}

NCCL_ERROR_INVALID_USAGE = 5
NCCL_ERROR_REMOTE_ERROR = 6


class FakeNcclError(RuntimeError):
    def __init__(self, status: int, msg: str = ""):
        super().__init__(f"NCCL error {status}: {msg}")
        self.status = status


@dataclass(eq=False)
class Op:
    rank: int
    kind: str  # "send" or "recv"
    ptr: int
    count: int
    dtype: int
    peer: int
    stream: "FakeStream"
    group: Optional[int]
    done: bool = False


@dataclass
class Call:
    """One recorded call. ``kind`` is the API name; the rest depends on it."""

    kind: str
    args: dict = field(default_factory=dict)

    def __getattr__(self, name):
        try:
            return self.args[name]
        except KeyError:
            raise AttributeError(name) from None


class FakeNcclWorld:
    """The shared state of P simulated ranks: the wire, the logs, the errors."""

    def __init__(self, world_size: int, *, blocking: bool = False, block_timeout: float = 10.0):
        self.world_size = world_size
        self.blocking = blocking
        self.block_timeout = block_timeout
        self.cond = threading.Condition()
        self.unmatched_sends: Dict[tuple, deque] = defaultdict(deque)
        self.unmatched_recvs: Dict[tuple, deque] = defaultdict(deque)
        self.calls: List[List[Call]] = [[] for _ in range(world_size)]
        self.errors: List[str] = []
        self.async_error: Dict[int, int] = {}
        self.unique_ids: List[bytes] = []
        self.comms: Dict[int, "FakeComm"] = {}
        self.moved_bytes = 0
        self._groups = itertools.count()
        self._handles = itertools.count(0x1000)

    def module(self, rank: int) -> "FakeNcclModule":
        return FakeNcclModule(self, rank)

    def streams(self, rank: int) -> "FakeStreams":
        return FakeStreams(self, rank)

    def record(self, who: int, kind: str, **args) -> None:
        self.calls[who].append(Call(kind, args))

    # -- the wire -------------------------------------------------------------------

    def post(self, ops: List[Op]) -> None:
        with self.cond:
            for op in ops:
                op.stream.ops.append(op)
                if op.kind == "send":
                    key, mine, theirs = (op.rank, op.peer), self.unmatched_sends, self.unmatched_recvs
                else:
                    key, mine, theirs = (op.peer, op.rank), self.unmatched_recvs, self.unmatched_sends
                if theirs[key]:
                    other = theirs[key].popleft()
                    send, recv = (op, other) if op.kind == "send" else (other, op)
                    self._move(send, recv)
                else:
                    mine[key].append(op)
            self.cond.notify_all()

    def _move(self, send: Op, recv: Op) -> None:
        if send.dtype != recv.dtype or send.count != recv.count:
            self.errors.append(
                f"rank {send.rank} -> rank {recv.rank}: send of {send.count} x dtype {send.dtype} "
                f"matched a receive of {recv.count} x dtype {recv.dtype}")
            for r in (send.rank, recv.rank):
                self.async_error[r] = NCCL_ERROR_INVALID_USAGE
            return  # neither completes, as a real mismatch would hang or fail
        nbytes = send.count * ITEMSIZE[send.dtype]
        if nbytes:
            ctypes.memmove(recv.ptr, send.ptr, nbytes)
        self.moved_bytes += nbytes
        send.done = recv.done = True

    def wait_done(self, ops: List[Op]) -> None:
        deadline = time.monotonic() + self.block_timeout
        with self.cond:
            while not all(op.done for op in ops):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("fake NCCL: a blocking group never completed "
                                         "(peers issued their calls in another order?)")
                self.cond.wait(left)

    def cancel(self, rank: int) -> None:
        """Abort: the rank's unmatched calls are dropped and count as finished."""
        with self.cond:
            for queues in (self.unmatched_sends, self.unmatched_recvs):
                for key, q in queues.items():
                    for op in [op for op in q if op.rank == rank]:
                        q.remove(op)
                        op.done = True
            self.cond.notify_all()

    def unmatched(self) -> Dict[tuple, int]:
        return {k: len(q) for d in (self.unmatched_sends, self.unmatched_recvs)
                for k, q in d.items() if q}


class FakeNcclModule:
    """Stands in for ``cupy.cuda.nccl`` for one rank (NCCL's group state is per thread)."""

    NcclError = FakeNcclError
    available = True

    def __init__(self, world: FakeNcclWorld, rank: int):
        self.world, self.rank = world, rank
        self._depth = 0
        self._group: Optional[int] = None
        self._ops: List[Op] = []
        for name, value in NCCL_ENUMS.items():
            setattr(self, name, value)

    def get_unique_id(self):
        uid = os.urandom(128)
        self.world.unique_ids.append(uid)
        return uid  # the real one returns bytes of length 128 too

    def NcclCommunicator(self, ndev: int, uid: bytes, rank: int) -> "FakeComm":
        if not isinstance(uid, bytes) or len(uid) != 128:
            raise FakeNcclError(NCCL_ERROR_INVALID_USAGE, "commId must be 128 bytes")
        if ndev != self.world.world_size or rank != self.rank:
            raise FakeNcclError(NCCL_ERROR_INVALID_USAGE, f"ndev={ndev} rank={rank}")
        self.world.record(self.rank, "NcclCommunicator", ndev=ndev, uid=uid, rank=rank)
        comm = FakeComm(self, rank)
        self.world.comms[rank] = comm
        return comm

    def groupStart(self):
        if self._depth == 0:
            self._group = next(self.world._groups)
        self._depth += 1
        self.world.record(self.rank, "groupStart", group=self._group)

    def groupEnd(self):
        if self._depth == 0:
            raise FakeNcclError(NCCL_ERROR_INVALID_USAGE, "groupEnd without groupStart")
        self._depth -= 1
        self.world.record(self.rank, "groupEnd", group=self._group)
        if self._depth == 0:
            ops, self._ops = self._ops, []
            self.world.post(ops)
            if self.world.blocking:
                self.world.wait_done(ops)

    def _issue(self, op: Op) -> None:
        if self._depth:
            self._ops.append(op)
        else:  # outside a group a call is its own group
            self.world.post([op])
            if self.world.blocking:
                self.world.wait_done([op])


class FakeComm:
    def __init__(self, module: FakeNcclModule, rank: int):
        self.module, self.rank = module, rank
        self.aborted = False

    def _op(self, kind, ptr, count, dtype, peer, stream):
        m = self.module
        if self.aborted:
            raise FakeNcclError(NCCL_ERROR_INVALID_USAGE, "communicator aborted")
        group = m._group if m._depth else None
        s = FakeStream.by_handle[stream]
        m.world.record(self.rank, kind, ptr=ptr, count=count, dtype=dtype, peer=peer,
                       stream=s.name, group=group)
        m._issue(Op(self.rank, kind, ptr, count, dtype, peer, s, group))

    def send(self, sendbuf, count, datatype, peer, stream):
        self._op("send", sendbuf, count, datatype, peer, stream)

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._op("recv", recvbuf, count, datatype, peer, stream)

    def check_async_error(self):
        status = self.module.world.async_error.get(self.rank)
        if status:
            raise FakeNcclError(status, "async error injected by the test")

    def abort(self):
        self.module.world.record(self.rank, "abort")
        self.aborted = True
        self.module.world.cancel(self.rank)

    def destroy(self):
        self.module.world.record(self.rank, "destroy")


class FakeStream:
    by_handle: Dict[int, "FakeStream"] = {}

    def __init__(self, world: FakeNcclWorld, rank: int, name: str, priority: int = 0):
        self.world, self.rank, self.name, self.priority = world, rank, name, priority
        self.cuda_stream = next(world._handles)
        self.ops: List[Op] = []
        FakeStream.by_handle[self.cuda_stream] = self

    def wait_event(self, event: "FakeEvent") -> None:
        self.world.record(self.rank, "wait_event", stream=self.name, event=event.id)

    def __repr__(self):
        return f"FakeStream({self.name!r}, rank {self.rank})"


class FakeEvent:
    _ids = itertools.count()

    def __init__(self, world: FakeNcclWorld, rank: int):
        self.world, self.rank = world, rank
        self.id = next(FakeEvent._ids)
        self.ops: List[Op] = []

    def record(self, stream: FakeStream) -> None:
        with self.world.cond:
            self.ops = [op for op in stream.ops if not op.done]
        self.world.record(self.rank, "record", stream=stream.name, event=self.id)

    def query(self) -> bool:
        with self.world.cond:
            return all(op.done for op in self.ops)


class FakeStreams:
    """Stands in for :class:`TorchCudaStreams`: streams, events, the current stream."""

    def __init__(self, world: FakeNcclWorld, rank: int):
        self.world, self.rank = world, rank
        self.device = torch.device("cpu")
        self.compute = FakeStream(world, rank, "compute")
        self._current = self.compute
        self._count = itertools.count()

    def new_stream(self, priority: int = 0) -> FakeStream:
        return FakeStream(self.world, self.rank, f"comm{next(self._count)}", priority)

    def current_stream(self) -> FakeStream:
        return self._current

    def new_event(self) -> FakeEvent:
        return FakeEvent(self.world, self.rank)

    @staticmethod
    def handle(stream: FakeStream) -> int:
        return stream.cuda_stream

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.world.record(self.rank, "record_stream", ptr=tensor.data_ptr(), stream=stream.name)

    @contextlib.contextmanager
    def use(self, stream: FakeStream):
        prev, self._current = self._current, stream
        self.world.record(self.rank, "use", stream=stream.name)
        try:
            yield stream
        finally:
            self._current = prev

    def device_context(self):
        return contextlib.nullcontext()
