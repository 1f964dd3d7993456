"""The alpha-beta-gamma cost model: predicted all-reduce time, calibration, choice.

Each algorithm's time for ``n`` bytes over ``P`` ranks is a sum of three terms:
``alpha`` seconds per message (latency, per step), ``beta`` seconds per byte
sent (inverse bandwidth), ``gamma`` seconds per byte reduced. With
``q = 2**floor(log2 P)`` and ``e = P - q`` (the ranks folded in and out)::

    ring              2(P-1) a  +  2(P-1)/P n b  +  (P-1)/P n g
    butterfly         log2(q) (a + n b + n g)                       + fold
    halving_doubling  2 log2(q) a  +  2(q-1)/q n b  +  (q-1)/q n g  + fold
    fold (e > 0)      2 a  +  2 n b  +  n g      (hand in + reduce, hand back)
    hierarchical,     2(G-1) a + 2 w n/G b + w n/G g       (inside the groups)
    torus2d           + 2(m-1) a + 2(m-1)/m k n/G b + (m-1)/m k n/G g   (across)

For the two-level ones G is the group size (hierarchical: the node size;
torus2d: the grid's columns), m = ceil(P/G) groups, s = P - (m-1)G the last
group's size, k = ceil(G/s) the most chunks one rank of it owns, and
w = (s-1)k + G-s (steps taken in lockstep: in s-1 of the G-1 steps inside,
the short group's messages are k chunks). With full groups (s = G):
2(G-1) + 2(m-1) messages and the ring's 2(P-1)/P n bytes.

Two link classes. The formulas above are a flat network (every rank its own
link). A model with ``inter_alpha`` / ``inter_beta`` describes nodes
(``Topology.node_size`` consecutive ranks) whose ranks share one full-duplex
link to the other nodes: a step in which any message crosses nodes costs
``inter_alpha`` plus the bytes on the busiest node link times
``inter_beta``; other steps cost ``alpha`` plus the busiest rank's bytes
times ``beta`` (:func:`link_coefficients`). Left out, the inter-node values
are the intra-node ones and the flat formulas apply, so an existing model
predicts exactly what it did.

(Thakur, Rabenseifner & Gropp 2005; the same formulas, with how to read them,
are in docs/PERFORMANCE.md.) Besides, ``native`` (the process group's own
all_reduce: gloo's or NCCL's, in C++) is modeled as a line ``a_n + n b_n``,
fitted separately where it was measured (the start-up probe, or the sweep's
``torch`` rows); an uncalibrated model does not offer it. The butterfly sends the whole buffer every step
but in the fewest steps, so it wins while ``alpha`` dominates; ring and
halving-doubling send the least. ``a``, ``b``, ``g`` are fitted by least
squares from a benchmark sweep (``hybridcomm-bench --calibrate``), saved as
JSON in the user's cache dir, and loaded from there by ``auto`` and the
planner.

Every rank must choose the same algorithm for the same call. The choice
depends only on (bytes, P) and the model's three numbers, so ranks agree as
long as they load the same model: a shared cache dir, the same
``HYBRIDCOMM_COST_MODEL`` file, or :func:`agree` (rank 0's model for all).
``all_reduce``'s pre-call check turns any disagreement into an error.

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
import json
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

log = logging.getLogger("hybridcomm")

MODELED = ("ring", "butterfly", "halving_doubling")  # auto's default candidates
TWO_LEVEL = ("hierarchical", "torus2d")  # take a Topology; auto adds hierarchical on many nodes
ALL = MODELED + TWO_LEVEL + ("native",)
FORMAT_VERSION = 1
ENV_PATH = "HYBRIDCOMM_COST_MODEL"


def _topology(topology, world_size: int):
    from .algorithms.topology import Topology

    return (topology or Topology()).resolve(world_size)


def _group_size(algorithm: str, topo) -> int:
    return topo.node_size if algorithm == "hierarchical" else topo.grid[1]


def coefficients(algorithm: str, nbytes: float, world_size: int,
                 topology=None) -> Tuple[float, float, float]:
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


def link_coefficients(algorithm: str, nbytes: float, world_size: int,
                      topology=None) -> LinkCoefficients:
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
        return LinkCoefficients(0.0, 0.0, 0.0, 0.0, 0.0)
    if algorithm not in MODELED + TWO_LEVEL:
        raise ValueError(f"no cost formula for {algorithm!r}; modeled: {MODELED + TWO_LEVEL}")
    topo = _topology(topology, world_size)
    a, b, g, ae, be = _per_byte(algorithm, world_size, topo)
    n = float(nbytes)
    return LinkCoefficients(a, b * n, g * n, ae, be * n)


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
    from .algorithms.grouped import runs

    m = -(-p // g)
    sizes = [min(g, p - t * g) for t in range(m)]
    short = sizes[-1]

    def inside(groups):  # one step of these groups' rings: each rank passes its largest run on
        return tuple((k * g + j, k * g + (j + 1) % s, -(-g // s) / g)
                     for k, s in groups for j in range(s))

    # The first short-1 steps run in every group, the rest in the full groups only.
    both = [(inside(enumerate(sizes)), short - 1), (inside(enumerate(sizes[:-1])), g - short)]
    both = [(e, n) for e, n in both if n > 0]
    owner = {s: [j for j in range(s) for _ in range(runs(g, s)[j + 1] - runs(g, s)[j])]
             for s in set(sizes)}  # chunk -> local rank, per group size
    across = tuple((k * g + owner[s][c], ((k + 1) % m) * g + owner[sizes[(k + 1) % m]][c],
                    1 / g / m) for c in range(g) for k, s in enumerate(sizes))
    rounds = [(e, True, n) for e, n in both]
    if m > 1:
        rounds += [(across, True, m - 1), (across, False, m - 1)]
    return rounds + [(e, False, n) for e, n in both]


NATIVE = "native"  # the process group's own all_reduce (gloo / NCCL)


def bytes_sent(algorithm: str, nbytes: float, world_size: int, topology=None) -> float:
    """Bytes each rank sends; ``native`` counts as a ring (what gloo and NCCL run)."""
    return coefficients("ring" if algorithm == NATIVE else algorithm, nbytes, world_size,
                        topology)[1]


@dataclass(frozen=True)
class CostModel:
    """alpha (s per message), beta (s per byte sent), gamma (s per byte reduced);
    native_alpha (s per call) and native_beta (s per byte) where measured;
    inter_alpha (s per step that crosses nodes) and inter_beta (s per byte on a
    node's shared link to the other nodes) for a two-level network (None: as
    alpha / beta, a flat network)."""

    alpha: float
    beta: float
    gamma: float
    source: str = field(default="built-in defaults", compare=False)
    meta: Dict = field(default_factory=dict, compare=False, repr=False)
    native_alpha: Optional[float] = None
    native_beta: Optional[float] = None
    inter_alpha: Optional[float] = None
    inter_beta: Optional[float] = None

    @property
    def two_level(self) -> bool:
        """Whether inter-node links are modeled apart (:func:`link_coefficients`)."""
        return self.inter_alpha is not None or self.inter_beta is not None

    def offers(self, algorithm: str) -> bool:
        return algorithm != NATIVE or self.native_alpha is not None

    def predict(self, algorithm: str, nbytes: int, world_size: int, topology=None) -> float:
        """Predicted seconds for one all-reduce of ``nbytes`` over ``world_size`` ranks
        (``topology``: node size and grid, default ``Topology.resolve``'s)."""
        if algorithm == NATIVE:
            if not self.offers(NATIVE):
                raise ValueError("this cost model has no measurement of 'native'")
            return 0.0 if world_size <= 1 else self.native_alpha + nbytes * self.native_beta
        if not self.two_level:
            a, b, g = coefficients(algorithm, nbytes, world_size, topology)
            return a * self.alpha + b * self.beta + g * self.gamma
        c = link_coefficients(algorithm, nbytes, world_size, topology)
        inter_alpha = self.alpha if self.inter_alpha is None else self.inter_alpha
        inter_beta = self.beta if self.inter_beta is None else self.inter_beta
        return (c.messages * self.alpha + c.bytes * self.beta + c.reduced * self.gamma
                + c.inter_messages * inter_alpha + c.inter_bytes * inter_beta)

    def predict_all(self, nbytes: int, world_size: int, topology=None,
                    algorithms: Sequence[str] = MODELED) -> Dict[str, float]:
        return {algo: self.predict(algo, nbytes, world_size, topology) for algo in algorithms}

    def choose(self, nbytes: int, world_size: int, window: Optional[float] = None,
               candidates: Sequence[str] = MODELED, topology=None) -> str:
        """The algorithm for ``nbytes`` over ``world_size`` ranks, among ``candidates``.

        Without ``window``: the fastest predicted. With ``window`` (seconds
        until the result is needed): among the algorithms predicted to finish
        within it, the one that sends the fewest bytes (it leaves the most
        bandwidth to the other buckets), then the fastest; if none fits, the
        fastest. Ties go to the earlier name in :data:`MODELED`.
        """
        order = [a for a in sorted(candidates, key=ALL.index) if self.offers(a)]
        times = {a: self.predict(a, nbytes, world_size, topology) for a in order}
        fastest = min(order, key=lambda a: times[a])
        if window is None:
            return fastest
        fits = [a for a in order if times[a] <= window]
        if not fits:
            return fastest
        return min(fits, key=lambda a: (bytes_sent(a, nbytes, world_size, topology), times[a]))

    def with_latency(self, seconds: float) -> "CostModel":
        """This model with ``seconds`` more per message (an emulated slower network;
        the emulation wraps hybridcomm's transport only, so ``native`` is dropped)."""
        inter = None if self.inter_alpha is None else self.inter_alpha + seconds
        return CostModel(self.alpha + seconds, self.beta, self.gamma,
                         source=f"{self.source} + {seconds * 1e6:g} us/message", meta=self.meta,
                         inter_alpha=inter, inter_beta=self.inter_beta)

    def crossover(self, world_size: int, a: str = "butterfly", b: str = "ring",
                  lo: int = 1, hi: int = 1 << 40, topology=None) -> Optional[int]:
        """Smallest byte count at which ``b`` is predicted no slower than ``a``
        (None if it never is up to ``hi``); the times are linear in n."""
        diff = lambda n: (self.predict(a, n, world_size, topology)  # noqa: E731
                          - self.predict(b, n, world_size, topology))
        if diff(lo) >= 0:
            return lo
        if diff(hi) < 0:
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if diff(mid) >= 0 else (mid, hi)
        return hi

    def to_json(self) -> Dict:
        native = {} if not self.offers(NATIVE) else {
            "native_alpha_s": self.native_alpha, "native_beta_s_per_byte": self.native_beta}
        inter = {k: v for k, v in (("inter_alpha_s", self.inter_alpha),
                                   ("inter_beta_s_per_byte", self.inter_beta)) if v is not None}
        return {"version": FORMAT_VERSION, "alpha_s": self.alpha, "beta_s_per_byte": self.beta,
                "gamma_s_per_byte": self.gamma, **native, **inter, **self.meta}

    @classmethod
    def from_json(cls, data: Dict, source: str = "json") -> "CostModel":
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"cost model format {data.get('version')!r}, expected {FORMAT_VERSION}")
        known = ("version", "alpha_s", "beta_s_per_byte", "gamma_s_per_byte", "native_alpha_s",
                 "native_beta_s_per_byte", "inter_alpha_s", "inter_beta_s_per_byte")
        meta = {k: v for k, v in data.items() if k not in known}
        native = data.get("native_alpha_s")
        opt = lambda key: None if data.get(key) is None else float(data[key])  # noqa: E731
        return cls(float(data["alpha_s"]), float(data["beta_s_per_byte"]),
                   float(data["gamma_s_per_byte"]), source=source, meta=meta,
                   native_alpha=None if native is None else float(native),
                   native_beta=None if native is None else float(data["native_beta_s_per_byte"]),
                   inter_alpha=opt("inter_alpha_s"), inter_beta=opt("inter_beta_s_per_byte"))


