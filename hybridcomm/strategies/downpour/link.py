"""A Downpour worker's link to one server shard: requests with a deadline,
reconnection with bounded retries, and a log of the pushes to replay.

Each push carries ``(worker, session, seq)``; the link keeps those the server's
last checkpoint lacks, and after a broken connection reconnects (backing off
from 50 ms to 1 s, re-reading the published address) and replays what the
server lacks. How: docs/STRATEGIES.md, "A killed server comes back".

Example (a server that never started: a clear error once the retries end)::

    >>> import tempfile
    >>> link = ServerLink("server0", tempfile.mkdtemp(), worker=0, session="s", timeout=0.3)
    >>> try:
    ...     link.hello()
    ... except HybridCommError as e:
    ...     print(str(e).split(" (")[0])
    Downpour: server0 unreachable for 0.3s
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Dict, List, Optional

import torch

from ...base.errors import HybridCommError, HybridCommTimeout
from . import wire as ps_wire
from .wire import ConnectionLost

log = logging.getLogger("hybridcomm")


class ServerLink:
    """One worker's connection to ``name``: ``host:port``, or a name published in
    ``rendezvous`` (``serverN``). ``part``: the part of a model-parallel replica
    this worker holds (``""``: the whole model); it sets up and fetches that part."""

    def __init__(
        self,
        name: str,
        rendezvous: Optional[str],
        *,
        worker: int,
        session: str,
        timeout: float,
        log_limit: Optional[int] = None,
        part: str = "",
    ):
        if ":" not in name and rendezvous is None:
            raise ValueError(
                f"server {name!r} is neither host:port nor a name to look up: "
                "pass rendezvous= (or call init_downpour first)"
            )
        self.name, self.rendezvous = name, rendezvous
        self.worker, self.session, self.timeout = worker, session, timeout
        self.part = part
        self.log_limit = log_limit
        self.log: collections.deque = collections.deque()  # (seq, grads) not yet checkpointed
        self.seq = 0  # the last push sent
        self.replayed = self.lost = self.reconnects = 0
        self.shard_pushes = 0  # the pushes the shard had applied (all workers') at the last ack
        self.reconnect_seconds = 0.0  # spent reconnecting and replaying
        self._lost_through = 0  # pushes up to here were counted lost already
        self._sock = None
        self._address = "?"
        self._pending_ack = False
        self._fetch_on: Optional[object] = None  # the socket a fetch request went out on
        self._hello: dict = {}  # the server's answer to the last hello

    # --- the requests ---------------------------------------------------------------
    def hello(self) -> bool:
        """Connect (waiting up to ``timeout`` for the server); True if its shard is set up."""
        return self._reconnect("connecting", first=True)

    def init(
        self,
        tensors: Dict[str, torch.Tensor],
        rule: str,
        lr: float,
        names: Optional[List[str]] = None,
    ) -> None:
        """Set up (or check) this part's ``tensors`` on the shard; ``names``: all of
        the part's parameters, on every shard (default: ``tensors``' names)."""
        self._call(
            {
                "op": "init",
                "rule": rule,
                "lr": lr,
                "part": self.part,
                "names": list(tensors) if names is None else list(names),
            },
            tensors,
            "setting up its shard",
        )

    def push(self, grads: Dict[str, torch.Tensor]) -> None:
        """Log and send a push; its ack is read later (:meth:`finish_push`)."""
        self.seq += 1
        self.log.append((self.seq, grads))
        if self.log_limit is not None and len(self.log) > self.log_limit:
            self.log.popleft()  # if the server crashes before checkpointing it: lost
        self._pending_ack = True
        self._send(self._push_header(self.seq), grads, f"sending push {self.seq}")

    def finish_push(self) -> None:
        if not self._pending_ack:
            return
        self._pending_ack = False
        try:
            self._ack(self._recv(f"applying push {self.seq}"))
        except ConnectionLost as e:  # the reconnect replays it if the server lacks it
            self._reconnect(f"applying push {self.seq}", cause=e)

    def start_fetch(self) -> None:
        self._fetch_on = self._sock
        self._send({"op": "fetch", "part": self.part}, None, "asking for its parameters")

    def finish_fetch(self) -> Dict[str, torch.Tensor]:
        self.finish_push()  # its ack comes first on this connection
        if self._fetch_on is self._sock and self._sock is not None:
            try:
                return self._recv("sending its parameters")[1]
            except ConnectionLost as e:
                self._reconnect("sending its parameters", cause=e)
        return self._call({"op": "fetch", "part": self.part}, None, "sending its parameters")[1]

    def close(self) -> None:
        """Wait for the last push and say goodbye (the server checkpoints)."""
        try:
            self.finish_push()
            self._call(
                {"op": "close", "worker": self.worker, "session": self.session}, None, "closing"
            )
        finally:
            self._drop()

    # --- the mechanics ----------------------------------------------------------------
    def _push_header(self, seq: int) -> dict:
        return {"op": "push", "worker": self.worker, "session": self.session, "seq": seq}

    def _ack(self, reply) -> None:
        self.shard_pushes = int(reply[0].get("pushes", self.shard_pushes))
        self._forget_through(int(reply[0]["durable"]))

    def _forget_through(self, durable: int) -> None:
        """The server's checkpoint holds this worker's pushes up to ``durable``."""
        while self.log and self.log[0][0] <= durable:
            self.log.popleft()

    def _send(self, header: dict, tensors, what: str) -> None:
        """Send, or leave the link broken for the reply's reader to repair."""
        if self._sock is None:
            return
        try:
            ps_wire.send(self._sock, header, tensors, timeout=self.timeout)
        except ConnectionLost:
            self._drop()
        except HybridCommTimeout as e:
            raise self._error(HybridCommTimeout, what, e) from e

    def _recv(self, what: str):
        if self._sock is None:
            raise ConnectionLost("not connected")
        try:
            header, tensors = ps_wire.recv(self._sock, timeout=self.timeout)
        except ConnectionLost:
            raise
        except HybridCommError as e:
            kind = HybridCommTimeout if isinstance(e, HybridCommTimeout) else HybridCommError
            raise self._error(kind, what, e) from e
        if header["op"] == "error":
            raise HybridCommError(f"Downpour: {self.name} refused {what}: {header.get('message')}")
        return header, tensors

    def _call(self, header: dict, tensors, what: str):
        """A request and its reply, reconnecting (and replaying) when the link breaks."""
        for attempt in range(3):
            try:
                if self._sock is None:
                    raise ConnectionLost("not connected")
                ps_wire.send(self._sock, header, tensors, timeout=self.timeout)
                return self._recv(what)
            except ConnectionLost as e:
                if attempt == 2:
                    raise self._error(HybridCommError, what, e) from e
                self._reconnect(what, cause=e)
            except HybridCommTimeout as e:
                raise self._error(HybridCommTimeout, what, e) from e

    def _reconnect(self, what: str, cause: Optional[Exception] = None, first: bool = False):
        """Connect again within ``timeout``, then replay what the server lacks."""
        start = time.monotonic()
        deadline, delay, attempts = start + self.timeout, 0.05, 0
        while True:
            self._drop()
            attempts += 1
            try:
                ready = self._open(deadline)
                if ready and not first:
                    self._replay()
                elif not ready and not first:
                    raise HybridCommError(
                        f"Downpour: {self.name} came back without its shard "
                        f"(no checkpoint at {self._address}'s checkpoint_dir?)"
                    )
                break
            except ConnectionLost as e:
                cause = e
            except HybridCommTimeout as e:  # connected (or connecting), then silence
                raise self._error(HybridCommTimeout, what, e) from e
            if time.monotonic() + delay >= deadline:
                raise HybridCommError(
                    f"Downpour: {self.name} unreachable for {self.timeout:g}s ({attempts} "
                    f"attempts) while {what}; last address {self._address}: {cause}"
                ) from cause
            time.sleep(delay)
            delay = min(2 * delay, 1.0)
        if not first:
            self.reconnects += 1
            self.reconnect_seconds += time.monotonic() - start
            log.warning(
                "Downpour worker %d: reconnected to %s at %s after %.2fs (%d attempts): "
                "%d pushes replayed, %d lost so far",
                self.worker,
                self.name,
                self._address,
                time.monotonic() - start,
                attempts,
                self.replayed,
                self.lost,
            )
        return ready

    def _open(self, deadline: float) -> bool:
        """Look the server up, connect and say hello; True if its shard is set up."""
        left = max(deadline - time.monotonic(), 1e-3)
        self._address = (
            self.name if ":" in self.name else ps_wire.lookup(self.rendezvous, self.name)
        )
        self._sock = ps_wire.connect(self._address, timeout=min(left, self.timeout))
        ps_wire.send(
            self._sock,
            {"op": "hello", "worker": self.worker, "session": self.session, "part": self.part},
            None,
            timeout=self.timeout,
        )
        reply = self._recv("saying hello")[0]
        if self.log_limit is None:  # every push a crash can take from the checkpoint
            self.log_limit = int(reply["checkpoint_every"]) + 1
        self._hello = reply
        return bool(reply["ready"])

    def _replay(self) -> None:
        """Send again the logged pushes the server lacks; count the ones it lacks
        that the log no longer holds."""
        applied = int(self._hello["applied"])
        if applied > self.seq:
            raise HybridCommError(
                f"Downpour: {self.name} has push {applied} of this worker, "
                f"which sent only {self.seq}"
            )
        first_logged = self.log[0][0] if self.log else self.seq + 1
        gone = min(first_logged - 1, self.seq) - max(applied, self._lost_through)
        if gone > 0:
            self.lost += gone
            log.warning(
                "Downpour worker %d: %s lost %d of its pushes (beyond its log of %d)",
                self.worker,
                self.name,
                gone,
                self.log_limit,
            )
        self._lost_through = max(self._lost_through, first_logged - 1)
        self._forget_through(int(self._hello["durable"]))
        for seq, grads in list(self.log):
            if seq > applied:
                ps_wire.send(self._sock, self._push_header(seq), grads, timeout=self.timeout)
                self._ack(self._recv(f"replaying push {seq}"))
                self.replayed += 1
        self._pending_ack = False

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _error(self, kind, what: str, e: Exception) -> HybridCommError:
        return kind(
            f"Downpour: {self.name} ({self._address}) failed while {what} (dead, or "
            f"silent for {self.timeout:g}s?): {e}"
        )
