"""Where compiled code meets the library: what torch.compile never traces.

Dynamo traces the Python a compiled region calls, and compiled autograd puts
the gradient hooks in its graph, which dynamo then traces too. The library's
verbs and hooks (threads, locks, a channel, per-bucket state) must run as they
are: :func:`eager_only` makes a function a call dynamo does not trace (a graph
break; under ``fullgraph=True`` an error, which is why the forward's reads go
through a registered operator instead: docs/ARCHITECTURE.md, "torch.compile").

Example::

    >>> def verb(x):
    ...     return x + 1
    >>> wrapped = eager_only(verb)
    >>> wrapped(1), is_eager_only(wrapped), is_eager_only(verb)
    (2, True, False)
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


@functools.lru_cache(maxsize=None)
def _disable() -> Callable:
    # (the first torch optimizer made in a process imports dynamo already; elsewhere
    # the first wrap pays the import)
    import torch._dynamo

    return torch._dynamo.disable


def eager_only(fn: F, why: str = "") -> F:
    """``fn`` as a call dynamo never traces: it runs eagerly, with nothing it calls
    compiled (torch._dynamo.disable, recursive). ``why``: what dynamo's error says
    where it cannot break the graph there (``fullgraph=True``), after "hybridcomm: ".
    Outside compiled code the wrapper costs a call, so it goes on per-step verbs
    and per-bucket hooks, not on per-parameter work."""
    disable = _disable()
    if not why:
        return disable(fn)
    try:
        return disable(fn, reason=f"hybridcomm: {why}")
    except TypeError:  # (a torch whose disable takes no reason)
        return disable(fn)


def is_eager_only(fn) -> bool:
    """Whether ``fn`` is :func:`eager_only`'s (dynamo's mark on what it skips)."""
    return bool(getattr(fn, "_torchdynamo_disable", False))
