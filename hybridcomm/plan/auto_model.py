"""The cost model ``algorithm="auto"`` uses in this process, and what it picks.

The active model is :func:`set_active`'s, else the saved calibration at
:func:`default_path` (re-read when the file changes), else the built-in
:data:`~hybridcomm.plan.cost_model.DEFAULT_MODEL`; :func:`choose_algorithm` is the
choice ``auto`` makes with it. Nothing here communicates: agreeing on a model
across ranks and measuring one (the start-up probe) are calibration.py's,
which runs collectives and so sits above collectives.py; this module sits
below it. Every name here is also importable from ``hybridcomm.comm.calibration``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from typing import Dict, Optional, Sequence, Tuple

from ..config import env
from .cost_model import DEFAULT_MODEL, MODELED, CostModel, FitReport

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


def save(
    model: CostModel, path: Optional[str] = None, report: Optional[FitReport] = None, **meta
) -> str:
    """Write ``model`` (plus ``meta``: world size, backend, ... and the fit error) as JSON."""
    path = path or default_path()
    data = model.to_json()
    data.update(meta)
    data.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    data.setdefault("host", platform.node())
    if report is not None:
        data["fit"] = {
            "n_points": report.n_points,
            "rms_rel_err": report.rms_rel_err,
            "max_rel_err": report.max_rel_err,
            "dropped": report.dropped,
            "confidence": report.confidence,
        }
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


def get_active() -> Optional[CostModel]:
    """The model :func:`set_active` set in this process, or None."""
    return _active


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


def choose_algorithm(
    nbytes: int,
    world_size: int,
    topology=None,
    *,
    model: Optional[CostModel] = None,
    candidates: Optional[Sequence[str]] = None,
) -> str:
    """The algorithm ``"auto"`` uses for ``nbytes`` over ``world_size`` ranks:
    the fastest under ``model`` (default :func:`active_model`), among ring,
    butterfly and halving-doubling, and ``hierarchical`` where ``topology``
    (default: from ``LOCAL_WORLD_SIZE``) has several nodes of several ranks.
    ``candidates`` replaces that list (the DDP hook's adds ``native``); those
    ``model`` does not offer drop out. At P <= 2 it is the butterfly unless
    ``model`` offers a candidate other than ring, butterfly and halving-doubling.

    Example::

        >>> set_active(DEFAULT_MODEL)
        >>> choose_algorithm(4096, 4), choose_algorithm(64 << 20, 4), choose_algorithm(64 << 20, 6)
        ('butterfly', 'halving_doubling', 'ring')
        >>> set_active(None)
    """
    from ..algorithms import Topology

    others = [a for a in candidates or () if a not in MODELED]  # e.g. native
    if others and model is None:
        model = active_model()
    if world_size <= 2 and not any(model.offers(a) for a in others):
        return "butterfly"  # at P <= 2 all three send the same bytes; butterfly in one step
    topo = (topology or Topology()).resolve(world_size)
    if candidates is None:
        many_nodes = 1 < topo.node_size < world_size
        candidates = MODELED + (("hierarchical",) if many_nodes else ())
    return (model or active_model()).choose(
        nbytes, world_size, candidates=candidates, topology=topo
    )
