"""A Chrome-trace timeline (opens in Perfetto or chrome://tracing).

Spans of compute phases on the training thread and of each bucket's
all-reduce on its lane's thread, so one can see what communication ran
behind compute and what the training thread waited for.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager


class Timeline:
    """Collects spans; ``enabled=False`` makes every call a cheap no-op.

    Example::

        >>> tl = Timeline()
        >>> with tl.span("forward", "compute"):
        ...     pass
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "trace.json")
        >>> tl.write(path)  # open in ui.perfetto.dev or chrome://tracing
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.events = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def add(self, name: str, cat: str, t0: float, t1: float, **args) -> None:
        if not self.enabled:
            return
        ev = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "pid": os.getpid(),
            "tid": threading.current_thread().name,
            "ts": (t0 - self._t0) * 1e6,
            "dur": (t1 - t0) * 1e6,
            "args": args,
        }
        with self._lock:
            self.events.append(ev)

    @contextmanager
    def span(self, name: str, cat: str, **args):
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, cat, t0, time.perf_counter(), **args)

    def write(self, path: str) -> None:
        with self._lock:
            events = list(self.events)
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
