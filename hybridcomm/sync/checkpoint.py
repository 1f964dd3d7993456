"""The synchronizer's part of ``opt.state_dict()``: the agreed plan, the step
count, and this rank's error feedback (top-k's; PowerSGD's, with its warm start).

No collective either way: one rank alone may save or load (Horovod's resume,
then ``broadcast_optimizer_state``). Every rank that loads the same checkpoint
adopts the same plan; one made for another world size or other parameters
keeps the current plan (logged). Error feedback is the saving rank's.

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
    state = {
        "plan": sync.plan.to_dict(),
        "steps": sync.state.steps,
        "params": list(sync.registry.names),
    }
    for key, views_of in FEEDBACK.items():
        with sync.watched():
            views = views_of(sync)
            flat = torch.cat([v.reshape(-1).float() for v in views]) if views else None
        if flat is not None:
            if sync.rt is not None:
                sync.rt.synchronize()  # a checkpoint may wait for the device
            state[key] = {"rank": sync.rank, "world": sync.world, "residuals": flat.cpu()}
    return state


def load(sync, state: Optional[dict]) -> None:
    """``sync`` adopts ``state``'s plan, step count and residuals, where they fit."""
    if state is None:
        return
    why = mismatch(sync, state)
    if why:
        log.warning(
            "hybridcomm: the checkpoint's plan is not used (%s): the current plan stays", why
        )
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
    copies = sync.world if sync.config.shard and sync.world > 1 else 1
    if any(b.flag_copies != copies for b in saved.buckets):
        return "it was made with another shard= (the buckets' layout differs)"
    whole = sync.config.shard_by == "parameters"
    if any((b.owners is not None) != whole for b in saved.buckets):
        return "it was made with another shard_by= (the buckets' layout differs)"
    return None


def load_residuals(sync, state: dict) -> None:
    """This rank's error feedback from ``state``, where it holds this rank's and fits."""
    for key, views_of in FEEDBACK.items():
        views = views_of(sync)
        if not views:
            continue
        mine = None
        if key == "topk" and "topk_per_rank" in state:  # format 1: every rank's, still read
            per_rank = state["topk_per_rank"]
            mine = per_rank[sync.rank] if per_rank and len(per_rank) == sync.world else None
        elif key in state:
            saved = state[key]
            if saved["rank"] == sync.rank and saved["world"] == sync.world:
                mine = saved["residuals"]
        else:
            continue  # none in it (broadcast_optimizer_state): this rank keeps its own
        total = sum(v.numel() for v in views)
        if mine is None or mine.numel() != total:
            log.warning(
                "hybridcomm: the checkpoint holds no %s error feedback of rank %d for "
                "this plan: it stays as it is (save every rank's opt.state_dict() to "
                "resume exactly)",
                key,
                sync.rank,
            )
            continue
        at = 0
        with sync.watched():
            for v in views:
                v.copy_(mine[at : at + v.numel()].view(v.shape))
                at += v.numel()


def _topk_views(sync) -> List[torch.Tensor]:
    return [
        v
        for _, residual, velocity in sync.group.topk_views()
        for v in (residual, velocity)
        if v is not None
    ]


def _powersgd_views(sync) -> List[torch.Tensor]:
    return [
        v
        for s in sync.group.states
        if s.bucket.lowrank is not None
        for v in s.bucket.lowrank.states()
    ]


# what a checkpoint keeps of each compression's state, under its key
FEEDBACK = {"topk": _topk_views, "powersgd": _powersgd_views}
