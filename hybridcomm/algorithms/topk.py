"""Top-k sparsification's sizes and its all-gather schedule: pure arithmetic the
planner prices and comm/compression.py's :class:`~hybridcomm.comm.compression.TopK`
runs.

Example::

    >>> k_of(1000, 0.01), segment_numel(1000, 3, 0.01), sparse_bytes_sent(1000, 3, 0.01, 4)
    (10, 23, 276)
"""

from __future__ import annotations

import math
from typing import Optional

from .ring import all_gather
from .schedule import Schedule, build

TOPK = "topk"  # the plan's name for a sparsified bucket


def parse_topk(compression) -> Optional[float]:
    """RATIO of ``"topk:RATIO"`` (0 < RATIO <= 1), None for any other compression."""
    if not isinstance(compression, str) or not compression.startswith("topk"):
        return None
    try:
        ratio = float(compression.split(":", 1)[1])
    except (IndexError, ValueError):
        raise ValueError(f"compression={compression!r}: expected 'topk:RATIO', e.g. 'topk:0.01'")
    if not 0 < ratio <= 1:
        raise ValueError(f"compression={compression!r}: RATIO must be in (0, 1]")
    return ratio


def k_of(numel: int, ratio: float) -> int:
    return max(1, min(numel, math.ceil(ratio * numel)))


def segment_numel(numel: int, params: int, ratio: float) -> int:
    """fp32 elements of one rank's message for a bucket."""
    return 2 * k_of(numel, ratio) + params


def sparse_bytes_sent(numel: int, params: int, ratio: float, world: int) -> int:
    """Bytes one rank sends in a ring all-gather of the segments."""
    return (world - 1) * segment_numel(numel, params, ratio) * 4


def gather_schedule(rank: int, world: int, seg: int) -> Schedule:
    """Ring all-gather of ``world`` segments of ``seg`` elements, rank r owning
    segment r: P-1 steps of copies."""
    steps = all_gather(rank, world, lambda i: ((i % world) * seg, (i % world + 1) * seg))
    return build("ring_allgather", rank, world, world * seg, steps=steps)
