"""Butterfly (recursive doubling) all-reduce: log2 P steps of whole-buffer exchange.

Latency-optimal: the fewest messages of any all-reduce (log2 P), each the
whole buffer, so it wins for small buffers. At step k rank r swaps buffers
with r XOR 2^k and adds. Both partners compute a + b in the same order of
operand values (IEEE addition is commutative), so every rank ends bitwise
identical. Non-power-of-two P folds the extra ranks in and out (fold.py).
"""

from __future__ import annotations

from .fold import folded
from .schedule import Recv, Schedule, Send, step


def _core_steps(rank: int, p: int, numel: int):
    steps, k = [], 1
    while k < p:
        peer = rank ^ k
        last = k * 2 >= p
        steps.append(step([Send(peer, 0, numel)], [Recv(peer, 0, numel, reduce=True, final=last)]))
        k *= 2
    return steps


def schedule(rank: int, world_size: int, numel: int) -> Schedule:
    """Butterfly schedule for ``rank`` of ``world_size`` over ``numel`` elements.

    Example::

        >>> len(schedule(0, 8, 1000).steps)
        3
    """
    return folded("butterfly", _core_steps, rank, world_size, numel=numel)