# Uncalibrated defaults: a 25 us message, 2.5 GB/s links, 10 GB/s reduction
# (a commodity cluster). They put the butterfly/halving-doubling crossover
# near 150 KB at P=4. Calibrate for anything that matters.
DEFAULT_MODEL = CostModel(alpha=25e-6, beta=1 / 2.5e9, gamma=1 / 10e9)


# --- calibration ---------------------------------------------------------------------------

Sample = Tuple[str, int, int, float]  # (algorithm, bytes, world_size, seconds)


@dataclass(frozen=True)
class FitReport:
    n_points: int
    rms_rel_err: float  # root mean square of (predicted - measured) / measured
    max_rel_err: float
    residuals: Tuple[Tuple[str, int, int, float, float], ...]  # (algo, bytes, P, measured, predicted)


def fit(samples: Iterable[Sample], topology=None) -> Tuple[CostModel, FitReport]:
    """Least-squares alpha, beta, gamma >= 0 from measured times.

    With a ``topology`` of more than one node (and more than one rank per
    node), ``inter_alpha`` and ``inter_beta`` too, from :func:`link_coefficients`:
    a sweep on a two-level network (ring and the butterfly cross nodes in
    different proportions than hierarchical, so the five are told apart).

    Each sample ``(algorithm, bytes, P, seconds)`` is one equation
    ``a*alpha + b*beta + g*gamma = seconds`` (see :func:`coefficients`),
    weighted by ``1/seconds`` so that a 4 KiB and a 64 MiB point count alike
    (relative error). Non-negativity by trying every subset of the three
    parameters (an exact NNLS for three unknowns). beta and gamma are only
    told apart when the sweep holds the butterfly beside ring or
    halving-doubling (their bytes-sent to bytes-reduced ratios differ).

    Example::

        >>> true = CostModel(50e-6, 1e-9, 2e-10)
        >>> pts = [(a, n, 4, true.predict(a, n, 4)) for a in MODELED for n in (4096, 1 << 20)]
        >>> m, rep = fit(pts)
        >>> round(m.alpha * 1e6, 3), rep.max_rel_err < 1e-9
        (50.0, True)
    """
    import numpy as np

    rows = [(algo, int(n), int(p), float(t)) for algo, n, p, t in samples
            if algo in MODELED + TWO_LEVEL and p > 1 and t > 0]
    if not rows:
        raise ValueError("no usable samples to fit (need ring/butterfly/halving_doubling at P > 1)")
    two = topology is not None and any(
        1 < _topology(topology, p).node_size < p for _, _, p, _ in rows)
    coeffs = link_coefficients if two else coefficients
    A = np.array([coeffs(algo, n, p, topology) for algo, n, p, _ in rows], dtype=np.float64)
    y = np.array([t for *_, t in rows], dtype=np.float64)
    w = 1.0 / y
    Aw, yw = A * w[:, None], y * w
    scale = np.maximum(np.abs(Aw).max(axis=0), 1e-300)  # condition: columns differ by ~1e9
    best, width = None, A.shape[1]
    for k in range(width, 0, -1):
        for cols in itertools.combinations(range(width), k):
            sol, *_ = np.linalg.lstsq(Aw[:, cols] / scale[list(cols)], yw, rcond=None)
            x = np.zeros(width)
            x[list(cols)] = sol / scale[list(cols)]
            if (x < 0).any():
                continue
            err = float(np.sum((Aw @ x - yw) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, x)
    x = best[1]
    native = _fit_native([(n, t) for algo, n, p, t in samples
                          if algo in (NATIVE, "torch") and p > 1 and t > 0])
    model = CostModel(float(x[0]), float(x[1]), float(x[2]), source="fit",
                      native_alpha=native[0] if native else None,
                      native_beta=native[1] if native else None,
                      inter_alpha=float(x[3]) if two else None,
                      inter_beta=float(x[4]) if two else None)
    pred = A @ x
    rel = (pred - y) / y
    report = FitReport(len(rows), float(np.sqrt(np.mean(rel ** 2))), float(np.max(np.abs(rel))),
                       tuple((algo, n, p, t, float(q)) for (algo, n, p, t), q in zip(rows, pred)))
    return model, report


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
        a, b = 0.0, float(np.sum(n * t / t ** 2) / np.sum(n ** 2 / t ** 2))
    if b < 0:
        a, b = float(np.sum(1 / t) / np.sum(1 / t ** 2)), 0.0
    return float(a), float(b)


# --- where calibrations live ----------------------------------------------------------------

def default_path() -> str:
    """``$HYBRIDCOMM_COST_MODEL``, else ``$XDG_CACHE_HOME/hybridcomm/cost_model.json``
    (``~/.cache/hybridcomm/cost_model.json``)."""
    env = os.environ.get(ENV_PATH)
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hybridcomm", "cost_model.json")


def save(model: CostModel, path: Optional[str] = None, report: Optional[FitReport] = None,
         **meta) -> str:
    """Write ``model`` (plus ``meta``: world size, backend, ... and the fit error) as JSON."""
    path = path or default_path()
    data = model.to_json()
    data.update(meta)
    data.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    data.setdefault("host", platform.node())
    if report is not None:
        data["fit"] = {"n_points": report.n_points, "rms_rel_err": report.rms_rel_err,
                       "max_rel_err": report.max_rel_err}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)  # atomic: a rank reading it never sees half a file
    return path


