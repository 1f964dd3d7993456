"""The alpha-beta-gamma cost model: predicted all-reduce time, fit, choice.

Each algorithm's time for ``n`` bytes over ``P`` ranks is ``alpha`` seconds per
message step, ``beta`` per byte sent and ``gamma`` per byte reduced (Thakur,
Rabenseifner & Gropp 2005; the formulas, with how to read them, are in
docs/PERFORMANCE.md, "The cost model, in brief"); ``native`` and ``ps`` are
lines fitted where measured. Formulas and fitting only: no I/O, no collectives
(saving and loading: auto_model.py; probing and agreeing: calibration.py).

Example::

    >>> m = CostModel(alpha=20e-6, beta=1 / 10e9, gamma=1 / 20e9)
    >>> m.choose(4096, 8), m.choose(256 << 20, 8)
    ('butterfly', 'halving_doubling')
    >>> round(m.predict("ring", 1 << 20, 8) * 1e6)
    509
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

MODELED = ("ring", "butterfly", "halving_doubling")  # auto's default candidates
TWO_LEVEL = ("hierarchical", "torus2d")  # take a Topology; auto adds hierarchical on many nodes
PS = "ps"  # the summation servers (ps.py): a candidate only where the job has servers
ALL = MODELED + TWO_LEVEL + ("native", PS)
FORMAT_VERSION = 1


def _topology(topology, world_size: int):
    from ..algorithms.topology import Topology

    return (topology or Topology()).resolve(world_size)


def _group_size(algorithm: str, topo) -> int:
    return topo.node_size if algorithm == "hierarchical" else topo.grid[1]


def coefficients(
    algorithm: str, nbytes: float, world_size: int, topology=None
) -> Tuple[float, float, float]:
    """(messages, bytes sent, bytes reduced) on the critical path: the
    multipliers of alpha, beta and gamma for one all-reduce on a flat network.
    ``topology`` (default: ``Topology.resolve``'s) sets the two-level
    algorithms' group size."""
    p, n = world_size, float(nbytes)
    if p <= 1:
        return 0.0, 0.0, 0.0
    if algorithm == "ring":
        return 2.0 * (p - 1), 2.0 * (p - 1) / p * n, (p - 1) / p * n
    if algorithm in TWO_LEVEL:
        # g ranks a group (hierarchical: the node size; torus2d: the grid's columns),
        # m groups, s ranks in the last one, k the most chunks one rank of it owns;
        # inside, the groups step in lockstep. Full groups (s = g): the ring's bytes.
        g = _group_size(algorithm, _topology(topology, p))
        m = -(-p // g)
        s = p - (m - 1) * g
        k = -(-g // s)
        inside = ((s - 1) * k + g - s) * n / g  # the short group's s-1 steps carry k chunks
        across = (m - 1) / m * k * n / g
        return 2.0 * (g - 1) + 2.0 * (m - 1), 2 * inside + 2 * across, inside + across
    if algorithm not in ("butterfly", "halving_doubling"):
        raise ValueError(f"no cost formula for {algorithm!r}; modeled: {MODELED + TWO_LEVEL}")
    q = 1 << (p.bit_length() - 1)
    k = q.bit_length() - 1  # log2 q
    if algorithm == "butterfly":
        a, b, g = float(k), k * n, k * n
    else:
        a, b, g = 2.0 * k, 2.0 * (q - 1) / q * n, (q - 1) / q * n
    if p > q:  # fold the extra ranks in (send + reduce) and out (send)
        a, b, g = a + 2, b + 2 * n, g + n
    return a, b, g


class LinkCoefficients(NamedTuple):
    """Multipliers of alpha, beta, gamma, inter_alpha and inter_beta."""

    messages: float
    bytes: float  # on the busiest rank link, in steps inside nodes
    reduced: float
    inter_messages: float  # steps in which some message crosses nodes
    inter_bytes: float  # on the busiest node link (shared by the node's ranks), in those steps


def link_coefficients(
    algorithm: str, nbytes: float, world_size: int, topology=None
) -> LinkCoefficients:
    """Coefficients on a two-level network: nodes of ``topology.node_size``
    consecutive ranks, each node's ranks sharing one full-duplex link to the
    others. Counted round by round from the algorithm's traffic pattern (who
    sends how much to whom in each step, the same pattern as its schedule):
    a round with a message between nodes is an inter-node step and costs its
    busiest node link's bytes, else its busiest rank's bytes.

    Example::

        >>> from hybridcomm.algorithms import Topology
        >>> link_coefficients("hierarchical", 1.0, 4, Topology(node_size=2))
        LinkCoefficients(messages=2.0, bytes=1.0, reduced=0.75, inter_messages=2.0, inter_bytes=1.0)
        >>> link_coefficients("ring", 1.0, 4, Topology(node_size=2)).inter_bytes
        1.5
    """
    if world_size <= 1:
        return LinkCoefficients(0.0, 0.0, 0.0, 0.0, inter_bytes=0.0)
    if algorithm not in MODELED + TWO_LEVEL:
        raise ValueError(f"no cost formula for {algorithm!r}; modeled: {MODELED + TWO_LEVEL}")
    topo = _topology(topology, world_size)
    a, b, g, ae, be = _per_byte(algorithm, world_size, topo)
    n = float(nbytes)
    return LinkCoefficients(a, b * n, g * n, ae, inter_bytes=be * n)


@lru_cache(maxsize=1024)
def _per_byte(algorithm: str, p: int, topo) -> Tuple[float, ...]:
    node = topo.node_size
    a = b = g = ae = be = 0.0
    for edges, reduces, repeat in _rounds(algorithm, p, topo):
        out, inn, up, down = {}, {}, {}, {}
        for src, dst, x in edges:
            out[src] = out.get(src, 0.0) + x
            inn[dst] = inn.get(dst, 0.0) + x
            if src // node != dst // node:
                up[src // node] = up.get(src // node, 0.0) + x
                down[dst // node] = down.get(dst // node, 0.0) + x
        if up:
            ae, be = ae + repeat, be + repeat * max(max(up.values()), max(down.values()))
        else:
            a, b = a + repeat, b + repeat * max(max(out.values()), max(inn.values()))
        if reduces:
            g += repeat * max(inn.values())
    return a, b, g, ae, be


def _rounds(algorithm: str, p: int, topo) -> List[Tuple[tuple, bool, int]]:
    """(edges (src, dst, fraction of the buffer), reduces, how many steps) per round."""
    if algorithm == "ring":
        ring = tuple((r, (r + 1) % p, 1 / p) for r in range(p))
        return [(ring, True, p - 1), (ring, False, p - 1)]
    if algorithm in TWO_LEVEL:
        return _grouped_rounds(_group_size(algorithm, topo), p)
    q = 1 << (p.bit_length() - 1)
    masks = [1 << i for i in range(q.bit_length() - 1)]
    if algorithm == "butterfly":
        core = [(tuple((r, r ^ k, 1.0) for r in range(q)), True, 1) for k in masks]
    else:  # halving_doubling: halve with mask q/2 .. 1, then double back
        halve = [(tuple((r, r ^ k, k / q) for r in range(q)), True, 1) for k in reversed(masks)]
        core = halve + [(e, False, 1) for e, _, _ in reversed(halve)]
    if p == q:
        return core
    fold_in = tuple((q + i, i, 1.0) for i in range(p - q))
    return [(fold_in, True, 1)] + core + [(tuple((d, s, x) for s, d, x in fold_in), False, 1)]


def _grouped_rounds(g: int, p: int) -> List[Tuple[tuple, bool, int]]:
    from ..algorithms.grouped import runs

    m = -(-p // g)
    sizes = [min(g, p - t * g) for t in range(m)]
    short = sizes[-1]

    def inside(groups):  # one step of these groups' rings: each rank passes its largest run on
        return tuple(
            (k * g + j, k * g + (j + 1) % s, -(-g // s) / g) for k, s in groups for j in range(s)
        )

    # The first short-1 steps run in every group, the rest in the full groups only.
    both = [(inside(enumerate(sizes)), short - 1), (inside(enumerate(sizes[:-1])), g - short)]
    both = [(e, n) for e, n in both if n > 0]
    owner = {
        s: [j for j in range(s) for _ in range(runs(g, s)[j + 1] - runs(g, s)[j])]
        for s in set(sizes)
    }  # chunk -> local rank, per group size
    across = tuple(
        (k * g + owner[s][c], ((k + 1) % m) * g + owner[sizes[(k + 1) % m]][c], 1 / g / m)
        for c in range(g)
        for k, s in enumerate(sizes)
    )
    rounds = [(e, True, n) for e, n in both]
    if m > 1:
        rounds += [(across, True, m - 1), (across, False, m - 1)]
    return rounds + [(e, False, n) for e, n in both]


NATIVE = "native"  # the process group's own all_reduce (gloo / NCCL)


def bytes_sent(algorithm: str, nbytes: float, world_size: int, topology=None) -> float:
    """Bytes each rank sends; ``native`` counts as a ring (what gloo and NCCL run);
    ``ps``: each worker pushes its buffer once (to the servers)."""
    if algorithm == PS:
        return float(nbytes) if world_size > 1 else 0.0
    return coefficients("ring" if algorithm == NATIVE else algorithm, nbytes, world_size, topology)[
        1
    ]


@dataclass(frozen=True)
class CostModel:
    """alpha (s per message), beta (s per byte sent), gamma (s per byte reduced);
    native_alpha (s per call) and native_beta (s per byte) where measured;
    inter_alpha (s per step that crosses nodes) and inter_beta (s per byte on a
    node's shared link to the other nodes) for a two-level network (None: as
    alpha / beta, a flat network, and predictions as without them).

    ``native`` (the process group's own all-reduce, in C++) and ``ps`` (the
    summation servers, extra processes on links of their own) are lines
    ``a + n b`` fitted from their own measurements: their traffic is not the
    schedules', so alpha and beta do not describe it. Unmeasured, neither is
    offered."""

    alpha: float
    beta: float
    gamma: float
    source: str = field(default="built-in defaults", compare=False)
    meta: Dict = field(default_factory=dict, compare=False, repr=False)
    native_alpha: Optional[float] = None
    native_beta: Optional[float] = None
    inter_alpha: Optional[float] = None
    inter_beta: Optional[float] = None
    ps_alpha: Optional[float] = None  # s per all-reduce through the summation servers
    ps_beta: Optional[float] = None  # s per byte of the buffer
    ps_servers: Optional[int] = None  # how many servers the ps line was measured with

    @property
    def two_level(self) -> bool:
        """Whether inter-node links are modeled apart (:func:`link_coefficients`)."""
        return self.inter_alpha is not None or self.inter_beta is not None

    def offers(self, algorithm: str, servers: Optional[int] = None) -> bool:
        """Whether this model predicts ``algorithm`` (``native`` and ``ps`` only where
        measured; ``ps`` with ``servers``: measured with that many servers)."""
        if algorithm == PS:
            return self.ps_alpha is not None and servers in (None, self.ps_servers)
        return algorithm != NATIVE or self.native_alpha is not None

    def predict(self, algorithm: str, nbytes: int, world_size: int, topology=None) -> float:
        """Predicted seconds for one all-reduce of ``nbytes`` over ``world_size`` ranks
        (``topology``: node size and grid, default ``Topology.resolve``'s)."""
        if algorithm == NATIVE:
            if not self.offers(NATIVE):
                raise ValueError("this cost model has no measurement of 'native'")
            return 0.0 if world_size <= 1 else self.native_alpha + nbytes * self.native_beta
        if algorithm == PS:
            if not self.offers(PS):
                raise ValueError(
                    "this cost model has no measurement of 'ps' (the summation "
                    "servers): hybridcomm-bench --servers K --calibrate fits one"
                )
            return 0.0 if world_size <= 1 else self.ps_alpha + nbytes * self.ps_beta
        if not self.two_level:
            a, b, g = coefficients(algorithm, nbytes, world_size, topology)
            return a * self.alpha + b * self.beta + g * self.gamma
        c = link_coefficients(algorithm, nbytes, world_size, topology)
        inter_alpha = self.alpha if self.inter_alpha is None else self.inter_alpha
        inter_beta = self.beta if self.inter_beta is None else self.inter_beta
        return (
            c.messages * self.alpha
            + c.bytes * self.beta
            + c.reduced * self.gamma
            + c.inter_messages * inter_alpha
            + c.inter_bytes * inter_beta
        )

    def predict_all(
        self, nbytes: int, world_size: int, topology=None, algorithms: Sequence[str] = MODELED
    ) -> Dict[str, float]:
        return {algo: self.predict(algo, nbytes, world_size, topology) for algo in algorithms}

    def choose(
        self,
        nbytes: int,
        world_size: int,
        window: Optional[float] = None,
        candidates: Sequence[str] = MODELED,
        topology=None,
    ) -> str:
        """The algorithm for ``nbytes`` over ``world_size`` ranks, among ``candidates``.

        Without ``window``: the fastest predicted. With ``window`` (seconds
        until the result is needed): among the algorithms predicted to finish
        within it, the one that sends the fewest bytes (it leaves the most
        bandwidth to the other buckets), then the fastest; if none fits, the
        fastest. Ties go to the earlier name in :data:`MODELED`; ``native`` goes
        to the fastest of ours unless predicted faster than it by more than the
        model can resolve (:attr:`uncertainty`).
        """
        order = [a for a in sorted(candidates, key=ALL.index) if self.offers(a)]
        times = {a: self.predict(a, nbytes, world_size, topology) for a in order}
        fits = [] if window is None else [a for a in order if times[a] <= window]
        if not fits:
            return self._ours_within_uncertainty(min(order, key=lambda a: times[a]), order, times)
        return self._ours_within_uncertainty(
            min(fits, key=lambda a: (bytes_sent(a, nbytes, world_size, topology), times[a])),
            fits,
            times,
        )

    @property
    def uncertainty(self) -> float:
        """How far apart two of this model's predictions must be (relative) before it
        can tell them apart: the larger of its fit's rms relative error and its
        samples' spread (each point's interquartile range over its median, the
        median over points), where it records them (the start-up probe; a saved
        calibration records its error), else 0."""
        fit = self.meta.get("fit") or {}
        return float(max(fit.get("rms_rel_err") or 0.0, fit.get("spread") or 0.0))

    def native_was_faster(
        self, pick: str, candidates: Sequence[str], nbytes: int, world_size: int, topology=None
    ) -> bool:
        """Whether ``native``, among ``candidates``, was predicted faster than ``pick``
        (one of ours, which :meth:`choose` kept: within :attr:`uncertainty`)."""
        return (
            pick != NATIVE
            and NATIVE in candidates
            and self.offers(NATIVE)
            and self.predict(NATIVE, nbytes, world_size, topology)
            < self.predict(pick, nbytes, world_size, topology)
        )

    def _ours_within_uncertainty(
        self, pick: str, among: Sequence[str], times: Dict[str, float]
    ) -> str:
        """``native`` only where it is predicted faster than the fastest of ours by
        more than :attr:`uncertainty`: within it the model cannot tell them apart,
        and which one a plan got would flip from probe to probe. Ours is kept:
        in a training step at P = 2 over gloo here, a 0.71 MB bucket's took
        0.82-0.83 ms against native's 1.01-1.23, where the probe, which times
        each alone, found them level (benchmarks/results/synchronizer/timeline/)."""
        ours = [a for a in among if a not in (NATIVE, PS)]
        if pick != NATIVE or not ours:
            return pick
        best = min(ours, key=lambda a: times[a])
        return best if times[best] <= times[NATIVE] * (1 + self.uncertainty) else pick

    def with_latency(self, seconds: float) -> "CostModel":
        """This model with ``seconds`` more per message (an emulated slower network;
        the emulation wraps hybridcomm's transport only, so ``native`` is dropped)."""
        inter = None if self.inter_alpha is None else self.inter_alpha + seconds
        return CostModel(
            self.alpha + seconds,
            self.beta,
            self.gamma,
            source=f"{self.source} + {seconds * 1e6:g} us/message",
            meta=self.meta,
            inter_alpha=inter,
            inter_beta=self.inter_beta,
        )

    def with_ps(self, alpha: float, beta: float, servers: int) -> "CostModel":
        """This model with a measured ``ps`` line (``servers`` summation servers)."""
        return dataclasses.replace(
            self, ps_alpha=float(alpha), ps_beta=float(beta), ps_servers=int(servers)
        )

    def crossover(
        self,
        world_size: int,
        a: str = "butterfly",
        b: str = "ring",
        lo: int = 1,
        hi: int = 1 << 40,
        topology=None,
    ) -> Optional[int]:
        """Smallest byte count at which ``b`` is predicted no slower than ``a``
        (None if it never is up to ``hi``); the times are linear in n."""
        diff = lambda n: (
            self.predict(a, n, world_size, topology)  # noqa: E731
            - self.predict(b, n, world_size, topology)
        )
        if diff(lo) >= 0:
            return lo
        if diff(hi) < 0:
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if diff(mid) >= 0 else (mid, hi)
        return hi

    def to_json(self) -> Dict:
        native = (
            {}
            if not self.offers(NATIVE)
            else {"native_alpha_s": self.native_alpha, "native_beta_s_per_byte": self.native_beta}
        )
        inter = {
            k: v
            for k, v in (
                ("inter_alpha_s", self.inter_alpha),
                ("inter_beta_s_per_byte", self.inter_beta),
            )
            if v is not None
        }
        ps = (
            {}
            if self.ps_alpha is None
            else {
                "ps_alpha_s": self.ps_alpha,
                "ps_beta_s_per_byte": self.ps_beta,
                "ps_servers": self.ps_servers,
            }
        )
        return {
            "version": FORMAT_VERSION,
            "alpha_s": self.alpha,
            "beta_s_per_byte": self.beta,
            "gamma_s_per_byte": self.gamma,
            **native,
            **inter,
            **ps,
            **self.meta,
        }

    @classmethod
    def from_json(cls, data: Dict, source: str = "json") -> "CostModel":
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"cost model format {data.get('version')!r}, expected {FORMAT_VERSION}"
            )
        known = (
            "version",
            "alpha_s",
            "beta_s_per_byte",
            "gamma_s_per_byte",
            "native_alpha_s",
            "native_beta_s_per_byte",
            "inter_alpha_s",
            "inter_beta_s_per_byte",
            "ps_alpha_s",
            "ps_beta_s_per_byte",
            "ps_servers",
        )
        meta = {k: v for k, v in data.items() if k not in known}
        native = data.get("native_alpha_s")
        opt = lambda key: None if data.get(key) is None else float(data[key])  # noqa: E731
        return cls(
            float(data["alpha_s"]),
            float(data["beta_s_per_byte"]),
            float(data["gamma_s_per_byte"]),
            source=source,
            meta=meta,
            native_alpha=None if native is None else float(native),
            native_beta=None if native is None else float(data["native_beta_s_per_byte"]),
            inter_alpha=opt("inter_alpha_s"),
            inter_beta=opt("inter_beta_s_per_byte"),
            ps_alpha=opt("ps_alpha_s"),
            ps_beta=opt("ps_beta_s_per_byte"),
            ps_servers=None if data.get("ps_servers") is None else int(data["ps_servers"]),
        )


# Uncalibrated defaults: a 25 us message, 2.5 GB/s links, 10 GB/s reduction
# (a commodity cluster). They put the butterfly/halving-doubling crossover
# near 150 KB at P=4. Calibrate for anything that matters.
DEFAULT_MODEL = CostModel(alpha=25e-6, beta=1 / 2.5e9, gamma=1 / 10e9)


# --- fitting -------------------------------------------------------------------------------

Sample = Tuple[str, int, int, float]  # (algorithm, bytes, world_size, seconds)


@dataclass(frozen=True)
class FitReport:
    n_points: int
    rms_rel_err: float  # root mean square of (predicted - measured) / measured
    max_rel_err: float
    residuals: Tuple[
        Tuple[str, int, int, float, float], ...
    ]  # (algo, bytes, P, measured, predicted)
    dropped: int = 0  # outliers left out of the fit
    confidence: str = "high"  # high (rms < 15%), medium (< 35%), low
    degenerate: bool = False  # alpha or beta came out 0: the planner uses safe defaults


MIN_SAMPLES = 4


def _nnls(A, y, fixed):
    """Least squares with every coefficient >= 0, the ``fixed`` columns held at their
    values: exact, by trying every subset of the free columns (at most five)."""
    import numpy as np

    width = A.shape[1]
    free = [c for c in range(width) if c not in fixed]
    rest = y - sum(A[:, c] * v for c, v in fixed.items())
    scale = np.maximum(np.abs(A).max(axis=0), 1e-300)  # columns differ by ~1e9
    best = None
    for k in range(len(free), 0, -1):
        for cols in itertools.combinations(free, k):
            sol, *_ = np.linalg.lstsq(A[:, cols] / scale[list(cols)], rest, rcond=None)
            x = np.zeros(width)
            x[list(cols)] = sol / scale[list(cols)]
            if (x < 0).any():
                continue
            for c, v in fixed.items():
                x[c] = v
            err = float(np.sum((A @ x - y) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, x)
    if best is None:
        x = np.zeros(width)
        for c, v in fixed.items():
            x[c] = v
        return x
    return best[1]


def fit(
    samples: Iterable[Sample],
    topology=None,
    *,
    gamma: Optional[float] = None,
    ps_servers: Optional[int] = None,
) -> Tuple[CostModel, FitReport]:
    """Least-squares alpha, beta, gamma >= 0 from measured times, robustly.

    Each sample ``(algorithm, bytes, P, seconds)`` is one equation
    ``a*alpha + b*beta + g*gamma = seconds`` (see :func:`coefficients`),
    weighted by ``1/seconds`` so that a 4 KiB and a 64 MiB point count alike
    (relative error); every coefficient is kept >= 0 (an exact NNLS). With a
    ``topology`` of more than one node (of more than one rank),
    ``inter_alpha`` and ``inter_beta`` too, from :func:`link_coefficients`.

    ``gamma``, when measured on its own (the probe times the reduction
    kernel), is held fixed: beta and gamma are otherwise told apart only by
    the butterfly's and the ring's different bytes-sent to bytes-reduced
    ratios, which noise easily swamps. Points more than 3x the median
    relative residual off (and over 25%) are dropped as outliers, once.
    The report gives the error, a confidence, and ``degenerate`` when alpha
    or beta is 0 (the planner then uses safe defaults). ``native`` (or
    ``torch``) samples fit the native line; ``ps`` samples, with
    ``ps_servers`` (the number of servers they ran with), the ps line.

    Example::

        >>> true = CostModel(50e-6, 1e-9, 2e-10)
        >>> pts = [(a, n, 4, true.predict(a, n, 4)) for a in MODELED for n in (4096, 1 << 20)]
        >>> m, rep = fit(pts)
        >>> round(m.alpha * 1e6, 3), rep.max_rel_err < 1e-9, rep.confidence
        (50.0, True, 'high')
    """
    import numpy as np

    samples = list(samples)
    rows = [
        (algo, int(n), int(p), float(t))
        for algo, n, p, t in samples
        if algo in MODELED + TWO_LEVEL and p > 1 and t > 0
    ]
    if len(rows) < MIN_SAMPLES or len({n for _, n, _, _ in rows}) < 2:
        raise ValueError(
            f"too few usable samples to fit ({len(rows)}; need {MIN_SAMPLES} at two "
            "or more sizes, of our algorithms at P > 1)"
        )
    two = topology is not None and any(
        1 < _topology(topology, p).node_size < p for _, _, p, _ in rows
    )
    coeffs = link_coefficients if two else coefficients
    fixed = {} if gamma is None else {2: float(gamma)}

    def solve(rs):
        A = np.array([coeffs(algo, n, p, topology) for algo, n, p, _ in rs], dtype=np.float64)
        y = np.array([t for *_, t in rs], dtype=np.float64)
        w = 1.0 / y
        x = _nnls(A * w[:, None], y * w, fixed)
        return x, (A @ x - y) / y

    x, rel = solve(rows)
    dropped = 0
    bound = max(3 * float(np.median(np.abs(rel))), 0.25)
    keep = [r for r, e in zip(rows, rel) if abs(e) <= bound]
    if MIN_SAMPLES <= len(keep) < len(rows):
        dropped = len(rows) - len(keep)
        rows = keep
        x, rel = solve(rows)
    native = _fit_native(
        [(n, t) for algo, n, p, t in samples if algo in (NATIVE, "torch") and p > 1 and t > 0]
    )
    ps = (
        _fit_native([(n, t) for algo, n, p, t in samples if algo == PS and p > 1 and t > 0])
        if ps_servers
        else None
    )
    model = CostModel(
        float(x[0]),
        float(x[1]),
        float(x[2]),
        source="fit",
        native_alpha=native[0] if native else None,
        native_beta=native[1] if native else None,
        inter_alpha=float(x[3]) if two else None,
        inter_beta=float(x[4]) if two else None,
        ps_alpha=ps[0] if ps else None,
        ps_beta=ps[1] if ps else None,
        ps_servers=int(ps_servers) if ps else None,
    )
    rms = float(np.sqrt(np.mean(rel**2)))
    report = FitReport(
        len(rows),
        rms,
        float(np.max(np.abs(rel))),
        tuple((algo, n, p, t, t * (1 + e)) for (algo, n, p, t), e in zip(rows, rel)),
        dropped=dropped,
        confidence="high" if rms < 0.15 else "medium" if rms < 0.35 else "low",
        degenerate=model.alpha <= 0 or model.beta <= 0,
    )
    return model, report


def rounded(model: CostModel, digits: int = 2) -> CostModel:
    """``model`` with every coefficient rounded to ``digits`` significant digits, so
    that repeated measurements of one machine give the same model (and plan)."""

    def r(v):
        return None if v is None else float(f"{v:.{digits - 1}e}")

    return dataclasses.replace(
        model,
        alpha=r(model.alpha),
        beta=r(model.beta),
        gamma=r(model.gamma),
        native_alpha=r(model.native_alpha),
        native_beta=r(model.native_beta),
        inter_alpha=r(model.inter_alpha),
        inter_beta=r(model.inter_beta),
        ps_alpha=r(model.ps_alpha),
        ps_beta=r(model.ps_beta),
    )


def _fit_native(points) -> Optional[Tuple[float, float]]:
    """(seconds per call, seconds per byte) >= 0 through (bytes, seconds) points,
    relative error weighted like :func:`fit`; None without two distinct sizes."""
    import numpy as np

    if len({n for n, _ in points}) < 2:
        return None
    n = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    A = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    (a, b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if a < 0:  # clamp, then refit the other
        a, b = 0.0, float(np.sum(n * t / t**2) / np.sum(n**2 / t**2))
    if b < 0:
        a, b = float(np.sum(1 / t) / np.sum(1 / t**2)), 0.0
    return float(a), float(b)


def table(model: CostModel, world_size: int, sizes: Sequence[int]) -> List[str]:
    """Predicted time per algorithm per size, as printable lines (the plan's evidence)."""
    lines = [f"{'size':>12} " + " ".join(f"{a:>17}" for a in MODELED) + "  choice"]
    for n in sizes:
        t = model.predict_all(n, world_size)
        lines.append(
            f"{n:>12} "
            + " ".join(f"{t[a] * 1e6:>15.1f}us" for a in MODELED)
            + f"  {model.choose(n, world_size)}"
        )
    return lines
