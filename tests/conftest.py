"""Shared pytest setup.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, so it
is set here, before the test modules (and through them the kernels) import.

The ``fast`` mark and its check (a fast test starts no process): tests/tiers.py.
"""

import contextlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

# The first torch.optim.Optimizer a process makes imports torch._dynamo (about 1.7 s of
# CPU here). Imported once in this process, it is inherited by every rank a test forks
# (tests/multiproc.py), which would each import it again.
import torch._dynamo  # noqa: E402,F401
import pytest  # noqa: E402

import tiers  # noqa: E402

_session_guard = None
_spawn_log = tiers.SpawnLog(os.environ[tiers.LOG_ENV]) if os.environ.get(tiers.LOG_ENV) else None


def pytest_configure(config):
    global _session_guard
    config.addinivalue_line(
        "markers",
        f"{tiers.FAST}: runs in the pytest process alone, no process started "
        "(make test-fast; checked in every run: tests/tiers.py)",
    )
    config.addinivalue_line(
        "markers",
        f"{tiers.SLOW}: left out of make test-fast although its module is '{tiers.FAST}' "
        "(the kernels' largest sizes under the Triton interpreter; a test that starts a "
        "process, such as a compiler or a fresh interpreter)",
    )
    if tiers.fast_session() and _session_guard is None:
        _session_guard = tiers.refusing("this session (HYBRIDCOMM_TEST_TIER=fast)")
        _session_guard.__enter__()


def pytest_unconfigure(config):
    global _session_guard
    if _session_guard is not None:
        _session_guard.__exit__(None, None, None)
        _session_guard = None


def pytest_collection_modifyitems(config, items):
    tiers.last_in_their_process(items)


def _phase(item):
    """The guard a test's phase runs under: the spawn log's watch, the fast tier's
    refusal of processes, or none."""
    if _spawn_log is not None:
        return tiers.watching(_spawn_log.started.append)
    if tiers.in_fast_tier(item) and _session_guard is None:
        return tiers.refusing(item.nodeid)
    return contextlib.nullcontext()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    if _spawn_log is not None:
        _spawn_log.begin()
    with _phase(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _phase(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _phase(item):
        yield
    if _spawn_log is not None:
        _spawn_log.end(item.nodeid, tiers.in_fast_tier(item))
