"""Choosing the transport for a tensor.

Host path (CPU tensors): :class:`TorchDistTransport` (gloo). Device path (CUDA
tensors, or CPU under ``HYBRIDCOMM_SIMULATE_GPU=1``), by ``transport`` (else
``HYBRIDCOMM_TRANSPORT``, else ``"auto"``): ``"auto"`` is
:class:`CupyNcclTransport` where CuPy with NCCL imports, else
:class:`TorchNcclTransport`; ``"cupy"`` / ``"torch"`` that one or an error (a
transport named never falls back); ``"one-device"`` ranks sharing one GPU
(:mod:`.one_device`). Every rank must make the same choice (logged at DEBUG).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Dict, Tuple

import torch

from ...config import env
from ...base.errors import HybridCommError
from ...gpu.runtime import import_nccl, runtime_for
from .torch_dist import TorchDistTransport, TorchNcclTransport

log = logging.getLogger("hybridcomm")

TRANSPORTS = ("auto", "cupy", "torch", "one-device")
ENV_VAR = "HYBRIDCOMM_TRANSPORT"

# One per (group, device), shared by everything in the process (the optimizer,
# all_reduce): one communicator and comm stream per group, so all of a rank's NCCL
# work keeps one issue order
_device_transports: Dict[Tuple[int, str, str], object] = {}
_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def cupy_nccl_status() -> Tuple[bool, str]:
    """(usable, why not): whether ``cupy.cuda.nccl`` imports with libnccl found (asked once)."""
    try:
        import_nccl()
    except HybridCommError as e:
        return False, str(e)
    return True, ""


def resolve_transport(transport: str | None = None) -> str:
    """The transport asked for (argument, then ``HYBRIDCOMM_TRANSPORT``), checked."""
    if transport is None:
        return env.get(ENV_VAR)
    if transport not in TRANSPORTS:
        raise HybridCommError(f"transport={transport!r} is not one of {TRANSPORTS}")
    return transport


def select_transport(
    device, group=None, transport: str | None = None, *, timeout: float | None = None
):
    """The transport for tensors on ``device`` (a torch.device, str, or tensor).

    Making a device transport is collective: the ranks first meet on the control
    plane within ``timeout`` (default ``HYBRIDCOMM_TIMEOUT``), so a rank that never
    arrives is a HybridCommTimeout, not a hang in NCCL's bootstrap.

    Example::

        >>> select_transport(grad).kind          # a CPU tensor: torch.distributed (gloo)
        'torch'

    (For a CUDA tensor: CuPy NCCL if installed; ``transport="torch"`` forces
    torch.distributed's NCCL.)
    """
    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device)
    name = resolve_transport(transport)
    rt = runtime_for(device)
    if rt is None:
        if name == "cupy":
            raise HybridCommError(f"transport 'cupy' needs CUDA tensors; this one is on {device}")
        return TorchDistTransport(group)
    if name == "one-device":
        choice = name
    elif rt.simulated:
        choice = "cupy"
        if name == "torch":
            raise HybridCommError(
                "transport 'torch' cannot run on the simulated GPU (it models "
                "CuPy's NCCL); unset HYBRIDCOMM_TRANSPORT"
            )
    elif name == "auto":
        ok, why = cupy_nccl_status()
        choice = "cupy" if ok else "torch"
        if not ok:
            log.debug("transport auto: CuPy NCCL unavailable (%s); using torch.distributed", why)
    else:
        choice = name
        if name == "cupy":
            ok, why = cupy_nccl_status()
            if not ok:
                raise HybridCommError(
                    f"transport 'cupy' was asked for ({_source(transport)}) but "
                    f"is unavailable: {why}"
                )
    log.debug("transport for %s: %s (asked: %s)", device, choice, name)
    return _device_transport(group, rt, choice, env.timeout(timeout))


def _device_transport(group, rt, choice: str, timeout: float):
    from .. import control
    from .cupy_nccl import CupyNcclTransport
    from .one_device import OneDeviceNccl

    key = (id(group), str(rt.device) + (f":{rt.index}" if rt.simulated else ""), choice)
    with _lock:
        t = _device_transports.get(key)
        if t is None:
            control.barrier(
                group=group, timeout=timeout, what=f"creating the {choice} NCCL communicator"
            )
            if choice == "torch":
                t = TorchNcclTransport(group, runtime=rt)
            else:
                nccl = OneDeviceNccl(rt) if choice == "one-device" else None
                t = CupyNcclTransport(group, runtime=rt, timeout=timeout, nccl=nccl)
            _device_transports[key] = t
    return t


def close_transports() -> None:
    """Destroy the cached device communicators (collective: call on every rank), e.g.
    after a timeout aborted one, or before destroying the process group."""
    with _lock:
        transports = list(_device_transports.values())
        _device_transports.clear()
    for t in transports:
        if hasattr(t, "close"):
            t.close()


def _source(transport) -> str:
    return "by argument" if transport is not None else f"by {ENV_VAR}"
