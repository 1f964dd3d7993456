"""A Downpour parameter-server shard that survives being killed.

:class:`ParameterShard` holds one server's share of the parameters (of every
*part* of a model-parallel replica), applies pushes one at a time under a lock
(SGD or Adagrad), applies a push sent twice once, and checkpoints itself.
:class:`ShardServer` serves it over :mod:`.wire`, a thread a connection, and
started again with the same index resumes from the checkpoint (the workers
replay the rest, :mod:`.link`). Details: docs/STRATEGIES.md, "A killed server
comes back".

Example (one worker, in one process)::

    >>> import tempfile, threading
    >>> from hybridcomm.strategies import DownpourSGD
    >>> rdv = tempfile.mkdtemp()
    >>> server = ShardServer(0, workers=1, rendezvous=rdv, timeout=30)
    >>> t = threading.Thread(target=server.run); t.start()
    >>> opt = DownpourSGD(model, ["server0"], lr=0.1, worker=0, rendezvous=rdv)
    >>> opt.zero_grad(); loss_fn(model(torch.randn(3, 4)), torch.randn(3, 2)).backward()
    >>> opt.step(); opt.close(); t.join()
    >>> torch.load(f"{rdv}/server0.pt", weights_only=True)["pushes"]
    1
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch

from ...config import env
from ...base.errors import HybridCommError, HybridCommTimeout
from . import wire as ps_wire

log = logging.getLogger("hybridcomm")

RULES = ("sgd", "adagrad")
FORMAT = 2  # 2: parts and claims (a format-1 checkpoint is one part, "")


class ParameterShard:
    """One server's share of the parameters, its update rule and its checkpoint.

    ``workers`` maps a worker id to ``[session, last push applied]``; ``durable``
    the same sequence numbers as of the last checkpoint written. ``parts`` maps
    a part to the names this shard holds of it, ``claims`` every name any part
    has (here or on another shard) to its part. ``tensors`` are part ``""``'s.
    """

    def __init__(
        self,
        tensors: Dict[str, torch.Tensor],
        rule: str,
        lr: float,
        eps: float = 1e-10,
        path: Optional[str] = None,
        checkpoint_every: int = 50,
    ):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        self.params: Dict[str, torch.Tensor] = {}
        self.rule, self.lr, self.eps = rule, lr, eps
        self.sums: Optional[Dict[str, torch.Tensor]] = {} if rule == "adagrad" else None
        self.parts: Dict[str, List[str]] = {}
        self.claims: Dict[str, str] = {}
        self.lock = threading.Lock()
        if tensors:
            self.add_part("", tensors, list(tensors))
        self.pushes = 0
        self.workers: Dict[int, List] = {}
        self.closed: set = set()
        self.durable: Dict[int, int] = {}
        self.path, self.checkpoint_every = path, checkpoint_every

    def add_part(self, part: str, tensors: Dict[str, torch.Tensor], names: List[str]) -> None:
        """Hold ``tensors``, part ``part``'s share here; ``names`` are all of the
        part's parameters (on every shard), each of which no other part may claim:
        every part tells every shard all its names, so a name two parts claim is
        refused wherever they meet first."""
        with self.lock:
            if part in self.parts:
                raise HybridCommError(f"part {part!r} is set up already")
            stray = sorted(set(tensors) - set(names))
            if stray:
                raise HybridCommError(f"part {part!r} sent {stray}, not among its names")
            taken = sorted(n for n in names if self.claims.get(n, part) != part)
            if taken:
                raise HybridCommError(
                    f"part {part!r} claims {taken}, which part {self.claims[taken[0]]!r} holds: "
                    "each parameter belongs to one part (give the parts' parameters distinct "
                    "names, e.g. DownpourStage's 'stage{k}.' prefix)"
                )
            for n in names:
                self.claims[n] = part
            self.parts[part] = list(tensors)
            for k, v in tensors.items():
                self.params[k] = v.detach().clone()
                if self.sums is not None:
                    self.sums[k] = torch.zeros_like(self.params[k])

    def names_of(self, part: str) -> List[str]:
        """All of ``part``'s names, as it claimed them (on every shard)."""
        return sorted(n for n, p in self.claims.items() if p == part)

    def fetch(self, part: Optional[str] = None) -> Dict[str, torch.Tensor]:
        """The parameters of ``part`` held here (all of them for ``None``)."""
        with self.lock:
            if part is not None and part not in self.parts:
                raise HybridCommError(f"no part {part!r} here (parts: {sorted(self.parts)})")
            names = self.params if part is None else self.parts[part]
            return {k: self.params[k].clone() for k in names}

    def hello(self, worker: int, session: str) -> Tuple[int, int]:
        """A worker (re)connects: ``(last push applied, last checkpointed)`` of its
        session; a new session (a new worker process) starts from 0."""
        with self.lock:
            if self.workers.get(worker, [None])[0] != session:
                self.workers[worker] = [session, 0]
                self.durable[worker] = 0
                self.closed.discard(worker)
            return self.workers[worker][1], self.durable.get(worker, 0)

    def push(
        self, grads: Dict[str, torch.Tensor], worker: int = -1, session: str = "", seq: int = 0
    ) -> Tuple[int, int]:
        """Apply ``grads`` unless this worker's push ``seq`` was applied already;
        returns ``(pushes applied, this worker's last checkpointed seq)``."""
        with self.lock:  # the server serves connections on threads: one push at a time
            entry = self.workers.setdefault(worker, [session, 0])
            if entry[0] != session:
                raise HybridCommError(
                    f"a push from worker {worker} of a session this server "
                    "has not been told about (no hello)"
                )
            if seq and seq <= entry[1]:  # sent again after a reconnect: already here
                return self.pushes, self.durable.get(worker, 0)
            for k, g in grads.items():
                if self.sums is not None:
                    self.sums[k].add_(g * g)
                    self.params[k].sub_(self.lr * g / (self.sums[k].sqrt() + self.eps))
                else:
                    self.params[k].sub_(g, alpha=self.lr)
            self.pushes += 1
            entry[1] = max(entry[1], seq)
            if self.path and self.pushes % self.checkpoint_every == 0:
                self._save()
            return self.pushes, self.durable.get(worker, 0)

    def close(self, worker: int) -> None:
        with self.lock:
            self.closed.add(worker)
            if self.path:
                self._save()

    def checkpoint(self) -> None:
        with self.lock:
            self._save()

    def _save(self) -> None:
        state = {
            "format": FORMAT,
            "rule": self.rule,
            "lr": self.lr,
            "eps": self.eps,
            "pushes": self.pushes,
            "params": self.params,
            "sums": self.sums or {},
            "parts": self.parts,
            "claims": self.claims,
            "workers": {w: list(v) for w, v in self.workers.items()},
            "closed": sorted(self.closed),
        }
        # temporary file, fsync, rename: a crash leaves the old checkpoint or the new one
        tmp = f"{self.path}.tmp"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # durable before a worker is told it may drop its log
        os.replace(tmp, self.path)
        self.durable = {w: v[1] for w, v in self.workers.items()}

    @classmethod
    def restore(cls, path: str, checkpoint_every: int = 50) -> "ParameterShard":
        """The shard a checkpoint holds (read with ``weights_only=True``)."""
        try:
            state = torch.load(path, weights_only=True)
            if state.get("format") not in (1, FORMAT):
                raise ValueError(f"format {state.get('format')!r}, expected 1 or {FORMAT}")
            shard = cls(
                {},
                state["rule"],
                state["lr"],
                state["eps"],
                path=path,
                checkpoint_every=checkpoint_every,
            )
            shard.params = {k: v.clone() for k, v in state["params"].items()}
            # format 1 knew one part, ""
            shard.parts = {
                str(p): [str(n) for n in ns]
                for p, ns in state.get("parts", {"": list(shard.params)}).items()
            }
            shard.claims = {
                str(n): str(p)
                for n, p in state.get("claims", {n: "" for n in shard.params}).items()
            }
            if shard.sums is not None:
                shard.sums = {k: v.clone() for k, v in state["sums"].items()}
            shard.pushes = int(state["pushes"])
            shard.workers = {int(w): [str(v[0]), int(v[1])] for w, v in state["workers"].items()}
            shard.closed = set(state["closed"])
        except Exception as e:
            raise HybridCommError(f"cannot resume from the checkpoint {path}: {e}") from e
        shard.durable = {w: v[1] for w, v in shard.workers.items()}
        return shard


