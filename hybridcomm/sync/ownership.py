"""One synchronizer per parameter.

A parameter reduced by two synchronizers would have its ``.grad`` bound to two
buckets; the second ``DistributedOptimizer`` over the same parameters is
refused, naming the first parameter they share. Entries hold weak references:
a parameter or synchronizer that is gone frees its entry.

Example::

    claim(params, sync, names)          # raises if another holds one of them
    owner_of(params[0]) is sync
    True
    release(params, sync)
"""

from __future__ import annotations

import weakref
from typing import Dict, Iterable, Sequence

from ..base.errors import HybridCommError

# id(param) -> (weakref to the param, weakref to its synchronizer)
_owners: Dict[int, tuple] = {}


def owner_of(p):
    """The synchronizer that reduces ``p``, or None."""
    entry = _owners.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def claim(params: Sequence, owner, names: Sequence[str]) -> None:
    """Mark ``params`` as ``owner``'s (``names[i]`` names ``params[i]`` in the error)."""
    for p, name in zip(params, names):
        other = owner_of(p)
        if other is not None and other is not owner:
            raise HybridCommError(
                f"parameter {name!r} is already reduced by another DistributedOptimizer: give "
                "each optimizer its own parameters (or close() the other first)"
            )
    for p in params:
        _owners[id(p)] = (weakref.ref(p), weakref.ref(owner))


def release(params: Iterable, owner) -> None:
    """``owner`` no longer reduces ``params``."""
    for p in params:
        if owner_of(p) is owner:
            del _owners[id(p)]
