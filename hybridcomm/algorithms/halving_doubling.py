"""Halving-doubling (Rabenseifner) all-reduce: 2 log2 P steps.

Reduce-scatter by recursive halving (at each step swap half of the current
range with the partner r XOR mask, mask = P/2 .. 1, and keep the other half
reduced), then all-gather by recursive doubling in reverse. Sends 2(P-1)/P
of the buffer like ring, in 2 log2 P messages instead of 2(P-1): the middle
ground. Partners share the same range history, so both split it at the same
point. Non-power-of-two P folds the extra ranks in and out (fold.py).
"""

from __future__ import annotations

from typing import Tuple

from .fold import folded
from .schedule import Recv, Schedule, Send, aligned_split, build, check_args, step, tail_body


def _halving(rank: int, p: int, numel: int):
    """The halving steps' (peer, kept range, given range), and the range kept last."""
    kept, lo, hi, mask = [], 0, numel, p // 2
    while mask:
        peer, mid = rank ^ mask, aligned_split(lo, hi, 1, 2)  # both partners alike
        keep, give = ((lo, mid), (mid, hi)) if rank & mask == 0 else ((mid, hi), (lo, mid))
        kept.append((peer, keep, give))
        (lo, hi), mask = keep, mask // 2
    return kept, (lo, hi)


def _with_tail(kept, rank: int, p: int, body: int, tail: int):
    """``kept``'s steps as (peer, kept ranges, given ranges), each with the segment's
    tail blocks riding along (``tail`` elements a rank after ``body``: the rank
    range halves as the elements do, lower half to the lower ranks)."""
    out, lo, hi = [], 0, p
    for peer, keep, give in kept:
        mid = (lo + hi) // 2
        block_keep, block_give = (
            ((lo, mid), (mid, hi)) if rank & (rank ^ peer) == 0 else ((mid, hi), (lo, mid))
        )
        keeps, gives = [keep], [give]
        if tail:
            keeps.append((body + block_keep[0] * tail, body + block_keep[1] * tail))
            gives.append((body + block_give[0] * tail, body + block_give[1] * tail))
        out.append((peer, keeps, gives))
        lo, hi = block_keep
    return out


def _reduce_scatter(kept):
    last = len(kept) - 1
    return [
        step(
            [Send(peer, *g) for g in gives],
            [Recv(peer, *k, reduce=True, final=i == last) for k in keeps],
        )
        for i, (peer, keeps, gives) in enumerate(kept)
    ]


def _all_gather(kept):  # the partner owns the given ranges
    return [
        step([Send(peer, *k) for k in keeps], [Recv(peer, *g, reduce=False) for g in gives])
        for peer, keeps, gives in reversed(kept)
    ]


def _core_steps(rank: int, p: int, numel: int):
    kept = _with_tail(_halving(rank, p, numel)[0], rank, p, numel, tail=0)
    return _reduce_scatter(kept) + _all_gather(kept)


def _power_of_two(world_size: int) -> None:
    if world_size < 1 or world_size & (world_size - 1):
        raise ValueError(
            f"halving-doubling's reduce-scatter alone needs a power-of-two "
            f"world size (the extra ranks would own nothing), got {world_size}"
        )


def shard_bounds(rank: int, world_size: int, numel: int) -> Tuple[int, int]:
    """The part ``rank`` owns after :func:`reduce_scatter_schedule` (ranks in order,
    each halving split aligned).

    >>> [shard_bounds(r, 4, 100) for r in range(4)]
    [(0, 24), (24, 48), (48, 72), (72, 100)]
    """
    _power_of_two(world_size)
    return _halving(rank, world_size, numel)[1]


def reduce_scatter_schedule(rank: int, world_size: int, numel: int, tail: int = 0) -> Schedule:
    """Recursive halving alone (power-of-two world sizes): log2 P steps after which
    ``rank`` holds the sum of its :func:`shard_bounds` of the first ``numel - P *
    tail`` elements and of its block of the ``tail`` elements a rank after them
    (:func:`~hybridcomm.algorithms.schedule.tail_block`), which ride along.

    >>> len(reduce_scatter_schedule(0, 8, 1000).steps)
    3
    """
    return build(
        "halving_doubling:reduce_scatter",
        rank,
        world_size,
        numel,
        steps=_reduce_scatter(_phase_steps(rank, world_size, numel, tail)),
    )


def all_gather_schedule(rank: int, world_size: int, numel: int, tail: int = 0) -> Schedule:
    """Recursive doubling alone: each rank's :func:`shard_bounds` part (and tail
    block) to every rank."""
    return build(
        "halving_doubling:all_gather",
        rank,
        world_size,
        numel,
        steps=_all_gather(_phase_steps(rank, world_size, numel, tail)),
    )


def _phase_steps(rank: int, world_size: int, numel: int, tail: int):
    check_args(rank, world_size, numel)
    _power_of_two(world_size)
    body = tail_body(world_size, numel, tail)
    return _with_tail(_halving(rank, world_size, body)[0], rank, world_size, body, tail=tail)


def schedule(rank: int, world_size: int, numel: int) -> Schedule:
    """Halving-doubling schedule for ``rank`` of ``world_size`` over ``numel`` elements.

    Example::

        >>> len(schedule(0, 8, 1000).steps)
        6
    """
    return folded("halving_doubling", _core_steps, rank, world_size, numel=numel)
