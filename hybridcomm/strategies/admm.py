"""Consensus ADMM SGD (Boyd, Parikh, Chu, Peleato & Eckstein 2011, section 7.1)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

from ..comm import control
from ..config import env
from ..averager import TensorAverager
from ..broadcast import broadcast_parameters
from .averaging import gather_per_rank, load_own, state_tensors


class ADMM:
    """Each worker minimizes its local loss plus the augmented Lagrangian term
    ``rho/2 ||x - z + u||^2`` for ``local_steps`` SGD steps (scaled form: ``u`` is
    the dual over ``rho``); then the consensus ``z`` is the all-reduced average
    of ``x + u`` and each dual moves by ``x - z``. The all-reduce plays the
    driver: there is no central process. :meth:`consensus` puts ``z`` in the
    model (e.g. to evaluate it).

    Example::

        >>> opt = ADMM(torch.optim.SGD(model.parameters(), lr=0.1), model, rho=0.1,
        ...            local_steps=2)
        >>> for x, y in loader:
        ...     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        >>> opt.rounds
        1
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        rho: float = 0.1,
        local_steps: int = 5,
        group=None,
        timeout: Optional[float] = None,
    ):
        control.require_initialized("hybridcomm.strategies.ADMM")
        if rho <= 0 or local_steps < 1:
            raise ValueError("rho must be > 0 and local_steps >= 1")
        self.optimizer, self.model, self.rho, self.local_steps = optimizer, model, rho, local_steps
        self.group, self.timeout = group, env.timeout(timeout)
        broadcast_parameters(model.state_dict(), process_group=group, timeout=self.timeout)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.z = [p.detach().clone() for p in self.params]
        self.u = [torch.zeros_like(p) for p in self.params]
        self.steps = self.rounds = 0
        self.bytes_sent = 0
        self._averager = TensorAverager(group, timeout=self.timeout)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """A local step on f(x) + rho/2 ||x - z + u||^2; a consensus round every
        ``local_steps`` steps."""
        with torch.no_grad():
            for p, z, u in zip(self.params, self.z, self.u):
                if p.grad is not None:
                    p.grad.add_(p - z + u, alpha=self.rho)
        loss = self.optimizer.step(closure)
        self.steps += 1
        if self.steps % self.local_steps == 0:
            self.round()
        return loss

    def round(self) -> None:
        """z = mean over ranks of (x + u); u += x - z."""
        with torch.no_grad():
            for p, z, u in zip(self.params, self.z, self.u):
                z.copy_(p).add_(u)
            self.bytes_sent += self._averager.average_(self.z)
            for p, z, u in zip(self.params, self.z, self.u):
                u.add_(p).sub_(z)
        self.rounds += 1

    def state_dict(self) -> dict:
        """The optimizer's state, the counters, the consensus ``z`` and every rank's
        own parameters, duals ``u`` and optimizer state (rank 0 may write it alone).
        A collective. Load the model's state first, then this."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
            "rounds": self.rounds,
            "z": [z.clone() for z in self.z],
            "per_rank": gather_per_rank(self._own(), self.group, self.timeout),
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps, self.rounds = int(state["steps"]), int(state["rounds"])
        with torch.no_grad():
            for z, saved in zip(self.z, state["z"]):
                z.copy_(saved)
        if not load_own(self._own(), state["per_rank"], self.group):
            raise ValueError(
                "this ADMM checkpoint was saved by another world size or model: "
                "its duals cannot be split over these ranks"
            )

    def _own(self):
        return self.params + self.u + state_tensors(self.optimizer)

    @contextmanager
    def consensus(self):
        """The model holds the consensus ``z`` inside (its own ``x`` restored after)."""
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, z in zip(self.params, self.z):
                p.copy_(z)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)
