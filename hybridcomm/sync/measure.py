"""What the measured steps teach the planner, and when it learns it.

Steps 1..``measure_iters`` of every ``replan_every`` steps are measured (only
the first cycle when ``replan_every`` is 0), and the plan is re-made after them
(the first time always, later only if a decision changes). Measured per layer:
when its gradient is ready, its overlap window and the order the next forward
needs it; per step: the communication's speed against the cost model, each
call's cost beyond it, and how many backward passes counted. Times are stamps of
the device's clock (:mod:`hybridcomm.gpu.clock`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..gpu.clock import HostClock
from ..plan.planner import Layer, Plan


def quantize(seconds: float) -> float:
    """A measured time rounded to 2 significant digits, so that plans repeat.

    >>> quantize(0.0012345)
    0.0012
    """
    return float(f"{seconds:.1e}")


@dataclass(frozen=True)
class Measured:
    """What the measured steps saw, in seconds, as the planner takes it (each None
    when not measured).

    Attributes:
        windows: per layer, from its bucket's launch to its first use.
        ready: per layer, when backward finished its gradients (since the first).
        need: per layer, its order of first use in the next forward (0: first).
        launch_pass: the most backward passes a measured step had.
        comm_scale: measured over predicted communication time (median).
        defer_pays: whether a bucket other than the first needed was still being
            reduced at some measured step() (forward mode's deferral can pay).
        call_s: seconds each all-reduce call cost beyond the cost model's bytes
            (:func:`call_cost`: the waits and start-up a probe on an idle link
            does not see).
    """

    windows: Optional[Dict[str, float]] = None
    ready: Optional[Dict[str, float]] = None
    need: Optional[Dict[str, int]] = None
    launch_pass: Optional[int] = None
    comm_scale: Optional[float] = None
    defer_pays: Optional[bool] = None
    call_s: Optional[float] = None


def op_samples(plan: Plan, ops) -> List[Tuple[float, int, float]]:
    """``(predicted seconds, all-reduce calls, measured seconds)`` of the channel's
    finished operations ``ops`` (``((plan, bucket, segment), seconds)``, the engine's
    keys) that ``plan``'s engine issued: a PowerSGD bucket's operation is two calls."""
    out = []
    for (issued_by, index, seg), seconds in ops:
        if issued_by is not plan:  # a replaced plan's, finished after the re-plan
            continue
        b = plan.buckets[index]
        a, z = b.segments[seg]
        predicted = b.predicted_s * (z - a) / max(b.segments[-1][1], 1)
        if predicted == predicted:  # nan: the model cannot predict it
            out.append((predicted, 2 if b.compressor else 1, seconds))
    return out


def call_cost(samples: Sequence[Tuple[float, int, float]]) -> Optional[float]:
    """Seconds per all-reduce call beyond the cost model, from ``(predicted, calls,
    measured)`` samples: the least-squares ``c >= 0`` of ``measured = x predicted +
    c calls`` (``x >= 0``: the bytes' speed, as measured), each sample weighted by
    1/measured (relative error, small operations count as much as large ones).
    None with fewer than three samples or a single ratio of calls to prediction.

        >>> round(call_cost([(0.024, 2, 0.030), (0.0036, 2, 0.026), (0.024, 2, 0.031)]), 4)
        0.0126
        >>> call_cost([(0.1, 1, 0.11), (1.0, 1, 1.1), (0.01, 1, 0.011)])   # bytes only
        0.0
    """
    import numpy as np

    if len(samples) < 3 or len({round(k / p, 12) for p, k, _ in samples if p > 0}) < 2:
        return None
    p, k, t = (np.array(v, dtype=np.float64) for v in zip(*samples))
    w = 1.0 / np.maximum(t, 1e-9)
    (x, c), *_ = np.linalg.lstsq(np.stack([p, k], axis=1) * w[:, None], t * w, rcond=None)
    if c < 0:
        c = 0.0
    elif x < 0:  # all of it per call
        c = float(np.sum(k * t * w * w) / np.sum((k * w) ** 2))
    return float(c)


class StepMeasurements:
    """Collects the measurements of the measured steps; ``take`` hands them to the planner.

    ``after``: steps that are not measured first (PowerSGD's exact steps: the
    plan is measured once it compresses).

    Example::

        >>> m = StepMeasurements(measure_iters=2, replan_every=0)
        >>> [m.measuring(step) for step in range(4)]      # steps done so far
        [False, True, True, False]
        >>> m = StepMeasurements(measure_iters=2, replan_every=0, after=3)
        >>> [m.measuring(step) for step in range(7)], m.replan_due(5)
        ([False, False, False, False, True, True, False], True)
    """

    def __init__(self, measure_iters: int, replan_every: int, after: int = 0):
        if replan_every and replan_every <= measure_iters:
            raise ValueError(
                f"replan_every ({replan_every}) must exceed measure_iters "
                f"({measure_iters}), or be 0"
            )
        self.measure_iters, self.replan_every, self.after = measure_iters, replan_every, after
        self._ready: Dict[int, object] = {}  # param index -> stamp: its gradient was ready
        self._windows: Dict[str, List[tuple]] = {}  # layer -> (launch, first use) stamps
        self._need: Dict[str, int] = {}  # layer -> order the next forward needed it in
        self._passes: List[int] = []  # backward passes per measured step
        self._comm: List[float] = []  # per measured step: channel busy / predicted time
        self._running: List[List[List[str]]] = []  # per measured step: unfinished buckets' layers
        self._ops: List[Tuple[float, int, float]] = []  # (predicted, calls, measured) per operation

    def phase(self, steps: int) -> int:
        """Position in the measuring cycle after ``steps`` steps (-1: before it)."""
        steps -= self.after
        if steps < 0:
            return -1
        return steps % self.replan_every if self.replan_every else steps

    def first_replan(self, steps: int) -> bool:
        """Whether the re-plan after ``steps`` steps is the first."""
        return steps == self.after + self.measure_iters

    def measuring(self, steps: int) -> bool:
        """Whether the step after ``steps`` completed steps is measured."""
        return 0 < self.phase(steps) <= self.measure_iters

    def replan_due(self, steps: int) -> bool:
        return self.measure_iters > 0 and self.phase(steps) == self.measure_iters

    # -- recording ---------------------------------------------------------------------
    def ready(self, param: int, stamp) -> None:
        """``stamp`` (a clock's, :mod:`hybridcomm.gpu.clock`): when its gradient was ready."""
        self._ready[param] = stamp

    def window(self, layers: Sequence[str], launched, used) -> None:
        """The layers' bucket was launched at stamp ``launched`` and its update needed
        at ``used`` (their first use in the next forward)."""
        for layer in layers:
            self._windows.setdefault(layer, []).append((launched, used))
            self._need.setdefault(layer, len(self._need))

    def passes(self, n: int) -> None:
        self._passes.append(n)

    def comm(self, busy_s: float, predicted_s: float) -> None:
        """A measured step's communication: the channel's busy seconds against the
        plan's prediction for one round of every bucket."""
        if busy_s > 0 and predicted_s > 0:
            self._comm.append(busy_s / predicted_s)

    def ops(self, samples: Sequence[Tuple[float, int, float]]) -> None:
        """Finished channel operations of a measured step (:func:`op_samples`)."""
        self._ops.extend(samples)

    def running_at_step(self, buckets: List[List[str]]) -> None:
        """The buckets (their layers) not yet reduced when a measured step's step()
        began: what forward overlap could still hide behind the next forward."""
        self._running.append(buckets)

    # -- handing over ------------------------------------------------------------------
    def take(self, layers: Sequence[Layer], clock=HostClock()) -> "Measured":
        """What the measured steps saw, for the planner (:class:`Measured`), and
        forget it. ``defer_pays``: whether any measured step had a bucket still
        unreduced at step() other than the one the next forward needs first (that one
        is waited for at once anyway); None: not measured. The stamps are read on
        ``clock``, the one they were taken on (a GPU's: one host sync here)."""
        clock.settle(
            [stamp for pairs in self._windows.values() for pair in pairs for stamp in pair]
            + list(self._ready.values())
        )
        windows = {
            k: quantize(sorted(clock.seconds(*w) for w in v)[len(v) // 2])
            for k, v in self._windows.items()
        }
        ready: Optional[Dict[str, float]] = None
        if self._ready:
            stamps = list(self._ready.values())
            since = {i: clock.seconds(stamps[0], s) for i, s in self._ready.items()}
            first = min(since.values())
            ready = {}
            for layer in layers:
                times = [since[i] for i in layer.params if i in since]
                if times:
                    ready[layer.name] = quantize(max(times) - first)
        need = dict(self._need) or None
        launch_pass = max(self._passes) if self._passes and max(self._passes) > 0 else None
        comm_scale = quantize(sorted(self._comm)[len(self._comm) // 2]) if self._comm else None
        first = {layer for layer, order in self._need.items() if order == 0}
        defer_pays = (
            any(first.isdisjoint(layers) for step in self._running for layers in step)
            if self._running
            else None
        )
        call_s = call_cost(self._ops)
        self._ready, self._windows, self._need, self._passes = {}, {}, {}, []
        self._comm, self._running, self._ops = [], [], []
        return Measured(
            windows or None,
            ready,
            need,
            launch_pass,
            comm_scale=comm_scale,
            defer_pays=defer_pays,
            call_s=None if call_s is None else quantize(call_s),
        )
