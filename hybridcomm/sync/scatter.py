"""A reduce-scattered bucket (``shard``, shard.py): made whole again, its parameters
all-gathered, and under ``shard="gradients"`` released in backward.

After its reduce-scatter each rank holds the reduced gradient of its own part
only. :func:`unscatter` all-gathers the parts where the whole gradient is read
or added to, :func:`all_gather` sends the step's updated parameters the same
way, and :func:`keep_part` keeps this rank's part and frees the buffer
(ZeRO-2). How: docs/ARCHITECTURE.md, "Sharded optimizer state".

Example::

    keep_part(s, [(48, 100)], placeholders)   # bucket s keeps [48, 100) of its buffer
    unscatter(group, s)                       # whole again: .grad the reduced views
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from ..algorithms import ALL_GATHER
from ..base.errors import HybridCommError
from ..comm.executor import reduce_operation


class ReleasedGrad(torch.Tensor):
    """``.grad`` of a parameter whose bucket kept only this rank's part of the
    reduced gradient: the parameter's shape, dtype and device, no memory; any
    operation on it raises, naming ``opt.synchronize()``. Whatever must add to it
    (a later backward pass) first makes the bucket whole (``BucketGroup.open``,
    through the pre-hook armed on a reduce-scattered bucket).

    >>> p = torch.nn.Parameter(torch.zeros(2, 3)); p.grad = ReleasedGrad(p)
    >>> p.grad.shape, is_released(p.grad)
    (torch.Size([2, 3]), True)
    """

    @staticmethod
    def __new__(cls, param: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise HybridCommError(
            f"{func.__name__} on a gradient that shard='gradients' released after its "
            "reduce-scatter (this rank keeps its part of it): call opt.synchronize() "
            "first to read or change .grad (it all-gathers the parts), clip with "
            "opt.clip_grad_norm_(max_norm), and unscale with scaler.step(opt) or after "
            "opt.synchronize()"
        )

    def __repr__(self) -> str:
        return (
            f"ReleasedGrad(shape={tuple(self.shape)}, dtype={self.dtype}: released after "
            "its reduce-scatter; opt.synchronize() gathers it)"
        )


def is_released(grad) -> bool:
    return type(grad) is ReleasedGrad


def keep_part(
    s,
    ranges: Sequence[Tuple[int, int]],
    placeholders: Dict[int, ReleasedGrad],
    reserved: bool = False,
) -> None:
    """Bucket ``s`` (a BucketState) is reduce-scattered and consumed: its buffer's
    ``ranges`` (this rank's part) kept, the rest freed; each ``.grad`` bound to it
    becomes its placeholder (``placeholders``: id(param) -> its :class:`ReleasedGrad`).
    ``reserved``: the part was reserved at the launch, and its copy queued behind the
    reduce-scatter (a GPU, where the host runs ahead; the allocator reuses the memory
    once the comm stream is past it). Called before backward ends, so backward holds
    whole only the buckets still being reduced."""
    b = s.bucket
    for p, view in zip(b.params, b.views):
        if p.grad is view:
            p.grad = placeholders[id(p)]
    b.release(keep=ranges if s.content else (), reserved=reserved)


def unscatter(group, s) -> None:
    """A reduce-scattered bucket (``group``'s BucketState ``s``) made whole: every
    rank's part all-gathered, so that ``.grad`` is the reduced gradient on every
    rank (to read it, or to add a late pass's gradients and reduce again); a
    released one's part is put back first, and its placeholders bound to the views
    again."""
    b = s.bucket
    released = b.released
    if released:
        b.restore()
    what = f"bucket {s.index}'s gradients (all_gather)"
    for ticket in all_gather(group, s, what):
        group.links.channel.wait(ticket, what)
    s.scattered = False
    if released:
        for pos, p in enumerate(b.params):
            if is_released(p.grad):
                b.bind(pos)
    group.rearm(s)


def all_gather(group, s, what: str) -> List:
    """Every rank's part of the bucket's buffer to every rank (shard.py), queued on
    the channel behind whatever is in flight, as every rank queues it (the
    channel's tickets, one per segment)."""
    b, links = s.bucket, group.links
    channel = links.channel
    ready = None
    if channel.stream_ordered:  # (after what the trainer's stream wrote into it)
        ready = channel.runtime.new_event()
        ready.record(channel.runtime.current_stream())
    last = len(b.spec.segments) - 1
    return [
        channel.submit(
            reduce_operation(
                b.buffer[a:z],
                links.transport,
                b.spec.algorithm,
                scale=None,
                timeout=group.config.timeout,
                label=what,
                range_id=None,
                ready=ready,
                stream_ordered=channel.stream_ordered,
                phase=ALL_GATHER,
                tail=b.spec.tail if i == last else 0,
            ),
            what,
        )
        for i, (a, z) in enumerate(b.spec.segments)
    ]
