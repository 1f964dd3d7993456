"""Point-to-point over torch.distributed: gloo on CPU (host-ordered), NCCL on CUDA
(stream-ordered, the fallback when CuPy is not installed).

One step's sends and receives go out in one ``batch_isend_irecv`` (a single
NCCL group on CUDA), matched between a pair in issue order. On gloo a dead or
stalled peer is a :class:`HybridCommTimeout` / :class:`HybridCommError` naming
the transfer; on NCCL hangs are left to torch's own watchdog (the process
group's timeout), and the GPU simulator does not cover this path (docs/GPU.md).
"""

from __future__ import annotations

from datetime import timedelta
from typing import List, Sequence

import torch.distributed as dist

from ..backend import backend_for
from ...base.errors import HybridCommError, HybridCommTimeout
from .base import CommStream, Transfer, own_part


# The process group's own reduce-scatter and all-gather of one flat tensor (torch
# 2.13 renamed them; older releases have the *_tensor names only)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchDistPending:
    """One step's posted sends and receives (``transfers``: ``(is_send, peer, tensor)``
    each, named in an error only)."""

    __slots__ = ("works", "transfers", "rank")

    def __init__(self, works, transfers, rank):
        self.works, self.transfers, self.rank = works, transfers, rank

    def wait(self, timeout: float | None = None) -> None:
        for work, transfer in zip(self.works, self.transfers):
            wait_work(work, self.rank, transfer, timeout)


def _transfer_label(transfer) -> str:
    """``(is_send, peer, tensor)`` as an error message names it."""
    is_send, peer, t = transfer
    return (
        f"send of {t.numel()} x {t.dtype} to rank {peer}"
        if is_send
        else f"receive of {t.numel()} x {t.dtype} from rank {peer}"
    )


def wait_work(work, rank: int, label, timeout: float | None) -> None:
    """``work.wait`` with every failure as our error, naming the rank and the work
    (``label``: a string, or a transfer, named only if it fails)."""
    kwargs = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    try:
        done = work.wait(**kwargs)
    except Exception as e:  # gloo raises RuntimeError for timeouts and dead peers
        kind = HybridCommTimeout if looks_like_timeout(e) else HybridCommError
        raise kind(f"rank {rank}: {_label(label)} failed (timeout {timeout}s): {e}") from e
    if done is False:
        raise HybridCommTimeout(f"rank {rank}: {_label(label)} did not complete within {timeout}s")


def _label(label) -> str:
    return label if isinstance(label, str) else _transfer_label(label)


def posted(post, rank: int, label):
    """``post()`` (an isend/irecv/collective call) with a failure at posting time (a
    peer's socket already closed) as our error too, naming the rank and the work
    (``label``: a string, or a function that makes it)."""
    try:
        return post()
    except RuntimeError as e:
        kind = HybridCommTimeout if looks_like_timeout(e) else HybridCommError
        raise kind(
            f"rank {rank}: posting {label if isinstance(label, str) else label()} "
            f"failed (a peer dead?): {e}"
        ) from e


