"""Many parameters' ``.grad`` fields and pre-hooks read, written and copied in one call per bucket.

The per-parameter loops of a step (is each ``.grad`` its bucket's view, bind,
drop, copy in, ``requires_grad``, the pre-hooks on and off) are each one call
into the host C++ extension (csrc/host_ops.cpp, host_ext.py), as DDP makes
these accesses in C++; the Python twin below runs where it does not load
(``HYBRIDCOMM_HOST_EXT=0``, no compiler) or declines: a tensor subclass (a
pending parameter) or a torch function or dispatch mode (the GPU simulator)
that must see each access. The result is the same; the tests run both.

Example::

    >>> ps = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    >>> views = [torch.zeros(2), torch.zeros(3)]
    >>> set_grads(ps, views); bound(ps, views), kept_apart(ps, views)
    (True, None)
    >>> set_grads(ps); [p.grad for p in ps]
    [None, None]
"""

from __future__ import annotations

import functools
from collections import deque
from itertools import repeat
from operator import attrgetter, is_
from typing import List, Optional, Sequence

import torch

from ..base.compile_boundary import eager_only
from . import host_ext

_GRAD, _REQUIRES = attrgetter("grad"), attrgetter("requires_grad")
_ext = None  # the loaded extension, False where there is none (set on first use)


def _loaded():
    global _ext
    if _ext is None:
        _ext = host_ext.load() or False
        if _ext:  # (what a guard that is on hands compiled autograd: add_guard)
            _ext.set_compiled_autograd_hook(_for_compiled_autograd)
    return _ext


def _for_compiled_autograd(fn):
    """What compiled autograd's graph calls for a guard of ``fn`` that is on: ``fn()``,
    eagerly (never traced), handed the node's gradients, which it leaves as they are."""
    return eager_only(
        functools.partial(_call_before_add, fn),
        why="the gradient guards run eagerly, each a graph break in compiled autograd's "
        "graph: leave compiled_autograd_kwargs_override's fullgraph off",
    )


def _call_before_add(fn, grads) -> None:
    fn()


class python:
    """The twins: what each function means, in Python (the reference the C++ is
    tested against, and the path subclasses and modes take)."""

    @staticmethod
    def kept_apart(params, views) -> Optional[list]:
        grads = list(map(_GRAD, params))
        if any(map(is_, grads, repeat(None))) or any(map(is_, grads, views)):
            return None
        return grads

    @staticmethod
    def bound(params, views) -> bool:
        return all(map(is_, map(_GRAD, params), views))

    @staticmethod
    def set_grads(params, values=None) -> None:
        deque(map(setattr, params, repeat("grad"), repeat(None) if values is None else values), 0)

    @staticmethod
    def requires_grad(params) -> List[bool]:
        return list(map(_REQUIRES, params))

    @staticmethod
    def arm(entries) -> None:
        for p, key, hook, alone in entries:
            hooks = p._backward_hooks
            if hooks is None:
                if len(alone) != 1 or key not in alone:  # (a user's hook went in)
                    alone.clear()
                    alone[key] = hook
                p._backward_hooks = alone  # (the setter hands it to autograd)
            elif key not in hooks:
                hooks[key] = hook

    @staticmethod
    def disarm(entries) -> None:
        for p, key, _, _ in entries:
            hooks = p._backward_hooks
            if hooks is not None and key in hooks:
                if len(hooks) == 1:
                    p._backward_hooks = None  # autograd drops its pre-hook: no call at all
                else:
                    del hooks[key]


