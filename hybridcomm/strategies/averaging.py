"""Averaging tensors across ranks with hybridcomm's all-reduce, counting the bytes."""
from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.distributed as dist

from ..collectives import all_reduce, resolve_algorithm
from ..cost_model import bytes_sent


def average_(tensors: Iterable[torch.Tensor], group=None, timeout: Optional[float] = None) -> int:
    """Average ``tensors`` across the ranks of ``group`` in place, one all-reduce per
    tensor with the cost model's algorithm for its size (hybrid per layer: the
    butterfly for small tensors, a ring for large ones). Returns the bytes this
    rank sent.

    Example::

        >>> w = torch.ones(3)
        >>> average_([w]), w                       # one rank: nothing to send
        (0, tensor([1., 1., 1.]))
    """
    world = dist.get_world_size(group)
    sent = 0
    for t in tensors:
        if world == 1 or t.numel() == 0:
            continue
        nbytes = t.numel() * t.element_size()
        algorithm = resolve_algorithm("auto", nbytes, world)
        all_reduce(t.data, op="avg", algorithm=algorithm, group=group, timeout=timeout,
                   check=False)
        sent += int(bytes_sent(algorithm, nbytes, world))
    return sent


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
