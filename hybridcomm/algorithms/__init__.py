"""All-reduce algorithms as pure schedules (see schedule.py for the format).

``SCHEDULES[name](rank, world_size, numel)`` gives the steps one rank runs;
the two-level ones (``TOPOLOGY_AWARE``) also take a :class:`Topology`.

May import: ``base``. Pure: no torch.distributed, no device.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

from . import butterfly, halving_doubling, hierarchical, ring, torus2d
from .schedule import Recv, Schedule, Send, Step, equal_bounds, equal_padding, tail_block, tail_body
from .simulate import ScheduleError, simulate
from .topology import Topology

SCHEDULES = {
    "ring": ring.schedule,
    "butterfly": butterfly.schedule,
    "halving_doubling": halving_doubling.schedule,
    "hierarchical": hierarchical.schedule,
    "torus2d": torus2d.schedule,
}
ALGORITHMS = tuple(SCHEDULES)
# The phases of a sharded reduction (sharded optimizer state): the algorithms
# that have them, each phase's schedule, and the part a rank owns after it.
REDUCE_SCATTER, ALL_GATHER, ALL_REDUCE = "reduce_scatter", "all_gather", "all_reduce"
PHASED = {
    "ring": {REDUCE_SCATTER: ring.reduce_scatter_schedule, ALL_GATHER: ring.all_gather_schedule},
    "halving_doubling": {
        REDUCE_SCATTER: halving_doubling.reduce_scatter_schedule,
        ALL_GATHER: halving_doubling.all_gather_schedule,
    },
}
# ``native`` (the process group's own reduce_scatter / all_gather, no schedule of
# ours) cuts a segment into equal parts: its layout pads the segment to fit
SHARD_BOUNDS = {
    "ring": ring.shard_bounds,
    "halving_doubling": halving_doubling.shard_bounds,
    "native": equal_bounds,
}
SHARDABLE = tuple(SHARD_BOUNDS)  # what a sharded bucket may be reduce-scattered with
TOPOLOGY_AWARE = ("hierarchical", "torus2d")


def get_schedule(
    algorithm: str, rank: int, world_size: int, numel: int, topology: Optional[Topology] = None
) -> Schedule:
    """Cached schedule; raises ValueError for an unknown algorithm name.

    ``topology`` (node size, grid) matters to ``TOPOLOGY_AWARE`` algorithms
    only; None takes the defaults (``Topology.resolve``), read on every call
    so that the cache never serves a stale one.
    """
    if algorithm not in SCHEDULES:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    topo = (topology or Topology()).resolve(world_size) if algorithm in TOPOLOGY_AWARE else None
    return _cached(algorithm, rank, world_size, numel, topo=topo)


@lru_cache(maxsize=4096)
def get_phase_schedule(
    phase: str, algorithm: str, rank: int, world_size: int, numel: int, tail: int = 0
) -> Schedule:
    """The schedule of one ``phase`` of ``algorithm``'s all-reduce (``PHASED``);
    ``tail``: each rank's block of the last ``world_size * tail`` elements rides
    along (``schedule.tail_body``; the whole buffer is all-reduced in ALL_REDUCE).

    >>> len(get_phase_schedule(ALL_GATHER, "ring", 0, 3, 90).steps)
    2
    """
    if phase == ALL_REDUCE:
        return get_schedule(algorithm, rank, world_size, numel)
    if algorithm not in PHASED:
        raise ValueError(f"{algorithm!r} has no {phase} of its own; one of {tuple(PHASED)}")
    return PHASED[algorithm][phase](rank, world_size, numel, tail)


@lru_cache(maxsize=4096)
def _cached(algorithm: str, rank: int, world_size: int, numel: int, topo) -> Schedule:
    if topo is None:
        return SCHEDULES[algorithm](rank, world_size, numel)
    return SCHEDULES[algorithm](rank, world_size, numel, topo)


__all__ = [
    "ALGORITHMS",
    "SCHEDULES",
    "PHASED",
    "SHARD_BOUNDS",
    "SHARDABLE",
    "REDUCE_SCATTER",
    "ALL_GATHER",
    "tail_body",
    "tail_block",
    "equal_bounds",
    "equal_padding",
    "ALL_REDUCE",
    "get_phase_schedule",
    "TOPOLOGY_AWARE",
    "Topology",
    "get_schedule",
    "simulate",
    "ScheduleError",
    "Schedule",
    "Step",
    "Send",
    "Recv",
]
