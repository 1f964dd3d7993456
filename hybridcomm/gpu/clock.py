"""The clock the planner's inputs are measured on: the host's, or the GPU's.

What the planner learns from the measured steps (when each gradient is ready,
each bucket's overlap window from launch to first use) must be the device's
times on a GPU: the host runs ahead of its stream, so a host timestamp taken
in a gradient hook says when the hook *ran*, not when the gradient was
computed. :class:`DeviceClock` stamps with timing events recorded on the
current stream instead, and reads them only once the measurements are taken
(at a re-plan: one host sync then, none in the steps measured).

Example (the host path)::

    >>> clock = clock_for(None)
    >>> a = clock.stamp(); b = clock.stamp()
    >>> clock.settle([a, b]); clock.seconds(a, b) >= 0.0
    True
"""

from __future__ import annotations

import time
from typing import Iterable


class HostClock:
    """Host timestamps (``time.perf_counter``): the host path, where the work runs
    when the host calls it."""

    device = False

    @staticmethod
    def stamp() -> float:
        return time.perf_counter()

    @staticmethod
    def settle(stamps: Iterable) -> None:
        """Nothing to wait for: host stamps are taken when they happen."""

    @staticmethod
    def seconds(start: float, end: float) -> float:
        return end - start


class DeviceClock:
    """Timing events on the current stream of ``runtime``'s device: a stamp is
    where the stream is when the host records it, read on the GPU's clock."""

    device = True

    def __init__(self, runtime):
        self.runtime = runtime

    def stamp(self):
        event = self.runtime.new_event(timing=True)
        event.record(self.runtime.current_stream())
        return event

    @staticmethod
    def settle(stamps: Iterable) -> None:
        """Wait until every stamp has been reached (a host sync for each one still
        pending: call this once, when the measurements are taken)."""
        for event in stamps:
            if not event.query():
                event.synchronize()

    @staticmethod
    def seconds(start, end) -> float:
        return start.elapsed_time(end) * 1e-3


def clock_for(runtime):
    """The GPU's clock for a device runtime, the host's for the host path (None)."""
    return HostClock() if runtime is None else DeviceClock(runtime)
