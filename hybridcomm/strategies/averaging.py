"""Which tensors a strategy averages besides the parameters (the optimizer's state)."""
from __future__ import annotations

from typing import List

import torch


def state_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The optimizer's floating-point state tensors (momentum, Adam moments), in a
    fixed order (parameter groups, then each parameter's state keys sorted)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                v = state[key]
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                    out.append(v)
    return out
