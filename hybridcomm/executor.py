"""Run one rank's schedule over a transport, reducing with the kernels.

Receives that are copies land directly in the caller's buffer; receives that
are reductions land in a scratch buffer, reused across calls (no allocation
per step), and are then added in with ``kernels.reduce``, which also applies
the ``avg`` scale on the step that finalizes those elements.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from .algorithms import Schedule
from .kernels import reduce
from .transport import Transport


class Workspace:
    """Scratch buffers kept per (device, dtype), grown on demand, never shrunk."""

    def __init__(self):
        self._buffers: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (device, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]


def execute(schedule: Schedule, buf: torch.Tensor, transport: Transport, *,
            scale: float | None = None, scratch: torch.Tensor | None = None,
            timeout: float | None = None) -> torch.Tensor:
    """All-reduce the 1-D contiguous ``buf`` in place by running ``schedule``.

    ``scale`` multiplies each element once, when its final value is produced
    (1/P gives an average). ``scratch`` must hold ``schedule.scratch_numel``
    elements of ``buf``'s dtype (allocated if None).

    Example::

        >>> s = get_schedule("ring", rank, world, buf.numel())
        >>> execute(s, buf, TorchDistTransport(), scale=1 / world, timeout=60)
    """
    if schedule.numel != buf.numel():
        raise ValueError(f"schedule is for {schedule.numel} elements, buffer has {buf.numel()}")
    if schedule.world_size == 1:
        if scale is not None and scale != 1:
            buf.mul_(scale)
        return buf
    if scratch is None:
        scratch = torch.empty(schedule.scratch_numel, dtype=buf.dtype, device=buf.device)
    for st in schedule.steps:
        recvs, reductions, offset = [], [], 0
        for r in st.recvs:
            if r.reduce:
                landing = scratch[offset:offset + r.stop - r.start]
                offset += r.stop - r.start
                reductions.append((r, landing))
            else:
                landing = buf[r.start:r.stop]
            recvs.append((r.peer, landing))
        sends = [(s.peer, buf[s.start:s.stop]) for s in st.sends]
        transport.exchange(sends, recvs).wait(timeout)
        for r, landing in reductions:
            reduce(buf[r.start:r.stop], landing, scale=scale if r.final else None)
    return buf
