"""Parallel SGD (Zinkevich, Weimer, Smola & Li 2010)."""

from __future__ import annotations

from typing import Optional

import torch

from ..comm import control
from ..config import env
from ..averager import TensorAverager
from ..broadcast import broadcast_parameters


class ParallelSGD:
    """Each worker runs SGD on its own shuffled shard, from the same initial model;
    the models are averaged every epoch (``average="epoch"``) or once at the end
    (``average="end"``). The analysis assumes a convex loss and shards that each
    represent the whole data set: shuffle before sharding.

    Example::

        >>> opt = ParallelSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
        >>> for x, y in loader:
        ...     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        >>> opt.end_epoch(); opt.bytes_sent                # one rank: nothing sent
        0
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        average: str = "epoch",
        group=None,
        timeout: Optional[float] = None,
    ):
        control.require_initialized("hybridcomm.strategies.ParallelSGD")
        if average not in ("epoch", "end"):
            raise ValueError(f"average must be 'epoch' or 'end', got {average!r}")
        self.optimizer, self.model, self.average = optimizer, model, average
        self.group, self.timeout = group, env.timeout(timeout)
        self.bytes_sent = 0
        broadcast_parameters(model.state_dict(), process_group=group, timeout=self.timeout)
        self._averager = TensorAverager(group, timeout=self.timeout)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """A local SGD step: no communication."""
        return self.optimizer.step(closure)

    def end_epoch(self) -> None:
        """Average the models if averaging every epoch."""
        if self.average == "epoch":
            self.synchronize()

    def synchronize(self) -> None:
        """Average the models now (also at the end of training)."""
        self.bytes_sent += self._averager.average_(self.model.parameters())
