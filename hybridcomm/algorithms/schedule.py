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


def chunk_bounds(numel: int, parts: int, i: int) -> Tuple[int, int]:
    """``[start, stop)`` of chunk ``i`` when ``numel`` is split into ``parts``
    near-equal chunks (sizes differ by at most one; some may be empty)."""
    return i * numel // parts, (i + 1) * numel // parts


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
    return Schedule(algorithm, rank, world_size, numel, tuple(s for s in steps if s is not None),
                    topology)
