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
from .schedule import Recv, Schedule, Send, aligned_split, build, check_args, step


def _halving(rank: int, p: int, numel: int):
    """The halving steps' (peer, kept range, given range), and the range kept last."""
    kept, lo, hi, mask = [], 0, numel, p // 2
    while mask:
        peer, mid = rank ^ mask, aligned_split(lo, hi, 1, 2)  # both partners alike
        keep, give = ((lo, mid), (mid, hi)) if rank & mask == 0 else ((mid, hi), (lo, mid))
        kept.append((peer, keep, give))
        (lo, hi), mask = keep, mask // 2
    return kept, (lo, hi)


def _reduce_scatter(kept):
    last = len(kept) - 1
    return [step([Send(peer, *give)], [Recv(peer, *keep, reduce=True, final=i == last)])
            for i, (peer, keep, give) in enumerate(kept)]


def _all_gather(kept):  # the partner owns `give`
    return [step([Send(peer, *keep)], [Recv(peer, *give, reduce=False)])
            for peer, keep, give in reversed(kept)]


def _core_steps(rank: int, p: int, numel: int):
    kept, _ = _halving(rank, p, numel)
    return _reduce_scatter(kept) + _all_gather(kept)


def _power_of_two(world_size: int) -> None:
    if world_size < 1 or world_size & (world_size - 1):
        raise ValueError(f"halving-doubling's reduce-scatter alone needs a power-of-two "
                         f"world size (the extra ranks would own nothing), got {world_size}")


def shard_bounds(rank: int, world_size: int, numel: int) -> Tuple[int, int]:
    """The part ``rank`` owns after :func:`reduce_scatter_schedule` (ranks in order,
    each halving split aligned).

    >>> [shard_bounds(r, 4, 100) for r in range(4)]
    [(0, 24), (24, 48), (48, 72), (72, 100)]
    """
    _power_of_two(world_size)
    return _halving(rank, world_size, numel)[1]


def reduce_scatter_schedule(rank: int, world_size: int, numel: int) -> Schedule:
    """Recursive halving alone (power-of-two world sizes): log2 P steps after which
    ``rank`` holds the sum of its :func:`shard_bounds`.

    >>> len(reduce_scatter_schedule(0, 8, 1000).steps)
    3
    """
    check_args(rank, world_size, numel)
    _power_of_two(world_size)
    return build("halving_doubling:reduce_scatter", rank, world_size, numel,
                 _reduce_scatter(_halving(rank, world_size, numel)[0]))


def all_gather_schedule(rank: int, world_size: int, numel: int) -> Schedule:
    """Recursive doubling alone: each rank's :func:`shard_bounds` part to every rank."""
    check_args(rank, world_size, numel)
    _power_of_two(world_size)
    return build("halving_doubling:all_gather", rank, world_size, numel,
                 _all_gather(_halving(rank, world_size, numel)[0]))


def schedule(rank: int, world_size: int, numel: int) -> Schedule:
    """Halving-doubling schedule for ``rank`` of ``world_size`` over ``numel`` elements.

    Example::

        >>> len(schedule(0, 8, 1000).steps)
        6
    """
    return folded("halving_doubling", _core_steps, rank, world_size, numel)
