"""Ring all-reduce: reduce-scatter then all-gather around a ring, 2(P-1) steps.

Bandwidth-optimal: each rank sends and receives 2(P-1)/P of the buffer, in
messages of n/P elements. Works for any P without folding.

Rank r sends to r+1 and receives from r-1. The buffer is cut into P parts;
after reduce-scatter step s (s = 0..P-2) rank r holds the partial sum of
part (r - s - 2) mod P over s + 2 ranks; at s = P-2 that is the full sum of
part r, which rank r then passes around the ring in the all-gather. The two
halves are also used on their own, over any parts, by the two-level
algorithms (grouped.py).
"""
from __future__ import annotations

from typing import Callable, List, Tuple

from .schedule import Recv, Schedule, Send, Step, build, check_args, chunk_bounds, step

Part = Callable[[int], Tuple[int, int]]  # part index (taken mod p) -> [start, stop)


def reduce_scatter(rank: int, p: int, part: Part, final: bool = True) -> List[Step]:
    """p-1 steps among ranks 0..p-1 after which rank r holds the sum of ``part(r)``
    (``final``: that reduction finalizes it). Peers are ring positions."""
    right, left = (rank + 1) % p, (rank - 1) % p
    return [step([Send(right, *part(rank - s - 1))],
                 [Recv(left, *part(rank - s - 2), reduce=True, final=final and s == p - 2)])
            for s in range(p - 1)]


def all_gather(rank: int, p: int, part: Part) -> List[Step]:
    """p-1 steps that pass each rank's ``part(r)`` around the ring to all."""
    right, left = (rank + 1) % p, (rank - 1) % p
    return [step([Send(right, *part(rank - s))], [Recv(left, *part(rank - s - 1), reduce=False)])
            for s in range(p - 1)]


def schedule(rank: int, world_size: int, numel: int) -> Schedule:
    """Ring schedule for ``rank`` of ``world_size`` over ``numel`` elements.

    Example::

        >>> len(schedule(0, 4, 1000).steps)
        6
    """
    check_args(rank, world_size, numel)
    p = world_size

    def part(i):  # rank r ends the reduce-scatter owning chunk r + 1
        return chunk_bounds(numel, p, (i + 1) % p)

    steps = reduce_scatter(rank, p, part) + all_gather(rank, p, part)
    return build("ring", rank, world_size, numel, steps)
