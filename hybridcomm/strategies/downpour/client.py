"""Downpour SGD (Dean et al. 2012): asynchronous SGD with a sharded parameter server.

Each worker (:class:`DownpourSGD`) fetches the parameters from the shards every
``n_fetch`` steps and pushes its accumulated gradients every ``n_push`` steps,
with no barrier; each shard applies pushes as they come (:mod:`.server`) over a
framed TCP protocol (:mod:`.wire`), and a killed shard resumes from its
checkpoint while the workers replay what it missed (:mod:`.link`). Usage,
recovery and what is covered: docs/STRATEGIES.md, "Downpour".
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ...config import env
from ...base.errors import HybridCommError
from .link import ServerLink
from .server import RULES, ParameterShard, ShardServer

__all__ = ["DownpourSGD", "ParameterShard", "RULES", "init_downpour", "serve", "shards_of"]

log = logging.getLogger("hybridcomm")


@dataclass(frozen=True)
class _Job:
    """What ``init_downpour`` learned, the defaults of ``serve`` and ``DownpourSGD``."""

    rank: int
    workers: int
    servers: int
    rendezvous: str
    timeout: Optional[float]


_job: Optional[_Job] = None


def init_downpour(
    rank: int, workers: int, servers: int, init_method: str, timeout: Optional[float] = None
) -> Tuple[str, str]:
    """This process's part: ``("worker", "worker{rank}")`` for ranks below ``workers``,
    else ``("server", "server{rank - workers}")``. ``init_method`` is
    ``file://DIR``: a directory every process can read (created if missing), where
    servers publish their addresses and keep their checkpoints. Not collective:
    workers wait (up to ``timeout``) for the servers when they connect.

    >>> import tempfile
    >>> init_downpour(5, workers=4, servers=2, init_method=f"file://{tempfile.mkdtemp()}")
    ('server', 'server1')
    """
    global _job
    if not 0 <= rank < workers + servers or workers < 1 or servers < 1:
        raise HybridCommError(
            f"init_downpour: rank {rank} of {workers} workers + {servers} "
            "servers (need at least one of each)"
        )
    scheme, sep, path = init_method.partition("://")
    if not sep or scheme != "file":
        raise HybridCommError(
            f"init_downpour: init_method must be file://<shared directory>, got "
            f"{init_method!r}; for servers on other machines without a shared "
            "directory, pass their host:port to DownpourSGD"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise HybridCommError(f"init_downpour: {path} exists and is not a directory")
    os.makedirs(path, exist_ok=True)
    _job = _Job(rank, workers, servers, path, timeout=timeout)
    role = "worker" if rank < workers else "server"
    return role, f"worker{rank}" if role == "worker" else f"server{rank - workers}"


def serve(
    timeout: Optional[float] = None,
    *,
    index: Optional[int] = None,
    workers: Optional[int] = None,
    rendezvous: Optional[str] = None,
    host: str = "127.0.0.1",
    port: int = 0,
    checkpoint_dir: Optional[str] = None,
    checkpoint_every: int = 50,
) -> int:
    """Be parameter-server shard ``index`` until ``workers`` workers have closed;
    returns the pushes the shard has applied. After ``init_downpour`` every argument
    has a default; call it again in a new process to restart a killed shard.
    ``host`` is the interface to listen on (loopback by default: name another one
    for a multi-machine job); see :class:`~.ps_server.ShardServer` for the rest."""
    job = _job
    if index is None:
        if job is None or job.rank < job.workers:
            raise HybridCommError("serve(): pass index= (or call init_downpour as a server first)")
        index = job.rank - job.workers
    workers = workers or (job.workers if job else None)
    if not workers:
        raise HybridCommError("serve(): pass workers= (or call init_downpour first)")
    rendezvous = rendezvous or (job.rendezvous if job else None)
    if timeout is None and job is not None:
        timeout = job.timeout
    return ShardServer(
        index,
        workers,
        rendezvous=rendezvous,
        host=host,
        port=port,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        timeout=timeout,
    ).run()


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
        servers: the servers: ``"serverN"`` names published in the rendezvous
            directory, or ``"host:port"`` addresses.
        lr: the servers' learning rate; ``rule``: ``"sgd"`` or ``"adagrad"``.
        n_fetch, n_push: fetch the parameters / push the accumulated gradients
            every this many steps.
        timeout: seconds any request may take, and the most a reconnect may
            try for (default ``HYBRIDCOMM_TIMEOUT``).
        worker: this worker's id, unique in the job (default: its
            ``init_downpour`` rank).
        rendezvous: where ``serverN`` names are looked up (default:
            ``init_downpour``'s directory).
        replay_log: pushes kept per server for replay after a server restart
            (default: that server's ``checkpoint_every`` + 1, enough that a crash
            loses nothing; fewer saves memory and counts the rest in ``lost``).
        part: for a model-parallel replica (one split over several processes,
            :class:`~.downpour_pipeline.DownpourStage`): the part of it that
            ``model`` is, e.g. ``"stage0"``. Each part spreads its own
            parameters over all the shards and sets up, fetches and pushes only
            those; the shards hold the union. Parameter names must be unique
            across the parts (the servers refuse a name two parts claim); every
            process of a part needs the same ``servers`` list. Default: the
            whole model.

    ``bytes_sent`` counts the gradients pushed (each once; replays not counted).
    ``replayed``, ``lost``, ``reconnects`` and ``reconnect_seconds`` count what
    server restarts cost.

    Example (in a worker process, after ``init_downpour``)::

        opt = DownpourSGD(model, servers=["server0", "server1"], lr=0.05, n_push=2)
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        opt.close()
        print(opt.reconnects, opt.replayed, opt.lost)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        servers: List[str],
        lr: float,
        rule: str = "sgd",
        n_fetch: int = 1,
        n_push: int = 1,
        timeout: Optional[float] = None,
        *,
        worker: Optional[int] = None,
        rendezvous: Optional[str] = None,
        replay_log: Optional[int] = None,
        part: Optional[str] = None,
    ):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        if n_fetch < 1 or n_push < 1 or not servers or len(set(servers)) != len(servers):
            raise ValueError(
                "n_fetch and n_push must be >= 1, and there must be servers "
                f"(each named once): got {servers!r}"
            )
        if replay_log is not None and replay_log < 0:
            raise ValueError(f"replay_log must be >= 0, got {replay_log}")
        job = _job
        if worker is None:
            if job is None or job.rank >= job.workers:
                raise ValueError(
                    "DownpourSGD: pass worker= (a unique id per worker), or call "
                    "init_downpour as a worker first"
                )
            worker = job.rank
        if timeout is None and job is not None:
            timeout = job.timeout
        rendezvous = rendezvous or (job.rendezvous if job else None)
        self.model, self.servers, self.worker = model, list(servers), worker
        self.n_fetch, self.n_push, self.timeout = n_fetch, n_push, env.timeout(timeout)
        self.named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        # each part spreads its own parameters: every process of a part agrees
        # without knowing the other parts' (the shards learn those from them)
        self.shards = shards_of(list(self.named.items()), len(self.servers))
        self.part = part or ""
        self.acc = {n: torch.zeros_like(p) for n, p in self.named.items()}
        self.steps = 0
        self.bytes_sent = 0
        session = os.urandom(8).hex()  # tells the servers a new process from a reconnect
        self.links = [
            ServerLink(
                s,
                rendezvous,
                worker=worker,
                session=session,
                timeout=self.timeout,
                log_limit=replay_log,
                part=self.part,
            )
            for s in self.servers
        ]
        for link, names in zip(self.links, self.shards):
            link.hello()
            # the first worker of a part sets it up on the shard; the others' (and
            # a restored shard's) must match: names, shapes, dtypes, rule and lr.
            # Every shard hears all the part's names, to refuse a name two parts claim
            link.init({n: self.named[n].detach() for n in names}, rule, lr, names=list(self.named))
        # a shard holding none of this part's parameters hears only hello and close
        self._used = [(link, names) for link, names in zip(self.links, self.shards) if names]
        self.fetch()

    @property
    def replayed(self) -> int:
        """Pushes sent again to a restarted server that lacked them."""
        return sum(link.replayed for link in self.links)

    @property
    def lost(self) -> int:
        """Pushes a restarted server lacked that were no longer in the replay log."""
        return sum(link.lost for link in self.links)

    @property
    def reconnects(self) -> int:
        return sum(link.reconnects for link in self.links)

    @property
    def reconnect_seconds(self) -> float:
        """Time spent waiting for restarted servers (reconnecting and replaying)."""
        return sum(link.reconnect_seconds for link in self.links)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def fetch(self) -> None:
        """The model <- the servers' current parameters."""
        for link, _ in self._used:  # every request out before the first reply is read
            link.start_fetch()
        with torch.no_grad():
            for link, _ in self._used:
                for name, value in link.finish_fetch().items():
                    self.named[name].copy_(value)

    def push(self) -> None:
        """Send the accumulated gradients to their shards, without waiting for them
        to be applied (the previous push is waited for first: one in flight)."""
        self._finish_pushes()
        for link, names in self._used:
            grads = {n: self.acc[n].clone() for n in names}
            self.bytes_sent += sum(g.numel() * g.element_size() for g in grads.values())
            link.push(grads)
        for a in self.acc.values():
            a.zero_()

    def _finish_pushes(self) -> None:
        for link in self.links:
            link.finish_push()

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
        """Finish the pushes in flight and tell every server this worker is done
        (a server stops once all its workers have)."""
        for link in self.links:
            link.close()
        if self.reconnects:
            log.info(
                "Downpour worker %d: %d reconnects, %d pushes replayed, %d lost",
                self.worker,
                self.reconnects,
                self.replayed,
                self.lost,
            )
