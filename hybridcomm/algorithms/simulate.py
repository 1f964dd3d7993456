"""In-memory execution of schedules over P buffers, for tests and tools.

Messages between each ordered pair of ranks are matched first-in first-out
with no tags, as NCCL matches them, so an order mismatch between two ranks
shows up here as a length mismatch, a deadlock or a wrong sum. Besides the
values it tracks, per element and rank, whether the final value was produced
by exactly one ``final`` reduction (or copied from one), which is where the
executor applies the ``avg`` scale.
"""

from __future__ import annotations

from collections import deque
from typing import Dict, List, Optional, Sequence, Tuple

from .schedule import Schedule


class ScheduleError(AssertionError):
    """The schedules are inconsistent: unmatched, mis-sized or deadlocked."""


def simulate(
    schedules: Sequence[Schedule],
    inputs: Sequence[Sequence[float]],
    owned: Optional[Sequence[Tuple[int, int]]] = None,
    phase: str = "all_reduce",
) -> List[list]:
    """Run every rank's schedule; return each rank's final buffer.

    ``inputs[r]`` is rank r's buffer (any numbers: Python ints keep it exact).
    Raises :class:`ScheduleError` on any inconsistency. A phase alone (sharded
    state) takes ``owned[r]``, rank r's part (a range, or a list of them): a
    ``"reduce_scatter"`` must make
    that part final (the rest is left partial); an ``"all_gather"`` starts with
    it final and must make everything final.

    Example::

        >>> from hybridcomm.algorithms import ring
        >>> simulate([ring.schedule(r, 3, 4) for r in range(3)], [[1] * 4] * 3)
        [[3, 3, 3, 3], [3, 3, 3, 3], [3, 3, 3, 3]]
    """
    p = len(schedules)
    bufs = [list(x) for x in inputs]
    final = [[p == 1] * len(b) for b in bufs]
    owned = [[o] if o and isinstance(o[0], int) else list(o) for o in owned or ()]
    if phase == "all_gather":
        for r, ranges in enumerate(owned):
            for lo, hi in ranges:
                final[r][lo:hi] = [True] * (hi - lo)
    queues: Dict[Tuple[int, int], deque] = {}
    pos = [0] * p  # index of each rank's current step
    posted = [False] * p  # whether that step's sends are posted

    def post(r):
        for s in schedules[r].steps[pos[r]].sends:
            if not 0 <= s.peer < p or s.peer == r:
                raise ScheduleError(f"rank {r} sends to invalid peer {s.peer}")
            msg = (bufs[r][s.start : s.stop], final[r][s.start : s.stop])
            queues.setdefault((r, s.peer), deque()).append(msg)
        posted[r] = True

    def try_finish(r):
        recvs = schedules[r].steps[pos[r]].recvs
        need: Dict[int, int] = {}
        for rv in recvs:
            need[rv.peer] = need.get(rv.peer, 0) + 1
        if any(len(queues.get((peer, r), ())) < n for peer, n in need.items()):
            return False
        for rv in recvs:
            data, fin = queues[(rv.peer, r)].popleft()
            if len(data) != rv.stop - rv.start:
                raise ScheduleError(
                    f"rank {r} step {pos[r]} expects {rv.stop - rv.start} elements from "
                    f"rank {rv.peer}, got {len(data)}"
                )
            for i, (x, f) in enumerate(zip(data, fin), start=rv.start):
                if rv.reduce:
                    if final[r][i] or f:
                        raise ScheduleError(f"rank {r} reduces into already-final element {i}")
                    bufs[r][i] = bufs[r][i] + x
                    if rv.final:
                        final[r][i] = True
                else:
                    bufs[r][i], final[r][i] = x, f
        pos[r] += 1
        posted[r] = False
        return True

    while True:
        progress = False
        for r in range(p):
            if pos[r] < len(schedules[r].steps):
                if not posted[r]:
                    post(r)
                    progress = True
                progress |= try_finish(r)
        if all(pos[r] == len(schedules[r].steps) for r in range(p)):
            break
        if not progress:
            stuck = {r: pos[r] for r in range(p) if pos[r] < len(schedules[r].steps)}
            raise ScheduleError(f"deadlock: ranks stuck at steps {stuck}")
    left = {k: len(q) for k, q in queues.items() if q}
    if left:
        raise ScheduleError(f"sends never received (src, dst): count {left}")
    for r in range(p):
        for lo, hi in owned[r] if phase == "reduce_scatter" else [(0, len(final[r]))]:
            if not all(final[r][lo:hi]):
                i = lo + final[r][lo:hi].index(False)
                raise ScheduleError(f"rank {r} element {i} never got its final value")
    return bufs
