"""Point-to-point over torch.distributed: gloo on CPU, nccl on CUDA.

One step's sends and receives go out in one ``batch_isend_irecv`` (a single
NCCL group on CUDA). Messages between a pair are matched in issue order; the
``tag`` separates independent lanes on gloo (NCCL ignores tags, so on NCCL a
lane needs its own process group).
"""
from __future__ import annotations

from datetime import timedelta
from typing import List, Sequence

import torch.distributed as dist

from ..errors import HybridCommError, HybridCommTimeout
from .base import Transfer


class TorchDistPending:
    __slots__ = ("works", "labels", "rank")

    def __init__(self, works, labels, rank):
        self.works, self.labels, self.rank = works, labels, rank

    def wait(self, timeout: float | None = None) -> None:
        kwargs = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
        for work, label in zip(self.works, self.labels):
            try:
                done = work.wait(**kwargs)
            except Exception as e:  # gloo raises RuntimeError for timeouts and dead peers
                kind = HybridCommTimeout if _looks_like_timeout(e) else HybridCommError
                raise kind(f"rank {self.rank}: {label} failed "
                           f"(timeout {timeout}s): {e}") from e
            if done is False:
                raise HybridCommTimeout(f"rank {self.rank}: {label} did not complete within {timeout}s")


def _looks_like_timeout(e: Exception) -> bool:
    text = str(e).lower()
    return "timeout" in text or "timed out" in text


class TorchDistTransport:
    """Transport over a torch.distributed process group.

    Example::

        >>> t = TorchDistTransport()                      # default group
        >>> t.exchange([(1, buf[:4])], [(1, scratch[:4])]).wait(timeout=60)
    """

    kind = "torch"

    def __init__(self, group=None, tag: int = 0):
        if not dist.is_available() or not dist.is_initialized():
            raise HybridCommError(
                "torch.distributed is not initialized: call "
                "torch.distributed.init_process_group(...) first (or run under torchrun)")
        self.group = group
        self.tag = tag
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        # P2P calls take global ranks; map the group's ranks once.
        self._global = [dist.get_global_rank(group, r) if group is not None else r
                        for r in range(self.world_size)]

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> TorchDistPending:
        ops: List[dist.P2POp] = []
        labels: List[str] = []
        for peer, t in sends:
            ops.append(dist.P2POp(dist.isend, t, self._global[peer], self.group, self.tag))
            labels.append(f"send of {t.numel()} x {t.dtype} to rank {peer}")
        for peer, t in recvs:
            ops.append(dist.P2POp(dist.irecv, t, self._global[peer], self.group, self.tag))
            labels.append(f"receive of {t.numel()} x {t.dtype} from rank {peer}")
        works = dist.batch_isend_irecv(ops) if ops else []
        if self.backend == "nccl" and works:
            # NCCL returns one work for the whole group.
            labels = ["; ".join(labels)] * len(works)
        return TorchDistPending(works, labels, self.rank)
