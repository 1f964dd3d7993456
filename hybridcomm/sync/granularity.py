"""How ``shard=`` cuts an optimizer's state: element slices or whole parameters.

An element slice of a bucket is stepped as if it were a tensor, which gives
one process's numbers only for an optimizer whose update of each element reads
that element alone. The library slices only the optimizers it knows to be
element-wise; every other one (Adafactor, Muon, a LARS, any class of the
user's own) gets whole parameters (plan/ownership.py). Unknown means whole.

Example::

    >>> choose(torch.optim.AdamW, None)[0], choose(torch.optim.Adafactor, None)[0]
    ('elements', 'parameters')
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..base.errors import HybridCommError

ELEMENTS, PARAMETERS = "elements", "parameters"
GRANULARITIES = (ELEMENTS, PARAMETERS)

# torch's optimizers whose update of an element reads that element's gradient and
# state alone (a step count or a product of scalars is per tensor and the same on
# every slice): their ``step`` functions, so that a subclass that only adds
# methods keeps the verdict and one that overrides ``step`` loses it
_ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "Adagrad",
        "Adadelta",
        "RMSprop",
        "Rprop",
        "ASGD",
    )
)
# Known to need whole tensors: a claim that they are element-wise is refused
_WHOLE_TENSOR = tuple(
    getattr(torch.optim, name)
    for name in ("Adafactor", "Muon", "LBFGS", "SparseAdam")
    if hasattr(torch.optim, name)  # (Muon and Adafactor are recent in torch)
)


def _known_elementwise(cls: type) -> Optional[type]:
    return next((k for k in _ELEMENTWISE if getattr(cls, "step", None) is k.step), None)


def choose(cls: type, shard_by: Optional[str]) -> Tuple[str, str]:
    """The granularity for an optimizer of class ``cls`` and the user's ``shard_by``
    (None: chosen), with the reason the plan reports. A claim of element slices
    for an optimizer known to need whole tensors is refused, naming the option."""
    if shard_by not in (None,) + GRANULARITIES:
        raise HybridCommError(
            f"shard_by must be None (chosen per optimizer), 'elements' or 'parameters', "
            f"got {shard_by!r}"
        )
    known = _known_elementwise(cls)
    needs_whole = next((k for k in _WHOLE_TENSOR if issubclass(cls, k)), None)
    if shard_by == ELEMENTS and needs_whole is not None:
        raise HybridCommError(
            f"shard_by='elements' with {cls.__name__}: its step needs whole tensors "
            f"({needs_whole.__name__} is not element-wise); leave shard_by=None or pass "
            "'parameters'"
        )
    if shard_by is not None:
        return shard_by, f"shard_by={shard_by!r} (given)"
    if known is not None:
        return ELEMENTS, f"{cls.__name__} is element-wise ({known.__name__}'s step)"
    return PARAMETERS, (
        f"{cls.__name__} is not known to be element-wise (shard_by='elements' declares "
        "an optimizer of your own element-wise)"
    )
