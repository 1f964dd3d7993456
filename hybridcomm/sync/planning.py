"""The synchronizer's plan: made by rank 0, followed by all, re-made from measurements.

Rank 0 plans from its cost model, the registry's layers and, after the measured
steps, what they measured; every rank follows (``control.rank0_decides``). The
first re-plan always happens, a later one only if it decides something
differently; after the first measured steps rank 0 logs the verdict
(plan/verdict.py).

Example::

    planning = Planning(config, cost_model, world=4, rank=0, group=None, servers=0)
    plan = planning.agree(registry.layers)                   # at construction
    new = planning.agree(registry.layers, measured, keep=plan)   # None: nothing new
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from ..comm import calibration, control
from ..config.config import SyncConfig
from ..plan.planner import Layer, Plan, make_plan
from ..plan.verdict import verdict
from .measure import Measured

log = logging.getLogger("hybridcomm")

# The measured steps' communication against the prediction beyond which a kept
# start-up probe is removed. Well above verdict.py's "poor fit" (2x): a step's
# communication shares the cores with the backward, which moves it by up to 2x.
FORGET_PROBE_OFF_BY = 4.0


def forward_estimate(measured: Measured) -> Optional[float]:
    """The forward's compute, estimated as half the measured backward (from its first
    gradient to its last): a layer's backward runs two matrix products to its
    forward's one. None when the backward was not measured.

        >>> forward_estimate(Measured(ready={"fc": 0.0, "conv": 0.3}))
        0.15
    """
    return max(measured.ready.values()) / 2 if measured.ready else None


class Planning:
    """Makes and agrees the bucket plan; logs it at INFO on rank 0 when it decides
    something new, at DEBUG otherwise."""

    def __init__(
        self, config: SyncConfig, cost_model, *, world: int, rank: int, group, servers: int
    ):
        self.config, self.cost_model = config, cost_model
        self.world, self.rank, self.group, self.servers = world, rank, group, servers

    def agree(
        self,
        layers: Sequence[Layer],
        measured: Optional[Measured] = None,
        keep: Optional[Plan] = None,
    ) -> Optional[Plan]:
        """The plan every rank follows; with ``keep``, None when rank 0's new plan
        decides nothing differently from it."""

        def decide() -> Optional[Plan]:
            m = measured or Measured()
            ordered = list(layers)
            if m.ready:
                ordered.sort(key=lambda layer: m.ready.get(layer.name, float("inf")))
            cfg = self.config
            launch_pass = (
                cfg.backward_passes_per_step
                or m.launch_pass
                or (keep.launch_pass if keep is not None else 1)
            )
            plan = make_plan(
                ordered,
                world_size=self.world,
                model=self.cost_model,
                strategy=cfg.strategy,
                fusion_bytes=cfg.fusion_bytes,
                split_bytes=cfg.split_bytes,
                windows=m.windows,
                ready=m.ready,
                need=m.need,
                topk=cfg.topk,
                lazy_bytes=cfg.lazy_bytes,
                launch_pass=launch_pass,
                comm_scale=m.comm_scale,
                defer_pays=m.defer_pays if cfg.overlap == "forward" else None,
                servers=self.servers,
                forward_s=forward_estimate(m) if cfg.overlap == "forward" else None,
                low_rank=cfg.low_rank,
                call_s=m.call_s,
                shard=bool(cfg.shard),
                whole_params=cfg.shard_by == "parameters",
            )
            if cfg.shard_by_reason:
                plan.notes.insert(0, f"state sharded by {cfg.shard_by}: {cfg.shard_by_reason}")
            return None if keep is not None and plan.decisions() == keep.decisions() else plan

        return control.rank0_decides(
            decide, group=self.group, timeout=self.config.timeout, what="the bucket plan"
        )

    def log(self, plan: Plan, title: str, changed: bool = True) -> None:
        """The plan at INFO on rank 0 when it decides something new (the same on every
        rank: DEBUG elsewhere, and for a re-plan that changed no decision)."""
        log.log(
            logging.INFO if self.rank == 0 and changed else logging.DEBUG, "%s:\n%s", title, plan
        )

    def say_verdict(self, plan: Plan, measured: Measured, stats: dict) -> None:
        """After the first measured steps, rank 0's one-line verdict."""
        if self.rank != 0:
            return
        ready = measured.ready
        line = verdict(
            total_bytes=sum(b.nbytes for b in plan.buckets),
            world=self.world,
            model=self.cost_model,
            busy_s=stats.get("comm_busy_s", 0.0),
            exposed_s=stats.get("exposed_comm_s", 0.0),
            backward_s=max(ready.values()) if ready else 0.0,
            comm_scale=measured.comm_scale,
        )
        # A kept probe this far from the measured steps was taken on another network
        # or a machine that changed since: kept, it would mislead every later run
        scale = measured.comm_scale
        if scale and not 1 / FORGET_PROBE_OFF_BY <= scale <= FORGET_PROBE_OFF_BY:
            removed = calibration.forget_saved_probe(self.cost_model)
            if removed:
                line += f"; the start-up probe kept at {removed} is removed: the next run probes"
        log.info("hybridcomm: %s", line)
