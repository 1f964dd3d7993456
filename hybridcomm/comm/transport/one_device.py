"""NCCL's point-to-point and all-reduce for several rank processes on one GPU.

NCCL refuses two ranks of a communicator on one device. :class:`OneDeviceNccl`
stands in for ``cupy.cuda.nccl`` (the part ``CupyNcclTransport`` uses), so the
whole GPU path runs unchanged with P processes sharing GPU 0
(``HYBRIDCOMM_TRANSPORT=one-device``). A proving ground, not a fast path: bytes
go through mailboxes (:class:`OneDeviceCommunicator`) with a host round trip
per piece, and CUDA graph capture of a step is not modelled.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import mmap
import os
import pickle
import threading
import time
from typing import List

import torch

from ...config import env

NCCL_TYPES = {
    "NCCL_INT8": 0,
    "NCCL_UINT8": 1,
    "NCCL_INT32": 2,
    "NCCL_INT64": 4,
    "NCCL_FLOAT16": 6,
    "NCCL_FLOAT32": 7,
    "NCCL_FLOAT64": 8,
    "NCCL_BFLOAT16": 9,
}
TORCH_OF = {
    0: torch.int8,
    1: torch.uint8,
    2: torch.int32,
    4: torch.int64,
    6: torch.float16,
    7: torch.float32,
    8: torch.float64,
    9: torch.bfloat16,
}
NCCL_OPS = {"NCCL_SUM": 0, "NCCL_AVG": 4}
ERROR_INTERNAL, ERROR_INVALID_USAGE, ERROR_REMOTE = 3, 5, 6
# Host counters of one ordered pair: pieces filled, pieces consumed, and the
# current message's bytes and dtype (a receive of another size is reported).
FILLED, CONSUMED, MSG_BYTES, MSG_DTYPE = range(4)
PAIR_SLOTS = 4


class OneDeviceNcclError(RuntimeError):
    def __init__(self, status: int, msg: str = ""):
        super().__init__(f"NCCL error {status}: {msg}")
        self.status = status


class _Op:
    """One posted send or receive: its pieces go one at a time."""

    __slots__ = ("kind", "peer", "data", "dtype", "stream", "pieces", "done")

    def __init__(self, kind, peer, data, dtype, stream, mailbox):
        self.kind, self.peer, self.data, self.dtype, self.stream = kind, peer, data, dtype, stream
        self.pieces = max(1, math.ceil(data.numel() / mailbox))
        self.done = 0


class OneDeviceCommunicator:
    """One rank's side: ``cupy.cuda.nccl.NcclCommunicator``'s calls, on one GPU.

    For each ordered pair (s, d), d owns a mailbox of
    ``HYBRIDCOMM_ONE_DEVICE_MAILBOX`` bytes that s maps (CUDA IPC), ordered by two
    shared events, *filled* (recorded by s) and *consumed* (by d); a message moves
    in mailbox-sized pieces, device-to-device copies only, no host waits for the
    GPU. A stream waits for an event's latest record *at the time of the wait
    call*, so two counters per pair in host shared memory say how many pieces
    were filled and consumed (recorded): s fills piece k once d has recorded
    consumed for k-1, d reads it once s has recorded filled for k. A call thus
    blocks the host until the peer posts its side (as NCCL's first-use
    connection does), never the GPU.
    """

    def __init__(self, module: "OneDeviceNccl", ndev: int, commId, rank: int):
        import torch.distributed as dist

        if not isinstance(commId, bytes) or len(commId) != 128:
            raise TypeError("commId must be the 128 bytes of get_unique_id()")
        self.module, self.rt, self.rank, self.size_ = module, module.runtime, rank, ndev
        self.mailbox = max(1, env.get("HYBRIDCOMM_ONE_DEVICE_MAILBOX"))
        self.aborted = self.destroyed = False
        self.sent = [0] * ndev  # pieces this rank has filled, per receiver
        self.received = [0] * ndev  # pieces this rank has consumed, per sender
        key = f"hybridcomm-one-device/{hashlib.sha256(commId).hexdigest()[:24]}"
        store = dist.distributed_c10d._get_default_store()
        self._host = _HostCounters(key, ndev)
        ipc = self.rt.ipc()
        self.boxes, self.filled, self.consumed, mine = {}, {}, {}, {}
        for q in range(ndev):  # what this rank owns of each pair it is in
            if q != rank:
                box, box_h = ipc.buffer(self.mailbox)  # q -> me lands here
                self.boxes[q] = box
                self.consumed[q], cons_h = ipc.event()  # q -> me: I read it out
                self.filled[q], fill_h = ipc.event()  # me -> q: I filled it
                mine[q] = (box_h, cons_h, fill_h)
        store.set(f"{key}/{rank}", pickle.dumps(mine))
        self.peer_boxes, self.peer_filled, self.peer_consumed = {}, {}, {}
        for q in range(ndev):
            if q != rank:
                box_h, cons_h, fill_h = pickle.loads(store.get(f"{key}/{q}"))[rank]
                self.peer_boxes[q] = ipc.open_buffer(box_h)  # me -> q lands there
                self.peer_consumed[q] = ipc.open_event(cons_h)  # me -> q: q read it
                self.peer_filled[q] = ipc.open_event(fill_h)  # q -> me: q filled it
        store.set(f"{key}/opened/{rank}", b"1")
        store.wait([f"{key}/opened/{q}" for q in range(ndev)])
        for handles in mine.values():  # every peer has them open
            for h in handles:
                ipc.forget(h)
        self._host.forget()

    # -- calls ------------------------------------------------------------------------
    def _post(self, kind, ptr, count, datatype, peer, stream):
        if self.aborted or self.destroyed:
            raise OneDeviceNcclError(ERROR_INVALID_USAGE, "communicator aborted or destroyed")
        if not (0 <= peer < self.size_ and peer != self.rank):
            raise OneDeviceNcclError(ERROR_INVALID_USAGE, f"invalid peer {peer}")
        nbytes = count * TORCH_OF[datatype].itemsize
        op = _Op(
            kind,
            peer,
            self.rt.at(ptr, nbytes),
            datatype,
            stream=self.rt.stream_of(stream),
            mailbox=self.mailbox,
        )
        self.module.post(self, op)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._post("send", sendbuf, count, datatype, peer=peer, stream=stream)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._post("recv", recvbuf, count, datatype, peer=peer, stream=stream)

    def allReduce(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int
    ) -> None:
        """Everyone's buffer to everyone, then a sum in rank order on ``stream``."""
        self._reduce(
            sendbuf, recvbuf, count, 0, kept=count, datatype=datatype, op=op, stream=stream
        )

    def reduceScatter(
        self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int
    ) -> None:
        """As :meth:`allReduce`, keeping this rank's ``recvcount`` elements of the sum."""
        self._reduce(
            sendbuf,
            recvbuf,
            recvcount * self.size_,
            self.rank * recvcount,
            kept=recvcount,
            datatype=datatype,
            op=op,
            stream=stream,
        )

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        """Everyone's ``count`` elements to everyone, in rank order."""
        nbytes = count * TORCH_OF[datatype].itemsize
        s, mine, theirs = self._everyones(sendbuf, nbytes, datatype, stream)
        if not nbytes:
            return
        out = self.rt.at(recvbuf, nbytes * self.size_)
        with self.rt.use(s):
            for q in range(self.size_):
                if q != self.rank:
                    out[q * nbytes : (q + 1) * nbytes].copy_(theirs[q])
                elif out.data_ptr() + q * nbytes != mine.data_ptr():  # (in place: there)
                    out[q * nbytes : (q + 1) * nbytes].copy_(mine)

    def _reduce(
        self,
        sendbuf: int,
        recvbuf: int,
        count: int,
        start: int,
        kept: int,
        datatype: int,
        op: int,
        stream: int,
    ) -> None:
        """The sum of everyone's ``count`` elements; ``[start, start + kept)`` of it
        into ``recvbuf``. Summed in rank order (fp32, fp64 for fp64, int64 for
        integers) on the stream: every rank gets the same bits."""
        dtype = TORCH_OF[datatype]
        s, mine, theirs = self._everyones(sendbuf, count * dtype.itemsize, datatype, stream)
        if not count:
            return
        acc_dtype = (
            torch.float64
            if dtype == torch.float64
            else torch.int64
            if not dtype.is_floating_point
            else torch.float32
        )
        with self.rt.use(s):
            acc = torch.zeros(count, dtype=acc_dtype, device=mine.device)
            for q in range(self.size_):
                acc += (mine if q == self.rank else theirs[q]).view(dtype).to(acc_dtype)
            if op == NCCL_OPS["NCCL_AVG"]:
                acc /= self.size_
            self.rt.at(recvbuf, kept * dtype.itemsize).view(dtype).copy_(acc[start : start + kept])

    def _everyones(self, sendbuf: int, nbytes: int, datatype: int, stream: int):
        """(the stream, this rank's ``nbytes`` at ``sendbuf``, every peer's), sent and
        received as one group on ``stream``."""
        if self.aborted or self.destroyed:
            raise OneDeviceNcclError(ERROR_INVALID_USAGE, "communicator aborted or destroyed")
        s = self.rt.stream_of(stream)
        mine = self.rt.at(sendbuf, nbytes)
        with self.rt.use(s):  # scratch on the stream that uses it: reused only after it
            parts = self.rt.empty(max(1, (self.size_ - 1) * nbytes), torch.uint8)
        theirs = {}
        with self.module.group():
            for i, q in enumerate(q for q in range(self.size_) if q != self.rank):
                theirs[q] = parts[i * nbytes : (i + 1) * nbytes]
                self.module.post(
                    self, _Op("send", q, mine, datatype, stream=s, mailbox=self.mailbox)
                )
                self.module.post(
                    self, _Op("recv", q, theirs[q], datatype, stream=s, mailbox=self.mailbox)
                )
        return s, mine, theirs

    # -- one piece (the group's progress loop calls these) --------------------------------
    def try_step(self, op: _Op) -> bool:
        """Issue ``op``'s next piece if the peer is ready for it; False if not yet."""
        if op.kind == "send":
            return self._fill(op)
        return self._consume(op)

    def _fill(self, op: _Op) -> bool:
        q, host = op.peer, self._host
        k = self.sent[q] + 1
        if host.get(self.rank, q, CONSUMED) < k - 1:
            return False  # q has not posted the receive of the previous piece
        lo = op.done * self.mailbox
        piece = op.data[lo : lo + self.mailbox]
        with self.rt.use(op.stream):
            if k > 1:
                op.stream.wait_event(self.peer_consumed[q])  # q read the mailbox out
            if piece.numel():
                self.rt.copy(self.peer_boxes[q][: piece.numel()], piece)
            self.filled[q].record(op.stream)
        host.set(self.rank, q, MSG_BYTES, op.data.numel())
        host.set(self.rank, q, MSG_DTYPE, op.dtype)
        host.set(self.rank, q, FILLED, k)  # last: q may read the piece from here on
        self.sent[q], op.done = k, op.done + 1
        return True

    def _consume(self, op: _Op) -> bool:
        q, host = op.peer, self._host
        k = self.received[q] + 1
        if host.get(q, self.rank, FILLED) < k:
            return False  # q has not posted this piece's send
        got = (host.get(q, self.rank, MSG_BYTES), host.get(q, self.rank, MSG_DTYPE))
        if got != (op.data.numel(), op.dtype):
            raise OneDeviceNcclError(
                ERROR_INVALID_USAGE,
                f"rank {self.rank} posted a receive of {op.data.numel()} bytes (type "
                f"{op.dtype}) from rank {q}, which sent {got[0]} bytes (type {got[1]}): the "
                "ranks issue their operations in different orders",
            )
        lo = op.done * self.mailbox
        piece = op.data[lo : lo + self.mailbox]
        with self.rt.use(op.stream):
            op.stream.wait_event(self.peer_filled[q])  # q's piece is in the mailbox
            if piece.numel():
                self.rt.copy(piece, self.boxes[q][: piece.numel()])
            self.consumed[q].record(op.stream)
        host.set(q, self.rank, CONSUMED, k)
        self.received[q], op.done = k, op.done + 1
        return True

    def peer_failed(self, peers) -> int | None:
        """A peer among ``peers`` that aborted, if any."""
        return next((q for q in peers if self._host.aborted(q)), None)

    # -- state ------------------------------------------------------------------------
    def check_async_error(self) -> None:
        if self.aborted or self.destroyed:
            raise OneDeviceNcclError(ERROR_INVALID_USAGE, "communicator aborted or destroyed")
        q = self.peer_failed(q for q in range(self.size_) if q != self.rank)
        if q is not None:
            raise OneDeviceNcclError(ERROR_REMOTE, f"rank {q} aborted its communicator")

    def abort(self) -> None:
        # Marked in shared memory: peers blocked on this rank, and their async-error
        # queries, then fail (NCCL's remote error)
        if not (self.aborted or self.destroyed):
            self.aborted = True
            self._host.set_aborted(self.rank)

    def destroy(self) -> None:
        self.destroyed = True

    def rank_id(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.size_

    def device_id(self) -> int:
        return self.rt.device.index or 0


class _HostCounters:
    """Per-pair counters and per-rank abort flags in host shared memory (a file
    every rank maps, removed once all have). Aligned 8-byte loads and stores:
    each is seen whole, and in program order (x86)."""

    DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"

    def __init__(self, key: str, ndev: int):
        self.ndev = ndev
        self.path = os.path.join(self.DIR, key.replace("/", "-"))
        n = ndev * ndev * PAIR_SLOTS + ndev
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 8 * n:
                os.ftruncate(fd, 8 * n)  # zeros; every rank asks for the same size
            self._mm = mmap.mmap(fd, 8 * n)
        finally:
            os.close(fd)
        self.v = (ctypes.c_int64 * n).from_buffer(self._mm)

    def get(self, src: int, dst: int, slot: int) -> int:
        return self.v[(src * self.ndev + dst) * PAIR_SLOTS + slot]

    def set(self, src: int, dst: int, slot: int, value: int) -> None:
        self.v[(src * self.ndev + dst) * PAIR_SLOTS + slot] = value

    def aborted(self, rank: int) -> bool:
        return bool(self.v[self.ndev * self.ndev * PAIR_SLOTS + rank])

    def set_aborted(self, rank: int) -> None:
        self.v[self.ndev * self.ndev * PAIR_SLOTS + rank] = 1

    def forget(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class OneDeviceNccl:
    """A stand-in for the ``cupy.cuda.nccl`` module over one device's runtime.

    Example (each of P processes on GPU 0, or on the simulated GPU)::

        nccl = OneDeviceNccl(runtime_for(torch.device("cuda", 0)))
        t = CupyNcclTransport(runtime=rt, nccl=nccl)     # the transport, unchanged
    """

    available = True
    NcclError = OneDeviceNcclError
    transport_kind = "one-device"
    POLL_S, POLL_MAX_S = 20e-6, 1e-3

    def __init__(self, runtime):
        self.runtime = runtime
        for k, v in {**NCCL_TYPES, **NCCL_OPS}.items():
            setattr(self, k, v)
        module = self

        class NcclCommunicator(OneDeviceCommunicator):
            def __init__(self, ndev, commId, rank):
                super().__init__(module, ndev, commId, rank)

        self.NcclCommunicator = NcclCommunicator
        self._tls = threading.local()

    @staticmethod
    def communicator_device():
        """No CuPy device context to enter (CuPy's communicators need one)."""
        return contextlib.nullcontext()

    @staticmethod
    def get_unique_id() -> bytes:
        return os.urandom(128)

    @staticmethod
    def get_version() -> int:
        return 0

    def groupStart(self) -> None:
        if getattr(self._tls, "group", None) is not None:
            raise OneDeviceNcclError(ERROR_INVALID_USAGE, "nested groupStart")
        self._tls.group = []

    def groupEnd(self) -> None:
        ops, self._tls.group = getattr(self._tls, "group", None), None
        if ops is None:
            raise OneDeviceNcclError(ERROR_INVALID_USAGE, "groupEnd without groupStart")
        self._progress(ops)

    @contextlib.contextmanager
    def group(self):
        self.groupStart()
        try:
            yield
        except BaseException:
            self._tls.group = None
            raise
        self.groupEnd()

    def post(self, comm: OneDeviceCommunicator, op: _Op) -> None:
        group = getattr(self._tls, "group", None)
        if group is not None:
            group.append((comm, op))
        else:
            self._progress([(comm, op)])  # a call outside a group is a group of one

    def _progress(self, ops: List[tuple]) -> None:
        """Issue every piece of the group's operations, each as soon as its peer is
        ready; messages on one (direction, peer) in posting order. Pieces of
        different peers interleave, so a schedule step's sends and receives cannot
        deadlock one another."""
        idle = 0
        while ops:
            moved, blocked = False, set()
            for comm, op in ops:
                lane = (id(comm), op.kind, op.peer)
                if lane in blocked:
                    continue  # an earlier message on this lane is not through yet
                while op.done < op.pieces and comm.try_step(op):
                    moved = True
                if op.done < op.pieces:
                    blocked.add(lane)
            ops = [(c, o) for c, o in ops if o.done < o.pieces]
            if moved or not ops:
                idle = 0
                continue
            for comm in {id(c): c for c, _ in ops}.values():
                if comm.aborted:
                    raise OneDeviceNcclError(ERROR_INTERNAL, "the communicator was aborted")
                q = comm.peer_failed(op.peer for c, op in ops if c is comm)
                if q is not None:
                    raise OneDeviceNcclError(
                        ERROR_REMOTE,
                        f"rank {q} aborted its communicator while this rank waited for it",
                    )
            idle += 1  # back off: a busy host loop takes the cores the peers need
            time.sleep(min(self.POLL_MAX_S, self.POLL_S * idle))