class ShardServer:
    """Serve shard ``index`` until ``workers`` workers have closed.

    Args:
        index: the shard's index (``server{index}``).
        workers: how many workers will close before the server stops.
        rendezvous: a directory where ``server{index}.addr`` is published (and the
            checkpoint kept, unless ``checkpoint_dir`` says elsewhere).
        host: the interface to listen on (default loopback); a wildcard
            (``0.0.0.0``, ``::``) publishes this machine's host name.
        port: the port (0: a free one).
        checkpoint_every: pushes between checkpoints.
        timeout: seconds any single send or receive may take; the server stops
            (``HybridCommTimeout``) when no worker has sent anything for twice this
            long (a worker may spend a whole timeout reconnecting to another shard).
    """

    def __init__(
        self,
        index: int,
        workers: int,
        *,
        rendezvous: Optional[str] = None,
        host: str = "127.0.0.1",
        port: int = 0,
        checkpoint_dir: Optional[str] = None,
        checkpoint_every: int = 50,
        timeout: Optional[float] = None,
    ):
        if workers < 1 or checkpoint_every < 1:
            raise ValueError("workers and checkpoint_every must be >= 1")
        checkpoint_dir = checkpoint_dir or rendezvous
        if checkpoint_dir is None:
            raise ValueError("a server needs a rendezvous directory or a checkpoint_dir")
        self.name, self.workers = f"server{index}", workers
        self.timeout, self.checkpoint_every = env.timeout(timeout), checkpoint_every
        os.makedirs(checkpoint_dir, exist_ok=True)
        self.path = os.path.join(checkpoint_dir, f"{self.name}.pt")
        self.shard: Optional[ParameterShard] = None
        if os.path.exists(self.path):
            self.shard = ParameterShard.restore(self.path, checkpoint_every)
            if len(self.shard.closed) >= workers:
                raise HybridCommError(
                    f"{self.name}: {self.path} is the checkpoint of a finished "
                    "job (every worker closed): use a fresh directory"
                )
            log.warning(
                "Downpour %s: resumed from %s (%d pushes; workers' last pushes %s)",
                self.name,
                self.path,
                self.shard.pushes,
                {w: v[1] for w, v in self.shard.workers.items()},
            )
        self._init_lock = threading.Lock()
        self._listener = ps_wire.listen(host, port)
        bound = self._listener.getsockname()[1]
        shown = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
        self.address = ps_wire.format_address(shown, bound)
        self._done = threading.Event()
        self._heard = time.monotonic()
        if rendezvous is not None:
            os.makedirs(rendezvous, exist_ok=True)
            ps_wire.publish(rendezvous, self.name, self.address)

    def run(self) -> int:
        """Serve until every worker has closed; returns the pushes applied (over the
        shard's life, the ones before a restart included)."""
        self._listener.settimeout(0.2)
        try:
            while not self._done.is_set():
                if time.monotonic() - self._heard > 2 * self.timeout:
                    closed = sorted(self.shard.closed) if self.shard else []
                    raise HybridCommTimeout(
                        f"Downpour {self.name}: no worker sent anything for "
                        f"{2 * self.timeout:g}s; {len(closed)} of {self.workers} closed"
                    )
                try:
                    sock, _ = self._listener.accept()
                except socket.timeout:
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(
                    target=self._serve, args=(sock,), daemon=True, name=f"{self.name}-conn"
                ).start()
        finally:
            self._listener.close()
            if self.shard is not None:
                self.shard.checkpoint()
        return self.shard.pushes if self.shard else 0

    def _serve(self, sock: socket.socket) -> None:
        """One connection: requests answered in order until the worker leaves."""
        with sock:
            while not self._done.is_set():
                try:
                    header, tensors = ps_wire.recv(sock, timeout=2 * self.timeout)
                except HybridCommError:
                    return  # gone, silent or garbled: a live worker reconnects
                self._heard = time.monotonic()
                try:
                    reply, out = self._handle(header, tensors)
                except Exception as e:  # a bad request: the worker raises it, the server goes on
                    reply, out = (
                        {"op": "error", "message": f"{self.name}: {type(e).__name__}: {e}"},
                        None,
                    )
                try:
                    ps_wire.send(sock, reply, out, timeout=self.timeout)
                except HybridCommError:
                    return
                if header["op"] == "close" and self._all_closed():
                    self._done.set()  # after the reply: the last worker hears back first

    def _all_closed(self) -> bool:
        return self.shard is not None and len(self.shard.closed) >= self.workers

    def _handle(self, header: dict, tensors: Dict[str, torch.Tensor]):
        op = header["op"]
        if op == "hello":
            ready = self.shard is not None and str(header.get("part", "")) in self.shard.parts
            applied, durable = (
                self.shard.hello(_int(header, "worker"), str(header["session"]))
                if ready
                else (0, 0)
            )
            return {
                "op": "ok",
                "ready": ready,
                "applied": applied,
                "durable": durable,
                "checkpoint_every": self.checkpoint_every,
            }, None
        if op == "init":
            self._init(header, tensors)
            return {"op": "ok"}, None
        if self.shard is None:
            raise HybridCommError(f"{op} before any worker set the shard up")
        if op == "fetch":
            return {"op": "ok"}, self.shard.fetch(str(header.get("part", "")))
        if op == "push":
            self._check(tensors, exact=False)
            pushes, durable = self.shard.push(
                tensors, _int(header, "worker"), str(header["session"]), _int(header, "seq")
            )
            return {"op": "ok", "pushes": pushes, "durable": durable}, None
        if op == "close":
            self.shard.close(_int(header, "worker"))
            return {"op": "ok", "pushes": self.shard.pushes}, None
        raise HybridCommError(f"unknown request {op!r}")

    def _init(self, header: dict, tensors: Dict[str, torch.Tensor]) -> None:
        """The first worker of each part sets the part up (checkpointed at once: a
        restart before the first periodic checkpoint still finds it); the others
        must agree: rule, lr, and their part's names, shapes and dtypes."""
        rule, lr = header["rule"], float(header["lr"])
        part = str(header.get("part", ""))
        names = [str(n) for n in header.get("names", list(tensors))]
        with self._init_lock:
            fresh = self.shard is None
            if fresh:
                self.shard = ParameterShard(
                    {}, rule, lr, path=self.path, checkpoint_every=self.checkpoint_every
                )
            if (rule, lr) != (self.shard.rule, self.shard.lr):
                raise HybridCommError(
                    f"the shard runs {self.shard.rule} at lr "
                    f"{self.shard.lr:g}; a worker asked for {rule} at lr {lr:g}"
                )
            if part not in self.shard.parts:
                self.shard.add_part(part, tensors, names)
                self.shard.checkpoint()
                return
        if sorted(names) != self.shard.names_of(part):
            raise HybridCommError(
                f"part {part!r} has {self.shard.names_of(part)}, a worker of it "
                f"sent the names {sorted(names)}"
            )
        self._check(tensors, exact=True, part=part)

    def _check(self, tensors: Dict[str, torch.Tensor], exact: bool, part: str = "") -> None:
        params = self.shard.params
        if exact and set(tensors) != set(self.shard.parts[part]):
            raise HybridCommError(
                f"this shard holds {sorted(self.shard.parts[part])}"
                + (f" of part {part!r}" if part else "")
                + f", a worker sent {sorted(tensors)}"
            )
        for k, t in tensors.items():
            p = params.get(k)
            if p is None:
                raise HybridCommError(f"{k}: not held by this shard (it holds {sorted(params)})")
            if p.shape != t.shape or p.dtype != t.dtype:
                raise HybridCommError(
                    f"{k}: {t.dtype} {tuple(t.shape)} does not match the "
                    f"shard's {p.dtype} {tuple(p.shape)}"
                )


def _int(header: dict, key: str) -> int:
    value = header.get(key)
    if type(value) is not int:
        raise HybridCommError(f"'{key}' must be an integer, got {value!r}")
    return value
