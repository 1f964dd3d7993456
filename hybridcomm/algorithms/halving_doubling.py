"""Halving-doubling (Rabenseifner) all-reduce: 2 log2 P steps.

Reduce-scatter by recursive halving (at each step swap half of the current
range with the partner r XOR mask, mask = P/2 .. 1, and keep the other half
reduced), then all-gather by recursive doubling in reverse. Sends 2(P-1)/P
of the buffer like ring, in 2 log2 P messages instead of 2(P-1): the middle
ground. Partners share the same range history, so both split it at the same
point. Non-power-of-two P folds the extra ranks in and out (fold.py).
"""
from __future__ import annotations

from .fold import folded
from .schedule import Recv, Schedule, Send, aligned_split, step


def _core_steps(rank: int, p: int, numel: int):
    steps, kept = [], []  # kept: our range before each halving, for the way back
    lo, hi, mask = 0, numel, p // 2
    while mask:
        peer, mid = rank ^ mask, aligned_split(lo, hi, 1, 2)  # both partners alike
        keep, give = ((lo, mid), (mid, hi)) if rank & mask == 0 else ((mid, hi), (lo, mid))
        steps.append(step([Send(peer, *give)], [Recv(peer, *keep, reduce=True, final=mask == 1)]))
        kept.append((peer, keep, give))
        (lo, hi), mask = keep, mask // 2
    for peer, keep, give in reversed(kept):  # all-gather: the partner owns `give`
        steps.append(step([Send(peer, *keep)], [Recv(peer, *give, reduce=False)]))
    return steps


def schedule(rank: int, world_size: int, numel: int) -> Schedule:
    """Halving-doubling schedule for ``rank`` of ``world_size`` over ``numel`` elements.

    Example::

        >>> len(schedule(0, 8, 1000).steps)
        6
    """
    return folded("halving_doubling", _core_steps, rank, world_size, numel)
