"""PowerSGD's sizes (Vogels et al. 2019): pure arithmetic the planner prices and
comm/powersgd.py's :class:`~hybridcomm.comm.powersgd.PowerSGD` lays out.

A gradient of two or more dimensions is an ``n x m`` matrix (its first
dimension, the rest), compressed to rank ``r`` where that saves at least half;
a bucket then sends two messages, ``P`` and ``Q`` (:func:`message_numels`).

Example::

    >>> compressed_shape((256, 64, 4, 4), 4)             # a conv weight: 256 x 1024
    (256, 1024)
    >>> compressed_shape((8, 16), 4) is None             # 2 * 4 * (8 + 16) > 8 * 16: whole
    True
    >>> message_numels([(256, 64, 4, 4), (256,)], 4)     # P: 256*4 + 256 + 2 flags; Q: 1024*4
    (1282, 4096)
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

POWERSGD = "powersgd"  # the plan's name for a bucket compressed to low rank


def parse_powersgd(compression) -> Optional[Tuple[int, int]]:
    """``(rank, start)`` of ``"powersgd:RANK"`` or ``"powersgd:RANK:START"`` (START:
    the steps sent exact before compression begins, DDP's ``start_powerSGD_iter``;
    default 0), None for any other compression.

        >>> parse_powersgd("powersgd:4"), parse_powersgd("powersgd:2:100"), parse_powersgd("fp16")
        ((4, 0), (2, 100), None)
    """
    if not isinstance(compression, str) or not compression.startswith(POWERSGD):
        return None
    parts = compression.split(":")
    try:
        if len(parts) not in (2, 3) or parts[0] != POWERSGD:
            raise ValueError
        rank = int(parts[1])
        start = int(parts[2]) if len(parts) == 3 else 0
    except ValueError:
        raise ValueError(
            f"compression={compression!r}: expected 'powersgd:RANK' or "
            "'powersgd:RANK:START', e.g. 'powersgd:4' or 'powersgd:4:100'"
        ) from None
    if rank < 1 or start < 0:
        raise ValueError(f"compression={compression!r}: RANK must be >= 1 and START >= 0")
    return rank, start


def compressed_shape(shape: Sequence[int], rank: int) -> Optional[Tuple[int, int]]:
    """``(n, m)``, the matrix a gradient of ``shape`` is compressed as, or None where
    it is sent whole (fewer than two dimensions, or rank ``rank`` saves under half)."""
    if len(shape) < 2:
        return None
    n = int(shape[0])
    m = math.prod(int(d) for d in shape[1:])
    # DDP's PowerSGD hook's rule with its default min_compression_rate=2
    return (n, m) if 2 * rank * (n + m) <= n * m else None


def message_numels(shapes: Sequence[Sequence[int]], rank: int) -> Tuple[int, int]:
    """fp32 elements of a bucket's two messages: ``P`` (the ``n x r`` factors, the
    gradients sent whole, one flag per parameter) and ``Q`` (the ``m x r`` factors)."""
    p = q = 0
    for shape in shapes:
        nm = compressed_shape(shape, rank)
        if nm is None:
            p += math.prod(int(d) for d in shape)
        else:
            p, q = p + nm[0] * rank, q + nm[1] * rank
    return p + len(shapes), q
