"""Point-to-point over NCCL through CuPy, on a dedicated CUDA stream.

One NCCL communicator per process group: rank 0 of the group makes the unique
id and shares it through the torch.distributed store. One schedule step's
sends and receives are issued together between ``groupStart``/``groupEnd``
(NCCL matches them between a pair of ranks in issue order, no tags), by data
pointer and element count: a view's ``data_ptr()`` already carries its
offset, so nothing is copied.

Ordering is by CUDA events, never by host synchronization:

* the comm stream waits for the caller's stream before a step's NCCL calls
  (whatever the caller queued there, e.g. the gradients, is ready), or for an
  explicit gradient-ready event given to :meth:`CupyNcclTransport.wait_event`;
* each step records a done event on the comm stream; a consumer makes its
  stream wait for it (:meth:`CupyNcclPending.wait_stream`), and only
  :meth:`CupyNcclPending.wait` blocks the host, polling the event and NCCL's
  async error with a deadline, and aborting the communicator on timeout so
  the caller gets :class:`HybridCommTimeout` instead of a hang.

The CUDA-only layer is injected (``nccl``: the ``cupy.cuda.nccl`` module,
``streams``: :class:`TorchCudaStreams`), so tests drive this exact code over a
recording fake on CPU (tests/fakes/fake_nccl.py).
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Dict, List, Sequence, Tuple

import torch

from ..errors import HybridCommError, HybridCommTimeout
from .base import Transfer

# torch dtype -> name of the ncclDataType_t constant in ``cupy.cuda.nccl``.
# The one place this map lives; the values come from the injected module.
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
                     *NCCL_DTYPE_NAMES.values())
NCCL_COMM_METHODS = ("send", "recv", "check_async_error", "abort", "destroy")

UNIQUE_ID_KEY = "hybridcomm/cupy_nccl/{ranks}/{serial}"
_serials: Dict[Tuple[Tuple[int, ...], int], itertools.count] = {}
_serials_lock = threading.Lock()


def import_nccl():
    """``cupy.cuda.nccl`` if CuPy imports and finds libnccl, else HybridCommError saying why."""
    try:
        from cupy.cuda import nccl
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        raise HybridCommError(
            f"the 'cupy' transport needs CuPy with NCCL: `import cupy.cuda.nccl` failed ({e}); "
            "install the extra matching your torch's CUDA: pip install 'hybridcomm[cuda12]' "
            "or 'hybridcomm[cuda13]'") from e
    if not getattr(nccl, "available", False):
        raise HybridCommError(
            "the 'cupy' transport needs NCCL: CuPy imports but did not find libnccl; "
            "pip install nvidia-nccl-cu12 (or -cu13, matching cupy-cuda12x/13x)")
    return nccl


def nccl_dtypes(nccl) -> Dict[torch.dtype, int]:
    """The torch dtype -> ncclDataType_t map, with the values of the ``nccl`` module given."""
    return {dt: getattr(nccl, name) for dt, name in NCCL_DTYPE_NAMES.items()}


class TorchCudaStreams:
    """The stream/event layer the transport needs, over ``torch.cuda``.

    Streams and events are torch's (``torch.cuda.Stream``/``Event``), so the
    executor and the kernels use them as they are; NCCL gets the raw
    ``cudaStream_t`` (``stream.cuda_stream``).
    """

    def __init__(self, device=None):
        if not torch.cuda.is_available():
            raise HybridCommError("the 'cupy' transport needs a CUDA device; none is available")
        index = None if device is None else torch.device(device).index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def new_stream(self, priority: int = 0):
        return torch.cuda.Stream(device=self.device, priority=priority)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def new_event(self):
        return torch.cuda.Event()  # timing off: cheapest to record and query

    @staticmethod
    def handle(stream) -> int:
        return stream.cuda_stream

    @staticmethod
    def use(stream):
        """Make ``stream`` current in a ``with`` block (kernels launch on it)."""
        return torch.cuda.stream(stream)

    @staticmethod
    def record_stream(tensor: torch.Tensor, stream) -> None:
        # The caching allocator must not hand this memory out again until the
        # comm stream is done with it.
        tensor.record_stream(stream)

    def device_context(self):
        """CuPy's current device for communicator creation (NCCL binds a comm to it)."""
        import cupy

        return cupy.cuda.Device(self.device.index)


