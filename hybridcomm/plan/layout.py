"""A bucket's buffer, as the plan lays it out on every rank alike::

    [ grad p0 | pad | grad p1 | pad | ... | usage flags (one copy, or one a rank) ]

Each gradient starts aligned; the flags follow. Under sharded optimizer state
(reduce-scattered buckets) each rank has its own copy of the flags, one aligned
block a rank at the end of the last segment (``algorithms.tail_body``), so the
reduce-scatter gives every rank the flags summed over the ranks.

Example::

    >>> layout([3, 40, 1], 4), flag_stride(3, 1), flag_stride(3, 4), buffer_numel(45, 3, 4)
    (([0, 4, 44], 45), 3, 8, 77)
    >>> segments(45 + 4 * 8, 45, 16), segments(48, 45, 0)
    ([(0, 16), (16, 32), (32, 77)], [(0, 48)])
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from ..algorithms.schedule import ALIGN_ELEMENTS, equal_padding

# Each gradient in a bucket's buffer starts at a multiple of this many bytes, so
# kernels, NCCL and the optimizer's multi-tensor paths get aligned 16-byte
# (vectorized) access; the padding between gradients stays zero and costs at
# most 12 bytes per parameter on the wire.
ALIGN_BYTES = 16


def layout(sizes: Sequence[int], element_size: int) -> Tuple[List[int], int]:
    """Each gradient's offset in a bucket's buffer (aligned to ALIGN_BYTES) and
    the length of the gradient region, padding included."""
    step = max(1, ALIGN_BYTES // element_size)
    offsets, end = [], 0
    for n in sizes:
        start = -(-end // step) * step
        offsets.append(start)
        end = start + n
    return offsets, end


def flag_stride(n_params: int, copies: int) -> int:
    """Elements a copy of the usage flags takes: one per parameter, aligned where
    each rank has a copy (a tail block)."""
    return n_params if copies == 1 else -(-n_params // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def buffer_numel(grad_numel: int, n_params: int, copies: int) -> int:
    """The buffer's length: the gradient region, then ``copies`` of the flags."""
    return grad_numel + copies * flag_stride(n_params, copies)


def segments(total: int, body: int, step: int) -> List[Tuple[int, int]]:
    """``[0, total)`` cut every ``step`` elements (0: not cut) over the first
    ``body``; what follows (the flags' copies, a tail) goes with the last."""
    cuts = [(s, min(s + step, body)) for s in range(0, body, step or max(body, 1))]
    cuts = cuts or [(0, 0)]
    cuts[-1] = (cuts[-1][0], total)
    return cuts


def equal_parts(grad_numel: int, n_params: int, world: int) -> Tuple[int, List[Tuple[int, int]]]:
    """A sharded bucket that the collective's own reduce-scatter cuts (``native``):
    its gradient region padded to ``world`` equal aligned parts, and its one
    segment (the whole buffer, a copy of the flags a rank in its tail).

    >>> equal_parts(45, 3, 4)
    (64, [(0, 96)])
    """
    padded = equal_padding(grad_numel, world)
    return padded, [(0, buffer_numel(padded, n_params, world))]
