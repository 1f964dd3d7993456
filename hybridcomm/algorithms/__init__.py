"""All-reduce algorithms as pure schedules (see schedule.py for the format).

``SCHEDULES[name](rank, world_size, numel)`` gives the steps one rank runs.
"""
from __future__ import annotations

from functools import lru_cache

from . import butterfly, halving_doubling, ring
from .schedule import Recv, Schedule, Send, Step
from .simulate import ScheduleError, simulate

SCHEDULES = {
    "ring": ring.schedule,
    "butterfly": butterfly.schedule,
    "halving_doubling": halving_doubling.schedule,
}
ALGORITHMS = tuple(SCHEDULES)


@lru_cache(maxsize=4096)
def get_schedule(algorithm: str, rank: int, world_size: int, numel: int) -> Schedule:
    """Cached schedule; raises ValueError for an unknown algorithm name."""
    try:
        make = SCHEDULES[algorithm]
    except KeyError:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}") from None
    return make(rank, world_size, numel)


__all__ = ["ALGORITHMS", "SCHEDULES", "get_schedule", "simulate", "ScheduleError",
           "Schedule", "Step", "Send", "Recv"]
