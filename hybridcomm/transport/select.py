"""Choosing the transport for a tensor: CuPy NCCL, or torch.distributed.

``backend`` (argument, else ``HYBRIDCOMM_TRANSPORT``, else ``"auto"``):

* ``"auto"``: CUDA tensors take :class:`CupyNcclTransport` when CuPy with
  NCCL imports, else :class:`TorchDistTransport` (nccl on GPU); CPU tensors
  take :class:`TorchDistTransport` (gloo).
* ``"cupy"``: :class:`CupyNcclTransport`; an error if CuPy/NCCL is missing or
  the tensor is not on a GPU (a backend asked for by name never falls back).
* ``"torch"``: :class:`TorchDistTransport`.

The choice is logged at DEBUG. Every rank must make the same choice (NCCL
communicators of different kinds never match); install the same packages on
every node, or force one with ``HYBRIDCOMM_TRANSPORT``.

A CuPy communicator is made once per (group, device) and cached: making one
is collective and takes milliseconds to seconds.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Dict, Tuple

import torch

from ..errors import HybridCommError
from .torch_dist import TorchDistTransport

log = logging.getLogger("hybridcomm")

BACKENDS = ("auto", "cupy", "torch")
ENV_VAR = "HYBRIDCOMM_TRANSPORT"

_cupy_transports: Dict[Tuple[int, torch.device], object] = {}
_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def cupy_nccl_status() -> Tuple[bool, str]:
    """(usable, why not): whether ``cupy.cuda.nccl`` imports with libnccl found (asked once)."""
    from .cupy_nccl import import_nccl

    try:
        import_nccl()
    except HybridCommError as e:
        return False, str(e)
    return True, ""


def resolve_backend(backend: str | None = None) -> str:
    """The backend name asked for (argument, then ``HYBRIDCOMM_TRANSPORT``), checked."""
    name = backend if backend is not None else os.environ.get(ENV_VAR, "auto").strip() or "auto"
    if name not in BACKENDS:
        source = "backend" if backend is not None else ENV_VAR
        raise HybridCommError(f"{source}={name!r} is not one of {BACKENDS}")
    return name


def select_transport(device, group=None, backend: str | None = None):
    """The transport for tensors on ``device`` (a torch.device, str, or tensor).

    Example::

        >>> t = select_transport(grad)                  # CuPy NCCL for a CUDA grad, if installed
        >>> t = select_transport("cuda:0", backend="torch")
    """
    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device)
    name = resolve_backend(backend)
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        choice = "torch"
    elif name == "cupy":
        if device.type != "cuda":
            raise HybridCommError(f"transport 'cupy' needs CUDA tensors; this one is on {device}")
        ok, why = cupy_nccl_status()
        if not ok:
            raise HybridCommError(f"transport 'cupy' was asked for ({_source(backend)}) but is "
                                  f"unavailable: {why}")
        choice = "cupy"
    else:  # auto, CUDA
        ok, why = cupy_nccl_status()
        choice = "cupy" if ok else "torch"
        if not ok:
            log.debug("transport auto: CuPy NCCL unavailable (%s); using torch.distributed", why)
    log.debug("transport for %s: %s (asked: %s)", device, choice, name)
    if choice == "torch":
        return TorchDistTransport(group)
    return _cupy_transport(group, device)


def _cupy_transport(group, device: torch.device):
    from .cupy_nccl import CupyNcclTransport

    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (id(group), device)
    with _lock:
        t = _cupy_transports.get(key)
        if t is None:
            t = CupyNcclTransport(group, device=device)
            _cupy_transports[key] = t
    return t


def close_transports() -> None:
    """Destroy the cached CuPy communicators (collective: call on every rank), e.g.
    after a timeout aborted one, or before destroying the process group."""
    with _lock:
        transports = list(_cupy_transports.values())
        _cupy_transports.clear()
    for t in transports:
        t.close()


def _source(backend) -> str:
    return "by argument" if backend is not None else f"by {ENV_VAR}"
