"""Which torch calls touch tensor data: the rule the GPU simulator's race detector
uses (``collect``, every tensor of a call's arguments, serves forward mode's
pending parameters too).

Seen through a ``TorchFunctionMode``, a call such as ``F.linear(x, w)`` reads
``w``'s elements; ``w.t()``, ``w.shape`` or ``p.grad = None`` do not (metadata
and views), and basic indexing (``w[0]``) makes a view.
"""

from __future__ import annotations

from typing import List

import torch

# Calls that read no element data: metadata, views, attribute plumbing.
NO_DATA = frozenset(
    {
        "__get__",
        "__set__",
        "__delete__",
        "size",
        "dim",
        "numel",
        "stride",
        "data_ptr",
        "is_contiguous",
        "element_size",
        "storage_offset",
        "untyped_storage",
        "__len__",
        "__hash__",
        "view",
        "view_as",
        "narrow",
        "select",
        "split",
        "chunk",
        "unbind",
        "squeeze",
        "unsqueeze",
        "t",
        "transpose",
        "permute",
        "expand",
        "expand_as",
        "as_strided",
        "detach",
        "detach_",
        "flatten",
        "unflatten",
        "reshape",
        "__repr__",
        "__format__",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "requires_grad_",
        "_is_view",
        "is_floating_point",
        "is_complex",
        "type",
        "__reduce_ex__",
        "__setstate__",
        "__deepcopy__",
        "set_",
        "empty_like",
        "record_stream",
        "retain_grad",
        "__contains__",
        "share_memory_",
        "is_shared",
        "is_pinned",
        "get_device",
        "__dlpack_device__",
    }
)
# Calls that write (besides in-place ``name_`` methods and ``out=``).
IN_PLACE_OPERATORS = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
    }
)


def collect(x, out: List[torch.Tensor]) -> List[torch.Tensor]:
    """Every tensor in ``x`` (nested lists, tuples and dicts), appended to ``out``."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            collect(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            collect(y, out)
    return out


def reads_data(name: str, args) -> bool:
    """Whether the call ``name(*args)`` touches element data of its tensors."""
    if name in NO_DATA:
        return False
    if name == "__getitem__":  # basic indexing is a view; a tensor index reads
        return bool(collect(args[1] if len(args) > 1 else None, []))
    return True


def written(name: str, args, kwargs) -> List[torch.Tensor]:
    """The tensors the call writes: ``out=``, and the first argument of in-place calls."""
    out: List[torch.Tensor] = []
    if "out" in kwargs:
        collect(kwargs["out"], out)
    if (name.endswith("_") and not name.startswith("__")) or name in IN_PLACE_OPERATORS:
        if args:
            collect(args[0], out)
    return out
