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
- Algorithm (``strategy="hybrid"``, the thesis's pair): butterfly or ring
  by ``CostModel.choose`` with the bucket's window: the one that sends fewer
  bytes if it is predicted to finish within the window, else the faster. So
  a small bucket with a short window gets the butterfly, a large one with a
  long window the ring. The ring may be hybridcomm's own or ``native`` (the
  process group's all_reduce, gloo's or NCCL's ring in C++), whichever the
  measured model predicts faster; an uncalibrated model offers no
  ``native``. ``strategy="auto"`` lets halving-doubling compete too (it
  sends the ring's bytes in fewer messages, but to a different peer each
  step, which shaped or oversubscribed links punish; measure before you pick
  it). ``strategy`` naming an algorithm, or ``HYBRIDCOMM_ALGO``, forces it
  for every bucket.
- Queueing: with measured ready times too, each bucket's candidates are
  judged by when they would *finish* in their lane, after the buckets queued
  there before it (``queued(us)`` in the table).
- Lane: butterfly buckets (small, latency-bound) go to the ``latency`` lane,
  the rest to the ``bandwidth`` lane. Each lane is its own communicator and
  thread with a fixed order, so a small urgent bucket never waits behind a
  big one, and every rank issues each lane's operations in the same order.

``print(plan)`` shows the table.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from .algorithms import ALGORITHMS
from .cost_model import NATIVE, CostModel, bytes_sent

LANES = ("latency", "bandwidth")
BUCKET_ALGORITHMS = ALGORITHMS + (NATIVE,)
STRATEGY_CANDIDATES = {"hybrid": ("ring", "butterfly", NATIVE), "auto": BUCKET_ALGORITHMS}


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
    queued_s: Optional[float] = None  # predicted wait behind its lane's earlier buckets


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
        cols = f"{'bucket':>6} {'bytes':>10} {'algorithm':>17} {'pred(us)':>9} {'queued(us)':>10} " \
               f"{'window(us)':>10} {'lane':>9} {'segs':>4}  layers\n"
        rows = []
        for b in self.buckets:
            win = "-" if b.window_s is None else f"{b.window_s * 1e6:.0f}"
            queued = "-" if b.queued_s is None else f"{b.queued_s * 1e6:.0f}"
            layers = ", ".join(b.layers)
            if len(layers) > 60:
                layers = layers[:57] + "..."
            rows.append(f"{b.index:>6} {b.nbytes:>10} {b.algorithm:>17} {b.predicted_s * 1e6:>9.0f} "
                        f"{queued:>10} {win:>10} {b.lane:>9} {len(b.segments):>4}  {layers}")
        return head + cols + "\n".join(rows)


def lane_of(algorithm: str) -> str:
    return "latency" if algorithm == "butterfly" else "bandwidth"  # native: a ring


def _least(values: Optional[dict], group: Sequence[Layer]) -> Optional[float]:
    known = [values[layer.name] for layer in group if values and layer.name in values]
    return min(known) if known else None


def forced_algorithm(strategy: str) -> Optional[str]:
    """The algorithm every bucket must use, or None for a per-bucket choice."""
    env = os.environ.get("HYBRIDCOMM_ALGO")
    if env:
        if env not in BUCKET_ALGORITHMS:
            raise ValueError(f"HYBRIDCOMM_ALGO={env!r} is not one of {BUCKET_ALGORITHMS}")
        return env
    if strategy in STRATEGY_CANDIDATES:
        return None
    if strategy not in BUCKET_ALGORITHMS:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of "
                         f"{tuple(STRATEGY_CANDIDATES) + BUCKET_ALGORITHMS}")
    return strategy


def make_plan(layers: Sequence[Layer], *, world_size: int, element_size: int, model: CostModel,
              strategy: str = "hybrid", fusion_bytes: Optional[int] = None,
              split_bytes: Optional[int] = None, windows: Optional[dict] = None,
              ready: Optional[dict] = None) -> Plan:
    """Group ``layers`` (in backward order) into buckets and choose for each.

    ``windows`` maps a layer name to its measured overlap window in seconds
    (a bucket's is its smallest layer's); ``ready`` maps it to when its
    gradient is ready, in seconds from the first one (a bucket's is its last
    layer's). With both, each bucket's choice accounts for what is queued
    ahead of it in each lane.
    ``fusion_bytes`` defaults to the model's alpha/beta.

    Example::

        >>> model = CostModel(alpha=1e-3, beta=1e-9, gamma=1e-10)
        >>> plan = make_plan([Layer("fc", [0, 1], 1 << 22), Layer("conv", [2], 500)],
        ...                  world_size=8, element_size=4, model=model)
        >>> [(b.algorithm, b.lane) for b in plan.buckets]
        [('ring', 'bandwidth'), ('butterfly', 'latency')]
        >>> make_plan([Layer("fc", [0, 1], 1 << 22)], world_size=8, element_size=4, model=model,
        ...           strategy="auto").buckets[0].algorithm
        'halving_doubling'

    """
    forced = forced_algorithm(strategy)
    if fusion_bytes is None:
        fusion_bytes = int(model.alpha / model.beta) if model.beta > 0 else 0
    groups: List[List[Layer]] = []
    for layer in layers:
        if layer.numel == 0:
            continue
        last = groups[-1] if groups else None
        if last is not None and sum(x.numel for x in last + [layer]) * element_size <= fusion_bytes:
            last.append(layer)
        else:
            groups.append([layer])
    candidates = [a for a in STRATEGY_CANDIDATES.get(strategy, ()) if model.offers(a)]
    lane_free = dict.fromkeys(LANES, 0.0)  # when each lane is next idle (from ``ready``)
    buckets = []
    for i, group in enumerate(groups):
        params = [p for layer in group for p in layer.params]
        numel = sum(layer.numel for layer in group)
        nbytes = numel * element_size
        total = numel + len(params)  # gradients, then one usage flag per parameter
        step = total if not split_bytes else max(1, split_bytes // element_size)
        segments = [(s, min(s + step, total)) for s in range(0, total, step)]

        def predicted(algo):
            return sum(model.predict(algo, (b - a) * element_size, world_size) for a, b in segments)

        window = _least(windows, group)
        at = max((ready[layer.name] for layer in group if layer.name in ready), default=None) \
            if ready else None
        if forced:
            algorithm = forced
        elif window is None or at is None:
            algorithm = model.choose(nbytes, world_size, window, candidates)
        else:
            # Each candidate runs in its lane after what is already queued there:
            # the ring behind a big bucket may miss a window the butterfly meets.
            finish = {a: max(lane_free[lane_of(a)], at) + predicted(a) for a in candidates}
            fits = [a for a in candidates if finish[a] - at <= window]
            algorithm = (min(fits, key=lambda a: (bytes_sent(a, nbytes, world_size), finish[a]))
                         if fits else min(candidates, key=lambda a: finish[a]))
        pred = predicted(algorithm)
        queued = None
        if at is not None:
            start = max(lane_free[lane_of(algorithm)], at)
            lane_free[lane_of(algorithm)] = start + pred
            queued = start - at
        buckets.append(Bucket(i, [layer.name for layer in group], params, numel, nbytes, algorithm,
                              lane_of(algorithm), pred, window, segments, queued))
    return Plan(world_size, strategy, buckets)

