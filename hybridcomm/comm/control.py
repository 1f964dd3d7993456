"""The control plane: small host-side agreements between ranks, with a deadline.

Agreeing on a plan, checking that every rank has the same parameters or the
same call, broadcasting rank 0's calibration: all of it is small, runs on the
host over gloo (never on the GPU, so it never synchronizes the device), and
every call honours the caller's ``timeout``: a dead peer is a
:class:`HybridCommError`, a stalled one a :class:`HybridCommTimeout`, each
naming what was being agreed, never a raw backend error or a hang.

Example::

    >>> broadcast_object({"buckets": 3} if rank == 0 else None, timeout=60,
    ...                  what="the bucket plan")
    {'buckets': 3}
"""

from __future__ import annotations

import contextlib
import io
import threading
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .backend import backend_for
from ..base.errors import HybridCommError, HybridCommTimeout
from ..gpu.runtime import simulating
from .transport.torch_dist import looks_like_timeout

if dist.is_available() and not dist.is_initialized():
    # Imported now, before init_process_group, torch.distributed.nn.functional binds
    # its ``group=group.WORLD`` defaults to None. Imported after it (dynamo imports
    # it, and torch's first optimizer imports dynamo), they hold the default group
    # for good: destroy_process_group() then leaves its gloo threads running into the
    # interpreter's exit, where one still releasing the last collective's tensors
    # needs the GIL and aborts the process ("terminate called without an active
    # exception"; pytorch/pytorch#190489).
    import torch.distributed.nn.functional  # noqa: F401

_groups: Dict[Any, Any] = {}
_lock = threading.Lock()


def _host_region():
    """Under the GPU simulator, this is host work in production too."""
    if simulating():
        from ..gpu.runtime import runtime_for

        return runtime_for("cpu").host_region()
    return contextlib.nullcontext()


def require_initialized(what: str = "this call") -> None:
    """Raise :class:`HybridCommError` saying what to call first when torch.distributed
    has no default process group yet (torch's own error there is a bare ValueError).
    Every public entry point that communicates calls it before anything else.

        >>> require_initialized("broadcast_parameters")   # after init_process_group: silent
    """
    if not dist.is_available() or not dist.is_initialized():
        raise HybridCommError(
            f"{what} needs torch.distributed: call "
            "torch.distributed.init_process_group(...) first (or run under "
            "torchrun)"
        )


def control_group(group=None):
    """A gloo group with ``group``'s ranks: ``group`` itself when it is gloo, else one
    made once (collective: the first call happens on every rank of ``group``)."""
    require_initialized("agreeing across ranks")
    if backend_for("cpu", group) == "gloo":  # (also a "cpu:gloo,cuda:nccl" group)
        return group
    key = id(group)
    with _lock:
        hit = _groups.get(key)
        if hit is None:
            hit = _groups[key] = new_group_like(group)
        return hit


def new_group_like(group=None, timeout: Optional[float] = None):
    """A new gloo group with ``group``'s ranks (collective over them)."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    kwargs = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    with _host_region():
        try:
            return dist.new_group(
                ranks, backend="gloo", use_local_synchronization=group is not None, **kwargs
            )
        except RuntimeError as e:  # gloo's connectFullMesh: a peer died or never came
            kind = HybridCommTimeout if looks_like_timeout(e) else HybridCommError
            raise kind(
                f"rank {dist.get_rank()}: making a gloo group of ranks "
                f"{ranks or 'all'} failed (a peer dead or not making it too): {e}"
            ) from e


def wait_work(work, timeout: float, what: str) -> None:
    """``work()`` posts a collective; it is waited for within ``timeout``. Failures,
    at posting or waiting, are our errors naming ``what``."""
    rank = dist.get_rank()
    try:
        done = work().wait(timeout=timedelta(seconds=timeout))
    except Exception as e:
        kind = HybridCommTimeout if looks_like_timeout(e) else HybridCommError
        raise kind(
            f"rank {rank}: agreeing on {what} failed (a peer dead, stalled for over "
            f"{timeout:g}s, or not making the same call): {e}"
        ) from e
    if done is False:
        raise HybridCommTimeout(
            f"rank {rank}: agreeing on {what} did not complete within "
            f"{timeout:g}s (a peer stalled or not making the same call)"
        )


class HostMax:
    """Which of ``n`` positions some rank marked: an element-wise max of 0/1 masks
    over the ranks, posted now on the host (gloo) and waited for later. Every
    rank posts it in the same order.

    Example::

        >>> used = HostMax(3, [0, 2] if rank == 0 else [1], timeout=60,
        ...                what="the gradients of bucket 0")
        >>> used.positions()           # one rank here; [0, 1, 2] with two
        [0, 2]
    """

    __slots__ = ("mask", "timeout", "what", "_work", "_error")

    def __init__(self, n: int, marked, *, group=None, timeout: float, what: str):
        self.timeout, self.what = timeout, what
        self._work = self._error = None
        with _host_region():  # host memory and a host collective: no device work
            if len(marked) == n:  # (the usual bucket: every position; no index_put, ~30 us)
                self.mask = torch.ones(n, dtype=torch.int32)
            else:
                self.mask = torch.zeros(n, dtype=torch.int32)
                if marked:
                    self.mask[list(marked)] = 1
            try:
                self._work = dist.all_reduce(
                    self.mask, op=dist.ReduceOp.MAX, group=control_group(group), async_op=True
                )
            except Exception as e:  # noqa: BLE001 - raised at wait(), on the waiting thread
                self._error = e

    def wait(self) -> None:
        """Until every rank's mask is in (within the timeout); idempotent."""
        if self._work is None and self._error is None:
            return
        work, error, self._work, self._error = self._work, self._error, None, None

        def posted():
            if error is not None:
                raise error
            return work

        with _host_region():
            wait_work(posted, self.timeout, self.what)

    def positions(self) -> List[int]:
        """The positions some rank marked."""
        self.wait()
        with _host_region():
            return [i for i, f in enumerate(self.mask.tolist()) if f > 0]


