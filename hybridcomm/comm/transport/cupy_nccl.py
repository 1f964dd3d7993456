"""Point-to-point and all-reduce over NCCL through CuPy, on one dedicated stream.

One communicator per (process group, device): rank 0 of the group makes the
unique id and shares it through the torch.distributed store. Everything a
transport issues goes on its one comm stream, in the order issued, so all of
a rank's NCCL work (our schedules and ``native`` all-reduce alike) is one
ordered channel: no second communicator can race the first.

* A schedule step's sends and receives are one ``groupStart``/``groupEnd``
  group, by data pointer and element count (a view's ``data_ptr()`` carries
  its offset: nothing is copied). Pairs match in issue order, with no tags.
* Ordering is by events, never by host waits: the caller makes the comm
  stream wait for its data (:meth:`wait_event`), queues the steps and the
  reduction kernels under :meth:`stream_context`, and records one done event
  (:meth:`record_event`) that consumers' streams wait on.
* A watchdog thread (bound to the rank's device) aborts the communicator
  when watched work misses its deadline or NCCL reports an async error; the
  next call on any thread then raises :class:`HybridCommTimeout` /
  :class:`HybridCommError` naming the rank and the work.
* Issuing can block the host: ``ncclGroupEnd`` (and a collective, a group of
  one) sets up a connection on its first use and waits there for the peer to
  post its side, or waits for room in a full work queue. So no lock is held
  across an NCCL call that can wait on a peer, and each such call runs under
  an issue deadline (:attr:`issue_timeout`) the watchdog enforces: past it, the
  watchdog aborts the communicator, which makes the blocked call return with
  an error (NCCL's set-up polls the abort flag), and the issuing thread raises
  the :class:`HybridCommTimeout`.

The CUDA layer comes from a runtime (``hybridcomm.gpu.runtime``): ``CudaRuntime``
in production, the simulator's ``SimRuntime`` in tests, which runs this exact
code over a simulated ``cupy.cuda.nccl``.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Dict, Sequence, Tuple

import torch

from ...config import env
from ...base.errors import HybridCommError, HybridCommTimeout
from .base import CommStream, Transfer

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
NCCL_MODULE_ATTRS = ("NcclCommunicator", "NcclError", "get_unique_id", "groupStart", "groupEnd",
                     "NCCL_SUM", "NCCL_AVG", *NCCL_DTYPE_NAMES.values())
NCCL_COMM_METHODS = ("send", "recv", "allReduce", "check_async_error", "abort", "destroy")

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

    Creating one is collective over the group: every rank creates its
    transports for a group in the same order.

    Usage (on a GPU)::

        t = CupyNcclTransport(runtime=runtime_for(grad))
        t.wait_event(grads_ready)                     # comm stream after the grads
        with t.stream_context():
            t.exchange([(1, buf[:4])], [(1, scratch[:4])])
        done = t.record_event(); compute_stream.wait_event(done)
    """

    kind = "cupy"

    def __init__(self, group=None, *, runtime, priority: int = -1, store=None,
                 rank: int | None = None, world_size: int | None = None,
                 timeout: float | None = None):
        import torch.distributed as dist

        self.nccl = runtime.nccl()
        if rank is None or world_size is None:
            if not dist.is_available() or not dist.is_initialized():
                raise HybridCommError(
                    "torch.distributed is not initialized: call "
                    "torch.distributed.init_process_group(...) first (or run under torchrun)")
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
            tuple(range(world_size))
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        self.rank, self.world_size, self.group = rank, world_size, group
        self.device = runtime.device
        self._dtypes = nccl_dtypes(self.nccl)
        self._aborted = False
        self._failure: HybridCommError | None = None  # set by the watchdog
        # The communicator's life: no call starts after an abort or destroy, and
        # abort, destroy and the async-error query never race each other. Never
        # held across an NCCL call that can block on a peer (see _issue).
        self._lock = threading.Lock()
        self.issue_timeout = env.timeout(timeout)
        self._issuing: Dict[int, Tuple[float, str, float]] = {}  # id: (deadline, what, timeout)
        self._issue_ids = itertools.count()
        self._watched: collections.deque = collections.deque()
        self._watchdog: threading.Thread | None = None
        self.runtime = runtime
        self.comm = self._make_comm(store, ranks)
        self._init_stream(runtime, priority)
        self._handle = runtime.handle(self.stream)

    def _make_comm(self, store, ranks):
        # The n-th communicator this rank makes for these ranks: the same n on
        # every rank, as all make them in the same order.
        with _serials_lock:
            serial = next(_serials.setdefault((ranks, self.rank), itertools.count()))
        key = UNIQUE_ID_KEY.format(ranks="-".join(map(str, ranks)), serial=serial)
        if self.rank == 0:
            uid = unique_id_bytes(self.nccl.get_unique_id())
            store.set(key, uid)
        else:
            try:  # blocks, up to the store's timeout, until rank 0 has set it
                uid = bytes(store.get(key))
            except Exception as e:
                raise HybridCommError(
                    f"rank {self.rank}: rank 0 never published the NCCL unique id under "
                    f"{key!r} (is every rank creating its transports in the same order?): "
                    f"{e}") from e
        try:
            with self.runtime.communicator_device():
                return make_communicator(self.nccl, self.world_size, uid, self.rank)
        except self.nccl.NcclError as e:
            raise HybridCommError(f"rank {self.rank}: creating the NCCL communicator over "
                                  f"{self.world_size} ranks failed: {e}") from e

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
        self._issue(lambda: comm.allReduce(ptr, ptr, count, dtype, op, stream),
                    "native all-reduce")

    def _issue(self, calls, what: str) -> None:
        """Run ``calls`` (NCCL calls that may block the host on a peer) under an issue
        deadline, outside the lock, so the watchdog can abort while they block.

        The deadline is registered before the first call: a peer that never posts
        its side of a first-use connection is a HybridCommTimeout within
        :attr:`issue_timeout`, not a hang. The lock covers only the check that the
        communicator is usable and the registration, so no call starts after an
        abort; an abort during the calls is what unblocks them (``ncclCommAbort``
        sets the abort flag NCCL's set-up polls: the blocked call returns an
        error), and the abort's error is raised here.
        """
        with self._lock:
            self._usable()
            key = next(self._issue_ids)
            self._issuing[key] = (time.monotonic() + self.issue_timeout, what,
                                  self.issue_timeout)
            self._start_watchdog()
        try:
            calls()
        except self.nccl.NcclError as e:
            with self._lock:
                if not self._aborted:
                    self._abort_locked(HybridCommError(
                        f"rank {self.rank}: {what}: NCCL failed while issuing it: {e}; the "
                        "communicator was aborted"))
                err = self._failure or self._aborted_error()
            raise err from e
        finally:
            with self._lock:
                del self._issuing[key]
        self._usable()  # aborted while issuing: what was queued may be garbage

    def _call(self, peer: int, t: torch.Tensor, op: str, label):
        if op != "allReduce" and (not 0 <= peer < self.world_size or peer == self.rank):
            raise HybridCommError(f"rank {self.rank}: {_step_name(label)}: invalid peer {peer} "
                                  f"(world size {self.world_size})")
        dtype = self._dtypes.get(t.dtype)
        if dtype is None:
            raise HybridCommError(f"rank {self.rank}: {_step_name(label)}: dtype {t.dtype} has "
                                  "no NCCL type")
        if t.device != self.device:
            raise HybridCommError(f"rank {self.rank}: {_step_name(label)}: tensor on {t.device}, "
                                  f"transport on {self.device}")
        if not t.is_contiguous():
            raise HybridCommError(f"rank {self.rank}: {_step_name(label)}: tensor is not "
                                  "contiguous")
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
        return HybridCommError(f"rank {self.rank}: the NCCL communicator was aborted after an "
                               "earlier error; create a new transport")

    def check_async_error(self) -> None:
        """Raise HybridCommError (after aborting) if NCCL reported an asynchronous error."""
        with self._lock:
            self._usable()
            try:
                self.comm.check_async_error()
            except self.nccl.NcclError as e:
                err = HybridCommError(f"rank {self.rank}: NCCL reported an error: {e}; the "
                                      "communicator was aborted")
                self._abort_locked(err)
                raise err from e

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
            self._watchdog = threading.Thread(target=self._watch_loop, daemon=True,
                                              name=f"hybridcomm-nccl-watchdog-r{self.rank}")
            self._watchdog.start()

    WATCHDOG_PERIOD_S = 0.05

    def _watch_loop(self) -> None:
        self.runtime.bind_thread()  # else its event queries make a context on GPU 0
        while not self._aborted:
            with self._lock:
                issuing = list(self._issuing.values())
            late = [(what, timeout) for deadline, what, timeout in issuing
                    if time.monotonic() >= deadline]
            if late:
                what, timeout = late[0]
                self._fail(HybridCommTimeout(
                    f"rank {self.rank}: {what} did not complete within {timeout}s: issuing it "
                    "blocked in NCCL (the first use of a connection waits for the peer to post "
                    "its side; a full work queue waits for the GPU); the NCCL communicator was "
                    "aborted (a peer dead, hung, or issuing its operations in another order?). "
                    "NCCL_DEBUG=INFO shows more."))
                return
            while self._watched:
                deadline, event, label, timeout = self._watched[0]
                if event.query():
                    self._watched.popleft()
                    continue
                if time.monotonic() >= deadline:
                    self._fail(HybridCommTimeout(
                        f"rank {self.rank}: {label or 'NCCL work'} did not complete within "
                        f"{timeout}s; the NCCL communicator was aborted (a peer dead, hung, or "
                        "issuing its operations in another order?). NCCL_DEBUG=INFO shows more."))
                    return
                break
            with self._lock:  # never races an abort or destroy on another thread
                if self._aborted:
                    return
                try:
                    self.comm.check_async_error()
                except self.nccl.NcclError as e:
                    self._abort_locked(HybridCommError(
                        f"rank {self.rank}: NCCL reported an error (watchdog): {e}; the "
                        "communicator was aborted"))
                    return
            time.sleep(self.WATCHDOG_PERIOD_S)

    def _fail(self, error: HybridCommError) -> None:
        with self._lock:
            self._abort_locked(error)

    def _abort_locked(self, error: HybridCommError | None) -> None:
        if not self._aborted:
            self._aborted = True
            self._failure = error
            self.comm.abort()

    def abort(self) -> None:
        """Abort the communicator: its GPU work is released and it cannot be used again."""
        with self._lock:
            self._abort_locked(None)

    def close(self) -> None:
        """Free the communicator (collective in NCCL: call it on every rank). With a
        call still issuing on another thread (blocked on a peer), abort instead:
        destroying would wait for it, or free the communicator under it."""
        with self._lock:
            if not self._aborted:
                self._aborted = True
                if self._issuing:
                    self.comm.abort()
                else:
                    self.comm.destroy()


def _step_name(label) -> str:
    """A step's name from its label: a str, (algorithm, step index), or None."""
    if isinstance(label, str):
        return label
    if isinstance(label, tuple):
        return f"{label[0]} step {label[1]}"
    return "exchange"
