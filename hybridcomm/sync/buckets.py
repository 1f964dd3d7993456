"""Gradient buckets: one contiguous buffer per bucket, each parameter's ``.grad`` a view of it.

A bucket's buffer, laid out by the plan (``plan/layout.py``) identically on
every rank::

    [ grad p0 | pad | grad p1 | pad | ... | flag p0 | flag p1 | ... ]

Backward accumulates straight into the views, the all-reduce runs in place on
the buffer, and the optimizer reads the same views: nothing is packed or
unpacked on the data path. The flags travel with the gradients (``used``).
This module holds data only; when a bucket may be written, launched or read is
the bucket group's (bucket_group.py; docs/ARCHITECTURE.md, "A gradient's path").
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch

from ..base.dtensor import grad_view, local_numel, local_shape
from ..base.errors import HybridCommError
from ..plan.layout import buffer_numel, layout
from ..plan.planner import Bucket
from .grad_fields import copy_into_on_host

Alloc = Callable[[int, torch.dtype], torch.Tensor]
_foreach_copy = getattr(torch, "_foreach_copy_", None)  # torch >= 2.1's multi-tensor copy
_PLAIN = {torch.Tensor}


def copy_into(views: List[torch.Tensor], grads: List[torch.Tensor]) -> None:
    """``views[i].copy_(grads[i])`` for every i: one multi-tensor copy (a launch or two on
    a GPU instead of one per tensor) where every tensor is a plain one.

    >>> views, grads = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.full((3,), 2.0)]
    >>> copy_into(views, grads); views
    [tensor([1., 1.]), tensor([2., 2., 2.])]
    """
    if copy_into_on_host(views, grads):  # (a byte copy each, in C++)
        return
    if (
        _foreach_copy is not None
        and len(views) > 1
        and set(map(type, grads)) == _PLAIN
        and set(map(type, views)) == _PLAIN
    ):
        _foreach_copy(views, grads)
        return
    for view, grad in zip(views, grads):
        view.copy_(grad)


_RELEASED = object()  # a released bucket's views


class GradBucket:
    """One bucket's memory: the buffer, each parameter's gradient view, the flags.

    Example::

        >>> from hybridcomm.plan.planner import Bucket
        >>> ps = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
        >>> spec = Bucket(0, ["l"], [0, 1], 5, 20, "ring", 0.0)
        >>> b = GradBucket(spec, ps, torch.float32, None, lambda n, dt: torch.empty(n, dtype=dt))
        >>> b.bind(0); ps[0].grad is b.views[0], b.offsets
        (True, [0, 4])
    """

    __slots__ = (
        "spec",
        "params",
        "buffer",
        "grads",
        "flags",
        "views",
        "offsets",
        "wire",
        "topk",
        "lowrank",
        "quant",
        "released",
        "operations",
        "part",
        "_part_at",
        "_alloc",
        "_dtype",
        "_grad_numel",
    )

    def __init__(
        self,
        spec: Bucket,
        params: List[torch.nn.Parameter],
        dtype: torch.dtype,
        wire_dtype: Optional[torch.dtype],
        alloc: Alloc,
    ):
        self.spec, self.params = spec, params
        if spec.offsets is not None:
            self.offsets, grad_numel = list(spec.offsets), spec.grad_numel
        else:
            self.offsets, grad_numel = layout(
                [local_numel(p) for p in params], torch.empty((), dtype=dtype).element_size()
            )
        self._alloc, self._dtype, self._grad_numel = alloc, dtype, grad_numel
        self._allocate()
        self.wire = None
        if wire_dtype is not None and wire_dtype != dtype:
            self.wire = alloc(self._numel(), wire_dtype)
            self.wire.zero_()
        self.topk = None  # compression.TopK when the plan sparsifies this bucket
        self.lowrank = None  # powersgd.PowerSGD when the plan compresses it to low rank
        self.quant = None  # quantized.QuantizedReduce: 8 or 4 bits a value (the averager's)
        self.released = False  # its memory freed between steps (shard="gradients")
        self.part, self._part_at = None, []  # released: the part kept, and where it was

    def _numel(self) -> int:
        """The gradients, then the flags (``spec.flag_copies`` of them)."""
        return buffer_numel(self._grad_numel, len(self.params), self.spec.flag_copies)

    def _allocate(self) -> None:
        """The buffer, zeroed, and its views."""
        # the engine's operations built on this buffer (comm/engine.py): they go with it
        self.operations: dict = {}
        n, spec = self._grad_numel, self.spec
        self.buffer = self._alloc(self._numel(), self._dtype)
        self.buffer.zero_()
        self.grads, self.flags = self.buffer[:n], self.buffer[n:]
        if spec.flag_copies > 1:  # a row a rank (its tail block), each holding them all
            self.flags = self.flags.view(spec.flag_copies, spec.flag_stride)[:, : len(self.params)]
        self.views = [
            grad_view(self.buffer[o : o + local_numel(p)].view(local_shape(p)), p)
            for o, p in zip(self.offsets, self.params)
        ]

    def reserve_part(self, keep: Sequence[Tuple[int, int]]) -> Callable[[], None]:
        """Memory for the ranges ``keep`` of the buffer (``part``, read with
        :meth:`region` once released), and the copy of them into it, for the caller to
        run where the buffer's reduction is done (a GPU: on the comm stream)."""
        self._part_at, at = [], 0
        for a, z in keep:
            self._part_at.append((a, z, at))
            at += z - a
        part = self.part = self._alloc(at, self._dtype)
        dst = [part[o : o + z - a] for a, z, o in self._part_at]
        src = [self.buffer[a:z] for a, z, _ in self._part_at]
        return lambda: copy_into(dst, src)

    def release(self, keep: Sequence[Tuple[int, int]] = (), reserved: bool = False) -> None:
        """Drop the buffer (its memory goes back to the allocator, which knows the
        comm stream used it) until :meth:`restore`: no ``.grad`` may be bound to it.
        ``keep``: ranges of it copied out first (``part``, read with :meth:`region`);
        ``reserved``: the part :meth:`reserve_part` made is kept (its copy queued)."""
        if keep:  # host path (released in backward: shard.py)
            self.reserve_part(keep)()
        elif not reserved:
            self.part, self._part_at = None, []
        self.buffer = self.grads = self.flags = None
        self.operations = {}  # (each holds a view of the buffer)
        self.views = [_RELEASED] * len(self.params)  # no .grad is one of them
        self.released = True

    def restore(self) -> None:
        """A new buffer, zeroed, with new views (the bucket's first gradient of a round);
        the part :meth:`release` kept back in its place."""
        self._allocate()
        if self.part is not None:
            copy_into(
                [self.buffer[a:z] for a, z, _ in self._part_at],
                [self.part[o : o + z - a] for a, z, o in self._part_at],
            )
        self.part, self._part_at = None, []
        self.released = False

    def region(self, at: int, n: int) -> torch.Tensor:
        """``buffer[at:at + n]``, or where released, the same elements of the part kept."""
        if self.buffer is not None:
            return self.buffer[at : at + n]
        for a, z, o in self._part_at:
            if a <= at and at + n <= z:
                return self.part[o + at - a : o + at - a + n]
        raise HybridCommError(
            f"internal error: [{at}, {at + n}) of bucket {self.spec.index} "
            "was not kept when its memory was released"
        )

    @property
    def comm(self) -> torch.Tensor:
        """The buffer the all-reduce runs on (the wire buffer under compression)."""
        return self.buffer if self.wire is None else self.wire

    def topk_state(self, pos: int):
        """(residual, velocity or None) views of parameter ``pos`` in a top-k bucket
        (its error feedback, kept across steps), else None."""
        tk = self.topk
        if tk is None:
            return None
        o, shape = self.offsets[pos], self.views[pos].shape
        n = shape.numel()
        vel = None if tk.velocity is None else tk.velocity[o : o + n].view(shape)
        return tk.residual[o : o + n].view(shape), vel

    def holds(self, pos: int) -> bool:
        """Whether parameter ``pos``'s ``.grad`` is its view of this buffer."""
        return self.params[pos].grad is self.views[pos]

    def bind(self, pos: int) -> None:
        self.params[pos].grad = self.views[pos]

    def zero(self, positions: Iterable[int]) -> None:
        """Zero these gradients (the whole buffer at once when all of them)."""
        positions = list(positions)
        if len(positions) == len(self.params):
            self.buffer.zero_()
            return
        for pos in positions:
            self.views[pos].zero_()

    def set_flags(self, positions: set) -> None:
        """Flag 1 where this rank holds a gradient, 0 elsewhere (in every copy): one
        fill, then one per run of the positions that differ from it. Fills only: a
        copy from a host mask is ATen's memcpy_and_sync on a GPU (a host sync in
        backward)."""
        n = len(self.params)
        most = 1 if 2 * len(positions) >= n else 0
        self.flags.fill_(most)
        if len(positions) == n:  # (the usual bucket: every position, one fill)
            return
        start = None
        for i in range(n + 1):
            differs = i < n and (i in positions) != bool(most)
            if differs and start is None:
                start = i
            elif not differs and start is not None:
                self.flags[..., start:i].fill_(1 - most)
                start = None

    def used(self, rank: int = 0) -> List[int]:
        """Positions some rank had a gradient for, read from the reduced flags (a host
        sync on a GPU: the synchronizer asks only when this rank lacked one): after
        the sum a flag is > 0 exactly where some rank had one, and a parameter no
        rank used is left alone, as a single process would. From ``rank``'s copy
        where each rank has one (``shard``: the block of the buffer's tail its
        part ends with; ``self.flags`` is then a row a rank)."""
        flags = self.flags if self.flags.dim() == 1 else self.flags[rank]
        return [i for i, f in enumerate(flags.tolist()) if f > 0]

    def to_wire(self) -> None:
        # With a wire dtype (compression="fp16"/"bf16") the reduction runs on a second
        # buffer: one cast in at launch, one back when done; the only copy on the path
        if self.wire is not None:
            self.wire.copy_(self.buffer)

    def from_wire(self) -> None:
        if self.wire is not None:
            self.buffer.copy_(self.wire)
