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

from .schedule import (
    Recv,
    Schedule,
    Send,
    Step,
    build,
    check_args,
    chunk_bounds,
    step,
    tail_block,
    tail_body,
)

Part = Callable[[int], Tuple[int, int]]  # part index (taken mod p) -> [start, stop)


def reduce_scatter(rank: int, p: int, *parts: Part, final: bool = True) -> List[Step]:
    """p-1 steps among ranks 0..p-1 after which rank r holds the sum of ``part(r)``
    of each of ``parts`` (``final``: that reduction finalizes it). Peers are ring
    positions."""
    right, left = (rank + 1) % p, (rank - 1) % p
    return [
        step(
            [Send(right, *part(rank - s - 1)) for part in parts],
            [
                Recv(left, *part(rank - s - 2), reduce=True, final=final and s == p - 2)
                for part in parts
            ],
        )
        for s in range(p - 1)
    ]


def all_gather(rank: int, p: int, *parts: Part) -> List[Step]:
    """p-1 steps that pass each rank's ``part(r)`` of each of ``parts`` around the
    ring to all."""
    right, left = (rank + 1) % p, (rank - 1) % p
    return [
        step(
            [Send(right, *part(rank - s)) for part in parts],
            [Recv(left, *part(rank - s - 1), reduce=False) for part in parts],
        )
        for s in range(p - 1)
    ]


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
    return build("ring", rank, world_size, numel, steps=steps)


def shard_bounds(rank: int, world_size: int, numel: int) -> Tuple[int, int]:
    """``[start, stop)`` of the part of ``numel`` elements that ``rank`` owns after
    :func:`reduce_scatter_schedule` (and sends in :func:`all_gather_schedule`).

    >>> [shard_bounds(r, 3, 100) for r in range(3)]
    [(0, 32), (32, 64), (64, 100)]
    """
    return chunk_bounds(numel, world_size, rank)


def reduce_scatter_schedule(rank: int, world_size: int, numel: int, tail: int = 0) -> Schedule:
    """The ring's first half on its own: afterwards ``rank`` holds the sum (scaled on
    its last receive) of its :func:`shard_bounds` of the first ``numel - P * tail``
    elements and of its block of the ``tail`` elements a rank after them
    (:func:`~hybridcomm.algorithms.schedule.tail_block`), which ride along in the
    same steps; the rest of the buffer holds partial sums. Sharded optimizer state
    reduces gradients with it.

    >>> s = reduce_scatter_schedule(1, 4, 1000); len(s.steps), s.steps[-1].recvs[0].final
    (3, True)
    """
    # (its own name: not cut into pipelined parts, which would move the owned part)
    return build(
        "ring:reduce_scatter",
        rank,
        world_size,
        numel,
        steps=reduce_scatter(rank, world_size, *_phase_parts(rank, world_size, numel, tail)),
    )


def all_gather_schedule(rank: int, world_size: int, numel: int, tail: int = 0) -> Schedule:
    """The ring's second half on its own: each rank's :func:`shard_bounds` part of
    the buffer (and its tail block) passed to every rank (copied, not added).

    >>> len(all_gather_schedule(0, 4, 1000).steps)
    3
    """
    return build(
        "ring:all_gather",
        rank,
        world_size,
        numel,
        steps=all_gather(rank, world_size, *_phase_parts(rank, world_size, numel, tail)),
    )


def _phase_parts(rank: int, world_size: int, numel: int, tail: int) -> List[Part]:
    check_args(rank, world_size, numel)
    body = tail_body(world_size, numel, tail)
    parts = [lambda i: shard_bounds(i % world_size, world_size, body)]
    if tail:
        parts.append(lambda i: tail_block(i % world_size, world_size, numel, tail))
    return parts
