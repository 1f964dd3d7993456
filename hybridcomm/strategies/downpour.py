"""Downpour SGD (Dean et al. 2012): asynchronous SGD with a sharded parameter server.

The parameters are split across S server processes (shards, balanced by
bytes); each model replica (a worker process) fetches them every ``n_fetch``
steps and pushes its accumulated gradients every ``n_push`` steps, with no
barrier: a slow worker delays nobody. Each shard applies what arrives on its
own (SGD or Adagrad), one push at a time under a lock, so no update is lost.
Everything goes over ``torch.distributed.rpc``; every call has a deadline and
a dead or silent server is a :class:`HybridCommError` naming it.

Left out: the paper's model-parallel replicas (a replica split across several
workers, each exchanging its own part with the shards); here a replica is one
process.

Usage::

    role, name = init_downpour(rank, workers=4, servers=2, init_method="file:///tmp/rdv")
    if role == "server":
        serve()                                   # until every worker has closed
    else:
        opt = DownpourSGD(model, servers=["server0", "server1"], lr=0.05)
        for x, y in loader:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        opt.close()
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed.rpc as rpc

from .. import env
from ..errors import HybridCommError, HybridCommTimeout
from ..transport.torch_dist import looks_like_timeout

RULES = ("sgd", "adagrad")


class ParameterShard:
    """One server's share of the parameters and the rule that updates them."""

    def __init__(self, tensors: Dict[str, torch.Tensor], rule: str, lr: float,
                 eps: float = 1e-10):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        self.params = {k: v.detach().clone() for k, v in tensors.items()}
        self.rule, self.lr, self.eps = rule, lr, eps
        self.sums = {k: torch.zeros_like(v) for k, v in self.params.items()} \
            if rule == "adagrad" else None
        self.pushes = 0
        self.lock = threading.Lock()

    def fetch(self) -> Dict[str, torch.Tensor]:
        with self.lock:
            return {k: v.clone() for k, v in self.params.items()}

    def push(self, grads: Dict[str, torch.Tensor]) -> int:
        with self.lock:  # RPC runs requests on a thread pool: one push at a time
            for k, g in grads.items():
                if self.sums is not None:
                    self.sums[k].add_(g * g)
                    self.params[k].sub_(self.lr * g / (self.sums[k].sqrt() + self.eps))
                else:
                    self.params[k].sub_(g, alpha=self.lr)
            self.pushes += 1
            return self.pushes


# --- what a server process runs (RPC targets: module functions on the server) --------
_shard: Optional[ParameterShard] = None
_shard_lock = threading.Lock()


def _init_shard(tensors: Dict[str, torch.Tensor], rule: str, lr: float) -> bool:
    """The first worker to arrive sets the shard up; the others find it ready."""
    global _shard
    with _shard_lock:
        if _shard is None:
            _shard = ParameterShard(tensors, rule, lr)
    return True


def _fetch() -> Dict[str, torch.Tensor]:
    return _shard.fetch()


def _push(grads: Dict[str, torch.Tensor]) -> int:
    return _shard.push(grads)


def _pushes() -> int:
    return 0 if _shard is None else _shard.pushes


def init_downpour(rank: int, workers: int, servers: int, init_method: str,
                  timeout: Optional[float] = None) -> Tuple[str, str]:
    """Join the RPC group as ``worker{rank}`` (ranks below ``workers``) or
    ``server{rank - workers}``; returns ``(role, name)``. Collective over all
    ``workers + servers`` processes; ``init_method`` is ``file://...`` or
    ``tcp://127.0.0.1:PORT`` (a free port)."""
    timeout = env.timeout(timeout)
    role = "worker" if rank < workers else "server"
    name = f"worker{rank}" if role == "worker" else f"server{rank - workers}"
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout,
                                           _transports=["uv"], _channels=["basic"])
    try:
        with _quiet_rpc():
            rpc.init_rpc(name, rank=rank, world_size=workers + servers,
                         rpc_backend_options=opts)
    except RuntimeError as e:
        raise HybridCommError(f"{name}: joining the Downpour RPC group failed: {e}") from e
    return role, name


