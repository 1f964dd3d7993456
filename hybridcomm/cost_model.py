"""Which algorithm an all-reduce of a given size uses when asked for "auto".

For now a plain size rule (a calibrated alpha-beta-gamma model replaces it):
the butterfly sends the whole buffer log2 P times, so it only pays for small
buffers, where the number of messages dominates; halving-doubling sends the
ring's bytes in 2 log2 P messages; the ring sends the least in 2(P-1).
The rule depends on (bytes, P) only, which every rank agrees on, so every
rank picks the same algorithm.
"""
from __future__ import annotations

BUTTERFLY_MAX_BYTES = 64 * 1024
HALVING_DOUBLING_MAX_BYTES = 1024 * 1024


def choose_algorithm(nbytes: int, world_size: int) -> str:
    """The algorithm "auto" uses for ``nbytes`` over ``world_size`` ranks.

    Example::

        >>> choose_algorithm(4096, 4), choose_algorithm(64 << 20, 4)
        ('butterfly', 'ring')
    """
    if world_size <= 2 or nbytes <= BUTTERFLY_MAX_BYTES:
        return "butterfly"  # at P=2 all three send the same bytes; butterfly in one step
    if nbytes <= HALVING_DOUBLING_MAX_BYTES:
        return "halving_doubling"
    return "ring"