def load(path: Optional[str] = None) -> Optional[CostModel]:
    """The calibrated model at ``path`` (default :func:`default_path`), or None if
    there is none. A file that exists but does not parse raises ValueError."""
    path = path or default_path()
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return CostModel.from_json(json.load(f), source=path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the cost model at {path}: {e}") from e


_active: Optional[CostModel] = None
_loaded: Dict[str, Tuple[float, Optional[CostModel]]] = {}  # path -> (mtime, model)


def set_active(model: Optional[CostModel]) -> None:
    """Use ``model`` for ``auto`` in this process (None: back to the file / defaults)."""
    global _active
    _active = model


def active_model() -> CostModel:
    """The model ``auto`` uses: :func:`set_active`'s, else the calibration file
    (:func:`default_path`, re-read when it changes), else :data:`DEFAULT_MODEL`."""
    if _active is not None:
        return _active
    path = default_path()
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return DEFAULT_MODEL
    hit = _loaded.get(path)
    if hit is None or hit[0] != mtime:
        try:
            model = load(path)
        except ValueError as e:
            log.warning("%s; using the built-in cost model", e)
            model = None
        hit = _loaded[path] = (mtime, model)
    return hit[1] or DEFAULT_MODEL


def agree(model: Optional[CostModel] = None, group=None, probe_if_uncalibrated: bool = True
          ) -> CostModel:
    """The model every rank of ``group`` uses, made active (for ``auto``): rank
    0's ``model`` if given, else its :func:`set_active` model or saved
    calibration, else a :func:`probe` (or, with ``probe_if_uncalibrated=False``,
    the built-in defaults). Rank 0 decides, so every rank takes the same path.
    A collective: call it on every rank.

    Example::

        >>> dist.init_process_group("gloo"); cost_model.agree()   # doctest: +SKIP
    """
    import torch.distributed as dist

    mine = model or _active
    if mine is None and dist.get_rank(group) == 0:
        try:
            mine = load()
        except ValueError as e:
            log.warning("%s; not using it", e)
    box = [mine]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    if box[0] is not None:
        agreed = dataclasses.replace(box[0], source=f"{box[0].source} (from rank 0)")
    else:
        agreed = probe(group) if probe_if_uncalibrated else DEFAULT_MODEL
    log.debug("hybridcomm cost model: %s", agreed)
    set_active(agreed)
    return agreed


PROBE_SIZES = (4 << 10, 1 << 20)


def probe(group=None, sizes: Sequence[int] = PROBE_SIZES, iters: int = 5) -> CostModel:
    """A quick calibration for when none is saved: time the butterfly, the ring
    and ``native`` at two sizes over ``group`` (the fastest of ``iters``, the least disturbed), fit, and
    take rank 0's fit on every rank. A collective, so call it on every rank; about 36
    all-reduces (~0.2 s over gloo on a small CPU machine, far less on GPUs).

    Example::

        >>> model = probe()  # inside an initialized process group  # doctest: +SKIP
    """
    import torch
    import torch.distributed as dist

    from .collectives import all_reduce

    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == "nccl" else torch.device("cpu")
    world = dist.get_world_size(group)
    samples = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4, device=device)
        for algo in ("butterfly", "ring", NATIVE):
            times = []
            for _ in range(iters + 1):  # the first is a warm-up
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                if algo == NATIVE:
                    dist.all_reduce(buf, group=group)
                else:
                    all_reduce(buf, algorithm=algo, group=group, check=False)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            samples.append((algo, nbytes, world, min(times[1:])))
    model = fit(samples)[0] if world > 1 else DEFAULT_MODEL
    model = dataclasses.replace(model, source="probe at start-up")
    box = [model]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


