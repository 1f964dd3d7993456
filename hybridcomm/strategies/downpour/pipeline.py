"""Downpour SGD with model-parallel replicas (Dean et al. 2012, the paper's setting).

Each replica is a pipeline of stage processes that pass activations forward
and their gradients back over torch.distributed point-to-point, one
mini-batch at a time. Towards the shards each stage is a Downpour worker for
its own parameters only (:class:`~.client.DownpourSGD` with ``part="stage{k}"``,
names prefixed ``stage{k}.``); a shard holds every stage's parameters. The
picture, usage and measurements: docs/PARALLELISM.md, "Downpour with
model-parallel replicas".
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ...config import env
from ...base.errors import HybridCommError, HybridCommTimeout
from .client import DownpourSGD

__all__ = ["DownpourStage"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
_MAX_DIMS = 6
# message tags: each kind of tensor has its own, header and data apart
_ACT, _GRAD, _EVAL, _RESULT = 10, 20, 40, 50


class DownpourStage:
    """Stage ``stage`` of a model-parallel Downpour replica whose stages run on the
    global ranks ``peers`` (this process is ``peers[stage]``).

    Args:
        module: this stage's slice of the model; its parameters go to the servers
            as ``stage{stage}.<name>``.
        servers, lr, rule, n_fetch, n_push, timeout, worker, rendezvous,
            replay_log: as :class:`~.downpour.DownpourSGD` (``worker`` defaults
            to the ``init_downpour`` rank: unique per stage process).
        stage: this stage's index, 0 to ``len(peers) - 1``.
        peers: the global ranks of this replica's stages, in order.
        loss_fn: ``loss_fn(output, target)``, needed on the last stage.

    ``step(x)`` on the first stage, ``step(y=targets)`` on the last, ``step()``
    in between (as ``torch.distributed.pipelining`` schedules take them): one
    forward and backward of the mini-batch through the replica, then this
    stage's accumulate/push/fetch. Every wait for a peer has ``timeout`` as its
    deadline.

    Example (one replica of one stage, the degenerate pipeline, in one process)::

        >>> import tempfile, threading, torch.nn.functional as F
        >>> from hybridcomm.strategies.downpour.server import ShardServer
        >>> rdv = tempfile.mkdtemp()
        >>> server = ShardServer(0, workers=1, rendezvous=rdv, timeout=30)
        >>> t = threading.Thread(target=server.run); t.start()
        >>> pipe = DownpourStage(torch.nn.Linear(4, 2), ["server0"], lr=0.1, stage=0, peers=[0],
        ...                      loss_fn=F.mse_loss, worker=0, rendezvous=rdv)
        >>> loss = pipe.step(torch.randn(3, 4), torch.randn(3, 2))   # first and last: x and y
        >>> pipe.close(); t.join()
        >>> sorted(torch.load(f"{rdv}/server0.pt", weights_only=True)["params"])
        ['stage0.bias', 'stage0.weight']
    """

    def __init__(
        self,
        module: torch.nn.Module,
        servers: List[str],
        lr: float,
        *,
        stage: int,
        peers: List[int],
        loss_fn: Optional[Callable] = None,
        rule: str = "sgd",
        n_fetch: int = 1,
        n_push: int = 1,
        timeout: Optional[float] = None,
        worker: Optional[int] = None,
        rendezvous: Optional[str] = None,
        replay_log: Optional[int] = None,
    ):
        peers = list(peers)
        if not peers or len(set(peers)) != len(peers) or not 0 <= stage < len(peers):
            raise HybridCommError(
                f"DownpourStage: stage {stage} of peers {peers} (need distinct "
                "ranks, one per stage, and 0 <= stage < len(peers))"
            )
        if len(peers) > 1:
            if not dist.is_initialized():
                raise HybridCommError(
                    "DownpourStage: the stages exchange activations over "
                    "torch.distributed: init_process_group first"
                )
            if dist.get_rank() != peers[stage]:
                raise HybridCommError(
                    f"DownpourStage: stage {stage} of peers {peers} is rank "
                    f"{peers[stage]}, but this process is rank "
                    f"{dist.get_rank()} (a stage claimed twice?)"
                )
        if stage == len(peers) - 1 and loss_fn is None:
            raise HybridCommError("DownpourStage: the last stage needs loss_fn")
        self.module, self.stage, self.peers, self.loss_fn = module, stage, peers, loss_fn
        self.first, self.last = stage == 0, stage == len(peers) - 1
        self.timeout = env.timeout(timeout)
        # the prefix makes the names unique across the stages
        self._named = torch.nn.ModuleDict({f"stage{stage}": module})
        self.opt = DownpourSGD(
            self._named,
            servers,
            lr,
            rule=rule,
            n_fetch=n_fetch,
            n_push=n_push,
            timeout=timeout,
            worker=worker,
            rendezvous=rendezvous,
            replay_log=replay_log,
            part=f"stage{stage}",
        )
        self.bytes_p2p = 0  # activations and their gradients sent to peers by step()

    def step(
        self, x: Optional[torch.Tensor] = None, y: Optional[torch.Tensor] = None
    ) -> Optional[float]:
        """One mini-batch through the replica: the first stage passes the inputs
        ``x``, the last the targets ``y`` (and gets the loss back)."""
        if self.first != (x is not None) or self.last != (y is not None):
            wanted = [
                w
                for w, mine in (("the inputs x", self.first), ("the targets y", self.last))
                if mine
            ]
            raise HybridCommError(
                f"DownpourStage.step: stage {self.stage} of {len(self.peers)} "
                f"passes {' and '.join(wanted) or 'nothing'}"
            )
        self.opt.zero_grad()
        if self.first:
            inp = x
        else:
            inp = self._recv(self.peers[self.stage - 1], _ACT).requires_grad_()
        out = self.module(inp)
        loss = None
        if self.last:
            loss = self.loss_fn(out, y)
            loss.backward()
        else:
            self._wait(
                self._isend(out.detach(), self.peers[self.stage + 1], _ACT),
                "sending activations to",
            )
            out.backward(self._recv(self.peers[self.stage + 1], _GRAD))
        if not self.first:
            self._wait(
                self._isend(inp.grad, self.peers[self.stage - 1], _GRAD), "sending gradients to"
            )
        self.opt.step()
        return None if loss is None else loss.item()

    def forward(self, x: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Inference through the replica (no gradients, nothing pushed or fetched):
        ``forward(x)`` on the first stage returns the last stage's output there;
        the other stages call ``forward()`` at the same point (None)."""
        if self.first == (x is None):
            raise HybridCommError(
                "DownpourStage.forward: the first stage passes the inputs, the others nothing"
            )
        with torch.no_grad():
            inp = x if self.first else self._recv(self.peers[self.stage - 1], _EVAL)
            out = self.module(inp)
            if not self.last:
                self._wait(
                    self._isend(out, self.peers[self.stage + 1], _EVAL, count=False),
                    "sending activations to",
                )
                return self._recv(self.peers[-1], _RESULT) if self.first else None
            if not self.first:
                self._wait(
                    self._isend(out, self.peers[0], _RESULT, count=False), "sending the output to"
                )
                return None
            return out

    def close(self) -> None:
        """Finish the pushes in flight and say goodbye to the servers."""
        self.opt.close()

    # the Downpour counters, per stage process
    @property
    def bytes_sent(self) -> int:
        """Gradients pushed to the servers (activations to peers: ``bytes_p2p``)."""
        return self.opt.bytes_sent

    @property
    def pushes(self) -> List[int]:
        """Pushes sent to each server (0 to a shard holding none of this stage's)."""
        return [link.seq for link in self.opt.links]

    @property
    def replayed(self) -> int:
        return self.opt.replayed

    @property
    def lost(self) -> int:
        return self.opt.lost

    @property
    def reconnects(self) -> int:
        return self.opt.reconnects

    # --- point to point: a fixed-size header (dtype, shape), then the data ---------------
    def _isend(self, t: torch.Tensor, peer: int, tag: int, count: bool = True):
        t = t.detach().contiguous()
        if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
            raise HybridCommError(
                f"DownpourStage: cannot send a {t.dtype} tensor of {t.dim()} dims to rank {peer}"
            )
        head = torch.tensor(
            [_DTYPES.index(t.dtype), t.dim()] + list(t.shape) + [0] * (_MAX_DIMS - t.dim()),
            dtype=torch.int64,
        )
        if count:
            self.bytes_p2p += t.numel() * t.element_size()
        # the tensors are kept with their works: gloo reads them until sent
        return [
            (dist.isend(head, peer, tag=tag), peer, head),
            (dist.isend(t, peer, tag=tag + 1), peer, t),
        ]

    def _recv(self, peer: int, tag: int) -> torch.Tensor:
        head = torch.empty(2 + _MAX_DIMS, dtype=torch.int64)
        self._wait([(dist.irecv(head, peer, tag=tag), peer, head)], "receiving from")
        code, dims = int(head[0]), int(head[1])
        if not 0 <= code < len(_DTYPES) or not 0 <= dims <= _MAX_DIMS:
            raise HybridCommError(
                f"DownpourStage: a garbled header from rank {peer}: {head.tolist()}"
            )
        t = torch.empty(head[2 : 2 + dims].tolist(), dtype=_DTYPES[code])
        self._wait([(dist.irecv(t, peer, tag=tag + 1), peer, t)], "receiving from")
        return t

    def _wait(self, works, what: str) -> None:
        for work, peer, _ in works:
            try:
                work.wait(timeout=timedelta(seconds=self.timeout))
            except RuntimeError as e:
                raise HybridCommTimeout(
                    f"DownpourStage {self.stage}: {what} rank {peer} failed or took over "
                    f"{self.timeout:g}s (a stage of this replica died or stopped?): {e}"
                ) from e
