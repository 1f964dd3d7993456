"""The stall inspector, as Horovod has one: when a bucket's reduction has waited
longer than a warning threshold (well under the timeout), say which ranks it
waits for, instead of timing out anonymously.

Every rank publishes its progress (buckets launched, steps) to the process
group's key-value store; a rank whose wait turns slow reads everyone's and
names the ranks that launched fewer buckets. The store is torch.distributed's
own (the rendezvous), so this works while the data-plane connections are
stuck. docs/TROUBLESHOOTING.md explains the warning; ``HYBRIDCOMM_STALL_WARN``
sets the threshold (docs/API.md).

Example::

    >>> warn_after(300.0), warn_after(20.0)
    (60.0, 4.0)
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
import weakref
from typing import Dict, List, Optional

import torch.distributed as dist

from ..config import env

log = logging.getLogger("hybridcomm")

_instances = itertools.count()  # every rank makes its synchronizers in the same order
PUBLISH_EVERY_S = 0.25  # the publishing thread's pause between writes
_publishers: "weakref.WeakSet[StallInspector]" = weakref.WeakSet()


@atexit.register
def _stop_publishers() -> None:
    """At exit, every publishing thread stopped and joined first: one left inside a
    store write while the interpreter finalizes dies in C++ ("terminate called
    without an active exception")."""
    for inspector in list(_publishers):
        inspector.close()


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
        ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
        )
        self.prefix = f"hybridcomm/stall/{next(_instances)}/{'-'.join(map(str, ranks))}"
        self._key = f"{self.prefix}/{self.rank}"
        try:
            self.store = dist.distributed_c10d._get_default_store() if self.warn_s > 0 else None
        except Exception:  # noqa: BLE001 - no store (an unusual init): no inspector
            self.store = None
        self._latest = None  # (launches, steps, when): the newest numbers, to be written
        self._lock = threading.Lock()  # one write at a time, none older than the last
        self._wake = threading.Event()  # newer numbers to write
        self._stop = threading.Event()
        self._thread = None
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def publish(self, launches: int, steps: int, force: bool = False) -> None:
        """This rank's progress, at every step's end (left for the publishing thread:
        a write is a store round trip, with every rank's load on one server, so
        not in the step; the newest numbers reach the store within
        ``PUBLISH_EVERY_S``) and before it reports a stall (``force``: written
        now). A store that fails (its host gone) is left alone: the next
        collective reports the peer."""
        if self.store is None:
            return
        self._latest = (launches, steps, time.time())
        if force:
            self._write()
            return
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(
                target=self._publishing, daemon=True, name=f"hybridcomm stall {self._key}"
            )
            _publishers.add(self)
            self._thread.start()
        self._wake.set()

    def _publishing(self) -> None:
        while True:
            self._wake.wait()
            if self._closed:
                return
            self._wake.clear()
            self._write()
            if self._stop.wait(PUBLISH_EVERY_S):  # a few writes a second at most
                return

    def _write(self) -> None:
        with self._lock:
            launches, steps, when = self._latest
            try:
                self.store.set(self._key, f"{launches} {steps} {when:.3f}")
            except Exception as e:  # noqa: BLE001 - diagnostics must never break a step
                log.debug("hybridcomm stall inspector: publishing progress failed: %s", e)

    def close(self, wait_s: float = 5.0) -> None:
        """The publishing thread stopped and joined (the synchronizer's close(), and at
        exit): a write under way finishes first, for at most ``wait_s``."""
        self._closed = True
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)

    def progress(self) -> Dict[int, List[float]]:
        """rank -> [launches, steps, when] for every rank that has published."""
        out = {}
        for r in range(self.world):
            key = f"{self.prefix}/{r}"
            if self.store.check([key]):
                launches, steps, when = self.store.get(key).decode().split()
                out[r] = [int(launches), int(steps), float(when)]
        return out

    def explain(
        self,
        what: str,
        launches: int,
        steps: int,
        unit: str = "buckets",
        hint: str = "A rank behind skipped a backward, left the training loop early, or runs "
        "a model whose graph differs; it must launch the same buckets",
    ) -> Optional[str]:
        """Why ``what`` waits: the ranks behind this one, or None if none is. ``unit``
        names what ``launches`` counts; ``hint`` says what a rank behind may have done."""
        if self.store is None:
            return None
        self.publish(launches, steps, force=True)
        seen = self.progress()
        now = time.time()
        behind = {r: p for r, p in seen.items() if p[0] < launches}
        silent = [r for r in range(self.world) if r not in seen]
        if not behind and not silent:
            return None
        parts = [
            f"rank {r} has launched {p[0]} {unit} in all after {p[1]} steps "
            f"(last heard {now - p[2]:.0f}s ago)"
            for r, p in sorted(behind.items())
        ]
        parts += [f"rank {r} has not reported any step" for r in silent]
        return (
            f"hybridcomm stall: {what} has waited over {self.warn_s:g}s; this rank "
            f"(rank {self.rank}) has launched {launches} {unit} after {steps} steps; "
            + "; ".join(parts)
            + f". {hint} (or this wait ends in a timeout)"
        )

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
