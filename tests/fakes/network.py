"""A fake network of P ranks in one process: host-ordered transports whose ranks are
threads, matching as NCCL matches and completing only on demand.

What it models, because it is what can go wrong (DESIGN.md, "Invariants"):

* **Matching per peer pair, in FIFO order, without tags.** The k-th send from rank
  s to rank d meets the k-th receive that d posts from s, whatever either was
  meant for. Two ranks issuing buckets in different orders therefore pair the
  wrong messages, and the fake says so (:class:`FakeNetworkError`, naming both
  messages) instead of letting a tag hide it, as gloo's would.
* **Completion on demand.** Posting moves nothing. A message's bytes are copied
  from the sender's buffer when one of its two sides waits for it, not when it
  was posted: a sender that writes its buffer between post and wait, or a
  receiver that reads before waiting, gets what a real network gives it.
  ``net.hold()`` keeps every wait blocked until ``net.release()``, to look at a
  rank while its messages are in flight.
* **A deadline on every wait**, whose :class:`HybridCommTimeout` names the rank,
  the peer and the message still unmatched.

The native collectives (``all_reduce``, ``reduce_scatter``, ``all_gather``: the
``native`` algorithm) match the k-th call of every rank, refuse calls of other
sizes, and sum in rank order, so every rank gets the same bits.

Example::

    net = FakeNetwork(2)
    run_ranks(2, lambda rank: net.transport(rank).exchange(
        [(1 - rank, torch.ones(3))], [(1 - rank, torch.empty(3))]).wait(5))
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Callable, List, Optional

import torch

from hybridcomm.base.errors import HybridCommError, HybridCommTimeout


class FakeNetworkError(HybridCommError):
    """Two ranks disagree: a send met a receive of another size or dtype, or a
    collective another collective."""


def _what(t: torch.Tensor) -> str:
    return f"{t.numel() * t.element_size()} B of {str(t.dtype).replace('torch.', '')}"


class _Message:
    __slots__ = ("src", "dst", "seq", "send", "recv", "send_label", "recv_label", "done", "error")

    def __init__(self, src: int, dst: int, seq: int):
        self.src, self.dst, self.seq = src, dst, seq
        self.send = self.recv = None
        self.send_label = self.recv_label = ""
        self.done = False
        self.error: Optional[BaseException] = None

    def describe(self) -> str:
        return f"message #{self.seq} from rank {self.src} to rank {self.dst}"


class _Collective:
    __slots__ = ("kind", "tensors", "done", "error")

    def __init__(self, kind: str, world: int):
        self.kind = kind
        self.tensors: List[Optional[torch.Tensor]] = [None] * world
        self.done = False
        self.error: Optional[BaseException] = None


class FakeNetwork:
    """The P ranks' shared wire. ``transport(rank)`` is that rank's transport."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._cv = threading.Condition()
        # (src, dst) -> messages in post order, matched by position (FIFO, no tags)
        self._pairs = defaultdict(list)
        self._sends = defaultdict(int)  # (src, dst) -> sends posted so far
        self._recvs = defaultdict(int)  # (src, dst) -> receives posted so far
        self._calls = [0] * world_size  # collectives called, per rank
        self._collectives: dict = {}
        self._held = False
        self.log: List[tuple] = []  # ("send" | "recv", src, dst, seq, bytes, label), in post order

    def transport(self, rank: int) -> "FakeTransport":
        return FakeTransport(self, rank)

    # ---- point to point -------------------------------------------------------------
    def _message(self, src: int, dst: int, seq: int) -> _Message:
        msgs = self._pairs[(src, dst)]
        while len(msgs) <= seq:
            msgs.append(_Message(src, dst, len(msgs)))
        return msgs[seq]

    def post(self, rank: int, sends, recvs, label) -> "FakePending":
        mine = []
        with self._cv:
            for peer, t in sends:
                self._check_peer(rank, peer)
                seq = self._sends[(rank, peer)]
                self._sends[(rank, peer)] += 1
                m = self._message(rank, peer, seq)
                m.send, m.send_label = t, label
                self.log.append(("send", rank, peer, seq, t.numel() * t.element_size(), label))
                mine.append(m)
            for peer, t in recvs:
                self._check_peer(rank, peer)
                seq = self._recvs[(peer, rank)]
                self._recvs[(peer, rank)] += 1
                m = self._message(peer, rank, seq)
                m.recv, m.recv_label = t, label
                self.log.append(("recv", peer, rank, seq, t.numel() * t.element_size(), label))
                mine.append(m)
            for m in mine:
                if m.send is not None and m.recv is not None and m.error is None:
                    if m.send.numel() != m.recv.numel() or m.send.dtype != m.recv.dtype:
                        m.error = FakeNetworkError(
                            f"{m.describe()}: rank {m.src} sent {_what(m.send)}"
                            f" ({m.send_label or 'unlabelled'}), rank {m.dst} posted a receive of"
                            f" {_what(m.recv)} ({m.recv_label or 'unlabelled'}): the ranks issue"
                            " in different orders"
                        )
            self._cv.notify_all()
        return FakePending(self, rank, mine)

    def _check_peer(self, rank: int, peer: int) -> None:
        if not 0 <= peer < self.world_size or peer == rank:
            raise FakeNetworkError(f"rank {rank}: no peer {peer} in a world of {self.world_size}")

    def wait(self, rank: int, messages: List[_Message], timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            for m in messages:
                while (m.send is None or m.recv is None or self._held) and m.error is None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        missing = "send" if m.send is None else "receive"
                        who = m.src if m.send is None else m.dst
                        raise HybridCommTimeout(
                            f"rank {rank}: {m.describe()} not matched within {timeout}s: "
                            f"rank {who} never posted its {missing}"
                        )
                    self._cv.wait(left)
                if m.error is not None:
                    raise m.error
                if not m.done:  # completion on demand: the bytes move now
                    m.recv.copy_(m.send)
                    m.done = True
            self._cv.notify_all()

    # ---- collectives (the process group's own: `native`) -------------------------------
    def collective(self, rank: int, kind: str, t: torch.Tensor, timeout, combine) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            k = self._calls[rank]
            self._calls[rank] += 1
            c = self._collectives.setdefault(k, _Collective(kind, self.world_size))
            first = next((x for x in c.tensors if x is not None), None)
            if c.kind != kind or (
                first is not None and (first.numel() != t.numel() or first.dtype != t.dtype)
            ):
                c.error = FakeNetworkError(
                    f"collective #{k}: rank {rank} called {kind} of {_what(t)} where another "
                    f"rank called {c.kind}" + (f" of {_what(first)}" if first is not None else "")
                )
            c.tensors[rank] = t
            if all(x is not None for x in c.tensors) and c.error is None and not c.done:
                combine(c.tensors)
                c.done = True
            self._cv.notify_all()
            while not c.done and c.error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    absent = [r for r, x in enumerate(c.tensors) if x is None]
                    raise HybridCommTimeout(
                        f"rank {rank}: {kind} #{k} not joined by ranks {absent} within {timeout}s"
                    )
                self._cv.wait(left)
            if c.error is not None:
                raise c.error

    # ---- the test's hand on the wire -----------------------------------------------------
    def hold(self) -> None:
        """Every wait blocks (posting goes on) until :meth:`release`."""
        with self._cv:
            self._held = True

    def release(self) -> None:
        with self._cv:
            self._held = False
            self._cv.notify_all()

    def sends(self, src: int, dst: int) -> List[tuple]:
        """(seq, bytes, label) of every send from ``src`` to ``dst``, in post order."""
        return [(e[3], e[4], e[5]) for e in self.log if e[0] == "send" and e[1:3] == (src, dst)]


class FakePending:
    """One step's posted transfers; ``wait`` completes them (the bytes move then)."""

    def __init__(self, net: FakeNetwork, rank: int, messages: List[_Message]):
        self.net, self.rank, self.messages = net, rank, messages

    def wait(self, timeout: Optional[float] = None) -> None:
        self.net.wait(self.rank, self.messages, timeout)


def _sum_in_rank_order(tensors):
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


class FakeTransport:
    """One rank's side of a :class:`FakeNetwork`: the host-ordered transport contract
    (hybridcomm/comm/transport/base.py), as ``TorchDistTransport`` over gloo keeps it."""

    kind = "fake"
    stream_ordered = False

    def __init__(self, net: FakeNetwork, rank: int):
        self.net, self.rank, self.world_size = net, rank, net.world_size

    def exchange(self, sends, recvs, *, label=None) -> FakePending:
        return self.net.post(self.rank, list(sends), list(recvs), label)

    def all_reduce(self, t, *, average: bool, timeout: Optional[float] = None) -> None:
        def combine(ts):
            total = _sum_in_rank_order(ts)
            for x in ts:
                x.copy_(total)

        self.net.collective(self.rank, "all_reduce", t, timeout, combine)
        if average:
            t.mul_(1.0 / self.world_size)

    def reduce_scatter(self, t, *, average: bool, timeout: Optional[float] = None) -> None:
        world = self.world_size
        part = t.numel() // world

        def combine(ts):
            total = _sum_in_rank_order(ts)
            for r, x in enumerate(ts):
                x[r * part : (r + 1) * part].copy_(total[r * part : (r + 1) * part])

        self.net.collective(self.rank, "reduce_scatter", t, timeout, combine)
        if average:
            t[self.rank * part : (self.rank + 1) * part].mul_(1.0 / world)

    def all_gather(self, t, *, timeout: Optional[float] = None) -> None:
        part = t.numel() // self.world_size

        def combine(ts):
            for r, src in enumerate(ts):
                mine = src[r * part : (r + 1) * part].clone()
                for x in ts:
                    x[r * part : (r + 1) * part].copy_(mine)

        self.net.collective(self.rank, "all_gather", t, timeout, combine)


def run_ranks(world_size: int, fn: Callable[[int], object], timeout: float = 30.0) -> list:
    """``fn(rank)`` on ``world_size`` threads of this process (no process is started);
    their results in rank order. The first rank's exception is raised, naming it; a
    rank still running after ``timeout`` seconds is a failure naming it."""
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def body(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # (re-raised below, in the test's thread)
            errors[rank] = e

    threads = [
        threading.Thread(target=body, args=(r,), name=f"fake-rank-{r}", daemon=True)
        for r in range(world_size)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for r, t in enumerate(threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            raise AssertionError(f"rank {r} still running after {timeout}s (a hang)")
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"rank {r} failed: {type(e).__name__}: {e}") from e
    return results
