"""Ring all-reduce: reduce-scatter then all-gather around a ring, 2(P-1) steps.

Bandwidth-optimal: each rank sends and receives 2(P-1)/P of the buffer, in
messages of n/P elements. Works for any P without folding.

Rank r sends to r+1 and receives from r-1. After reduce-scatter step s
(s = 0..P-2) rank r holds the partial sum of chunk (r - s - 1) mod P over
s + 2 ranks; at s = P-2 that is the full sum of chunk (r + 1) mod P, which
rank r then passes around the ring in the all-gather.
"""
from __future__ import annotations

from .schedule import Recv, Schedule, Send, build, check_args, chunk_bounds, step


def schedule(rank: int, world_size: int, numel: int) -> Schedule:
    """Ring schedule for ``rank`` of ``world_size`` over ``numel`` elements.

    Example::

        >>> len(schedule(0, 4, 1000).steps)
        6
    """
    check_args(rank, world_size, numel)
    p = world_size
    right, left = (rank + 1) % p, (rank - 1) % p

    def chunk(i):
        return chunk_bounds(numel, p, i % p)

    steps = []
    for s in range(p - 1):  # reduce-scatter
        send, recv = chunk(rank - s), chunk(rank - s - 1)
        steps.append(step([Send(right, *send)], [Recv(left, *recv, reduce=True, final=s == p - 2)]))
    for s in range(p - 1):  # all-gather
        send, recv = chunk(rank + 1 - s), chunk(rank - s)
        steps.append(step([Send(right, *send)], [Recv(left, *recv, reduce=False)]))
    return build("ring", rank, world_size, numel, steps)
