"""The data a schedule is made of, and the index arithmetic every algorithm shares.

A schedule is what one rank runs for one all-reduce of ``numel`` elements: a
tuple of :class:`Step`. Within a step all sends and receives are posted
together (one NCCL group); a step ends when all of them have completed. Sends
and receives between a pair of ranks are matched in issue order, with no tags,
exactly as NCCL does.

No torch, no devices: schedules are plain data, cheap to build and cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True, slots=True)
class Send:
    """Send elements ``[start, stop)`` of the buffer to ``peer``."""

    peer: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive ``stop - start`` elements from ``peer`` for ``[start, stop)``.

    ``reduce``: add them into the buffer (else copy them over it).
    ``final``: this reduction produces those elements' final value on this
    rank, so the op's scale (1/P for ``avg``) is applied here, exactly once.
    """

    peer: int
    start: int
    stop: int
    reduce: bool
    final: bool = False


@dataclass(frozen=True, slots=True)
class Step:
    sends: Tuple[Send, ...]
    recvs: Tuple[Recv, ...]


@dataclass(frozen=True, slots=True)
class Schedule:
    """All steps one rank runs for one all-reduce."""

    algorithm: str
    rank: int
    world_size: int
    numel: int
    steps: Tuple[Step, ...]
    # The resolved Topology the schedule was built for (two-level algorithms
    # only): rebuild a part of it with the same one (``get_schedule``'s topology=).
    topology: Optional[object] = None

    @property
    def scratch_numel(self) -> int:
        """Largest number of elements one step receives for reduction."""
        return max(
            (sum(r.stop - r.start for r in s.recvs if r.reduce) for s in self.steps),
            default=0,
        )


def check_args(rank: int, world_size: int, numel: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")


# Chunk boundaries fall on multiples of this many elements (32 bytes of fp32, 16 of
# fp16/bf16): every chunk a transfer or a reduction kernel touches starts aligned
# (buffers start aligned), so NCCL and the kernels take their vectorised paths.
ALIGN_ELEMENTS = 8


def aligned_split(lo: int, hi: int, num: int, den: int) -> int:
    """The point ``num/den`` of the way through ``[lo, hi)``, rounded down to a
    multiple of ALIGN_ELEMENTS from ``lo`` (``hi`` when ``num == den``).

    >>> aligned_split(0, 100, 1, 2), aligned_split(0, 100, 2, 2), aligned_split(0, 7, 1, 2)
    (48, 100, 0)
    """
    if num >= den:
        return hi
    units = -(-(hi - lo) // ALIGN_ELEMENTS)
    return min(hi, lo + ALIGN_ELEMENTS * (num * units // den))


def chunk_bounds(numel: int, parts: int, i: int) -> Tuple[int, int]:
    """``[start, stop)`` of chunk ``i`` when ``numel`` is split into ``parts``
    near-equal chunks starting at multiples of ALIGN_ELEMENTS (sizes differ by
    at most ALIGN_ELEMENTS; some may be empty).

    >>> [chunk_bounds(100, 3, i) for i in range(3)]
    [(0, 32), (32, 64), (64, 100)]
    """
    return aligned_split(0, numel, i, parts), aligned_split(0, numel, i + 1, parts)


def equal_bounds(rank: int, world_size: int, numel: int) -> Tuple[int, int]:
    """``[start, stop)`` of ``rank``'s part of ``numel`` elements cut into
    ``world_size`` equal parts, as a collective's own reduce-scatter and all-gather
    cut them (``native``: the layout pads the buffer to a multiple of the ranks).

    >>> [equal_bounds(r, 3, 48) for r in range(3)]
    [(0, 16), (16, 32), (32, 48)]
    """
    check_args(rank, world_size, numel)
    if numel % world_size:
        raise ValueError(f"{numel} elements do not split into {world_size} equal parts")
    part = numel // world_size
    return rank * part, (rank + 1) * part


def equal_padding(numel: int, world_size: int) -> int:
    """``numel`` rounded up so that it splits into ``world_size`` equal parts that
    each start aligned (ALIGN_ELEMENTS).

    >>> equal_padding(45, 3), equal_padding(48, 3), equal_padding(0, 4)
    (48, 48, 0)
    """
    unit = world_size * ALIGN_ELEMENTS
    return -(-numel // unit) * unit


def tail_body(world_size: int, numel: int, tail: int) -> int:
    """The elements of a phased segment before its tail: the last ``world_size *
    tail`` elements are one block of ``tail`` per rank, in rank order, that a
    reduce-scatter gives whole to its rank (a copy of the bucket's usage flags
    in each, so that every rank learns them with no collective of their own).

    >>> tail_body(4, 1000, 8), tail_block(1, 4, 1000, 8)
    (968, (976, 984))
    """
    body = numel - world_size * tail
    if tail < 0 or body < 0 or tail % ALIGN_ELEMENTS:
        raise ValueError(
            f"a tail of {world_size} x {tail} elements does not fit {numel} "
            f"(and must be a multiple of {ALIGN_ELEMENTS})"
        )
    return body


def tail_block(rank: int, world_size: int, numel: int, tail: int) -> Tuple[int, int]:
    """``[start, stop)`` of ``rank``'s block of the tail (:func:`tail_body`)."""
    body = tail_body(world_size, numel, tail)
    return body + rank * tail, body + (rank + 1) * tail


def largest_power_of_two(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def step(sends=(), recvs=()) -> Step | None:
    """A step without its empty transfers, or None if nothing is left.

    Both sides of a transfer compute its range from the same arithmetic, so
    both drop an empty one: nothing is left unmatched.
    """
    sends = tuple(s for s in sends if s.stop > s.start)
    recvs = tuple(r for r in recvs if r.stop > r.start)
    return Step(sends, recvs) if sends or recvs else None


def build(algorithm: str, rank: int, world_size: int, numel: int, steps, topology=None) -> Schedule:
    return Schedule(
        algorithm,
        rank,
        world_size,
        numel,
        steps=tuple(s for s in steps if s is not None),
        topology=topology,
    )