def choose_algorithm(nbytes: int, world_size: int, topology=None) -> str:
    """The algorithm ``"auto"`` uses for ``nbytes`` over ``world_size`` ranks:
    the fastest under :func:`active_model`, among ring, butterfly and
    halving-doubling, and ``hierarchical`` where ``topology`` (default: from
    ``LOCAL_WORLD_SIZE``) has several nodes of several ranks.

    Example::

        >>> set_active(DEFAULT_MODEL)
        >>> choose_algorithm(4096, 4), choose_algorithm(64 << 20, 4), choose_algorithm(64 << 20, 6)
        ('butterfly', 'halving_doubling', 'ring')
    """
    if world_size <= 2:
        return "butterfly"  # at P <= 2 all three send the same bytes; butterfly in one step
    topo = _topology(topology, world_size)
    many_nodes = 1 < topo.node_size < world_size
    candidates = MODELED + (("hierarchical",) if many_nodes else ())
    return active_model().choose(nbytes, world_size, candidates=candidates, topology=topo)


def table(model: CostModel, world_size: int, sizes: Sequence[int]) -> List[str]:
    """Predicted time per algorithm per size, as printable lines (the plan's evidence)."""
    lines = [f"{'size':>12} " + " ".join(f"{a:>17}" for a in MODELED) + "  choice"]
    for n in sizes:
        t = model.predict_all(n, world_size)
        lines.append(f"{n:>12} " + " ".join(f"{t[a] * 1e6:>15.1f}us" for a in MODELED)
                     + f"  {model.choose(n, world_size)}")
    return lines
