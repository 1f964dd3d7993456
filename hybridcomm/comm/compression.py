"""Top-k sparsification with error feedback (Lin et al. 2018, Deep Gradient
Compression, https://arxiv.org/abs/1712.01887; Stich et al. 2018):
``DistributedOptimizer(..., compression="topk:RATIO")``.

Each rank sends the ``k`` entries of its residual largest in magnitude, with
DGC's momentum correction under SGD with momentum (:class:`TopK`); the messages
are all-gathered through the same ordered channel as every other bucket, and
every rank sums them in rank order: identical bits everywhere. The planner
keeps a bucket dense where its sparse message would be larger.

Example::

    >>> opt = hybridcomm.DistributedOptimizer(
    ...     torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model,
    ...     compression="topk:0.01")
    >>> x, y = loader[0]; loss_fn(model(x), y).backward(); opt.step()
    >>> opt.last_step_stats["bytes_sent"]              # one rank: nothing to send
    0
    >>> opt.close()
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..algorithms.topk import gather_schedule, k_of, segment_numel


class TopK:
    """One bucket's sparsifier: residual, velocity, the gathered message buffer.

    ``alloc(numel, dtype)`` makes device memory (the optimizer's allocator).

    Per step, a residual ``v`` (what this rank has not sent yet) and, with
    momentum ``m``, a velocity ``u``::

        u = m u + g ;  v = v + u          (momentum correction; without it: v = v + g)
        send the k = ceil(RATIO n) entries of v largest in magnitude
        v[sent] = 0 ;  u[sent] = 0        (error feedback; momentum factor masking)

    A rank's message is one fp32 segment ``[values(k) | indices as int32 bits(k)
    | usage flags]``, all-gathered around a ring (copies only). With momentum
    correction the optimizer then steps with momentum 0 (applied before
    sparsifying). Residuals and velocities are in the optimizer's state.
    """

    def __init__(
        self,
        numel: int,
        params: int,
        ratio: float,
        rank: int,
        world: int,
        momentum: float,
        alloc: Callable[[int, torch.dtype], torch.Tensor],
    ):
        self.numel, self.params, self.rank, self.world = numel, params, rank, world
        self.k = k_of(numel, ratio)
        self.seg = segment_numel(numel, params, ratio)
        self.momentum = momentum
        self.residual = alloc(numel, torch.float32)
        self.residual.zero_()
        self.velocity = None
        if momentum:
            self.velocity = alloc(numel, torch.float32)
            self.velocity.zero_()
        self.gathered = alloc(world * self.seg, torch.float32)
        self.schedule = gather_schedule(rank, world, self.seg)

    @property
    def bytes_sent(self) -> int:
        return (self.world - 1) * self.seg * 4

    def select(self, grads: torch.Tensor, flags: torch.Tensor) -> None:
        """This rank's message from its gradients (and flags); on the current stream."""
        g = grads.float()
        v = self.residual
        if self.velocity is not None:
            self.velocity.mul_(self.momentum).add_(g)
            v.add_(self.velocity)
        else:
            v.add_(g)
        idx = v.abs().topk(self.k, sorted=False).indices
        mine = self.gathered[self.rank * self.seg : (self.rank + 1) * self.seg]
        mine[: self.k] = v[idx]
        mine[self.k : 2 * self.k] = idx.to(torch.int32).view(torch.float32)
        mine[2 * self.k :] = flags.float()
        v[idx] = 0
        if self.velocity is not None:
            self.velocity[idx] = 0

    def decode(self, grads: torch.Tensor, flags: torch.Tensor, scale: Optional[float]) -> None:
        """The bucket's gradients and flags from every rank's message, summed in rank
        order (then scaled): the same operations, so the same bits, on every rank."""
        acc = torch.zeros(self.numel, dtype=torch.float32, device=grads.device)
        used = torch.zeros(self.params, dtype=torch.float32, device=grads.device)
        parts = self.gathered.view(self.world, self.seg)
        for r in range(self.world):
            part = parts[r]
            idx = part[self.k : 2 * self.k].view(torch.int32).long()
            acc.index_add_(0, idx, part[: self.k])  # one rank's indices are distinct
            used.add_(part[2 * self.k :])
        if scale is not None:
            acc.mul_(scale)
            used.mul_(scale)
        grads.copy_(acc)
        flags.copy_(used)

    def state(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self.residual, self.velocity