@contextlib.contextmanager
def _quiet_rpc():
    """Hides the deprecation warning torch's own RPC start-up and shutdown
    barriers print on every process (they pass a gloo Backend as a group)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using a Backend")
        yield


def _shutdown(timeout: float) -> None:
    with _quiet_rpc():
        rpc.shutdown(graceful=True, timeout=timeout)


def serve(timeout: Optional[float] = None) -> int:
    """Be a parameter-server shard until every process has shut down; returns the
    pushes applied. A worker that never shuts down ends the wait after ``timeout``."""
    try:
        _shutdown(env.timeout(timeout))
    except RuntimeError as e:
        raise HybridCommError(f"a Downpour server's shutdown failed: {e}") from e
    return _pushes()


def shards_of(named: List[Tuple[str, torch.Tensor]], servers: int) -> List[List[str]]:
    """Parameter names per server: largest first onto the least-loaded server (by
    bytes), the same on every worker."""
    load = [0] * servers
    out: List[List[str]] = [[] for _ in range(servers)]
    for name, t in sorted(named, key=lambda kv: (-kv[1].numel() * kv[1].element_size(), kv[0])):
        s = min(range(servers), key=lambda i: (load[i], i))
        out[s].append(name)
        load[s] += t.numel() * t.element_size()
    return out


class DownpourSGD:
    """A model replica of Downpour SGD (run it in each worker process).

    Args:
        model: the replica; its parameters are overwritten by fetches.
        servers: the server processes' RPC names (``init_downpour`` makes them).
        lr: the servers' learning rate; ``rule``: ``"sgd"`` or ``"adagrad"``.
        n_fetch, n_push: fetch the parameters / push the accumulated gradients
            every this many steps.
        timeout: seconds any RPC may take (default ``HYBRIDCOMM_TIMEOUT``).

    ``bytes_sent`` counts the gradients pushed (the fetch requests carry none).

    Example (in a worker process, after ``init_downpour``)::

        opt = DownpourSGD(model, servers=["server0", "server1"], lr=0.05, n_push=2)
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        opt.close()
    """

    def __init__(self, model: torch.nn.Module, servers: List[str], lr: float,
                 rule: str = "sgd", n_fetch: int = 1, n_push: int = 1,
                 timeout: Optional[float] = None):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        if n_fetch < 1 or n_push < 1 or not servers:
            raise ValueError("n_fetch and n_push must be >= 1, and there must be servers")
        self.model, self.servers = model, list(servers)
        self.n_fetch, self.n_push, self.timeout = n_fetch, n_push, env.timeout(timeout)
        self.named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.shards = shards_of(list(self.named.items()), len(self.servers))
        self.acc = {n: torch.zeros_like(p) for n, p in self.named.items()}
        self.steps = 0
        self.bytes_sent = 0
        self._pending: List[Tuple[str, object]] = []
        for server, names in zip(self.servers, self.shards):
            tensors = {n: self.named[n].detach() for n in names}
            self._wait(server, "setting up its shard",
                       rpc.rpc_async(server, _init_shard, args=(tensors, rule, lr),
                                     timeout=self.timeout))
        self.fetch()

    def _wait(self, server: str, what: str, fut):
        try:
            return fut.wait()
        except Exception as e:  # RPC timeouts and dead peers alike
            kind = HybridCommTimeout if looks_like_timeout(e) else HybridCommError
            raise kind(f"Downpour: {server} failed while {what} (dead, or silent for "
                       f"{self.timeout:g}s?): {e}") from e

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def fetch(self) -> None:
        """The model <- the servers' current parameters."""
        futs = [(s, rpc.rpc_async(s, _fetch, timeout=self.timeout)) for s in self.servers]
        with torch.no_grad():
            for server, fut in futs:
                for name, value in self._wait(server, "sending its parameters", fut).items():
                    self.named[name].copy_(value)

    def push(self) -> None:
        """Send the accumulated gradients to their shards, without waiting for them
        to be applied (the previous push is waited for first: one in flight)."""
        self._finish_pushes()
        for server, names in zip(self.servers, self.shards):
            grads = {n: self.acc[n].clone() for n in names}
            self.bytes_sent += sum(g.numel() * g.element_size() for g in grads.values())
            self._pending.append((server, rpc.rpc_async(server, _push, args=(grads,),
                                                        timeout=self.timeout)))
        for a in self.acc.values():
            a.zero_()

    def _finish_pushes(self) -> None:
        pending, self._pending = self._pending, []
        for server, fut in pending:
            self._wait(server, "applying a push", fut)

    def step(self) -> None:
        """Accumulate this step's gradients; push every ``n_push`` steps and fetch
        every ``n_fetch`` steps."""
        with torch.no_grad():
            for name, p in self.named.items():
                if p.grad is not None:
                    self.acc[name].add_(p.grad)
        self.steps += 1
        if self.steps % self.n_push == 0:
            self.push()
        if self.steps % self.n_fetch == 0:
            self.fetch()

    def close(self) -> None:
        """Finish the pushes in flight and leave the RPC group (waits for the others,
        at most ``timeout``)."""
        try:
            self._finish_pushes()
        finally:
            try:
                _shutdown(self.timeout)
            except RuntimeError as e:
                raise HybridCommError(f"Downpour: leaving the RPC group failed: {e}") from e