def kept_apart(params: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> Optional[list]:
    """The gradients if autograd (or the user) put every one in a tensor of its own
    (none None, none its view ``views[i]``), else None."""
    ext = _ext if _ext is not None else _loaded()
    out = ext.kept_apart(params, views) if ext else NotImplemented
    return python.kept_apart(params, views) if out is NotImplemented else out


def bound(params: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> bool:
    """Whether every ``params[i].grad`` is ``views[i]``."""
    ext = _ext if _ext is not None else _loaded()
    out = ext.bound(params, views) if ext else NotImplemented
    return python.bound(params, views) if out is NotImplemented else out


def set_grads(params: Sequence[torch.Tensor], values: Optional[Sequence] = None) -> None:
    """``params[i].grad = values[i]`` (an item may be None); ``values`` None: every
    ``.grad`` None."""
    ext = _ext if _ext is not None else _loaded()
    if not ext or ext.set_grads(params, values) is NotImplemented:
        python.set_grads(params, values)


def requires_grad(params: Sequence[torch.Tensor]) -> List[bool]:
    """``[p.requires_grad for p in params]``."""
    ext = _ext if _ext is not None else _loaded()
    out = ext.requires_grad(params) if ext else NotImplemented
    return python.requires_grad(params) if out is NotImplemented else out


def arm(entries: Sequence[tuple]) -> None:
    """Each library pre-hook on: an entry is ``(param, key, hook, alone)``, ``hook``
    under ``key`` in the param's ``_backward_hooks`` (torch's dict of its pre-hooks;
    ``alone``, holding only ``hook``, is handed to torch where the param has none).
    A user's hooks in the same dict stay."""
    ext = _ext if _ext is not None else _loaded()
    if not ext or ext.arm(entries) is NotImplemented:
        python.arm(entries)


def disarm(entries: Sequence[tuple]) -> None:
    """Each library pre-hook of ``entries`` (as :func:`arm`'s) off; torch's dict is
    dropped where it held only that hook (autograd then calls no pre-hook at all)."""
    ext = _ext if _ext is not None else _loaded()
    if not ext or ext.disarm(entries) is NotImplemented:
        python.disarm(entries)


def has_extension() -> bool:
    """Whether the host extension is loaded (the functions here run in C++)."""
    return bool(_ext if _ext is not None else _loaded())


def add_guard(p: torch.Tensor, fn) -> Optional[object]:
    """A pre-hook of C++ on ``p``'s gradient accumulator (csrc/host_ops.cpp) that calls
    ``fn()`` before autograd adds a gradient into ``p.grad``, while it is on
    (:func:`set_guards`); off, autograd's call costs a load. Under compiled
    autograd a guard that is on puts a call of ``fn()`` in the graph, before the
    node's add, run eagerly (compile_boundary.py); one that is off puts nothing. It stays on the node
    until :func:`drop_guards` (or until the returned handle is freed). None without
    the extension: the pre-hooks then go on and off through :func:`arm` and
    :func:`disarm` (the twin: the same calls, made by torch's Python pre-hooks).

    Example::

        guard = add_guard(p, lambda: print("adding into", p.grad))
        set_guards([guard], True)   # from now on, each backward calls it first
        drop_guards([guard])
    """
    ext = _ext if _ext is not None else _loaded()
    return ext.add_guard(p, fn) if ext else None


def set_guards(guards: Sequence[object], on: bool) -> None:
    """Each of :func:`add_guard`'s ``guards`` on or off."""
    _ext.set_guards(guards, on)


def drop_guards(guards: Sequence[object]) -> None:
    """Each of ``guards``' hooks off its parameter's node now."""
    _ext.drop_guards(guards)


def switch_classes(objs: Sequence, classes: dict, every: bool) -> bool:
    """``o.__class__ = classes[type(o)]`` for each of ``objs`` (pending.py's class
    switches), True; with ``every``, False where a class is missing from ``classes``,
    nothing switched (the caller switches them); without, objects whose class is not
    in ``classes`` stay as they are. Off the extension: False (with ``every``)."""
    ext = _ext if _ext is not None else _loaded()
    if ext:
        return ext.switch_classes(objs, classes, every)
    if every:
        return False
    for o in objs:
        to = classes.get(o.__class__)
        if to is not None:
            o.__class__ = to
    return True


def copy_into_on_host(views: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
    """``views[i].copy_(grads[i])`` for every i where every tensor is on the CPU (a
    vectorized byte copy each, no dispatch per tensor), returning True; False where it did
    nothing (not all on the CPU, a subclass, a mode, no extension): the caller's
    multi-tensor copy then."""
    ext = _ext if _ext is not None else _loaded()
    return bool(ext) and ext.copy_into(views, grads) is not NotImplemented
