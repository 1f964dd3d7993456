"""Whole-parameter shards: which rank owns each parameter, and a bucket's layout
that gives each rank its own parameters as one part of the buffer.

An optimizer that is not element-wise (Adafactor's factored moments, Muon's
orthogonalized update, a LARS trust ratio) must step whole tensors, so under
``shard_by="parameters"`` each parameter's state and step live on one rank, as
in ``ZeroRedundancyOptimizer`` and Megatron-core's layer-wise distributed
optimizer. docs/ARCHITECTURE.md ("Sharded optimizer state") has the rest.

Example::

    >>> totals = [0, 0]
    >>> assign([40, 30, 20, 10], world=2, totals=totals), totals
    ([0, 1, 1, 0], [50, 50])
    >>> order, offsets, part = owner_layout([40, 30, 20, 10], [0, 1, 1, 0], world=2,
    ...                                     element_size=4)
    >>> order, offsets, part       # rank 0: params 0 and 3; rank 1: params 1 and 2
    ([0, 3, 1, 2], [0, 40, 56, 88], 56)
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from ..algorithms.schedule import ALIGN_ELEMENTS
from .layout import layout

# A bucket of whole parameters is closed once its largest part is within this much
# of an equal share: a reduce-scatter's time is set by its largest part (every part
# is padded to it on the wire), so a lopsided bucket costs up to P times its bytes.
WHOLE_BALANCE = 1.05


def assign(sizes: Sequence[int], world: int, totals: List[int]) -> List[int]:
    """Each parameter's owner in one bucket (``sizes``: their element counts):
    largest first, to the rank with the least of this bucket, ties to the rank
    with the least of every bucket so far (``totals``, updated), then the lowest.
    The first keeps the bucket's parts even (its reduce-scatter's time), the
    second the ranks' shares of the whole state."""
    load = [0] * world
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], totals[r], r))
        owners[i] = rank
        load[rank] += sizes[i]
        totals[rank] += sizes[i]
    return owners


def largest_part(sizes: Sequence[int], world: int) -> int:
    """The largest rank's part of a bucket of ``sizes`` as :func:`assign` cuts it
    (a tie changes which rank takes a parameter, never the parts' sizes)."""
    load = [0] * world
    for size, rank in zip(sizes, assign(sizes, world, [0] * world)):
        load[rank] += size
    return max(load, default=0)


def balanced(sizes: Sequence[int], world: int) -> bool:
    """Whether a bucket of ``sizes`` cut by owner has its largest part within
    WHOLE_BALANCE of an equal share.

    >>> balanced([100], 2), balanced([100, 96], 2), balanced([4, 4, 3, 1], 4)
    (False, True, False)
    """
    return world * largest_part(sizes, world) <= WHOLE_BALANCE * sum(sizes)


def owner_layout(
    sizes: Sequence[int], owners: Sequence[int], *, world: int, element_size: int
) -> Tuple[List[int], List[int], int]:
    """A bucket's buffer cut by owner: ``[rank 0's parameters | pad | rank 1's |
    pad | ...]``, every part padded to the largest, a multiple of ALIGN_ELEMENTS,
    so that the equal parts a reduce-scatter cuts (ours, NCCL's, gloo's) are each
    exactly one rank's parameters. Returns the parameters' positions in buffer
    order, their offsets (in that order) and the part's length."""
    order = sorted(range(len(sizes)), key=lambda i: (owners[i], i))
    local, ends = [], [0] * world
    for rank in range(world):
        mine = [i for i in order if owners[i] == rank]
        offsets, end = layout([sizes[i] for i in mine], element_size)
        local.extend(offsets)
        ends[rank] = end
    part = -(-max(ends, default=0) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
    offsets = [owners[i] * part + o for i, o in zip(order, local)]
    return order, offsets, part
