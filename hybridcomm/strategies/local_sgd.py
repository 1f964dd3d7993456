"""Local SGD / periodic model averaging (post-local SGD: Lin et al. 2020)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import env
from ..broadcast import broadcast_parameters
from .averaging import average_, state_tensors


class LocalSGD:
    """``period`` (H) local steps, then the parameters (and, with
    ``average_state``, the optimizer state) averaged with hybridcomm's all-reduce,
    one per tensor with the cost model's algorithm. With ``warmup_steps`` the
    first steps are synchronous (the gradients averaged before each step):
    post-local SGD. ``period=1`` gives synchronous SGD's numbers (for SGD, with or
    without momentum: the momentum is linear in the gradients).

    Example::

        >>> opt = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, period=4)
        >>> for x, y in loader:
        ...     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        >>> opt.synchronize(); opt.steps
        2
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                 period: int = 8, average_state: bool = False, warmup_steps: int = 0,
                 group=None, timeout: Optional[float] = None):
        if period < 1 or warmup_steps < 0:
            raise ValueError("period must be >= 1 and warmup_steps >= 0")
        self.optimizer, self.model = optimizer, model
        self.period, self.average_state, self.warmup_steps = period, average_state, warmup_steps
        self.group, self.timeout = group, env.timeout(timeout)
        self.steps = 0
        self.bytes_sent = 0
        broadcast_parameters(model.state_dict(), process_group=group, timeout=self.timeout)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        warming = self.steps < self.warmup_steps
        if warming:  # synchronous: average the gradients first
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self.bytes_sent += average_(grads, self.group, self.timeout)
        loss = self.optimizer.step(closure)
        self.steps += 1
        if not warming and (self.steps - self.warmup_steps) % self.period == 0:
            self.synchronize()
        return loss

    def synchronize(self) -> None:
        """Average the parameters (and the optimizer state if asked) now."""
        tensors = list(self.model.parameters())
        if self.average_state:
            tensors += state_tensors(self.optimizer)
        self.bytes_sent += average_(tensors, self.group, self.timeout)
