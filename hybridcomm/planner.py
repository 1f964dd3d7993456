"""Layers -> buckets -> (algorithm, lane, window): the plan every rank follows.

Inputs, all agreed across ranks: the trainable parameters grouped into
layers (a module's own parameters), in the order backward produces them; the
cost model's prediction per algorithm; optionally the measured overlap window
of each layer (from its gradient being ready to its next forward).

- Fusion: consecutive small layers share one bucket while the bucket stays
  under ``fusion_bytes`` (default: the cost model's alpha/beta, the size
  below which one message costs mostly its latency, so merging saves it).
- Split: a bucket over ``split_bytes`` is all-reduced in segments, each a
  separate operation in its lane (bounded message size, earlier progress).
- Algorithm: the one with the least predicted time (``strategy="hybrid"``),
  or the one named by ``strategy`` / ``HYBRIDCOMM_ALGO`` for every bucket.
- Lane: butterfly buckets (small, latency-bound) go to the ``latency`` lane,
  the rest to the ``bandwidth`` lane. Each lane is its own communicator and
  thread with a fixed order, so a small urgent bucket never waits behind a
  big one, and every rank issues each lane's operations in the same order.

``print(plan)`` shows the table.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

from .algorithms import ALGORITHMS

Predict = Callable[[str, int, int], float]  # (algorithm, nbytes, world_size) -> seconds
LANES = ("latency", "bandwidth")


@dataclass
class Layer:
    """A module's own trainable parameters (indices into the optimizer's list)."""

    name: str
    params: List[int]
    numel: int


@dataclass
class Bucket:
    index: int
    layers: List[str]
    params: List[int]  # parameter indices, in buffer order
    numel: int  # gradient elements (the buffer also holds one flag per parameter)
    nbytes: int
    algorithm: str
    lane: str
    predicted_s: float
    window_s: Optional[float] = None
    segments: List[Tuple[int, int]] = field(default_factory=list)  # over the whole buffer


@dataclass
class Plan:
    world_size: int
    strategy: str
    buckets: List[Bucket]

    def lane_order(self, lane: str) -> List[Bucket]:
        """Buckets of a lane in the fixed order every rank issues them."""
        return [b for b in self.buckets if b.lane == lane]

    def __str__(self) -> str:
        head = (f"hybridcomm plan: {len(self.buckets)} buckets, world size {self.world_size}, "
                f"strategy {self.strategy}\n")
        cols = f"{'bucket':>6} {'bytes':>10} {'algorithm':>17} {'pred(us)':>9} {'window(us)':>10} " \
               f"{'lane':>9} {'segs':>4}  layers\n"
        rows = []
        for b in self.buckets:
            win = "-" if b.window_s is None else f"{b.window_s * 1e6:.0f}"
            layers = ", ".join(b.layers)
            if len(layers) > 60:
                layers = layers[:57] + "..."
            rows.append(f"{b.index:>6} {b.nbytes:>10} {b.algorithm:>17} {b.predicted_s * 1e6:>9.0f} "
                        f"{win:>10} {b.lane:>9} {len(b.segments):>4}  {layers}")
        return head + cols + "\n".join(rows)


def forced_algorithm(strategy: str) -> Optional[str]:
    """The algorithm every bucket must use, or None for a per-bucket choice."""
    env = os.environ.get("HYBRIDCOMM_ALGO")
    if env:
        if env not in ALGORITHMS:
            raise ValueError(f"HYBRIDCOMM_ALGO={env!r} is not one of {ALGORITHMS}")
        return env
    if strategy == "hybrid":
        return None
    if strategy not in ALGORITHMS:
        raise ValueError(f"unknown strategy {strategy!r}; choose 'hybrid' or one of {ALGORITHMS}")
    return strategy


def make_plan(layers: Sequence[Layer], *, world_size: int, element_size: int, predict: Predict,
              strategy: str = "hybrid", fusion_bytes: int = 0, split_bytes: Optional[int] = None,
              windows: Optional[dict] = None) -> Plan:
    """Group ``layers`` (in backward order) into buckets and choose for each.

    ``windows`` maps a layer name to its measured overlap window in seconds;
    a bucket's window is its first-needed (smallest) layer window.

    Example::

        >>> plan = make_plan([Layer("fc", [0, 1], 1 << 20), Layer("conv", [2], 500)],
        ...                  world_size=4, element_size=4, fusion_bytes=0,
        ...                  predict=lambda a, n, p: {"butterfly": 1e-9 * n * 2,
        ...                                           "ring": 1e-5 + 1e-9 * n,
        ...                                           "halving_doubling": 2e-5 + 1e-9 * n}[a])
        >>> [(b.algorithm, b.lane) for b in plan.buckets]
        [('ring', 'bandwidth'), ('butterfly', 'latency')]
    """
    forced = forced_algorithm(strategy)
    groups: List[List[Layer]] = []
    for layer in layers:
        if layer.numel == 0:
            continue
        last = groups[-1] if groups else None
        if last is not None and sum(x.numel for x in last + [layer]) * element_size <= fusion_bytes:
            last.append(layer)
        else:
            groups.append([layer])
    buckets = []
    for i, group in enumerate(groups):
        params = [p for layer in group for p in layer.params]
        numel = sum(layer.numel for layer in group)
        nbytes = numel * element_size
        if forced:
            algorithm = forced
        else:
            algorithm = min(ALGORITHMS, key=lambda a: predict(a, nbytes, world_size))
        window = None
        if windows:
            known = [windows[layer.name] for layer in group if layer.name in windows]
            window = min(known) if known else None
        total = numel + len(params)  # gradients, then one usage flag per parameter
        step = total if not split_bytes else max(1, split_bytes // element_size)
        segments = [(s, min(s + step, total)) for s in range(0, total, step)]
        buckets.append(Bucket(i, [layer.name for layer in group], params, numel, nbytes, algorithm,
                              "latency" if algorithm == "butterfly" else "bandwidth",
                              sum(predict(algorithm, (b - a) * element_size, world_size)
                                  for a, b in segments),
                              window, segments))
    return Plan(world_size, strategy, buckets)


def predictor(cost_model=None) -> Predict:
    """``predict(algorithm, nbytes, world_size) -> seconds`` from a cost model.

    TEMPORARY built-in alpha-beta-gamma constants until the calibrated model lands.
    """
    import math

    alpha, beta, gamma = 5e-4, 1e-9, 3e-10

    def predict(algorithm, nbytes, p):
        if p == 1:
            return 0.0
        core = 1 << (p.bit_length() - 1)
        fold = 0.0 if core == p else 2 * (alpha + nbytes * beta)
        steps = int(math.log2(core))
        share = (p - 1) / p * nbytes
        if algorithm == "ring":
            return 2 * (p - 1) * alpha + 2 * share * beta + share * gamma
        if algorithm == "butterfly":
            return fold + steps * (alpha + nbytes * (beta + gamma))
        return fold + 2 * steps * alpha + 2 * share * beta + share * gamma

    predict.fusion_bytes = int(alpha / beta)
    return predict
