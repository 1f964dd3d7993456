"""Point-to-point and all-reduce over NCCL through CuPy, on one dedicated stream.

One communicator per (process group, device), its unique id shared through the
torch.distributed store. Everything a transport issues goes on its one comm
stream in issue order, ordered against the trainer by events, never by host
waits; one thread makes every call on the communicator, and a watchdog turns a
hang into an error naming the rank and the work. The CUDA layer comes from
``hybridcomm.gpu.runtime`` (the simulator's in tests, over a simulated
``cupy.cuda.nccl``). Its place on a gradient's path: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import threading
import time
from typing import Dict, Sequence, Tuple

import torch

from ...config import env
from ...base.errors import HybridCommError, HybridCommTimeout
from .base import CommStream, OrderedTask, Transfer, own_part
from .comm_thread import CommThread

# torch dtype -> name of the ncclDataType_t constant in ``cupy.cuda.nccl``.
NCCL_DTYPE_NAMES: Dict[torch.dtype, str] = {
    torch.float32: "NCCL_FLOAT32",
    torch.float16: "NCCL_FLOAT16",
    torch.bfloat16: "NCCL_BFLOAT16",
    torch.float64: "NCCL_FLOAT64",
    torch.int8: "NCCL_INT8",
    torch.uint8: "NCCL_UINT8",
    torch.int32: "NCCL_INT32",
    torch.int64: "NCCL_INT64",
}

# What the transport uses of ``cupy.cuda.nccl`` (tests check the real module has it all).
NCCL_MODULE_ATTRS = (
    "NcclCommunicator",
    "NcclError",
    "get_unique_id",
    "groupStart",
    "groupEnd",
    "NCCL_SUM",
    "NCCL_AVG",
    *NCCL_DTYPE_NAMES.values(),
)
NCCL_COMM_METHODS = (
    "send",
    "recv",
    "allReduce",
    "reduceScatter",
    "allGather",
    "check_async_error",
    "abort",
    "destroy",
)

CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1  # CUstreamCaptureMode (cuda.h)
log = logging.getLogger("hybridcomm")

UNIQUE_ID_KEY = "hybridcomm/cupy_nccl/{ranks}/{serial}"
_serials: Dict[Tuple[Tuple[int, ...], int], itertools.count] = {}
_serials_lock = threading.Lock()


def nccl_dtypes(nccl) -> Dict[torch.dtype, int]:
    """The torch dtype -> ncclDataType_t map, with the values of the ``nccl`` module given."""
    return {dt: getattr(nccl, name) for dt, name in NCCL_DTYPE_NAMES.items()}


def unique_id_bytes(uid) -> bytes:
    """A unique id as 128 bytes: CuPy 14 returns bytes, CuPy 13 a tuple of signed chars."""
    return uid if isinstance(uid, bytes) else bytes(x & 0xFF for x in uid)


def make_communicator(nccl, world_size: int, uid: bytes, rank: int):
    """``NcclCommunicator`` from stored id bytes, in the form this CuPy takes
    (14: bytes; 13: a tuple of signed chars; each rejects the other's with TypeError)."""
    try:
        return nccl.NcclCommunicator(world_size, uid, rank)
    except TypeError:
        signed = tuple(b - 256 if b > 127 else b for b in uid)
        return nccl.NcclCommunicator(world_size, signed, rank)


def open_communicator(nccl, runtime, store, ranks: Tuple[int, ...], rank: int, world_size: int):
    """The NCCL communicator over ``ranks`` (collective: rank 0 publishes the unique
    id in ``store``), the n-th this rank makes for these ranks: the same n on
    every rank, as all make them in the same order."""
    with _serials_lock:
        serial = next(_serials.setdefault((ranks, rank), itertools.count()))
    key = UNIQUE_ID_KEY.format(ranks="-".join(map(str, ranks)), serial=serial)
    if rank == 0:
        uid = unique_id_bytes(nccl.get_unique_id())
        store.set(key, uid)
    else:
        try:  # blocks, up to the store's timeout, until rank 0 has set it
            uid = bytes(store.get(key))
        except Exception as e:
            raise HybridCommError(
                f"rank {rank}: rank 0 never published the NCCL unique id under "
                f"{key!r} (is every rank creating its transports in the same order?): "
                f"{e}"
            ) from e
    try:
        # CuPy's device context binds an NCCL communicator; the one-device module
        # needs none (and no CuPy)
        ctx = getattr(nccl, "communicator_device", runtime.communicator_device)
        with ctx():
            return make_communicator(nccl, world_size, uid, rank)
    except nccl.NcclError as e:
        raise HybridCommError(
            f"rank {rank}: creating the NCCL communicator over {world_size} ranks failed: {e}"
        ) from e


class CupyNcclTransport(CommStream):
    """Transport over a CuPy NCCL communicator, on its own stream.

    Args:
        group: torch.distributed process group whose ranks take part (None:
            the default group); its rank, size and the store are used.
        runtime: the device runtime (``hybridcomm.gpu.runtime.runtime_for(device)``).
        priority: the comm stream's priority (-1, high: NCCL kernels are
            scheduled ahead of queued compute kernels).
        timeout: seconds an NCCL call may block the host while issuing (first-use
            connection set-up waits for the peer) before the watchdog aborts
            (default ``HYBRIDCOMM_TIMEOUT``); each :meth:`watch` sets it to the
            latest operation's timeout.
        store, rank, world_size: override the group's (tests).
        nccl: the NCCL module (default: the runtime's, ``cupy.cuda.nccl``); the
            one-device transport passes ``one_device.OneDeviceNccl``.

    Creating one is collective over the group: every rank creates its
    transports for a group in the same order.

    One thread (``hybridcomm-nccl-r<rank>``) makes every call on the communicator:
    NCCL calls on one communicator must not overlap from several threads, and
    CuPy makes only blocking communicators, whose ``groupEnd`` can block the host
    (a first-use connection waits for the peer, or a full work queue for room).
    Other threads hand it the calls and wait up to :attr:`issue_timeout`. The
    watchdog thread never calls the communicator; a call blocked on a peer that
    never posts stays blocked (only an abort racing it could end it), and its
    caller has had the timeout.

    Usage (on a GPU)::

        t = CupyNcclTransport(runtime=runtime_for(grad))
        t.wait_event(grads_ready)                     # comm stream after the grads
        with t.stream_context():
            t.exchange([(1, buf[:4])], [(1, scratch[:4])])
        done = t.record_event(); compute_stream.wait_event(done)
    """

    kind = "cupy"

    def __init__(
        self,
        group=None,
        *,
        runtime,
        priority: int = -1,
        store=None,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: float | None = None,
        nccl=None,
    ):
        import torch.distributed as dist

        self.nccl = nccl if nccl is not None else runtime.nccl()
        self.kind = getattr(self.nccl, "transport_kind", "cupy")
        if rank is None or world_size is None:
            if not dist.is_available() or not dist.is_initialized():
                raise HybridCommError(
                    "torch.distributed is not initialized: call "
                    "torch.distributed.init_process_group(...) first (or run under torchrun)"
                )
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        ranks = (
            tuple(dist.get_process_group_ranks(group))
            if group is not None
            else tuple(range(world_size))
        )
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        self.rank, self.world_size, self.group = rank, world_size, group
        self.device = runtime.device
        self._dtypes = nccl_dtypes(self.nccl)
        self._aborted = False
        self._failure: HybridCommError | None = None  # set by the watchdog
        # The transport's state (failed, closing, calls issuing, the owner's tasks);
        # never held across an NCCL call: only the owner thread calls the communicator.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._closing = self._destroy_on_close = False
        self.issue_timeout = env.timeout(timeout)
        self._issuing: Dict[int, Tuple[float, str, float]] = {}  # id: (deadline, what, timeout)
        self._issue_ids = itertools.count()
        self._watched: collections.deque = collections.deque()
        self._watchdog: threading.Thread | None = None
        self.runtime = runtime
        self.comm = open_communicator(
            self.nccl, runtime, store, ranks, rank=rank, world_size=world_size
        )
        self._init_stream(runtime, priority)
        self._handle = runtime.handle(self.stream)
        # from here on the only thread calling self.comm; it runs whole operations too
        # (comm_thread.submit_ordered: the channel's issuing, one hand-off per operation)
        self.comm_thread = CommThread(self)

    # -- data path ----------------------------------------------------------------

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], *, label=None) -> None:
        """Queue one step's sends and receives as one NCCL group on the comm stream.

        Stream-ordered: nothing to wait for here; completion is the comm
        stream's next event. ``label`` names the step in errors.
        """
        self._usable()
        calls = [self._call(peer, t, "send", label) for peer, t in sends]
        calls += [self._call(peer, t, "recv", label) for peer, t in recvs]
        if not calls:
            return
        nccl, comm, stream = self.nccl, self.comm, self._handle

        def group():
            nccl.groupStart()
            try:
                # by data pointer and count (a view's data_ptr() carries its offset:
                # no copy); pairs match in issue order, no tags
                for op, ptr, count, dtype, peer in calls:
                    getattr(comm, op)(ptr, count, dtype, peer, stream)
            finally:
                nccl.groupEnd()  # may wait for the peers (first use): see _issue

        self._issue(group, _step_name(label))

    def all_reduce(self, t: torch.Tensor, *, average: bool) -> None:
        """NCCL's own all-reduce (``native``) of ``t`` in place, on the comm stream:
        the same communicator and stream as every step, so it keeps the one order."""
        self._usable()
        _, ptr, count, dtype, _ = self._call(-1, t, "allReduce", "native all-reduce")
        op = self.nccl.NCCL_AVG if average else self.nccl.NCCL_SUM
        comm, stream = self.comm, self._handle
        self._issue(lambda: comm.allReduce(ptr, ptr, count, dtype, op, stream), "native all-reduce")

    def reduce_scatter(self, t: torch.Tensor, *, average: bool) -> None:
        """NCCL's own reduce-scatter (``native``, sharded optimizer state) in place on
        the comm stream: this rank's equal part of ``t`` ends summed (or averaged)."""
        self._usable()
        _, ptr, _, dtype, _ = self._call(-1, t, "reduceScatter", "native reduce-scatter")
        part = own_part(t, self.rank, self.world_size).numel()
        mine = ptr + self.rank * part * t.element_size()  # (in place, as NCCL defines it)
        op = self.nccl.NCCL_AVG if average else self.nccl.NCCL_SUM
        comm, stream = self.comm, self._handle
        self._issue(
            lambda: comm.reduceScatter(ptr, mine, part, dtype, op, stream), "native reduce-scatter"
        )

    def all_gather(self, t: torch.Tensor) -> None:
        """NCCL's own all-gather in place on the comm stream: every rank's part of
        ``t`` to every rank."""
        self._usable()
        _, ptr, _, dtype, _ = self._call(-1, t, "allGather", "native all-gather")
        part = own_part(t, self.rank, self.world_size).numel()
        mine = ptr + self.rank * part * t.element_size()
        comm, stream = self.comm, self._handle
        self._issue(lambda: comm.allGather(mine, ptr, part, dtype, stream), "native all-gather")

    def _issue(self, calls, what: str) -> None:
        """Have the communicator's thread run ``calls`` (NCCL calls that may block the
        host on a peer) and wait for them, up to the issue deadline.

        The deadline is registered before the first call: a peer that never posts
        its side of a first-use connection is a HybridCommTimeout within
        :attr:`issue_timeout`, not a hang. This thread never touches the
        communicator: past the deadline the watchdog flags the failure, this wait
        raises it, and the communicator's thread aborts once the blocked call
        returns (an abort from another thread would race that call).
        """
        if threading.current_thread() is self.comm_thread.thread:
            self._issue_here(calls, what)  # a whole operation run in order (submit_ordered)
            return
        with self._cv:
            key = self._deadline(what)
            try:
                task = self._wait(self.comm_thread.submit(calls))
            finally:
                del self._issuing[key]
        if isinstance(task.error, self.nccl.NcclError):
            self._fail(
                HybridCommError(
                    f"rank {self.rank}: {what}: NCCL failed while issuing it: {task.error}; the "
                    "communicator was aborted"
                )
            )
            raise (self._failure or self._aborted_error()) from task.error
        if task.error is not None:
            raise task.error
        self._usable()  # failed while issuing: what was queued may be garbage

    def _deadline(self, what: str) -> int:  # caller holds the lock
        """Register an issue's deadline before its first call (the watchdog flags it
        late); returns its key in ``_issuing``."""
        self._usable()
        key = next(self._issue_ids)
        self._issuing[key] = (time.monotonic() + self.issue_timeout, what, self.issue_timeout)
        self._start_watchdog()
        return key

    def _issue_here(self, calls, what: str) -> None:
        """:meth:`_issue` on the communicator's own thread (inside an operation it runs
        for :meth:`submit_ordered`): the calls run here, under the same deadline."""
        with self._cv:
            key = self._deadline(what)
        try:
            calls()
        except self.nccl.NcclError as e:
            self._fail(
                HybridCommError(
                    f"rank {self.rank}: {what}: NCCL failed while issuing it: {e}; the "
                    "communicator was aborted"
                )
            )
            raise (self._failure or self._aborted_error()) from e
        finally:
            with self._cv:
                del self._issuing[key]
        self._usable()  # failed while issuing: what was queued may be garbage

    def _wait(self, task: OrderedTask) -> OrderedTask:  # caller holds the lock
        """Until the communicator's thread has run ``task`` or the transport failed."""
        while not task.issued and not self._aborted:
            self._cv.wait(self.WATCHDOG_PERIOD_S)
        return task

    def _call(self, peer: int, t: torch.Tensor, op: str, label):
        if op in ("send", "recv") and (not 0 <= peer < self.world_size or peer == self.rank):
            raise HybridCommError(
                f"rank {self.rank}: {_step_name(label)}: invalid peer {peer} "
                f"(world size {self.world_size})"
            )
        dtype = self._dtypes.get(t.dtype)
        if dtype is None:
            raise HybridCommError(
                f"rank {self.rank}: {_step_name(label)}: dtype {t.dtype} has no NCCL type"
            )
        if t.device != self.device:
            raise HybridCommError(
                f"rank {self.rank}: {_step_name(label)}: tensor on {t.device}, "
                f"transport on {self.device}"
            )
        if not t.is_contiguous():
            raise HybridCommError(
                f"rank {self.rank}: {_step_name(label)}: tensor is not contiguous"
            )
        return op, t.data_ptr(), t.numel(), dtype, peer

    # -- failure ------------------------------------------------------------------

    @property
    def failure(self) -> HybridCommError | None:
        """The error that aborted the communicator, if any (no device access)."""
        return self._failure

    def _usable(self) -> None:
        if self._aborted:
            raise self._failure or self._aborted_error()

    def _aborted_error(self) -> HybridCommError:
        return HybridCommError(
            f"rank {self.rank}: the NCCL communicator was aborted after an "
            "earlier error; create a new transport"
        )

    def check_async_error(self) -> None:
        """Raise HybridCommError (after aborting) if NCCL reported an asynchronous error.
        The query runs on the communicator's thread (it polls by itself when idle)."""
        with self._cv:
            self._usable()
            task = self._wait(self.comm_thread.submit(self.comm.check_async_error))
        if isinstance(task.error, self.nccl.NcclError):
            self._fail(
                HybridCommError(
                    f"rank {self.rank}: NCCL reported an error: "
                    f"{task.error}; the communicator was aborted"
                )
            )
        self._usable()

    def watch(self, event, timeout: float, label: str = "") -> None:
        """Abort the communicator if ``event`` is not done within ``timeout`` seconds.

        The stream-ordered path never waits on the host, so without this a dead
        peer would hang the GPU instead of raising: the next call on any thread
        raises the HybridCommTimeout. Events are watched in issue order (all
        are on the comm stream, so they complete in that order too).
        """
        self._watched.append((time.monotonic() + timeout, event, label, timeout))
        self.issue_timeout = timeout  # the latest operation's: what the next issues get
        with self._lock:
            self._start_watchdog()

    def _start_watchdog(self) -> None:  # caller holds the lock
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch_loop, daemon=True, name=f"hybridcomm-nccl-watchdog-r{self.rank}"
            )
            self._watchdog.start()

    WATCHDOG_PERIOD_S = 0.05
    CLOSE_WAIT_S = 10.0  # close()/abort() wait this long for a call blocked on a peer

    def _watch_loop(self) -> None:
        try:
            self.runtime.bind_thread()  # else its event queries make a context on GPU 0
            self._watch()
        except BaseException as e:  # noqa: BLE001 - a sticky CUDA error: fail, never die silently
            self._fail(
                HybridCommError(
                    f"rank {self.rank}: the NCCL watchdog failed ({type(e).__name__}: {e}): NCCL "
                    "work could no longer be watched for hangs, so the communicator was aborted; "
                    "create a new transport"
                )
            )

    def _watch(self) -> None:
        """Flag late issues and late watched events; never calls the communicator."""
        self._exempt_from_capture("NCCL watchdog")
        while not self._aborted:
            with self._lock:
                issuing = list(self._issuing.values())
            late = [
                (what, timeout)
                for deadline, what, timeout in issuing
                if time.monotonic() >= deadline
            ]
            if late:
                what, timeout = late[0]
                self._fail(
                    HybridCommTimeout(
                        f"rank {self.rank}: {what} did not complete within {timeout}s: issuing it "
                        "blocked in NCCL (the first use of a connection waits for the peer to post "
                        "its side; a full work queue waits for the GPU); the NCCL communicator was "
                        "aborted (a peer dead, hung, or issuing its operations in another order?). "
                        "NCCL_DEBUG=INFO shows more."
                    )
                )
                return
            while self._watched:
                deadline, event, label, timeout = self._watched[0]
                if event.query():
                    self._watched.popleft()
                    continue
                if time.monotonic() >= deadline:
                    self._fail(
                        HybridCommTimeout(
                            f"rank {self.rank}: {label or 'NCCL work'} did not complete within "
                            f"{timeout}s; the NCCL communicator was aborted (a peer dead, hung, or "
                            "issuing its operations in another order?). NCCL_DEBUG=INFO shows more."
                        )
                    )
                    return
                break
            time.sleep(self.WATCHDOG_PERIOD_S)

    def _exempt_from_capture(self, who: str) -> None:
        """This thread's CUDA calls (event queries; NCCL's async-error query) must not
        invalidate a graph another thread captures in global mode."""
        if not getattr(self.runtime, "simulated", False) and not exempt_from_global_capture():
            log.warning(
                "rank %d: the %s could not set its CUDA stream-capture mode to "
                "thread-local: its queries invalidate a graph captured in global mode "
                "on another thread",
                self.rank,
                who,
            )

    def _fail(self, error: HybridCommError | None) -> None:
        """Flag the transport failed: no call starts after this, waits raise ``error``,
        and the communicator's thread aborts as soon as no call of its is in progress
        (never from here: an abort racing a call on the communicator is a use after free)."""
        with self._cv:
            if not self._aborted:
                self._aborted, self._failure = True, error
                self._cv.notify_all()

    def abort(self) -> None:
        """Abort the communicator: its GPU work is released and it cannot be used again
        (by its own thread; this waits for that, up to :attr:`CLOSE_WAIT_S`)."""
        self._fail(None)
        self._wait_released("abort")

    def close(self) -> None:
        """Free the communicator (collective in NCCL: call it on every rank). With a
        call still issuing (blocked on a peer), abort instead: destroying would wait
        for it. Either is done by the communicator's own thread, after its call
        returns; this waits up to :attr:`CLOSE_WAIT_S` for it."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            if not self._aborted:
                self._aborted, self._destroy_on_close = True, not self._issuing
                self._failure = HybridCommError(f"rank {self.rank}: the NCCL transport was closed")
                self._cv.notify_all()
        self._wait_released("close")

    def _wait_released(self, what: str) -> None:
        deadline = time.monotonic() + self.CLOSE_WAIT_S
        with self._cv:
            while not self.comm_thread.released:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "rank %d: %s: an NCCL call is still blocked on a peer after "
                        "%gs; its thread aborts the communicator when it returns",
                        self.rank,
                        what,
                        self.CLOSE_WAIT_S,
                    )
                    return
                self._cv.wait(min(left, 1.0))


def exempt_from_global_capture() -> bool:
    """Set the calling thread's CUDA stream-capture mode to thread-local, so its event
    queries never invalidate a graph another thread captures in global mode (torch's
    default; PyTorch's NCCL watchdog does the same). CuPy has no wrapper for
    ``cudaThreadExchangeStreamCaptureMode``: this calls the driver's
    ``cuThreadExchangeStreamCaptureMode``, which keeps the mode per thread. False
    where the driver or the call is missing."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
    except (OSError, AttributeError):
        return False
    mode = ctypes.c_int(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    return fn(ctypes.byref(mode)) == 0


def _step_name(label) -> str:
    """A step's name from its label: a str, (algorithm, step index), or None."""
    if isinstance(label, str):
        return label
    if isinstance(label, tuple):
        return f"{label[0]} step {label[1]}"
    return "exchange"
