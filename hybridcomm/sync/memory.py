"""Bucket memory: where a bucket's flat buffers come from.

On the host path a plain tensor. On a device the buffer is allocated on the
trainer's stream and recorded on the comm stream once, when it is made: the
caching allocator then never hands its memory out while the comm stream may
still use it, and no ``record_stream`` is needed per use (the engine passes
``reserved=True``). The synchronizer's buckets and ``TensorAverager``'s take
their memory here.

Example::

    >>> alloc = bucket_allocator(None, torch.device("cpu"))
    >>> alloc(4, torch.float32).shape
    torch.Size([4])
"""

from __future__ import annotations

from typing import Callable

import torch

Allocator = Callable[[int, torch.dtype], torch.Tensor]


def bucket_allocator(rt, device: torch.device, comm_stream=None) -> Allocator:
    """``alloc(numel, dtype)`` for buckets on ``device`` (``rt``: its runtime, None on
    the host path; ``comm_stream``: the stream that will read and write them)."""
    if rt is None:
        return lambda n, dt: torch.empty(n, dtype=dt, device=device)

    def alloc(n: int, dt: torch.dtype) -> torch.Tensor:
        buf = rt.empty(n, dt)  # on the trainer's stream; the comm stream records its use
        rt.record_stream(buf, comm_stream)
        return buf

    return alloc
