"""The transport contract: move bytes between ranks, nothing else.

A transport posts one schedule step's sends and receives together
(``exchange``) and runs the process group's own all-reduce (``all_reduce``,
the ``native`` algorithm). Tensors are 1-D contiguous views into the caller's
buffers: a transport never copies or allocates on the data path. Two kinds:

* host-ordered (``stream_ordered = False``, gloo): ``exchange`` returns a
  :class:`Pending` the caller waits on, with a timeout;
* stream-ordered (``stream_ordered = True``, NCCL): work is queued on the
  transport's one comm stream (:class:`CommStream`); completion is an event.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Protocol, Sequence, Tuple

import torch

from ...base.errors import HybridCommError

Transfer = Tuple[int, torch.Tensor]  # (peer rank in the group, 1-D contiguous tensor)
_ALREADY = contextlib.nullcontext()


class OrderedTask:
    """Work run in a transport's issue order by the thread that issues for it: its
    ``result`` once ``issued`` (or the ``error`` running it raised). ``ordered``: a
    whole operation in the issue order, whose failure fails the transport."""

    __slots__ = ("fn", "what", "result", "error", "issued", "ordered")

    def __init__(self, fn, what: str = ""):
        self.fn, self.what = fn, what
        self.result = self.error = None
        self.issued = self.ordered = False


class Pending(Protocol):
    def wait(self, timeout: float | None = None) -> None:
        """Block until every posted transfer is done, or raise HybridCommTimeout."""


class Transport(Protocol):
    rank: int
    world_size: int
    stream_ordered: bool

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]):
        """Post all sends and receives of one step as a group."""


class CommStream:
    """The comm stream of a stream-ordered transport: everything it issues goes
    there, in issue order, ordered against other streams by events only."""

    stream_ordered = True
    # a thread whose current stream is the comm stream for its whole life (the
    # communicator's thread): stream_context costs nothing there
    _stream_thread = None

    def _init_stream(self, runtime, priority: int) -> None:
        self.runtime = runtime
        self.stream = runtime.new_stream(priority)

    def stream_context(self):
        """``with t.stream_context():`` makes the comm stream current (kernels
        launched inside queue after the communication issued so far)."""
        if threading.current_thread() is self._stream_thread:
            return _ALREADY
        return self.runtime.use(self.stream)

    def wait_event(self, event) -> None:
        """The comm stream waits for ``event`` (e.g. gradients ready on the compute stream)."""
        self.stream.wait_event(event)

    def record_event(self):
        """An event on the comm stream now: done when everything issued so far is."""
        ev = self.runtime.new_event()
        ev.record(self.stream)
        return ev


def own_part(t, rank: int, world_size: int):
    """``rank``'s equal part of the flat ``t`` (a view): what a reduce-scatter leaves
    it, what an all-gather sends from it (in place, as NCCL defines it)."""
    if t.numel() % world_size:
        raise HybridCommError(
            f"a native reduce-scatter or all-gather needs {world_size} "
            f"equal parts; {t.numel()} elements do not split so"
        )
    part = t.numel() // world_size
    return t[rank * part : (rank + 1) * part]