class CupyNcclPending:
    """One step in flight on the comm stream: its done event and what it was."""

    __slots__ = ("transport", "event", "_label", "_calls")

    def __init__(self, transport: "CupyNcclTransport", event, label, calls):
        # Described only on error: no string formatting in the hot path.
        self.transport, self.event, self._label, self._calls = transport, event, label, calls

    @property
    def label(self) -> str:
        return _step_name(self._label)

    @property
    def peers(self) -> str:
        return _describe(self.transport, self._calls)

    def done(self) -> bool:
        """True once the step's transfers have completed (never blocks)."""
        return self.event.query()

    def wait_stream(self, stream=None) -> None:
        """Make ``stream`` (default: the current one) wait for this step; the host goes on."""
        t = self.transport
        (t.streams.current_stream() if stream is None else stream).wait_event(self.event)

    def wait(self, timeout: float | None = None) -> None:
        """Block the host until the step is done (the Transport contract).

        Polls the done event and NCCL's async error. On an NCCL error, or
        when ``timeout`` seconds pass first, the communicator is aborted (so
        the GPU work stuck on it is released) and HybridCommError /
        HybridCommTimeout names the rank, step and peers.
        """
        t = self.transport
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.0
        while not self.event.query():
            t.check_async_error(self)
            if deadline is not None and time.monotonic() >= deadline:
                t.abort()
                raise HybridCommTimeout(
                    f"rank {t.rank}: {self.label} ({self.peers}) did not complete within "
                    f"{timeout}s; the NCCL communicator was aborted (a peer dead, hung, or "
                    "issuing its steps in another order?). Run with NCCL_DEBUG=INFO for details.")
            # Spin briefly (a step is often tens of microseconds), then back off to 1 ms.
            if pause:
                time.sleep(pause)
            pause = min(1e-3, pause * 2 or 1e-5)
        t.check_async_error(self)


