"""Where cost models come from: saved calibrations, the start-up probe, agreement.

A calibration (``hybridcomm-bench --calibrate``) is a JSON file at
:func:`default_path` (saving, loading and ``auto``'s choice live in
auto_model.py and are importable from here). Without one, :func:`probe`
measures this job's network at start-up, and the first probe of a job is kept
for its later runs. :func:`agree` makes every rank use rank 0's model, since a
plan must be the same everywhere. Every collective here goes through the
control plane (control.py): with a deadline, raising our errors.

Example::

    >>> model = agree(timeout=60)        # on every rank, after init_process_group
    >>> model.predict("ring", 1 << 20, 4) > 0
    True
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import statistics
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import control
from ..config import env

# (re-exported: the calibration API's names, defined beside the model they load)
from ..plan.auto_model import (  # noqa: F401
    ENV_PATH,
    active_model,
    choose_algorithm,
    default_path,
    get_active,
    load,
    save,
    set_active,
)
from .backend import comm_device
from .executor import reduce_now
from .transport.select import select_transport
from ..plan.cost_model import DEFAULT_MODEL, NATIVE, PS, CostModel, fit, rounded

log = logging.getLogger("hybridcomm")


def agree(
    model: Optional[CostModel] = None,
    group=None,
    *,
    timeout: Optional[float] = None,
    probe_if_uncalibrated: bool = True,
) -> CostModel:
    """The model every rank of ``group`` uses, made active (for ``auto``): rank
    0's ``model`` if given, else its :func:`set_active` model or saved
    calibration, else a :func:`probe` (or, with ``probe_if_uncalibrated=False``,
    the built-in defaults). Rank 0 decides, so every rank takes the same path.
    A collective: call it on every rank.

    Example::

        >>> isinstance(agree(timeout=60), CostModel)     # on every rank
        True
    """
    control.require_initialized("agreeing on a cost model")
    timeout = env.timeout(timeout)
    mine = model or get_active()
    if mine is None and dist.get_rank(group) == 0:
        try:
            mine = load()
        except ValueError as e:  # truncated, not JSON, another format or schema
            log.warning("hybridcomm: %s; probing instead", e)
        why = None if mine is None else _not_for_this_job(mine, group)
        if why:
            log.warning(
                "hybridcomm: the saved cost model %s was measured %s; probing instead "
                "(`hybridcomm-bench --calibrate` on this job's ranks saves one)",
                mine.source,
                why,
            )
            mine = None
    # A job's first probe is kept, so that its later runs plan alike
    cache = probe_cache_path(group) if probe_if_uncalibrated else None
    if mine is None and cache is not None and dist.get_rank(group) == 0:
        mine = _load_probe_cache(cache, group)
    agreed = control.broadcast_object(
        mine, group=group, timeout=timeout, what="rank 0's cost model"
    )
    if agreed is not None:
        agreed = dataclasses.replace(agreed, source=f"{agreed.source} (from rank 0)")
    elif probe_if_uncalibrated:
        agreed = probe(group, timeout=timeout)
        if cache is not None and dist.get_rank(group) == 0:
            _save_probe_cache(agreed, cache, group)
    else:
        agreed = DEFAULT_MODEL
    log.debug("hybridcomm cost model: %s", agreed)
    set_active(agreed)
    return agreed


# What names the network a job runs over, in the kept probe's key
NETWORK_VARIABLES = ("MASTER_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def probe_cache_path(group=None) -> Optional[str]:
    """Where the start-up probe of a job like this one (world size, backend, device,
    ranks per host, rendezvous address and socket interface) is kept for the next
    run, beside the saved calibration's place; None when ``HYBRIDCOMM_PROBE_CACHE``
    is off."""
    if not env.get("HYBRIDCOMM_PROBE_CACHE"):
        return None
    key = (
        f"w{dist.get_world_size(group)}-{dist.get_backend(group)}-{comm_device(group).type}"
        f"-local{os.environ.get('LOCAL_WORLD_SIZE', 'na')}"
    )
    # The network is part of the job: a probe taken over loopback is no plan for a
    # run between hosts, nor over another interface
    network = [os.environ.get(name) for name in NETWORK_VARIABLES]
    key += "".join(f"-{part}" for part in network if part)
    key = re.sub(r"[^A-Za-z0-9._-]", "_", key)
    return os.path.join(os.path.dirname(os.path.abspath(default_path())), f"probe-{key}.json")


def _load_probe_cache(path: str, group) -> Optional[CostModel]:
    try:
        model = load(path)
    except ValueError as e:
        log.warning("hybridcomm: %s; probing again", e)
        return None
    if model is None or _not_for_this_job(model, group):
        return None
    if "fit" not in model.meta:  # kept before probes recorded their uncertainty
        log.info(
            "hybridcomm: the start-up probe kept at %s does not say how far it can be "
            "trusted (an older hybridcomm kept it); probing again",
            path,
        )
        return None
    log.info(
        "hybridcomm: using the start-up probe an earlier run of this job saved (%s), so "
        "the plan is the same from run to run; `hybridcomm-bench --calibrate` measures "
        "properly",
        path,
    )
    return dataclasses.replace(
        model, source=f"probe saved at {path}", meta={**model.meta, "saved_at": path}
    )


def _save_probe_cache(model: CostModel, path: str, group) -> None:
    try:
        save(
            model,
            path,
            world_size=dist.get_world_size(group),
            device=comm_device(group).type,
            backend=str(dist.get_backend(group)),
        )
    except OSError as e:  # a read-only home: probe again next time
        log.debug("hybridcomm: the start-up probe was not saved at %s: %s", path, e)


def forget_saved_probe(model: CostModel) -> Optional[str]:
    """Remove the kept start-up probe ``model`` was read from (rank 0's call, when the
    measured steps contradict it), so that the job's next run probes again; the
    path removed, or None (``model`` is no kept probe, or it is gone already)."""
    path = model.meta.get("saved_at")
    if not path:
        return None
    try:
        os.remove(path)
    except OSError:
        return None
    return path


def _not_for_this_job(model: CostModel, group) -> Optional[str]:
    """Why a saved calibration does not describe ``group`` (None: it does, or it
    does not say): measured on another world size or another kind of device."""
    world, saved_world = dist.get_world_size(group), model.meta.get("world_size")
    if saved_world is not None and saved_world != world:
        return f"on {saved_world} ranks, and this group has {world}"
    device, saved_device = comm_device(group).type, model.meta.get("device")
    if saved_device is not None and saved_device != device:
        return f"on {saved_device}, and this group communicates on {device}"
    return None


PROBE_SIZES = (4 << 10, 1 << 20)


def measure_gamma(device: torch.device, nbytes: int = 4 << 20, iters: int = 5) -> float:
    """Seconds per byte of the reduction kernel (``dst += src``, fp32) on ``device``."""
    from ..kernels import reduce

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
    from ..gpu.runtime import runtime_for

    rt = runtime_for(device)
    if rt is not None:
        rt.synchronize()


def probe(
    group=None,
    sizes: Sequence[int] = PROBE_SIZES,
    iters: int = 7,
    *,
    timeout: Optional[float] = None,
) -> CostModel:
    """A quick calibration for when none is saved: gamma from the reduction kernel
    alone, then the butterfly, the ring and ``native`` at two sizes over
    ``group`` (in ``iters`` rounds of each once, after one to warm up; the
    median of each), alpha and beta fitted with gamma held, and rank 0's fit,
    rounded, with its error and its samples' spread (``meta["fit"]``,
    :attr:`CostModel.uncertainty`), on every rank. A collective: call it on
    every rank; 48 small all-reduces (~0.07 s at two ranks over gloo on a
    small CPU machine).

    A fit that comes out degenerate (alpha or beta 0) is kept, logged, and
    marked; the planner then falls back to safe fusion (planner.py).
    """
    control.require_initialized("the cost model's start-up probe")
    timeout = env.timeout(timeout)
    device = comm_device(group)
    world = dist.get_world_size(group)
    model, report = DEFAULT_MODEL, None
    if world > 1:
        gamma = measure_gamma(device)
        transport = select_transport(device, group, timeout=timeout)
        bufs = {nbytes: torch.zeros(nbytes // 4, device=device) for nbytes in sizes}
        points = [(algo, nbytes) for nbytes in sizes for algo in ("butterfly", "ring", NATIVE)]
        times = {point: [] for point in points}
        # In rounds of every point once: a stall of the machine (several ms now
        # and then over gloo here) then lands on all of them alike, not on one
        # point's every run (which once made native look 3x slower, and once
        # the butterfly).
        for i in range(iters + 1):  # the first round is a warm-up
            for algo, nbytes in points:
                _sync(device)
                t0 = time.perf_counter()
                reduce_now(bufs[nbytes], transport, algo, scale=None, timeout=timeout)
                _sync(device)
                if i:
                    times[algo, nbytes].append(time.perf_counter() - t0)
        samples = [
            (algo, nbytes, world, statistics.median(times[algo, nbytes])) for algo, nbytes in points
        ]
        model, report = fit(samples, gamma=gamma)
        model = rounded(model)  # two digits: the same job and machine, the same plan
    # (CostModel.uncertainty, rounded as the model is; one rank: nothing measured)
    meta = {
        "degenerate": bool(report and report.degenerate),
        "fit": {}
        if report is None
        else {
            "rms_rel_err": float(f"{report.rms_rel_err:.2g}"),
            "spread": float(f"{_spread(times.values()):.2g}"),
            "confidence": report.confidence,
        },
    }
    model = dataclasses.replace(model, source="probe at start-up", meta=meta)
    if (
        report is not None
        and (report.degenerate or report.confidence == "low")
        and dist.get_rank(group) == 0
    ):  # rank 0's fit is everyone's: say it once
        log.info(
            "hybridcomm: the start-up probe's fit is %s (rms error %.0f%%%s); the planner "
            "uses safe defaults where it cannot trust it. `hybridcomm-bench --calibrate` "
            "measures properly.",
            report.confidence,
            report.rms_rel_err * 100,
            ", a coefficient is 0" if report.degenerate else "",
        )
    return control.broadcast_object(
        model, group=group, timeout=timeout, what="rank 0's start-up probe"
    )


def _spread(runs) -> float:
    """The median over points of each point's interquartile range over its median:
    how much the machine moves one measurement (the noise, not the fit's misfit)."""

    def one(ts):
        q1, _, q3 = statistics.quantiles(ts, n=4)
        return (q3 - q1) / statistics.median(ts)

    spreads = [one(ts) for ts in runs if len(ts) >= 2]
    return statistics.median(spreads) if spreads else 0.0


# ps is probed up to a typical bucket (4 MiB) too: its chunks are pipelined under
# a window, so below a few chunks per server its time per byte is far above the
# steady state a bucket sees (fitted on 4 KiB and 1 MiB alone, the line predicted
# 640 ms for a 4 MiB bucket that took 435 ms, and the planner chose native).
PS_PROBE_SIZES = PROBE_SIZES + (4 << 20,)


def with_ps(
    model: CostModel,
    servers,
    group=None,
    sizes: Sequence[int] = PS_PROBE_SIZES,
    iters: int = 5,
    *,
    timeout: Optional[float] = None,
) -> CostModel:
    """``model`` with a ``ps`` line for ``servers`` (a :class:`~hybridcomm.comm.servers.SummationServers`):
    as it is where it has one for that many servers, else ``ps`` timed at
    ``sizes`` (median of ``iters``), rank 0's fit, rounded, on every rank. A
    collective over the workers' ``group``; the servers serve meanwhile.

    Example (every worker; the servers run ``hybridcomm.comm.servers.serve``)::

        servers = hybridcomm.comm.servers.SummationServers(role)
        model = with_ps(agree(group=role.worker_group, timeout=60), servers,
                        role.worker_group)
        model.offers("ps", len(role.servers))       # True
    """
    k = len(servers.role.servers)
    if model.offers(PS, k) or dist.get_world_size(group) <= 1:
        return model
    timeout = env.timeout(timeout)
    samples = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        times = []
        for _ in range(iters + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            servers.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        samples.append((nbytes, statistics.median(times[1:])))
    from ..plan.cost_model import _fit_native

    # rounded to 2 significant digits, as agree()'s fit is, so that plans repeat
    a, b = (float(f"{v:.1e}") for v in _fit_native(samples))
    mine = dataclasses.replace(model, source=f"{model.source}, ps probed").with_ps(a, b, k)
    return control.broadcast_object(mine, group=group, timeout=timeout, what="rank 0's ps probe")


def resolve(cost_model, group=None, timeout: Optional[float] = None, servers=None) -> CostModel:
    """The cost model a caller asked for: a ``CostModel`` as it is; None: rank 0's saved
    calibration, else a probe (:func:`agree`); ``"probe"``: always probe;
    ``"default"``: the built-in constants. With ``servers`` (summation servers),
    None and ``"probe"`` also get a ``ps`` line (:func:`with_ps`) where missing.

        >>> resolve("default") is DEFAULT_MODEL
        True
    """
    if isinstance(cost_model, CostModel):
        return cost_model
    if cost_model == "default":
        return DEFAULT_MODEL
    if cost_model == "probe":
        model = probe(group, timeout=timeout)
    elif cost_model is None:
        model = agree(group=group, timeout=timeout)
    else:
        model = None
    if model is not None:
        if servers is not None:
            model = with_ps(model, servers, group, timeout=timeout)
        return model
    raise ValueError(
        f"cost_model must be a CostModel, None, 'probe' or 'default', got {cost_model!r}"
    )