def _safe_types() -> list:
    """The library's own types an agreement may carry (plans, cost models, a
    topology); with tensors, containers and plain values, nothing else loads."""
    from ..algorithms.topology import Topology
    from ..plan.cost_model import CostModel, LinkCoefficients
    from ..plan.planner import Bucket, Layer, Plan

    return [
        Plan,
        Bucket,
        Layer,
        CostModel,
        LinkCoefficients,
        Topology,
        set,
        frozenset,
        torch.dtype,
        torch.device,
    ]


def _dumps(obj: Any) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def _loads(data: bytes, what: str) -> Any:
    """What another rank sent, read with torch's restricted unpickler
    (``weights_only``): tensors, containers, plain values and the library's own
    types load; anything else (a class that runs code when loaded) is refused."""
    try:
        with torch.serialization.safe_globals(_safe_types()):
            return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch's UnpicklingError, or a corrupt message
        raise HybridCommError(
            f"rank {dist.get_rank()}: agreeing on {what}: refused what a "
            f"peer sent (only tensors, containers, plain values and "
            f"hybridcomm's own types are loaded): {e}"
        ) from e


def _src(group, root: int) -> int:
    return dist.get_global_rank(group, root) if group is not None else root


def broadcast_object(
    obj: Any, *, group=None, root: int = 0, timeout: float, what: str = "an object"
) -> Any:
    """``root``'s ``obj`` on every rank of ``group`` (a collective), within ``timeout``.

    Example::

        >>> broadcast_object("rank 0's" if rank == 0 else None, timeout=60, what="a string")
        "rank 0's"
    """
    g = control_group(group)
    with _host_region():
        mine = dist.get_rank(g) == root
        data = _dumps(obj) if mine else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        wait_work(
            lambda: dist.broadcast(size, _src(g, root), group=g, async_op=True), timeout, what
        )
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if mine
            else torch.empty(int(size[0]), dtype=torch.uint8)
        )
        if buf.numel():
            wait_work(
                lambda: dist.broadcast(buf, _src(g, root), group=g, async_op=True), timeout, what
            )
        return obj if mine else _loads(buf.numpy().tobytes(), what)


def rank0_decides(decide: Callable[[], Any], *, group=None, timeout: float, what: str) -> Any:
    """``decide()`` run on rank 0 of ``group`` only, its answer on every rank (a
    collective): the one way a choice that must be the same everywhere (a plan)
    is made.

    Example::

        plan = rank0_decides(lambda: make_plan(layers, world_size=4), timeout=60,
                             what="the bucket plan")
    """
    mine = decide() if dist.get_rank(group) == 0 else None
    return broadcast_object(mine, group=group, timeout=timeout, what=what)


def all_gather_object(
    obj: Any, *, group=None, timeout: float, what: str = "an object"
) -> List[Any]:
    """Every rank's ``obj``, in rank order (a collective), within ``timeout``."""
    g = control_group(group)
    with _host_region():
        world = dist.get_world_size(g)
        data = _dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
        wait_work(lambda: dist.all_gather(sizes, size, group=g, async_op=True), timeout, what)
        longest = max(int(s[0]) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        wait_work(lambda: dist.all_gather(parts, mine, group=g, async_op=True), timeout, what)
        return [_loads(p[: int(s[0])].numpy().tobytes(), what) for p, s in zip(parts, sizes)]


def all_gather_tensor(
    t: torch.Tensor, *, group=None, timeout: float, what: str = "a tensor"
) -> List[torch.Tensor]:
    """Every rank's CPU tensor ``t`` (the same shape and dtype on every rank), in
    rank order (a collective), within ``timeout``: no pickling."""
    g = control_group(group)
    with _host_region():
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(g))]
        wait_work(
            lambda: dist.all_gather(parts, t.contiguous(), group=g, async_op=True), timeout, what
        )
        return parts


def all_to_all(
    send: torch.Tensor,
    send_bytes: List[int],
    recv_bytes: List[int],
    *,
    group=None,
    timeout: float,
    what: str = "bytes",
) -> torch.Tensor:
    """Each rank's bytes to each rank (an all-to-all; a collective), within ``timeout``:
    ``send`` (a CPU uint8 tensor) is cut into ``send_bytes[r]`` for rank ``r``, in rank
    order; returns what came, ``recv_bytes[r]`` from rank ``r``, in rank order."""
    g = control_group(group)
    with _host_region():
        recv = torch.empty(sum(recv_bytes), dtype=torch.uint8)
        wait_work(
            lambda: dist.all_to_all_single(
                recv, send, list(recv_bytes), list(send_bytes), group=g, async_op=True
            ),
            timeout,
            what,
        )
        return recv


def barrier(*, group=None, timeout: float, what: str = "a barrier") -> None:
    """Every rank of ``group`` arrives, within ``timeout``."""
    all_gather_object(None, group=group, timeout=timeout, what=what)


def describe_difference(values: List[Any], describe=repr) -> str:
    """Which ranks hold which value, for an error message (rank 0's first)."""
    by_value: Dict[str, List[int]] = {}
    for rank, v in enumerate(values):
        by_value.setdefault(describe(v), []).append(rank)
    return ", ".join(f"ranks {ranks} have {v}" for v, ranks in by_value.items())
