"""The two test tiers: ``make test-fast`` runs the fast tier; ``make test`` everything.

The fast tier is the tests marked ``fast`` (a test, or its module) and not ``slow``
(``slow`` takes a case out of a fast module: the kernels' largest sizes, a test that
starts a compiler or a fresh interpreter): ``-m "fast and not slow"``. A test of the fast tier runs in the
pytest process alone: no spawned rank, no subprocess (threads are fine: the fakes in
tests/fakes run ranks as threads). That is checked, not trusted: in every run, each
such test's setup, call and teardown run with process creation refused
(:func:`refusing`), so a fast test that starts a process fails with its name
whichever tier runs it, and the mark cannot rot. Under ``HYBRIDCOMM_TEST_TIER=fast``
(``make test-fast``) the refusal holds for the whole session.

``HYBRIDCOMM_SPAWN_LOG=PATH`` records instead of refusing: one JSON line per test
(node id, whether it started a process, its duration), for finding tests that
could be fast.
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing.process
import os
import subprocess
import threading
import time

FAST = "fast"
SLOW = "slow"  # left out of the fast tier: ``-m "fast and not slow"``
TIER_ENV = "HYBRIDCOMM_TEST_TIER"
LOG_ENV = "HYBRIDCOMM_SPAWN_LOG"

_OS_CALLS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")


class ProcessStarted(RuntimeError):
    pass


# The originals, as this module found them (a nested watch calls these, not the watch
# around it)
_POPEN_INIT = subprocess.Popen.__init__
_PROCESS_START = multiprocessing.process.BaseProcess.start
_OS = {name: getattr(os, name) for name in _OS_CALLS if hasattr(os, name)}


def _patched(on_start):
    """Replacements for every way Python starts a process, each calling
    ``on_start(how)`` first (which may raise)."""
    popen_init, start = _POPEN_INIT, _PROCESS_START

    @functools.wraps(popen_init)
    def popen(self, *args, **kwargs):
        on_start(f"subprocess.Popen({args[0] if args else kwargs.get('args')!r})")
        popen_init(self, *args, **kwargs)

    @functools.wraps(start)
    def process_start(self):
        on_start(f"multiprocessing {type(self).__name__}.start() ({self.name})")
        return start(self)

    out = [
        (subprocess.Popen, "__init__", popen),
        (multiprocessing.process.BaseProcess, "start", process_start),
    ]
    for name, real in _OS.items():

        @functools.wraps(real)
        def call(*args, _real=real, _name=name, **kwargs):
            on_start(f"os.{_name}()")
            return _real(*args, **kwargs)

        call.__module__ = "os"  # (pickled by reference as os.<name>, as the original is)
        out.append((os, name, call))
    return out


_lock = threading.Lock()


@contextlib.contextmanager
def watching(on_start):
    """Every process start inside calls ``on_start(how)`` first."""
    patches = _patched(on_start)
    with _lock:
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        for owner, name, fn in patches:
            setattr(owner, name, fn)
    try:
        yield
    finally:
        with _lock:
            for owner, name, fn in saved:
                setattr(owner, name, fn)


def refusing(what: str):
    """Process starts inside raise :class:`ProcessStarted` naming ``what``."""

    def refuse(how: str):
        raise ProcessStarted(
            f"{what} is marked '{FAST}' (tests/tiers.py), but started a process: {how}. "
            f"A fast test runs in the pytest process alone: use the fakes in tests/fakes, "
            f"or drop the '{FAST}' mark"
        )

    return watching(refuse)


def in_fast_tier(item) -> bool:
    """Marked ``fast`` (itself or its module) and not ``slow``."""
    return item.get_closest_marker(FAST) is not None and item.get_closest_marker(SLOW) is None


def fast_session() -> bool:
    return os.environ.get(TIER_ENV) == FAST


class SpawnLog:
    """Records, per test, whether it started a process (``HYBRIDCOMM_SPAWN_LOG``)."""

    def __init__(self, path: str):
        self.path = path
        self.started: list = []
        self.t0 = 0.0

    def begin(self):
        self.started, self.t0 = [], time.perf_counter()

    def end(self, nodeid: str, marked: bool):
        row = {
            "test": nodeid,
            "fast": marked,
            "spawned": bool(self.started),
            "how": self.started[:1],
            "seconds": round(time.perf_counter() - self.t0, 3),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def last_in_their_process(items) -> None:
    """Items of a module that sets ``RUN_LAST = True`` run after every other item of
    the session (stable order otherwise): such a module uses the library in the
    test's own process (a process group of one rank, tests/fakes/world.py), and
    the library's process-wide state that outlives it (parameter classes, caches
    keyed by ``id``) must not be inherited by the rank processes a later test
    forks. ``make test`` runs such modules in the doctests' lane, which forks
    nothing; this order keeps a one-process ``pytest tests`` safe too."""

    def last(item) -> bool:
        return getattr(getattr(item, "module", None), "RUN_LAST", False)

    late = [i for i in items if last(i)]
    if late:
        items[:] = [i for i in items if not last(i)] + late
