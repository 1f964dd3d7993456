"""Checkpoints of sharded optimizer state through ``torch.distributed.checkpoint``:
each rank hands DCP its own part of the state, never the whole.

Under ``shard=``, an element-sliced parameter's per-element state is a
:class:`StatePieces` (the row-major rectangles of it this rank holds, in DCP's
checkpointable protocol, as DTensor's); a whole parameter's state is its
owner's tensors. DCP reads back what another world size (or plain torch) asks
for. docs/API.md ("Checkpoints at scale") has the recipe.

Example::

    >>> rectangles((3, 4), 2, 11)   # elements 2..10 of a 3x4 tensor
    [((0, 2), (1, 2), 2, 4), ((1, 0), (1, 4), 4, 8), ((2, 0), (1, 3), 8, 11)]
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Dict, List, Sequence, Tuple

import torch

from ..base.errors import HybridCommError

if TYPE_CHECKING:  # (imported where DCP calls: it imports torch.distributed.tensor, ~2 s)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

Rectangle = Tuple[Tuple[int, ...], Tuple[int, ...], int, int]  # offsets, sizes, flat [lo, hi)

# The functions of torch.distributed.checkpoint.state_dict that call an optimizer's
# state_dict(): get_state_dict's, which set_state_dict's loading path calls too
_DCP_MODULE = "torch.distributed.checkpoint.state_dict"
_DCP_CALLERS = ("_get_optim_state_dict",)


def asked_by_dcp(depth: int = 2) -> bool:
    """Whether the function ``depth`` frames up (the caller of the optimizer's
    ``state_dict``) is DCP's ``get_state_dict``: it then gets this rank's part."""
    frame = sys._getframe(depth)
    return frame.f_globals.get("__name__") == _DCP_MODULE and frame.f_code.co_name in _DCP_CALLERS


def rectangles(shape: Sequence[int], start: int, stop: int) -> List[Rectangle]:
    """Elements ``[start, stop)`` of a row-major tensor of ``shape`` as the fewest
    rectangles (each a contiguous run of the range, in order): at most two per
    dimension besides one of whole rows."""
    shape = tuple(shape)
    out: List[Rectangle] = []

    def split(dim: int, prefix: Tuple[int, ...], origin: int, lo: int, hi: int) -> None:
        if lo >= hi:
            return
        rest = shape[dim + 1 :]
        inner = math.prod(rest)
        ones = (1,) * len(prefix)  # (the outer indices are fixed)
        if not rest:  # the last dimension: one run
            out.append((prefix + (lo,), ones + (hi - lo,), origin + lo, origin + hi))
            return
        first, last = -(-lo // inner), hi // inner  # whole rows [first, last)
        if first > last:  # inside one row
            row = lo // inner
            split(
                dim + 1,
                prefix + (row,),
                origin + row * inner,
                lo - row * inner,
                hi=hi - row * inner,
            )
            return
        if lo % inner:
            row = lo // inner
            split(dim + 1, prefix + (row,), origin + row * inner, lo - row * inner, hi=inner)
        if last > first:
            zeros = (0,) * len(rest)
            sizes = ones + (last - first,) + rest
            out.append(
                (prefix + (first,) + zeros, sizes, origin + first * inner, origin + last * inner)
            )
        if hi % inner:
            split(dim + 1, prefix + (last,), origin + last * inner, 0, hi=hi - last * inner)

    split(0, (), 0, start, hi=stop)
    return out


class StatePieces(torch.Tensor):
    """This rank's pieces of one per-element state tensor: a tensor of the state's
    whole shape that holds only ``pieces`` (each: its offsets in the whole, and the
    piece, a view of a slice's state). DCP writes and loads it as it does a DTensor's
    local shards (its checkpointable protocol: write items, chunk list, shard
    look-up); ``dcp.async_save`` stages it through ``new_empty`` and a copy of its
    attributes. Any other operation on it is refused."""

    pieces: List[Tuple[Tuple[int, ...], torch.Tensor]]

    @staticmethod
    def __new__(cls, shape, pieces, *, dtype: torch.dtype, device) -> "StatePieces":
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        r.pieces = pieces
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        self, kwargs = args[0], kwargs or {}
        if func is torch.ops.aten.detach.default:
            return self
        if func is torch.ops.aten.new_empty.default:  # (the stager fills in the pieces)
            device = kwargs.get("device") or self.device
            return StatePieces(self.shape, [], dtype=self.dtype, device=device)
        if func is torch.ops.aten.clone.default:
            pieces = [(o, piece.clone()) for o, piece in self.pieces]
            return StatePieces(self.shape, pieces, dtype=self.dtype, device=self.device)
        raise HybridCommError(
            f"{func} on a sharded optimizer state handed to torch.distributed.checkpoint: "
            "it holds this rank's pieces only (load it with dcp.load and set_state_dict, or "
            "use opt.state_dict() outside DCP for the whole state)"
        )

    def __create_write_items__(self, fqn: str, obj) -> List[WriteItem]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), piece.size()),
                    properties=TensorProperties.create_from_tensor(piece),
                    size=self.shape,
                ),
            )
            for offsets, piece in self.pieces
        ]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(o), piece.size()) for o, piece in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.piece_at(tuple(index.offset))

    def piece_at(self, offsets: Tuple[int, ...]) -> torch.Tensor:
        for o, piece in self.pieces:
            if tuple(o) == tuple(offsets):
                return piece
        raise HybridCommError(
            f"this rank holds no piece at {offsets} of a state tensor of shape "
            f"{tuple(self.shape)}: load the state get_state_dict made in this job"
        )

    def pieces_numel(self) -> int:
        return sum(piece.numel() for _, piece in self.pieces)

    def __repr__(self) -> str:  # (torch's would read the data)
        return f"StatePieces(shape={tuple(self.shape)}, {len(self.pieces)} pieces)"


def _alias(state: torch.Tensor, lo: int, hi: int, sizes) -> torch.Tensor:
    """Elements ``[lo, hi)`` of a contiguous ``state`` as a tensor of ``sizes`` over the
    same memory, but with a storage of exactly its own bytes: DCP's writer copies a
    tensor that is a view of a larger storage (and keeps the copy until the file is
    written), so a view of each piece would copy this rank's whole state."""
    itemsize, base = state.element_size(), state.storage_offset()
    storage = state.untyped_storage()[(base + lo) * itemsize : (base + hi) * itemsize]
    return torch.empty(0, dtype=state.dtype, device=state.device).set_(storage, 0, sizes)


def _pieces(param, slices_and_state) -> StatePieces:
    """One per-element state tensor of ``param``: this rank's slices' parts of it."""
    pieces = []
    for sl, v in slices_and_state:
        for offsets, sizes, lo, hi in rectangles(param.shape, sl.start, sl.stop):
            pieces.append((offsets, _alias(v, lo - sl.start, hi - sl.start, sizes)))
    value = slices_and_state[0][1]
    return StatePieces(param.shape, pieces, dtype=value.dtype, device=value.device)


def save_entries(shards, state: dict) -> Dict[object, dict]:
    """Each sharded parameter's entry of this rank's DCP state: param -> key -> its
    :class:`StatePieces` (element slices), the owner's own tensor (a whole parameter),
    or the value itself (a step count, a factored moment); ``{}`` where this rank
    holds none of it (DCP's strict load wants every parameter named)."""
    out: Dict[object, dict] = {}
    for p in shards.params:
        held = [sl for sl in shards.by_param.get(id(p), []) if sl.tensor in state]
        if not held:
            out[p] = {}
            continue
        whole = len(held) == 1 and held[0].tensor.shape == p.shape and p.dim() > 0
        entry = {}
        for key, v in state[held[0].tensor].items():
            per_element = torch.is_tensor(v) and v.dim() > 0 and v.shape == held[0].tensor.shape
            if not per_element or whole:
                entry[key] = v
                continue
            entry[key] = _pieces(p, [(sl, state[sl.tensor][key]) for sl in held])
        out[p] = entry
    return out


def load_entries(shards, state: dict, loaded: Dict[object, dict]) -> None:
    """This rank's slices' state from a DCP state (param -> entry, as
    :func:`save_entries` made it and DCP filled in): each ShardedTensor's local
    shards into the slices they cover (no copy where DCP loaded into the slices'
    own memory), a whole parameter's tensors to its owner, other values as they are."""
    for p, entry in loaded.items():
        held = shards.by_param.get(id(p), [])
        if not entry or not held:
            continue
        for sl in held:
            target = state.setdefault(sl.tensor, {})
            for key, v in entry.items():
                if isinstance(v, StatePieces):
                    _unshard_into(sl, target, key, v, param=p)
                elif torch.is_tensor(v) and v.dim() > 0 and v.shape == p.shape:
                    # a whole tensor (the owner's, or a consolidated one): this slice's part
                    piece = v.reshape(-1)[sl.start : sl.stop].view(sl.tensor.shape)
                    _copy_or_keep(target, key, piece.to(sl.tensor.device))
                else:
                    target[key] = v


def _copy_or_keep(target: dict, key, v: torch.Tensor) -> None:
    mine = target.get(key)
    if mine is None or mine.shape != v.shape or mine.dtype != v.dtype:
        target[key] = v.clone()
    elif mine.data_ptr() != v.data_ptr():
        mine.copy_(v)


def _unshard_into(sl, target: dict, key, value: StatePieces, param) -> None:
    """Slice ``sl``'s state ``key`` from ``value``'s pieces (which cover it: the
    loading job's own cut)."""
    mine = target.get(key)
    if mine is None:
        dtype = value.pieces[0][1].dtype
        mine = target[key] = torch.empty(sl.tensor.shape, dtype=dtype, device=sl.tensor.device)
    flat = mine.view(-1)
    for offsets, _sizes, lo, hi in rectangles(param.shape, sl.start, sl.stop):
        piece = value.piece_at(offsets)
        run = flat[lo - sl.start : hi - sl.start]
        if run.data_ptr() != piece.data_ptr():
            run.copy_(piece.reshape(-1))
