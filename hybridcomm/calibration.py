"""Where cost models come from: saved calibrations, the start-up probe, agreement.

* A calibration (``hybridcomm-bench --calibrate``) is a JSON file at
  :func:`default_path` (``HYBRIDCOMM_COST_MODEL``, else the user cache dir).
* Without one, :func:`probe` measures this job's network at start-up: the
  reduction kernel alone (gamma, seconds per reduced byte), then the
  butterfly, the ring and ``native`` at two sizes (median of several runs),
  and fits alpha and beta with gamma held (cost_model.fit).
* :func:`agree` makes every rank use rank 0's model (a plan must be the same
  everywhere). Rank 0's fit is rounded to two significant digits, so that
  the same job on the same machine gets the same model, and so the same
  plan, run after run (a saved calibration makes that exact).

Every collective here goes through the control plane (control.py): with a
deadline, and raising our errors.

Example::

    >>> model = agree(timeout=60)        # on every rank, after init_process_group
    >>> model.predict("ring", 1 << 20, 4) > 0
    True
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import statistics
import time
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import control, env
from .cost_model import DEFAULT_MODEL, MODELED, NATIVE, CostModel, FitReport, fit, rounded

log = logging.getLogger("hybridcomm")

ENV_PATH = "HYBRIDCOMM_COST_MODEL"


def default_path() -> str:
    """``$HYBRIDCOMM_COST_MODEL``, else ``$XDG_CACHE_HOME/hybridcomm/cost_model.json``
    (``~/.cache/hybridcomm/cost_model.json``)."""
    path = env.get(ENV_PATH)
    if path:
        return path
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
                       "max_rel_err": report.max_rel_err, "dropped": report.dropped,
                       "confidence": report.confidence}
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


def choose_algorithm(nbytes: int, world_size: int, topology=None) -> str:
    """The algorithm ``"auto"`` uses for ``nbytes`` over ``world_size`` ranks:
    the fastest under :func:`active_model`, among ring, butterfly and
    halving-doubling, and ``hierarchical`` where ``topology`` (default: from
    ``LOCAL_WORLD_SIZE``) has several nodes of several ranks.

    Example::

        >>> set_active(DEFAULT_MODEL)
        >>> choose_algorithm(4096, 4), choose_algorithm(64 << 20, 4), choose_algorithm(64 << 20, 6)
        ('butterfly', 'halving_doubling', 'ring')
        >>> set_active(None)
    """
    from .algorithms import Topology

    if world_size <= 2:
        return "butterfly"  # at P <= 2 all three send the same bytes; butterfly in one step
    topo = (topology or Topology()).resolve(world_size)
    many_nodes = 1 < topo.node_size < world_size
    candidates = MODELED + (("hierarchical",) if many_nodes else ())
    return active_model().choose(nbytes, world_size, candidates=candidates, topology=topo)


def agree(model: Optional[CostModel] = None, group=None, *, timeout: Optional[float] = None,
          probe_if_uncalibrated: bool = True) -> CostModel:
    """The model every rank of ``group`` uses, made active (for ``auto``): rank
    0's ``model`` if given, else its :func:`set_active` model or saved
    calibration, else a :func:`probe` (or, with ``probe_if_uncalibrated=False``,
    the built-in defaults). Rank 0 decides, so every rank takes the same path.
    A collective: call it on every rank.

    Example::

        >>> isinstance(agree(timeout=60), CostModel)     # on every rank
        True
    """
    timeout = env.timeout(timeout)
    mine = model or _active
    if mine is None and dist.get_rank(group) == 0:
        try:
            mine = load()
        except ValueError as e:
            log.warning("%s; not using it", e)
    agreed = control.broadcast_object(mine, group=group, timeout=timeout,
                                      what="rank 0's cost model")
    if agreed is not None:
        agreed = dataclasses.replace(agreed, source=f"{agreed.source} (from rank 0)")
    else:
        agreed = probe(group, timeout=timeout) if probe_if_uncalibrated else DEFAULT_MODEL
    log.debug("hybridcomm cost model: %s", agreed)
    set_active(agreed)
    return agreed


PROBE_SIZES = (4 << 10, 1 << 20)


def measure_gamma(device: torch.device, nbytes: int = 4 << 20, iters: int = 5) -> float:
    """Seconds per byte of the reduction kernel (``dst += src``, fp32) on ``device``."""
    from .kernels import reduce

    a = torch.zeros(nbytes // 4, device=device)
    b = torch.ones_like(a)
    times = []
    for _ in range(iters + 1):
        _sync(device)
        t0 = time.perf_counter()
        reduce(a, b)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / nbytes


def _sync(device) -> None:
    """Wait for the device (timing only; never on a training step)."""
    from .runtime import runtime_for

    rt = runtime_for(device)
    if rt is not None:
        rt.synchronize()


def probe(group=None, sizes: Sequence[int] = PROBE_SIZES, iters: int = 5, *,
          timeout: Optional[float] = None) -> CostModel:
    """A quick calibration for when none is saved: gamma from the reduction kernel
    alone, then the butterfly, the ring and ``native`` at two sizes over
    ``group`` (median of ``iters``), alpha and beta fitted with gamma held, and
    rank 0's fit, rounded, on every rank. A collective: call it on every rank;
    about 36 small all-reduces (~0.2 s over gloo on a small CPU machine).

    A fit that comes out degenerate (alpha or beta 0) is kept, logged, and
    marked; the planner then falls back to safe fusion (planner.py).
    """
    from .collectives import all_reduce  # the collective the model is for

    timeout = env.timeout(timeout)
    device = torch.device("cuda", torch.cuda.current_device()) \
        if str(dist.get_backend(group)) == "nccl" else torch.device("cpu")
    world = dist.get_world_size(group)
    model, report = DEFAULT_MODEL, None
    if world > 1:
        gamma = measure_gamma(device)
        samples = []
        for nbytes in sizes:
            buf = torch.zeros(nbytes // 4, device=device)
            for algo in ("butterfly", "ring", NATIVE):
                times = []
                for _ in range(iters + 1):  # the first is a warm-up
                    _sync(device)
                    t0 = time.perf_counter()
                    all_reduce(buf, algorithm=algo, group=group, check=False, timeout=timeout)
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                samples.append((algo, nbytes, world, statistics.median(times[1:])))
        model, report = fit(samples, gamma=gamma)
        model = rounded(model)
    model = dataclasses.replace(model, source="probe at start-up",
                                meta={"degenerate": bool(report and report.degenerate)})
    if report is not None and (report.degenerate or report.confidence == "low") \
            and dist.get_rank(group) == 0:  # rank 0's fit is everyone's: say it once
        log.info("hybridcomm: the start-up probe's fit is %s (rms error %.0f%%%s); the planner "
                 "uses safe defaults where it cannot trust it. `hybridcomm-bench --calibrate` "
                 "measures properly.", report.confidence, report.rms_rel_err * 100,
                 ", a coefficient is 0" if report.degenerate else "")
    return control.broadcast_object(model, group=group, timeout=timeout,
                                    what="rank 0's start-up probe")


def resolve(cost_model, group=None, timeout: Optional[float] = None) -> CostModel:
    """The cost model a caller asked for: a ``CostModel`` as it is; None: rank 0's saved
    calibration, else a probe (:func:`agree`); ``"probe"``: always probe;
    ``"default"``: the built-in constants.

        >>> resolve("default") is DEFAULT_MODEL
        True
    """
    if isinstance(cost_model, CostModel):
        return cost_model
    if cost_model == "default":
        return DEFAULT_MODEL
    if cost_model == "probe":
        return probe(group, timeout=timeout)
    if cost_model is None:
        return agree(group=group, timeout=timeout)
    raise ValueError(f"cost_model must be a CostModel, None, 'probe' or 'default', "
                     f"got {cost_model!r}")
