"""Which tensors a strategy averages besides the parameters (the optimizer's state),
and each rank's own tensors in a checkpoint one rank writes."""

from __future__ import annotations

from typing import List

import torch

from ..comm import control


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


def gather_per_rank(tensors: List[torch.Tensor], group, timeout: float) -> List[torch.Tensor]:
    """Every rank's ``tensors`` flattened into one CPU tensor each, in rank order (a
    collective): per-rank state (local models between averages, ADMM's duals) in
    a checkpoint that rank 0 alone writes."""
    flat = (
        torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors])
        if tensors
        else torch.zeros(0, dtype=torch.float64)
    )
    return control.all_gather_tensor(
        flat, group=group, timeout=timeout, what="per-rank state for a checkpoint"
    )


def load_own(tensors: List[torch.Tensor], per_rank: List[torch.Tensor], group) -> bool:
    """Copy this rank's entry of :func:`gather_per_rank`'s list into ``tensors``;
    False (nothing copied) when it was saved by another world size or layout."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    total = sum(t.numel() for t in tensors)
    if len(per_rank) != world or per_rank[rank].numel() != total:
        return False
    at, mine = 0, per_rank[rank]
    with torch.no_grad():
        for t in tensors:
            t.copy_(mine[at : at + t.numel()].view(t.shape))
            at += t.numel()
    return True