def _labels(sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> str:
    return "; ".join(
        [_transfer_label((True, p, t)) for p, t in sends]
        + [_transfer_label((False, p, t)) for p, t in recvs]
    )


def looks_like_timeout(e: Exception) -> bool:
    text = str(e).lower()
    return "timeout" in text or "timed out" in text


class TorchDistTransport:
    """Transport over a torch.distributed process group (host-ordered: gloo).

    Example::

        >>> t = TorchDistTransport()                      # default group
        >>> t.rank, t.world_size, t.backend
        (0, 1, 'gloo')
        >>> t.exchange([], []).wait(timeout=60)          # one step's sends and receives
    """

    kind = "torch"
    stream_ordered = False

    def __init__(self, group=None, tag: int = 0):
        if not dist.is_available() or not dist.is_initialized():
            raise HybridCommError(
                "torch.distributed is not initialized: call "
                "torch.distributed.init_process_group(...) first (or run under torchrun)"
            )
        self.group = group
        self.tag = tag
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = backend_for("cuda" if self.stream_ordered else "cpu", group) or str(
            dist.get_backend(group)
        )
        # P2P calls take global ranks; map the group's ranks once.
        self._global = [
            dist.get_global_rank(group, r) if group is not None else r
            for r in range(self.world_size)
        ]
        # the group itself (its send and recv take group ranks)
        self._pg = group if group is not None else dist.group.WORLD

    def _post(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]):
        """One ``batch_isend_irecv`` (a single NCCL group on CUDA)."""
        ops: List[dist.P2POp] = []
        for peer, t in sends:
            ops.append(dist.P2POp(dist.isend, t, self._global[peer], self.group, tag=self.tag))
        for peer, t in recvs:
            ops.append(dist.P2POp(dist.irecv, t, self._global[peer], self.group, tag=self.tag))
        return (
            posted(lambda: dist.batch_isend_irecv(ops), self.rank, lambda: _labels(sends, recvs))
            if ops
            else []
        )

    def exchange(
        self, sends: Sequence[Transfer], recvs: Sequence[Transfer], *, label=None
    ) -> TorchDistPending:
        """Host-ordered (gloo): the sends, then the receives, posted on the process
        group itself (group ranks), as ``batch_isend_irecv`` posts them without
        coalescing, less its Python checks per call (about a quarter of a small
        step's posting); what they are is formatted only for an error."""
        pg, tag = self._pg, self.tag
        works = posted(
            lambda: (
                [pg.send([t], peer, tag) for peer, t in sends]
                + [pg.recv([t], peer, tag) for peer, t in recvs]
            ),
            self.rank,
            lambda: _labels(sends, recvs),
        )
        return TorchDistPending(
            works, [(True, p, t) for p, t in sends] + [(False, p, t) for p, t in recvs], self.rank
        )

    def all_reduce(self, t, *, average: bool, timeout: float | None = None) -> None:
        """The group's own all-reduce (``native``) in place. Every rank gets the same
        bits back (gloo copies each reduced chunk around) and scales them alike."""
        label = f"native all_reduce of {t.numel()} x {t.dtype}"
        work = posted(lambda: dist.all_reduce(t, group=self.group, async_op=True), self.rank, label)
        wait_work(work, self.rank, label, timeout)
        if average:
            t.mul_(1.0 / self.world_size)

    def reduce_scatter(self, t, *, average: bool, timeout: float | None = None) -> None:
        """The group's own reduce-scatter (``native``, sharded optimizer state) in
        place: this rank's equal part of ``t`` (:func:`own_part`) ends summed, or
        averaged; the rest of ``t`` is left as it was."""
        mine = own_part(t, self.rank, self.world_size)
        label = f"native reduce_scatter of {t.numel()} x {t.dtype}"
        work = posted(
            lambda: _reduce_scatter(mine, t, group=self.group, async_op=True), self.rank, label
        )
        wait_work(work, self.rank, label, timeout)
        if average:
            mine.mul_(1.0 / self.world_size)

    def all_gather(self, t, *, timeout: float | None = None) -> None:
        """The group's own all-gather in place: every rank's part of ``t`` to every
        rank."""
        label = f"native all_gather of {t.numel()} x {t.dtype}"
        mine = own_part(t, self.rank, self.world_size)
        work = posted(
            lambda: _all_gather(t, mine, group=self.group, async_op=True), self.rank, label
        )
        wait_work(work, self.rank, label, timeout)


class TorchNcclTransport(TorchDistTransport, CommStream):
    """torch.distributed over NCCL, stream-ordered on its own comm stream.

    Usage (on a GPU)::

        t = TorchNcclTransport(runtime=runtime_for(grad))
        with t.stream_context():
            t.exchange([(1, buf[:4])], [(1, scratch[:4])])
    """

    stream_ordered = True

    def __init__(self, group=None, *, runtime, priority: int = -1):
        super().__init__(group)
        if self.backend != "nccl":
            raise HybridCommError(
                f"TorchNcclTransport needs an NCCL process group, got {self.backend}"
            )
        self._init_stream(runtime, priority)
        self.failure = None

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], *, label=None) -> None:
        with self.stream_context():
            works = self._post(sends, recvs)
            for w in works:
                # the comm stream waits; the host does not (a timeout would busy-wait
                # on the host: a host sync per step)
                w.wait()

    def all_reduce(self, t, *, average: bool, timeout: float | None = None) -> None:
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        with self.stream_context():
            dist.all_reduce(t, op=op, group=self.group, async_op=True).wait()

    def reduce_scatter(self, t, *, average: bool, timeout: float | None = None) -> None:
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        mine = own_part(t, self.rank, self.world_size)
        with self.stream_context():
            _reduce_scatter(mine, t, op=op, group=self.group, async_op=True).wait()

    def all_gather(self, t, *, timeout: float | None = None) -> None:
        mine = own_part(t, self.rank, self.world_size)
        with self.stream_context():
            _all_gather(t, mine, group=self.group, async_op=True).wait()

    def watch(self, event, timeout: float, label: str = "") -> None:
        """Hangs are torch's NCCL watchdog's to catch (the process group's timeout)."""

    def check_async_error(self) -> None:
        """Errors surface through torch's NCCL watchdog."""
