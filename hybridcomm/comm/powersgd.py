"""PowerSGD: low-rank gradient compression with error feedback (Vogels, Karimireddy
and Jaggi 2019, https://arxiv.org/abs/1905.13727),
``DistributedOptimizer(..., compression="powersgd:RANK[:START]")``.

The arithmetic of PyTorch DDP's ``powerSGD_hook`` (:class:`PowerSGD`); what
differs is where it runs: a bucket's two all-reduces go through hybridcomm's
one ordered channel as soon as backward has produced the bucket, so in forward
mode they overlap the rest of backward and the next forward. The first
``START`` steps are plain all-reduces (early gradients compress badly).

Example::

    >>> opt = hybridcomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...                                       model=model, compression="powersgd:4")
    >>> x, y = loader[0]; loss_fn(model(x), y).backward(); opt.step()
    >>> opt.close()
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..algorithms.lowrank import compressed_shape

# fixed, so that every rank draws the same first Q (and a re-plan the same again)
SEED = 1_000_003


def orthogonalize(m: torch.Tensor, eps: float = 1e-8) -> None:
    """Gram-Schmidt on the columns of ``m`` (``n x r``), in place; ``eps`` keeps a
    vanished column finite. The same operations on the same bits give the same
    bits, so ranks holding the same all-reduced ``P`` agree after it."""
    for i in range(m.shape[1]):
        col = m[:, i : i + 1]
        col.div_(col.norm() + eps)
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1 :]
            rest.sub_((col * rest).sum(0, keepdim=True) * col)


class PowerSGD:
    """One bucket's low-rank compressor: factors, error feedback and its two messages.

    ``shapes``: the bucket's gradients' shapes (this rank's shard of a DTensor);
    ``offsets``: where each starts in the bucket's flat gradients; ``ids``: a
    number per gradient that is the same on every rank and across re-plans (the
    parameter's index), which seeds its first ``Q``; ``alloc(numel, dtype)`` makes
    device memory (the optimizer's allocator). ``active`` is set per launch by the
    bucket group.

    Each gradient of two or more dimensions that rank ``r`` compresses is a
    matrix ``G`` (``n x m``); each rank keeps its error feedback ``E`` and, shared
    by all ranks, a warm start ``Q`` (``m x r``)::

        X = G + E                         (this rank's, with what it has not sent yet)
        P = X Q,   all-reduced (sum), then orthogonalized (the same bits everywhere)
        Q = X^T P, all-reduced (sum), then divided by the world size
        X' = P Q^T                        (the averaged gradient, to rank r)
        E = X - X'                        (kept for the next step)

    The other gradients travel whole in ``P``'s message, with the usage flags.
    Every sum is a plain all-reduce's and the orthogonalization runs on identical
    inputs on every rank, so every rank ends with the same bits.
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        offsets: Sequence[int],
        ids: Sequence[int],
        rank: int,
        start: int,
        world: int,
        alloc: Callable[[int, torch.dtype], torch.Tensor],
    ):
        self.rank, self.start, self.world = rank, start, world
        self.offsets = list(offsets)
        self.active = False
        # (position, n, m, offset in P, offset in Q, offset in the residual)
        self.mats: List[Tuple[int, int, int, int, int, int]] = []
        self.dense: List[Tuple[int, int, int]] = []  # (position, numel, offset in P)
        p_at = q_at = e_at = 0
        for pos, shape in enumerate(shapes):
            nm = compressed_shape(shape, rank)
            if nm is not None:
                n, m = nm
                self.mats.append((pos, n, m, p_at, q_at, e_at))
                p_at, q_at, e_at = p_at + n * rank, q_at + m * rank, e_at + n * m
        for pos, shape in enumerate(shapes):
            if compressed_shape(shape, rank) is None:
                numel = int(torch.Size(shape).numel())
                self.dense.append((pos, numel, p_at))
                p_at += numel
        self.flags_at = p_at
        self.p = alloc(p_at + len(shapes), torch.float32)
        self.q = alloc(q_at, torch.float32)
        self.residual = alloc(e_at, torch.float32)
        self.residual.zero_()
        for pos, n, m, _, q0, _ in self.mats:  # every rank draws the same first Q
            gen = torch.Generator().manual_seed(SEED * (ids[pos] + 1))
            self.q[q0 : q0 + m * rank].copy_(torch.randn(m * rank, generator=gen))

    # -- views ---------------------------------------------------------------------------
    def _p(self, n: int, at: int) -> torch.Tensor:
        return self.p[at : at + n * self.rank].view(n, self.rank)

    def _q(self, m: int, at: int) -> torch.Tensor:
        return self.q[at : at + m * self.rank].view(m, self.rank)

    def _x(self, n: int, m: int, at: int) -> torch.Tensor:
        return self.residual[at : at + n * m].view(n, m)

    def state(self, pos: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(error feedback, warm-start Q) of the gradient at ``pos``, None where it
        is sent whole: what a re-plan carries and a checkpoint keeps."""
        for p, n, m, _, q0, e0 in self.mats:
            if p == pos:
                return self._x(n, m, e0), self._q(m, q0)
        return None

    def states(self) -> List[torch.Tensor]:
        """Every tensor of state, in a fixed order (a checkpoint's). Between a launch
        and the end of its reduction the error feedback holds X = G + E (what is
        being sent); ``opt.state_dict()`` after ``step()`` waits for the reductions
        first, so it saves E."""
        return [self.residual, self.q]

    @property
    def bytes_sent_numel(self) -> Tuple[int, int]:
        """Elements of the two messages (P with the whole gradients and flags, Q)."""
        return self.p.numel(), self.q.numel()

    # -- the three stages --------------------------------------------------------------
    def _g(self, grads: torch.Tensor, pos: int, numel: int) -> torch.Tensor:
        return grads[self.offsets[pos] : self.offsets[pos] + numel]

    def compress(self, grads: torch.Tensor, flags: torch.Tensor) -> None:
        """At launch, on the caller's stream, from the bucket's flat gradients:
        X = G + E (kept in the residual), P = X Q, and the whole gradients and the
        flags into P's message."""
        for pos, n, m, p0, q0, e0 in self.mats:
            x = self._x(n, m, e0)
            x.add_(self._g(grads, pos, n * m).view(n, m))
            torch.matmul(x, self._q(m, q0), out=self._p(n, p0))
        for pos, numel, at in self.dense:
            self.p[at : at + numel].copy_(self._g(grads, pos, numel))
        self.p[self.flags_at :].copy_(flags)

    def project(self) -> None:
        """After P is all-reduced: orthogonalize it, Q = X^T P (this rank's)."""
        for _, n, m, p0, q0, e0 in self.mats:
            p = self._p(n, p0)
            orthogonalize(p)
            torch.matmul(self._x(n, m, e0).t(), p, out=self._q(m, q0))

    def decode(self, grads: torch.Tensor, flags: torch.Tensor, scale: Optional[float]) -> None:
        """After Q is all-reduced: Q averaged (the next step's warm start), the
        gradients P Q^T (times the world size for a sum), E = X - P Q^T; the whole
        gradients and the flags back from P's message (``scale``: 1/P for an average)."""
        self.q.div_(self.world)
        for pos, n, m, p0, q0, e0 in self.mats:
            x = self._x(n, m, e0)
            approx = torch.matmul(self._p(n, p0), self._q(m, q0).t())
            x.sub_(approx)
            if scale is None:
                approx.mul_(self.world)
            self._g(grads, pos, n * m).copy_(approx.view(-1))
        for pos, numel, at in self.dense:
            part = self.p[at : at + numel]
            if scale is not None:
                part.mul_(scale)
            self._g(grads, pos, numel).copy_(part)
        flags.copy_(self.p[self.flags_at :])
