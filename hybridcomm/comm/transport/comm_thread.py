"""The one thread that calls a CuPy NCCL transport's communicator.

One thread per transport (``hybridcomm-nccl-r<rank>``) makes every call on the
communicator (why: :class:`~.cupy_nccl.CupyNcclTransport`): the NCCL groups and
all-reduces other threads hand it, whole operations in the transport's issue
order (:meth:`CommThread.submit_ordered`: one hand-off per operation, none per
NCCL call), the async-error query while idle, and the last call, abort or
destroy. Its current stream is the comm stream for its whole life.

Example (``transport`` a ``CupyNcclTransport``, which makes its thread)::

    thread = transport.comm_thread
    task = thread.submit_ordered(queue_bucket, "bucket 0")   # returns at once
    thread.wait_ordered(task, "bucket 0", limit=60)          # issued (not done)
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from ...base.errors import HybridCommError, HybridCommTimeout
from .base import OrderedTask

log = logging.getLogger("hybridcomm")


class CommThread:
    """The one thread that calls a transport's communicator.

    It runs the submitted tasks in turn, polls NCCL's async error while idle, and
    once the transport has failed or is closed it makes the communicator's last
    call, abort or destroy, and ends. ``t``: the CupyNcclTransport (its lock and
    condition, its failure state, its communicator).
    """

    def __init__(self, transport):
        self.t, self.nccl = transport, transport.nccl
        self.tasks: collections.deque = collections.deque()
        self.released = False
        self.thread = threading.Thread(
            target=self._run, daemon=True, name=f"hybridcomm-nccl-r{transport.rank}"
        )
        self.thread.start()

    def submit(self, fn, what: str = "") -> OrderedTask:  # caller holds the transport's lock
        task = OrderedTask(fn, what)
        self.tasks.append(task)
        self.t._cv.notify_all()
        return task

    def submit_ordered(self, fn, what: str) -> OrderedTask:
        """Queue a whole operation ``fn``, run after everything submitted before. A failure
        running it fails the transport (:meth:`_execute`): nothing is issued after it,
        or the ranks' orders would part."""
        t = self.t
        with t._cv:
            if t._aborted:
                task = OrderedTask(fn, what)
                task.error, task.issued = t._failure or t._aborted_error(), True
                return task
            task = self.submit(fn, what)
            task.ordered = True
            return task

    def wait_ordered(self, task: OrderedTask, what: str, limit: float) -> None:
        """Until ``task`` has run; raises once the transport failed (the watchdog flags
        a call blocked on a peer) or past ``limit`` seconds."""
        if task.issued:
            return
        t = self.t
        deadline = time.monotonic() + limit
        with t._cv:
            while not task.issued:
                if t._aborted:
                    raise t._failure or t._aborted_error()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HybridCommTimeout(
                        f"rank {t.rank}: {what} not issued within {limit:g}s (the "
                        "communicator's thread is blocked on a peer?)"
                    )
                t._cv.wait(min(left, 1.0))

    def _run(self) -> None:
        t = self.t
        try:
            t.runtime.bind_thread()  # NCCL's calls from this thread: the rank's device
            t._exempt_from_capture("NCCL communicator's thread")
            with t.runtime.use(t.stream):  # what it launches goes on the comm stream
                t._stream_thread = self.thread
                self._loop()
        except BaseException as e:  # noqa: BLE001 - fail the transport, then still release
            t._fail(
                HybridCommError(
                    f"rank {t.rank}: the NCCL communicator's thread failed "
                    f"({type(e).__name__}: {e}); the communicator was aborted"
                )
            )
        finally:
            t._stream_thread = None
            self._release()

    def _loop(self) -> None:
        """Run the tasks in turn; poll NCCL's async error while idle; end on failure."""
        t = self.t
        while True:
            with t._cv:
                while not self.tasks and not t._aborted:
                    if not t._cv.wait(t.WATCHDOG_PERIOD_S):
                        break
                if t._aborted:
                    return
                task = self.tasks.popleft() if self.tasks else None
            if task is None:
                self._poll()
                continue
            self._execute(task)
            with t._cv:
                task.issued = True
                t._cv.notify_all()

    def _execute(self, task: OrderedTask) -> None:
        fn, task.fn = task.fn, None
        try:
            task.result = fn()
        except BaseException as e:  # noqa: BLE001 - the waiting caller raises it (NcclError too)
            if task.ordered:  # a whole operation: nothing is issued after it
                t = self.t
                t._fail(
                    e
                    if isinstance(e, HybridCommError)
                    else HybridCommError(
                        f"rank {t.rank}: issuing {task.what} failed ({type(e).__name__}: {e}); "
                        "nothing more is issued on this communicator"
                    )
                )
            task.error = e

    def _poll(self) -> None:
        try:
            self.t.comm.check_async_error()
        except self.nccl.NcclError as e:
            self.t._fail(
                HybridCommError(
                    f"rank {self.t.rank}: NCCL reported an error "
                    f"(watchdog): {e}; the communicator was aborted"
                )
            )

    def _release(self) -> None:
        """The communicator's last call: destroy on a clean close, else abort."""
        t = self.t
        with t._cv:
            error = t._failure or t._aborted_error()
            for task in self.tasks:  # submitted after the failure: never run
                task.error, task.issued = error, True
            self.tasks.clear()
            destroy = t._destroy_on_close
        try:
            t.comm.destroy() if destroy else t.comm.abort()
        except Exception as e:  # noqa: BLE001 - nothing left to tell it to
            log.warning("rank %d: releasing the NCCL communicator failed: %s", t.rank, e)
        finally:
            with t._cv:
                self.released = True
                t._cv.notify_all()
