"""Make every rank's parameters or optimizer state equal one rank's (start of training,
after a restart): ``broadcast_parameters`` and ``broadcast_optimizer_state``.

Both first agree across ranks on what is broadcast (names, shapes, dtypes) and
raise the same ``HybridCommError`` on every rank, naming the difference, instead
of crashing or copying part of it; every wait honours the timeout.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import control, env
from .errors import HybridCommError
from .registry import describe_param_difference


def _signature(items):
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in items]


def broadcast_parameters(params, root_rank: int = 0, process_group=None,
                         timeout: Optional[float] = None) -> None:
    """Copy ``root_rank``'s parameters (a state_dict or (name, tensor) pairs) to every rank.

    The ranks first agree that they hold the same names, shapes and dtypes; a
    difference is a HybridCommError on every rank naming it (never a crash or
    a partial copy). Every wait honours ``timeout``.

    Example::

        >>> hybridcomm.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    timeout = env.timeout(timeout)
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    items = [(n, t) for n, t in items if isinstance(t, torch.Tensor)]
    sigs = control.all_gather_object(_signature(items), group=process_group, timeout=timeout,
                                     what="the parameters to broadcast")
    root = sigs[root_rank]
    for r, theirs in enumerate(sigs):
        if theirs != root:
            raise HybridCommError(f"broadcast_parameters: the tensors differ between rank "
                                  f"{root_rank} and rank {r}: "
                                  + describe_param_difference(root, theirs, r).replace(
                                      "rank 0", f"rank {root_rank}"))
    src = dist.get_global_rank(process_group, root_rank) if process_group is not None else root_rank
    for name, t in items:
        control.wait_work(lambda: dist.broadcast(t.data, src=src, group=process_group,
                                                 async_op=True),
                          timeout, f"broadcasting {name!r}")


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _shared_state(optimizer) -> dict:
    """The root's optimizer state to hand to every rank: with a DistributedOptimizer's
    plan and step count (so every rank adopts the plan the root loaded), without
    its per-rank part (top-k's error feedback: each rank keeps its own)."""
    state = _to_cpu(optimizer.state_dict())
    ours = state.get("hybridcomm")
    if isinstance(ours, dict):
        state["hybridcomm"] = {k: v for k, v in ours.items() if k not in ("topk", "topk_per_rank")}
    return state


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_group=None, timeout: Optional[float] = None) -> None:
    """Make every rank's optimizer state (and hyper-parameters) equal ``root_rank``'s.

    The ranks first agree on the optimizer's parameter groups (sizes, shapes,
    dtypes); a difference is a HybridCommError on every rank naming it.

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> hybridcomm.broadcast_optimizer_state(opt, root_rank=0)
    """
    timeout = env.timeout(timeout)
    mine = [[(tuple(p.shape), str(p.dtype)) for p in g["params"]] for g in optimizer.param_groups]
    groups = control.all_gather_object(mine, group=process_group, timeout=timeout,
                                       what="the optimizer's parameter groups")
    for r, theirs in enumerate(groups):
        if theirs != groups[root_rank]:
            raise HybridCommError(
                f"broadcast_optimizer_state: rank {r}'s parameter groups differ from rank "
                f"{root_rank}'s: {len(theirs)} groups of sizes {[len(g) for g in theirs]} vs "
                f"{len(groups[root_rank])} of sizes {[len(g) for g in groups[root_rank]]}"
                + ("" if [len(g) for g in theirs] != [len(g) for g in groups[root_rank]]
                   else " (same sizes, different shapes or dtypes)"))
    rank = dist.get_rank(process_group)
    state = control.broadcast_object(_shared_state(optimizer) if rank == root_rank else None,
                                     group=process_group, root=root_rank, timeout=timeout,
                                     what="the optimizer state")
    if rank != root_rank:
        optimizer.load_state_dict(state)
