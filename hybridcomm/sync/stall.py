"""The stall inspector, as Horovod has one: when a bucket's reduction has waited
longer than a warning threshold (well under the timeout), say which ranks it
waits for, instead of timing out anonymously.

Every rank publishes its progress to the process group's key-value store (how
many buckets it has launched in all, and its step count: one write of a short
string, a few microseconds on torchrun's TCPStore over loopback) at the end of
every step, so what a report names is current: a rank that stopped publishing
has stopped stepping, and its numbers are those of its last step. A rank whose
wait turns slow publishes its own at once and reads everyone's: a rank that
has launched fewer buckets is behind this one (it skipped a backward, left the
loop early, or its model's graph differs), and the warning names it with its
numbers. The store is torch.distributed's own (the rendezvous), so this works
while the data-plane connections are stuck.

``HYBRIDCOMM_STALL_WARN`` sets the threshold in seconds (default: a fifth of
the timeout, at most 60 s; 0 turns the inspector off).

Example::

    >>> warn_after(300.0), warn_after(20.0)
    (60.0, 4.0)
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Dict, List, Optional

import torch.distributed as dist

from ..config import env

log = logging.getLogger("hybridcomm")

_instances = itertools.count()  # every rank makes its synchronizers in the same order


def warn_after(timeout: float) -> float:
    """The seconds a wait may take before the inspector looks (0: never)."""
    value = env.get("HYBRIDCOMM_STALL_WARN")
    return min(60.0, timeout / 5) if value is None else value


class StallInspector:
    """Progress in the store, and who a slow wait is waiting for.

    Args:
        group: the process group the buckets are reduced over.
        timeout: the library's timeout (the threshold is derived from it).
    """

    def __init__(self, group, timeout: float):
        self.warn_s = warn_after(timeout)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else \
            list(range(self.world))
        self.prefix = f"hybridcomm/stall/{next(_instances)}/{'-'.join(map(str, ranks))}"
        self._key = f"{self.prefix}/{self.rank}"
        try:
            self.store = dist.distributed_c10d._get_default_store() if self.warn_s > 0 else None
        except Exception:  # noqa: BLE001 - no store (an unusual init): no inspector
            self.store = None

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def publish(self, launches: int, steps: int, force: bool = False) -> None:
        """This rank's progress, at every step's end and before it reports a stall
        (``force``: kept for callers; every call publishes). A store that fails
        (its host gone) is left alone: the next collective reports the peer."""
        if self.store is not None:
            try:
                self.store.set(self._key, f"{launches} {steps} {time.time():.3f}")
            except Exception as e:  # noqa: BLE001 - diagnostics must never break a step
                log.debug("hybridcomm stall inspector: publishing progress failed: %s", e)

    def progress(self) -> Dict[int, List[float]]:
        """rank -> [launches, steps, when] for every rank that has published."""
        out = {}
        for r in range(self.world):
            key = f"{self.prefix}/{r}"
            if self.store.check([key]):
                launches, steps, when = self.store.get(key).decode().split()
                out[r] = [int(launches), int(steps), float(when)]
        return out

    def explain(self, what: str, launches: int, steps: int) -> Optional[str]:
        """Why ``what`` waits: the ranks behind this one, or None if none is."""
        if self.store is None:
            return None
        self.publish(launches, steps, force=True)
        seen = self.progress()
        now = time.time()
        behind = {r: p for r, p in seen.items() if p[0] < launches}
        silent = [r for r in range(self.world) if r not in seen]
        if not behind and not silent:
            return None
        parts = [f"rank {r} has launched {p[0]} buckets in all after {p[1]} steps "
                 f"(last heard {now - p[2]:.0f}s ago)" for r, p in sorted(behind.items())]
        parts += [f"rank {r} has not reported any step" for r in silent]
        return (f"hybridcomm stall: {what} has waited over {self.warn_s:g}s; this rank "
                f"(rank {self.rank}) has launched {launches} buckets after {steps} steps; "
                + "; ".join(parts) + ". A rank behind skipped a backward, left the training "
                "loop early, or runs a model whose graph differs; it must launch the same "
                "buckets (or this wait ends in a timeout)")

    def bucket_is_slow(self, plan, index: int, launches: int, steps: int) -> Optional[str]:
        """A wait on bucket ``index`` of ``plan`` turned slow: name the ranks behind,
        if any (logged, and returned for the timeout's message). Never raises."""
        layers = ", ".join(plan.buckets[index].layers)
        try:
            why = self.explain(f"bucket {index} ({layers})", launches, steps)
        except Exception as e:  # noqa: BLE001 - the inspector must never break a wait
            why = f"hybridcomm stall: bucket {index} ({layers}) is slow; the inspector failed: {e}"
        if why:
            log.warning(why)
        return why
