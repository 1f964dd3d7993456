"""Tensor-parallel parameters (``torch.distributed.tensor.DTensor``): each rank
holds a shard, which data parallelism averages with the ranks holding the same
shard in the other replicas (``mesh["dp"].get_group()``).

hybridcomm reduces the local shards: a DTensor parameter's bucket view is its
local shard in the bucket's buffer, wrapped as a DTensor (:func:`grad_view`),
so backward accumulates straight into the buffer.

Example::

    >>> local_shape(torch.zeros(3, 4))      # a plain tensor: its own shape
    torch.Size([3, 4])
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.distributed as dist

# torch.distributed.tensor is not imported here: it costs about a second of every
# process's start (sympy, the sharding rules), and no tensor can be a DTensor before
# something has imported it. Its class is looked up once it is there.
_DTENSOR_MODULE = "torch.distributed.tensor"
_dtensor_class = None


def _dtensor():
    """DTensor's class, or None while ``torch.distributed.tensor`` is not imported
    (or has no DTensor)."""
    global _dtensor_class
    if _dtensor_class is None:
        module = sys.modules.get(_DTENSOR_MODULE)  # a dict look-up until it is imported
        if module is not None:
            _dtensor_class = getattr(module, "DTensor", None)
    return _dtensor_class


def is_dtensor(t) -> bool:
    cls = _dtensor()
    return cls is not None and isinstance(t, cls)


def local_shape(p) -> torch.Size:
    """The shape of this rank's part of ``p`` (its own shape unless a DTensor)."""
    return p.to_local().shape if is_dtensor(p) else p.shape


def local_data(t) -> torch.Tensor:
    """This rank's memory of ``t`` (its local shard for a DTensor), detached: writing
    into it writes ``t``."""
    return (t.to_local() if is_dtensor(t) else t).detach()


def local_numel(p) -> int:
    return local_shape(p).numel()


def grad_view(view: torch.Tensor, p) -> torch.Tensor:
    """``view`` (this rank's gradient memory, shaped like the local shard) as ``p``'s
    ``.grad``: a DTensor on ``p``'s mesh and placements for a DTensor ``p``."""
    if not is_dtensor(p):
        return view
    return _dtensor().from_local(
        view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def group_problem(p, name: str, group) -> Optional[str]:
    """Why ``group`` must not reduce the DTensor ``p`` (None: it may, or ``p`` is
    not a DTensor): it holds another rank of ``p``'s mesh. Averaging different
    shards (or the tensor-parallel replicas of one) would be silently wrong, so
    the optimizer refuses it at construction."""
    if not is_dtensor(p):
        return None
    mesh_ranks = set(p.device_mesh.mesh.flatten().tolist())
    reducing = set(
        dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    )
    others = sorted((mesh_ranks & reducing) - {dist.get_rank()})
    if not others:
        return None
    return (
        f"{name!r} is a DTensor on a device mesh of ranks {sorted(mesh_ranks)}, and the "
        f"reduction group also holds ranks {others} of that mesh: they hold other shards "
        "(or tensor-parallel copies) of it, not data-parallel replicas. Pass "
        "process_group=<the data-parallel group> (mesh['dp'].get_group() on a 2-D mesh)"
    )
