"""The synchronizer's part of ``opt.state_dict()``: the agreed plan, the step
count, and this rank's top-k error feedback.

No collective either way: one rank alone may save (``if rank == 0:
torch.save(opt.state_dict(), f)``) or load (Horovod's resume, followed by
``broadcast_optimizer_state``). Every rank that loads the same checkpoint
adopts the same plan; a checkpoint made for another world size or other
parameters keeps the current plan (logged). Top-k residuals are per rank: a
checkpoint holds the saving rank's (format 1 held every rank's, still read).

Example::

    state = checkpoint.save(sync)        # plain types and a CPU tensor
    checkpoint.load(sync, state)         # the plan adopted, the residuals restored
"""
from __future__ import annotations

import logging
from typing import List, Optional

import torch

from ..plan.planner import plan_from_dict

log = logging.getLogger("hybridcomm")


def save(sync) -> dict:
    """``sync``'s (a GradientSynchronizer's) checkpoint state."""
    state = {"plan": sync.plan.to_dict(), "steps": sync.state.steps,
             "params": list(sync.registry.names)}
    with sync.watched():
        views = _residual_views(sync)
        flat = torch.cat([v.reshape(-1).float() for v in views]) if views else None
    if flat is not None:
        if sync.rt is not None:
            sync.rt.synchronize()  # a checkpoint may wait for the device
        state["topk"] = {"rank": sync.rank, "world": sync.world, "residuals": flat.cpu()}
    return state


def load(sync, state: Optional[dict]) -> None:
    """``sync`` adopts ``state``'s plan, step count and residuals, where they fit."""
    if state is None:
        return
    why = mismatch(sync, state)
    if why:
        log.warning("hybridcomm: the checkpoint's plan is not used (%s): the current plan "
                    "stays", why)
        return
    sync.rebuild(plan_from_dict(state["plan"]), "the checkpoint's plan")
    sync.state.steps = int(state["steps"])
    load_residuals(sync, state)
    sync.state.epoch += 1


def mismatch(sync, state: dict) -> Optional[str]:
    """Why ``state``'s plan cannot be used here (None: it can)."""
    saved = plan_from_dict(state["plan"])
    if saved.world_size != sync.world:
        return f"it was made for {saved.world_size} ranks, this job has {sync.world}"
    if list(state.get("params", [])) != list(sync.registry.names):
        return "it was made for other parameters"
    return None


def load_residuals(sync, state: dict) -> None:
    """This rank's top-k error feedback from ``state``, if it holds this rank's and fits."""
    views = _residual_views(sync)
    if not views:
        return
    mine = None
    if "topk_per_rank" in state:
        per_rank = state["topk_per_rank"]
        mine = per_rank[sync.rank] if per_rank and len(per_rank) == sync.world else None
    elif "topk" in state:
        saved = state["topk"]
        if saved["rank"] == sync.rank and saved["world"] == sync.world:
            mine = saved["residuals"]
    else:
        return  # no residuals in it (broadcast_optimizer_state): this rank keeps its own
    total = sum(v.numel() for v in views)
    if mine is None or mine.numel() != total:
        log.warning("hybridcomm: the checkpoint holds no top-k residuals of rank %d for this "
                    "plan: its error feedback stays as it is (save every rank's "
                    "opt.state_dict() to resume top-k exactly)", sync.rank)
        return
    at = 0
    with sync.watched():
        for v in views:
            v.copy_(mine[at:at + v.numel()].view(v.shape))
            at += v.numel()


def _residual_views(sync) -> List[torch.Tensor]:
    return [v for _, residual, velocity in sync.group.topk_views()
            for v in (residual, velocity) if v is not None]
