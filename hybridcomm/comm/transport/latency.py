"""An emulated high-latency network: a fixed delay added to every step's messages.

The development kernels have no ``netem`` (``tbf`` shapes bandwidth only), so
:class:`LatencyTransport` wraps another transport: a step completes no sooner
than ``delay`` seconds after it was posted, its transfers sharing the delay, so
a step costs ``max(delay, real time)``. An emulation: results taken with it must
say so, and torch.distributed's own collectives cannot be wrapped.

Example::

    >>> from hybridcomm.algorithms import get_schedule
    >>> from hybridcomm.comm.executor import execute
    >>> from hybridcomm.comm.transport import TorchDistTransport
    >>> t = LatencyTransport(TorchDistTransport(), delay=500e-6)
    >>> execute(get_schedule("ring", 0, 1, 4), torch.ones(4), t)
    tensor([1., 1., 1., 1.])
"""

from __future__ import annotations

import time
from typing import Sequence

from .base import Pending, Transfer, Transport

# time.sleep overshoots by ~50-100 us on a loaded box; the last stretch spins.
_SPIN_S = 100e-6


class _DelayedPending:
    __slots__ = ("inner", "due")

    def __init__(self, inner: Pending, due: float):
        self.inner, self.due = inner, due

    def wait(self, timeout: float | None = None) -> None:
        self.inner.wait(timeout)
        left = self.due - time.perf_counter()
        if left > _SPIN_S:
            time.sleep(left - _SPIN_S)
        while time.perf_counter() < self.due:
            pass


class LatencyTransport:
    """``inner`` with ``delay`` seconds of emulated latency per step's messages."""

    def __init__(self, inner: Transport, delay: float):
        if delay < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay}")
        self.inner, self.delay = inner, float(delay)
        self.rank, self.world_size = inner.rank, inner.world_size

    def __getattr__(self, name):  # group, tag, backend, ...: the inner transport's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> Pending:
        due = time.perf_counter() + self.delay
        return _DelayedPending(self.inner.exchange(sends, recvs), due)
