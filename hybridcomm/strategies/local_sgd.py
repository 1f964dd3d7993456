"""Local SGD / periodic model averaging (post-local SGD: Lin et al. 2020)."""

from __future__ import annotations

from typing import Optional

import torch

from ..comm import control
from ..config import env
from ..averager import TensorAverager
from ..broadcast import broadcast_parameters
from ..sync.synchronizer import GradientSynchronizer
from .averaging import gather_per_rank, load_own, state_tensors


class LocalSGD:
    """``period`` (H) local steps, then the parameters (and, with
    ``average_state``, the optimizer state) averaged with hybridcomm's all-reduce
    (planned buckets: small tensors fused, butterfly or ring per bucket). With
    ``warmup_steps`` the first steps are synchronous: the gradient synchronizer
    reduces them during backward, as ``DistributedOptimizer(overlap="backward")``
    does (post-local SGD). ``period=1`` gives synchronous SGD's numbers (for SGD, with or
    without momentum: the momentum is linear in the gradients).

    Example::

        >>> opt = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, period=4)
        >>> for x, y in loader:
        ...     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        >>> opt.synchronize(); opt.steps
        2
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        period: int = 8,
        average_state: bool = False,
        warmup_steps: int = 0,
        group=None,
        timeout: Optional[float] = None,
    ):
        control.require_initialized("hybridcomm.strategies.LocalSGD")
        if period < 1 or warmup_steps < 0:
            raise ValueError("period must be >= 1 and warmup_steps >= 0")
        self.optimizer, self.model = optimizer, model
        self.period, self.average_state, self.warmup_steps = period, average_state, warmup_steps
        self.group, self.timeout = group, env.timeout(timeout)
        self.steps = 0
        self.bytes_sent = 0
        broadcast_parameters(model.state_dict(), process_group=group, timeout=self.timeout)
        self._averager = TensorAverager(group, timeout=self.timeout)
        # The cost model's agreement (a start-up probe where none is kept: 9 s at 100
        # Mbit/s) and the parameters' plan now, not in the first average's step; with
        # average_state the state's tensors come later, and only their plan with them
        self._averager.prepare(list(model.parameters()))
        # The synchronous warm-up: the gradient synchronizer, closed when it ends.
        self._sync = (
            GradientSynchronizer(
                optimizer.param_groups,
                None,
                model=model,
                overlap="backward",
                process_group=group,
                timeout=self.timeout,
            )
            if warmup_steps
            else None
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        sync = self._sync
        if sync is None:
            loss = self.optimizer.step(closure)
        else:  # warm-up: synchronous, the gradients reduced first
            sync.begin_step()
            sync.finish()
            loss = self.optimizer.step(None if closure is None else sync.reduce_after(closure))
            sync.end_step()
            self.bytes_sent += sync.last_step_stats["bytes_sent"]
        self.steps += 1
        if sync is not None and self.steps == self.warmup_steps:
            sync.close()
            self._sync = None
        elif sync is None and (self.steps - self.warmup_steps) % self.period == 0:
            self.synchronize()
        return loss

    def synchronize(self) -> None:
        """Average the parameters (and the optimizer state if asked) now."""
        tensors = list(self.model.parameters())
        if self.average_state:
            tensors += state_tensors(self.optimizer)
        self.bytes_sent += self._averager.average_(tensors)

    def state_dict(self) -> dict:
        """The optimizer's state, the step count, and every rank's own parameters and
        optimizer state (between averages they differ; rank 0 may write it alone).
        A collective. Load the model's state first, then this."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
            "per_rank": gather_per_rank(self._own(), self.group, self.timeout),
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        if not load_own(self._own(), state["per_rank"], self.group):
            self.synchronize()  # another world size: start from the average
        if self._sync is not None and self.steps >= self.warmup_steps:
            self._sync.close()
            self._sync = None

    def _own(self):
        return list(self.model.parameters()) + state_tensors(self.optimizer)
