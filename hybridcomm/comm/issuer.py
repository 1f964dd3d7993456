"""The thread that issues a transport's GPU work, in one order for every caller.

NCCL matches operations by their order on a communicator, so everything a
rank issues on one transport must be issued in the same order on every rank.
Issuing from the gradient hooks (autograd's thread) puts each bucket's NCCL
group calls and reduction launches on the thread that launches the next
backward kernels; an :class:`Issuer` takes them off it. There is one per
transport (``issuer_for``), shared by the optimizer's channels and, once it
exists, by ``all_reduce``, the DDP hook and the averager (``issue_in_order``):
two threads issuing on one communicator would interleave differently on
each rank.

Example (``queue`` queues work on the transport's comm stream and returns its
done event)::

    done = issue_in_order(transport, queue, "all_reduce", timeout=60)
    rt.current_stream().wait_event(done)
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Optional

from ..base.errors import HybridCommTimeout


class _Issue:
    """An operation submitted to an :class:`Issuer`: its result once the thread has
    issued it (or the error issuing it raised)."""

    __slots__ = ("fn", "what", "result", "error", "issued")

    def __init__(self, fn, what: str):
        self.fn, self.what = fn, what
        self.result = self.error = None
        self.issued = False


class Issuer:
    """The thread that issues a transport's work, in submission order.

    One per transport (``issuer_for``), shared by every channel on it and by
    ``all_reduce`` and the DDP hook once it exists: two threads issuing on one
    communicator would interleave differently on each rank (NCCL matches by
    order). Bound to the rank's device; lives as long as the process (a daemon).
    """

    def __init__(self, transport):
        self.transport = transport
        self._cv = threading.Condition()
        self._queue: deque = deque()
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="hybridcomm-issue", daemon=True)
        self._thread.start()

    def submit(self, fn, what: str) -> _Issue:
        issue = _Issue(fn, what)
        with self._cv:
            self._queue.append(issue)
            self._cv.notify_all()
        return issue

    def _run(self) -> None:
        self.transport.runtime.bind_thread()
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                issue = self._queue[0]
            try:
                if self.error is not None:
                    raise self.error  # nothing is issued after a failure
                issue.result = issue.fn()
            except BaseException as e:  # noqa: BLE001 - surfaced by the waits
                issue.error = e
                if self.error is None:
                    self.error = e
            with self._cv:
                issue.issued, issue.fn = True, None
                self._queue.popleft()
                self._cv.notify_all()

    def drain(self, timeout: float) -> None:
        """Until everything submitted so far is issued (tests, shutdown)."""
        self.result(self.submit(lambda: None, "drain"), "draining the issue queue", timeout)

    def result(self, issue: _Issue, what: str, timeout: float):
        """``issue``'s result once issued (a host wait for the issuing only), or the
        error issuing it raised."""
        if not issue.issued:
            # A backstop only: the transport's watchdog aborts a call blocked on a peer
            # at the timeout, and the issuing thread's error (naming the rank and the
            # step) is what the wait raises.
            limit = 2 * timeout
            deadline = time.perf_counter() + limit
            with self._cv:
                while not issue.issued:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        raise HybridCommTimeout(
                            f"rank {self.transport.rank}: {what} not issued within {limit:g}s "
                            "(the issuing thread is blocked on a peer?)")
                    self._cv.wait(min(left, 1.0))
        if issue.error is not None:
            raise issue.error
        return issue.result


_issuers: dict = {}
_issuers_lock = threading.Lock()


def issuer_for(transport, create: bool = True) -> Optional[Issuer]:
    """The transport's issuing thread (made on first use when ``create``)."""
    with _issuers_lock:
        hit = _issuers.get(id(transport))
        if hit is None or hit.transport is not transport:
            if not create:
                return None
            hit = _issuers[id(transport)] = Issuer(transport)
        return hit


def issue_in_order(transport, fn, what: str, timeout: float):
    """``fn()`` (which queues work on ``transport``'s stream), in the transport's issue
    order: on its issuing thread when it has one (the caller waits for the issue,
    not for the device), else right here."""
    issuer = issuer_for(transport, create=False)
    if issuer is None:
        return fn()
    return issuer.result(issuer.submit(fn, what), what, timeout)
