"""Make every rank's parameters or optimizer state equal one rank's (start of training,
after a restart): ``broadcast_parameters`` and ``broadcast_optimizer_state``.

Both first agree across ranks on what is broadcast (names, shapes, dtypes) and
raise the same ``HybridCommError`` on every rank, naming the difference, instead
of crashing or copying part of it; every wait honours the timeout.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .comm import control
from .config import env
from .base.dtensor import local_data
from .base.errors import HybridCommError
from .sync.registry import describe_param_difference


def _signature(items):
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in items]


def broadcast_parameters(
    params, root_rank: int = 0, process_group=None, timeout: Optional[float] = None
) -> None:
    """Copy ``root_rank``'s parameters (a state_dict or (name, tensor) pairs) to every rank.

    The ranks first agree that they hold the same names, shapes and dtypes; a
    difference is a HybridCommError on every rank naming it (never a crash or
    a partial copy). Every wait honours ``timeout``.

    Example::

        >>> hybridcomm.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    control.require_initialized("broadcast_parameters")
    timeout = env.timeout(timeout)
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    items = [(n, t) for n, t in items if isinstance(t, torch.Tensor)]
    sigs = control.all_gather_object(
        _signature(items), group=process_group, timeout=timeout, what="the parameters to broadcast"
    )
    root = sigs[root_rank]
    for r, theirs in enumerate(sigs):
        if theirs != root:
            raise HybridCommError(
                f"broadcast_parameters: the tensors differ between rank "
                f"{root_rank} and rank {r}: "
                + describe_param_difference(root, theirs, r).replace("rank 0", f"rank {root_rank}")
            )
    src = dist.get_global_rank(process_group, root_rank) if process_group is not None else root_rank
    _broadcast_coalesced(items, src, process_group, timeout)


def _broadcast_coalesced(items, src: int, group, timeout: float) -> None:
    """One broadcast per (device, dtype): a model of many small tensors costs a few
    messages, not one each."""
    by_kind: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for _, t in items:
        t = local_data(t)  # a DTensor's shard: the group holds the ranks of the same shard
        if t.numel():
            by_kind.setdefault((t.device, t.dtype), []).append(t)
    for (device, dtype), tensors in by_kind.items():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        control.wait_work(
            lambda: dist.broadcast(flat, src=src, group=group, async_op=True),
            timeout,
            f"broadcasting {len(tensors)} {dtype} tensors",
        )
        at = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[at : at + t.numel()].view_as(t))
                at += t.numel()


def _digest(t: torch.Tensor) -> str:
    data = local_data(t).cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def check_parameters_agree(params, process_group=None, timeout: Optional[float] = None) -> None:
    """Raise the same ``HybridCommError`` on every rank, naming the first tensor whose
    values differ between ranks (a digest of each tensor's bytes, compared across
    ranks); nothing when they are equal (every rank calls it: a collective).

    Example::

        >>> hybridcomm.broadcast.check_parameters_agree(model.named_parameters())
    """
    timeout = env.timeout(timeout)
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    items = [(n, t) for n, t in items if isinstance(t, torch.Tensor)]
    mine = [(name, tuple(t.shape), str(t.dtype), _digest(t)) for name, t in items]
    every = control.all_gather_object(
        mine,
        group=process_group,
        timeout=timeout,
        what="the parameters' values (a digest per tensor)",
    )
    for r, theirs in enumerate(every[1:], start=1):
        for (name, *ours), (_, *other) in zip(every[0], theirs):
            if ours != other:
                raise HybridCommError(
                    f"the ranks' parameters differ: {name!r} on rank {r} is not rank 0's "
                    "(a different seed or checkpoint per rank?). Let DistributedOptimizer "
                    "broadcast them from rank 0 (broadcast_parameters=True, the default) or "
                    "call hybridcomm.broadcast_parameters(model.state_dict(), root_rank=0) "
                    "before wrapping"
                )


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


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int = 0,
    process_group=None,
    timeout: Optional[float] = None,
) -> None:
    """Make every rank's optimizer state (and hyper-parameters) equal ``root_rank``'s.

    The ranks first agree on the optimizer's parameter groups (sizes, shapes,
    dtypes); a difference is a HybridCommError on every rank naming it.

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> hybridcomm.broadcast_optimizer_state(opt, root_rank=0)
    """
    control.require_initialized("broadcast_optimizer_state")
    timeout = env.timeout(timeout)
    mine = [[(tuple(p.shape), str(p.dtype)) for p in g["params"]] for g in optimizer.param_groups]
    groups = control.all_gather_object(
        mine, group=process_group, timeout=timeout, what="the optimizer's parameter groups"
    )
    for r, theirs in enumerate(groups):
        if theirs != groups[root_rank]:
            raise HybridCommError(
                f"broadcast_optimizer_state: rank {r}'s parameter groups differ from rank "
                f"{root_rank}'s: {len(theirs)} groups of sizes {[len(g) for g in theirs]} vs "
                f"{len(groups[root_rank])} of sizes {[len(g) for g in groups[root_rank]]}"
                + (
                    ""
                    if [len(g) for g in theirs] != [len(g) for g in groups[root_rank]]
                    else " (same sizes, different shapes or dtypes)"
                )
            )
    rank = dist.get_rank(process_group)
    state = control.broadcast_object(
        _shared_state(optimizer) if rank == root_rank else None,
        group=process_group,
        root=root_rank,
        timeout=timeout,
        what="the optimizer state",
    )
    if rank != root_rank:
        optimizer.load_state_dict(state)
