"""After the measured steps: whether hybridcomm helped, in one plain sentence.

The line compares what the library measured (the communication of the last
measured step, how much of it the training thread waited for) with what
DDP's default would leave exposed under the same cost model: 25 MB buckets,
each all-reduced (the process group's own all-reduce) once backward has
produced it, with gradients assumed to arrive evenly over the measured
backward pass, and nothing overlapping the next forward. It is an estimate
and says so; ``benchmarks/train.py`` measures DDP itself.

    >>> model = CostModel(alpha=1e-4, beta=1e-9, gamma=0.0)   # 1 GB/s
    >>> round(ddp_exposed_s(8 << 20, 4, model, backward_s=0.0) * 1e3)   # nothing to hide behind
    13
    >>> round(ddp_exposed_s(8 << 20, 4, model, backward_s=1.0) * 1e3)   # one bucket: still all
    13
    >>> round(ddp_exposed_s(100 << 20, 4, model, backward_s=1.0) * 1e3)  # all but the last
    40
"""

from __future__ import annotations

from typing import Optional

from .cost_model import NATIVE, CostModel
from ..base.units import format_bytes

DDP_BUCKET_BYTES = 25 << 20  # DDP's bucket_cap_mb default


def ddp_exposed_s(
    total_bytes: int, world: int, model: CostModel, backward_s: float, cap: int = DDP_BUCKET_BYTES
) -> float:
    """Seconds of DDP's all-reduce left after backward ends, under ``model``: buckets
    of ``cap`` bytes, each ready when backward has produced its share (gradients
    arriving evenly over ``backward_s``), reduced one after another."""
    algo = NATIVE if model.offers(NATIVE) else "ring"
    end, done_bytes = 0.0, 0
    while done_bytes < total_bytes:
        size = min(cap, total_bytes - done_bytes)
        done_bytes += size
        ready = backward_s * done_bytes / total_bytes
        end = max(end, ready) + model.predict(algo, size, world)
    return max(0.0, end - backward_s)


def verdict(
    *,
    total_bytes: int,
    world: int,
    model: CostModel,
    busy_s: float,
    exposed_s: float,
    backward_s: float,
    comm_scale: Optional[float],
) -> str:
    """The sentence logged on rank 0 after the measured steps."""
    hidden = max(0.0, busy_s - exposed_s)
    share = f"{100 * hidden / busy_s:.0f}%" if busy_s > 0 else "-"
    ddp = ddp_exposed_s(total_bytes, world, model, backward_s)
    if comm_scale:  # the measured speed, as the planner uses it
        ddp *= comm_scale
    line = (
        f"each step all-reduces {format_bytes(total_bytes)} over {world} ranks: communication took "
        f"{busy_s * 1e3:.1f} ms in the last measured step, {share} of it hidden "
        f"({exposed_s * 1e3:.1f} ms exposed); DDP's default (25 MB buckets, overlapping "
        f"backward only) would expose about {ddp * 1e3:.1f} ms under the same cost model "
        f"(an estimate; benchmarks/train.py measures it)"
    )
    if comm_scale and not 0.5 <= comm_scale <= 2.0:
        line += (
            f". Communication ran at {comm_scale:.1f}x the cost model's prediction: "
            "the plan rests on a poor fit; run `hybridcomm-bench --calibrate` (or "
            "`python -m hybridcomm calibrate`) once on this machine"
        )
    return line