class CupyNcclTransport:
    """Transport over a CuPy NCCL communicator, on its own CUDA stream.

    Args:
        group: torch.distributed process group whose ranks take part (None:
            the default group); only its rank, size and store are used.
        device: the CUDA device this rank's tensors live on (default: current).
        priority: the comm stream's priority (-1, high, by default, so NCCL
            kernels are scheduled ahead of queued compute kernels).
        nccl, streams, store, rank, world_size: injected for tests (a fake
            NCCL module and stream layer); by default ``cupy.cuda.nccl``,
            :class:`TorchCudaStreams`, the torch.distributed default store and
            the group's rank and size.

    Creating one is collective over the group: every rank must create its
    transports for a group in the same order.

    Example::

        >>> t = CupyNcclTransport()                    # after init_process_group
        >>> t.wait_event(grad_ready)                  # comm stream waits for the grads
        >>> p = t.exchange([(1, buf[:4])], [(1, scratch[:4])])
        >>> p.wait_stream()                            # consumer stream waits, host does not
    """

    # The executor runs whole schedules on ``stream`` (stream_context) with no
    # host wait per step when this is True; False keeps its host-wait path.
    stream_ordered = True

    kind = "cupy"

    def __init__(self, group=None, *, device=None, priority: int = -1, nccl=None, streams=None,
                 store=None, rank: int | None = None, world_size: int | None = None):
        self.nccl = import_nccl() if nccl is None else nccl
        self.streams = TorchCudaStreams(device) if streams is None else streams
        if rank is None or world_size is None:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise HybridCommError(
                    "torch.distributed is not initialized: call "
                    "torch.distributed.init_process_group(...) first (or run under torchrun)")
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
                tuple(range(world_size))
            if store is None:
                store = dist.distributed_c10d._get_default_store()
        else:
            ranks = tuple(range(world_size))
        if store is None:
            raise HybridCommError("CupyNcclTransport needs a store to share the NCCL unique id")
        self.rank, self.world_size = rank, world_size
        self.group = group
        self.device = self.streams.device
        self._dtypes = nccl_dtypes(self.nccl)
        self._aborted = False
        self._failure: HybridCommError | None = None  # set by the watchdog
        self._steps = 0
        self._watched: collections.deque = collections.deque()
        self._watchdog: threading.Thread | None = None
        self._abort_lock = threading.Lock()
        self.comm = self._make_comm(store, ranks)
        self.stream = self.streams.new_stream(priority)
        self._handle = self.streams.handle(self.stream)

    def _make_comm(self, store, ranks):
        # The n-th communicator this rank makes for these ranks: the same n on
        # every rank, as all make them in the same order. (Counted per rank too,
        # only so tests can run several simulated ranks in one process.)
        with _serials_lock:
            serial = next(_serials.setdefault((ranks, self.rank), itertools.count()))
        key = UNIQUE_ID_KEY.format(ranks="-".join(map(str, ranks)), serial=serial)
        if self.rank == 0:
            uid = bytes(self.nccl.get_unique_id())
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
            with self.streams.device_context():
                return self.nccl.NcclCommunicator(self.world_size, uid, self.rank)
        except self.nccl.NcclError as e:
            raise HybridCommError(f"rank {self.rank}: creating the NCCL communicator over "
                                  f"{self.world_size} ranks failed: {e}") from e

    # -- ordering -----------------------------------------------------------------

    def stream_context(self):
        """``with t.stream_context():`` makes the comm stream current, so kernels
        launched inside (the executor's reductions) are ordered after the NCCL
        calls without any host synchronization."""
        return self.streams.use(self.stream)

    def wait_event(self, event) -> None:
        """The comm stream waits for ``event`` (e.g. gradients ready on the compute stream)."""
        self.stream.wait_event(event)

    def record_event(self):
        """An event recorded on the comm stream now: everything issued so far is done when it is."""
        ev = self.streams.new_event()
        ev.record(self.stream)
        return ev

    # -- data path ----------------------------------------------------------------

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], *,
                 label=None) -> CupyNcclPending:
        """Issue one step's sends and receives as one NCCL group on the comm stream.

        Called from another stream, the comm stream first waits for it; called
        with the comm stream current (the executor's GPU path), nothing extra
        is queued. ``label`` names the step in errors (default: a counter).
        """
        if self._aborted:
            if self._failure is not None:
                raise self._failure
            raise HybridCommError(f"rank {self.rank}: the NCCL communicator was aborted after an "
                                  "earlier error; create a new transport")
        self._steps += 1
        label = label or self._steps  # formatted only if an error names it
        # Validate everything before the first call: a half-issued group would
        # leave the peers' matching out of step.
        calls = [self._call(peer, t, "send", label) for peer, t in sends]
        calls += [self._call(peer, t, "recv", label) for peer, t in recvs]
        stream = self.stream
        caller = self.streams.current_stream()
        foreign = caller != stream
        if foreign:
            ready = self.streams.new_event()
            ready.record(caller)
            stream.wait_event(ready)
        nccl, comm, handle = self.nccl, self.comm, self._handle
        try:
            nccl.groupStart()
            try:
                for op, ptr, count, dtype, peer in calls:
                    (comm.send if op == "send" else comm.recv)(ptr, count, dtype, peer, handle)
            finally:
                nccl.groupEnd()
        except nccl.NcclError as e:
            self.abort()
            pending = CupyNcclPending(self, None, label, calls)
            raise HybridCommError(f"rank {self.rank}: {pending.label}: NCCL rejected the step "
                                  f"({pending.peers}): {e}") from e
        if foreign:
            for _, t in itertools.chain(sends, recvs):
                self.streams.record_stream(t, stream)
        done = self.streams.new_event()
        done.record(stream)
        return CupyNcclPending(self, done, label, calls)

    def _call(self, peer: int, t: torch.Tensor, op: str, label):
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise HybridCommError(f"rank {self.rank}: {_step_name(label)}: invalid peer {peer} "
                                  f"(world size {self.world_size})")
        dtype = self._dtypes.get(t.dtype)
        if dtype is None:
            raise HybridCommError(f"rank {self.rank}: {_step_name(label)}: dtype {t.dtype} has no NCCL type")
        if t.device != self.device:
            raise HybridCommError(f"rank {self.rank}: {_step_name(label)}: tensor on {t.device}, "
                                  f"transport on {self.device}")
        if not t.is_contiguous():
            raise HybridCommError(f"rank {self.rank}: {_step_name(label)}: tensor is not contiguous")
        return op, t.data_ptr(), t.numel(), dtype, peer

    # -- failure ------------------------------------------------------------------

    def check_async_error(self, pending: CupyNcclPending | None = None) -> None:
        """Raise HybridCommError (after aborting) if NCCL reported an asynchronous error."""
        if self._aborted:
            if self._failure is not None:
                raise self._failure
            raise HybridCommError(f"rank {self.rank}:{_what(pending)} the NCCL communicator was "
                                  "aborted after an earlier error")
        try:
            self.comm.check_async_error()
        except self.nccl.NcclError as e:
            self.abort()
            raise HybridCommError(f"rank {self.rank}:{_what(pending)} failed with an NCCL error: "
                                  f"{e}; the communicator was aborted") from e

    def watch(self, pending_or_event, timeout: float, label: str = "") -> None:
        """Have a background thread abort the communicator if this work is not done
        within ``timeout`` seconds: the stream-ordered path never waits on the host,
        so without this a dead peer would hang the GPU, not raise. The next
        :meth:`exchange` (on any thread) then raises the HybridCommTimeout.

        Events are watched in issue order (they are all on the comm stream, so
        they complete in that order too).
        """
        event = getattr(pending_or_event, "event", pending_or_event)
        if isinstance(pending_or_event, CupyNcclPending) and not label:
            label = pending_or_event.label
        self._watched.append((time.monotonic() + timeout, event, label, timeout))
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch_loop, daemon=True,
                                              name=f"hybridcomm-nccl-watchdog-r{self.rank}")
            self._watchdog.start()

    WATCHDOG_PERIOD_S = 0.05

    def _watch_loop(self) -> None:
        while not self._aborted:
            while self._watched:
                deadline, event, label, timeout = self._watched[0]
                if event.query():
                    self._watched.popleft()
                    continue
                if time.monotonic() >= deadline:
                    self._fail(HybridCommTimeout(
                        f"rank {self.rank}: {label or 'a step'} did not complete within "
                        f"{timeout}s (watchdog); the NCCL communicator was aborted (a peer "
                        "dead, hung, or issuing its steps in another order?)"))
                    return
                break
            try:
                self.comm.check_async_error()
            except self.nccl.NcclError as e:
                self._fail(HybridCommError(f"rank {self.rank}: NCCL reported an error "
                                           f"(watchdog): {e}; the communicator was aborted"))
                return
            time.sleep(self.WATCHDOG_PERIOD_S)

    def _fail(self, error: HybridCommError) -> None:
        self._failure = error
        self.abort()

    def abort(self) -> None:
        """Abort the communicator: its GPU work is released and it cannot be used again."""
        with self._abort_lock:
            if not self._aborted:
                self._aborted = True
                self.comm.abort()

    def close(self) -> None:
        """Free the communicator (collective in NCCL: call it on every rank)."""
        with self._abort_lock:
            if not self._aborted:
                self._aborted = True
                self.comm.destroy()


def _what(pending) -> str:
    return "" if pending is None else f" {pending.label} ({pending.peers})"


def _step_name(label) -> str:
    """A step's name from its label: a str, (algorithm, step index), or a counter."""
    if isinstance(label, str):
        return label
    if isinstance(label, tuple):
        return f"{label[0]} step {label[1]}"
    return f"exchange #{label}"


def _describe(transport: CupyNcclTransport, calls) -> str:
    names = {v: str(k).replace("torch.", "") for k, v in transport._dtypes.items()}
    parts: List[str] = [
        f"send {count} x {names.get(dtype, dtype)} to rank {peer}" if op == "send" else
        f"receive {count} x {names.get(dtype, dtype)} from rank {peer}"
        for op, _, count, dtype, peer in calls]
    return "; ".join(parts) or "no transfers"
