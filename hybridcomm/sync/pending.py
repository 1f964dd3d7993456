"""Forward mode's deferred updates, invisible by construction.

Forward mode's ``step()`` returns before a parameter's update is applied, so
that its all-reduce overlaps the next forward; the update waits for the
parameter's first read. While pending, a parameter carries a subclass of its
class (as ``torch.nn.UninitializedParameter`` does) whose
``__torch_function__`` applies the update before any call that reads or
aliases its data (a module's forward, ``.data``, ``state_dict()``, an EMA,
``torch.save``...); calls that touch no element data (``p.grad``, ``p.shape``)
leave it pending. Under ``torch.compile`` the read becomes an operator call in
the graph (compiled.py). docs/ARCHITECTURE.md (overlap="forward") has the path;
docs/TROUBLESHOOTING.md the one read it cannot see.

Example::

    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> defer([p], lambda q: (release(q), q.data.add_(1)))  # the update: +1
    >>> is_pending(p), p.shape                             # metadata: still pending
    (True, torch.Size([2]))
    >>> p * 2                                              # a read applies it first
    tensor([2., 2.], grad_fn=<MulBackward0>)
    >>> is_pending(p), type(p) is torch.nn.Parameter
    (False, True)
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from itertools import chain
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch

from ..base.compile_boundary import eager_only
from ..base.errors import HybridCommError
from . import grad_fields

log = logging.getLogger("hybridcomm")

# id(param) -> (weak reference to it, the callable that applies its update); kept from
# one step to the next (a step's defer and release only change the class)
_waiting: Dict[int, Tuple[weakref.ref, Callable[[torch.Tensor], None]]] = {}
# id(list) -> (the list, apply): every parameter of the list is registered with apply
# (defer's fast path; cleared whenever a registration changes)
_registered: Dict[int, Tuple[list, Callable]] = {}
_classes: Dict[type, type] = {}  # a parameter's class (or its pending class) -> its pending class
_bases: Dict[type, type] = {}  # a pending class -> the parameter's class

# Attributes and methods that read no element data and return no alias of it:
# they leave the update pending (the gradient, metadata, hooks).
_QUIET_ATTRIBUTES = frozenset(
    {
        "grad",
        "shape",
        "dtype",
        "device",
        "requires_grad",
        "is_leaf",
        "grad_fn",
        "ndim",
        "layout",
        "is_cuda",
        "is_cpu",
        "is_sparse",
        "is_quantized",
        "is_meta",
        "is_mkldnn",
        "is_nested",
        "names",
        "output_nr",
        "_version",
        "_backward_hooks",
        "_post_accumulate_grad_hooks",
        "retains_grad",
        "itemsize",
        "nbytes",
        "_grad",
        "_grad_fn",
        "_cdata",
    }
)
_QUIET_METHODS = frozenset(
    {
        "size",
        "dim",
        "numel",
        "nelement",
        "stride",
        "is_contiguous",
        "element_size",
        "is_floating_point",
        "is_complex",
        "get_device",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "requires_grad_",
        "retain_grad",
        "__hash__",
        "data_ptr",
        "storage_offset",
        "__len__",
        "is_shared",
        "is_pinned",
        "__dlpack_device__",
    }
)


# what a call on a pending parameter is (_kind)
LOUD, QUIET, GRAD_READ, GRAD_WRITE = 0, 1, 2, 3
_kinds: Dict[object, int] = {}  # func -> _kind(func): zero_grad asks per parameter
# owner's read callable -> (shown(p, grad), written(p)): what a read of p.grad returns,
# what a write of it tells the owner (watch_grads)
_watchers: Dict[Callable, Tuple[Callable, Callable]] = {}


def _kind(func) -> int:
    kind = _kinds.get(func)
    if kind is None:
        kind = _kinds[func] = _classify(func)
    return kind


def _classify(func) -> int:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        if attribute in ("grad", "_grad"):
            return GRAD_READ if name == "__get__" else GRAD_WRITE
        # p.data = x replaces the memory the update writes into: apply it first
        return (
            QUIET
            if attribute in _QUIET_ATTRIBUTES and not (name == "__set__" and attribute == "data")
            else LOUD
        )
    return QUIET if name in _QUIET_METHODS else LOUD


_DISABLED = DISABLED = torch._C.DisableTorchFunctionSubclass  # calls see no pending class


class _Pending:
    """Mixed in front of a parameter's class while its update is pending. The update
    is applied once, the class restored, and nothing is left on the module or the
    parameter: a copy (``copy.deepcopy``, ``pickle``) is a plain model."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if _compiling():  # dynamo traces this call: the update goes into the graph
            return _read_in_graph(func, args, kwargs)
        kind = _kind(func)
        if kind:
            with _DISABLED():
                out = func(*args, **kwargs)
            if kind == GRAD_READ and out is not None:
                return _watcher(args[0], 0, _unseen)(args[0], out)
            if kind == GRAD_WRITE:
                _watcher(args[0], 1, _unseen)(args[0])
            return out
        _resolve_in(args)
        if kwargs:
            _resolve_in(kwargs.values())
        return func(*args, **kwargs)

    def __deepcopy__(self, memo):
        resolve(self)
        return self.__deepcopy__(memo)

    def __reduce_ex__(self, protocol):
        resolve(self)
        return self.__reduce_ex__(protocol)


# Argument types that hold no tensor: skipped without an isinstance check (a call's
# arguments are mostly these and plain tensors)
_NO_TENSORS = frozenset(
    {
        int,
        float,
        bool,
        str,
        type(None),
        torch.Tensor,
        torch.Size,
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
    }
)


def _resolve_in(args: Iterable) -> None:
    """Apply the update of every pending parameter in ``args`` (nested lists, tuples,
    dicts): the first read's walk, by exact type first (``isinstance`` against a
    tensor class costs ~0.4 us an argument, ``tensor_access.collect``'s way)."""
    for a in args:
        cls = type(a)
        if cls in _bases:
            resolve(a)
        elif cls not in _NO_TENSORS:
            if isinstance(a, (list, tuple)):
                _resolve_in(a)
            elif isinstance(a, dict):
                _resolve_in(a.values())


def _pending_in(args: Iterable, found: list) -> list:
    """The pending parameters in ``args`` (nested lists, tuples, dicts), appended to
    ``found``: ``_resolve_in``'s walk, written for dynamo to trace."""
    for a in args:
        if type(a) in _bases:
            found.append(a)
        elif isinstance(a, (list, tuple)):
            _pending_in(a, found)
        elif isinstance(a, dict):
            _pending_in(a.values(), found)
    return found


def _read_in_graph(func, args, kwargs):
    """A call on a pending parameter as dynamo traces it: for each pending argument
    the graph first calls the operator that applies its update (compiled.py
    registers it: ``apply_in_graph_with``), then ``func`` on the updated values.
    Without the operator (torch < 2.4) the update is applied eagerly, at a graph
    break. Calls that read no element data (``p.shape``, ``p.grad``) apply nothing.
    An operator call per read: so the synchronizer keeps pending parameters out of
    compiled code where it can (compiled.py).
    (Every torch-function override is off for the call, modes too: a graph's
    operators see none at run time, and dynamo re-enters a mode's override here.)"""
    with torch._C.DisableTorchFunction():
        if _classify(func) == LOUD:  # (not _kind's cache: dynamo keys no dict by a function)
            for p in _pending_in(kwargs.values(), _pending_in(args, [])):
                if _in_graph is not None:
                    _in_graph(p, id(p))
                else:
                    _resolve_eagerly(p)
        return func(*args, **kwargs)


_in_graph: Optional[Callable] = None  # the operator (param, key): apply_in_graph_with


def apply_in_graph_with(op: Callable) -> None:
    """``op(p, id(p))``, a registered operator that applies pending ``p``'s update and
    declares that it writes ``p``, is what a compiled graph calls before reading a
    pending parameter (compiled.py)."""
    global _in_graph
    _in_graph = op


def registered(key: int) -> Optional[torch.Tensor]:
    """The parameter registered under ``key`` (its ``id``), if it is still alive."""
    entry = _waiting.get(key)
    p = entry[0]() if entry is not None else None
    return p if p is not None and id(p) == key else None


def _pending_class(base: type) -> type:
    cls = _classes.get(base)
    if cls is None:
        cls = type(f"Pending{base.__name__}", (_Pending, base), {"__module__": __name__})
        _classes[base] = _classes[cls] = cls
        _bases[cls] = base
    return cls


def _unseen(p, grad=None):
    return grad  # (no watcher: a read returns the field, a write tells no one)


def _watcher(p, which: int, default: Callable) -> Callable:
    """Pending ``p``'s owner's ``watch_grads`` callable (``which``: 0 shown, 1 written)."""
    entry = _waiting.get(id(p))
    watchers = _watchers.get(entry[1]) if entry is not None and entry[0]() is p else None
    return default if watchers is None else watchers[which]


def watch_grads(
    apply: Callable[[torch.Tensor], None],
    shown: Callable[[torch.Tensor, torch.Tensor], object],
    written: Callable[[torch.Tensor], None],
) -> None:
    """While ``p`` is pending with ``apply``: a read of ``p.grad`` (or ``p._grad``)
    returns ``shown(p, grad)`` instead of ``grad`` (the tensor the field holds, never
    None), and after a write of either (``=``, ``del``) ``written(p)`` is called.
    Forward mode shows None for a gradient that ``zero_grad()`` zeroed while its
    update was pending, and sets the field to None once the update took it; a
    bucket none of whose fields was written since the step is not read again."""
    _watchers[apply] = (shown, written)


def grad_field(p: torch.Tensor):
    """``p.grad`` as the tensor holds it, whatever a pending parameter shows."""
    if isinstance(p, _Pending):
        with _DISABLED():
            return p.grad
    return p.grad


def drop_grads(param_groups) -> None:
    """Every ``p.grad`` of ``param_groups`` None (``zero_grad()``'s default), per
    parameter in C; a pending parameter's update stays pending."""
    params = list(chain.from_iterable(g["params"] for g in param_groups))
    with _DISABLED():
        grad_fields.set_grads(params)


def is_pending(t) -> bool:
    """Whether ``t`` is a parameter whose deferred update is not applied yet."""
    return isinstance(t, _Pending)


def defer(params: Sequence[torch.Tensor], apply: Callable[[torch.Tensor], None]) -> None:
    """The updates of ``params`` are pending: the first read of one of them, ``p``,
    calls ``apply(p)``, which must apply it and ``release`` every parameter it
    updates. (Per parameter and step: a class change, and a look-up unless this
    very list was registered with ``apply`` and no registration changed since;
    ``apply`` is registered again only when it is another object: pass the same
    one, and the same list, each step.)"""
    waiting, classes = _waiting, _classes
    known = _registered.get(id(params))
    if known is None or known[0] is not params or known[1] is not apply:
        for p in params:
            entry = waiting.get(id(p))
            if entry is None or entry[1] is not apply or entry[0]() is not p:
                waiting[id(p)] = (weakref.ref(p, functools.partial(_forget_dead, id(p))), apply)
                _registered.clear()  # (another list's registration may be this one's)
        _registered[id(params)] = (params, apply)
    if not grad_fields.switch_classes(params, classes, True):  # (a class not seen yet)
        for p in params:
            cls = p.__class__
            p.__class__ = classes.get(cls) or _pending_class(cls)
    arm_compiled_forward_hook()


def _forget_dead(pid: int, ref: weakref.ref) -> None:
    """A registered parameter died: its entry goes (not a later one under its id)."""
    entry = _waiting.get(pid)
    if entry is not None and entry[0] is ref:
        del _waiting[pid]
        _registered.clear()


def release(p: torch.Tensor) -> None:
    """``p``'s update was applied (or dropped): it is an ordinary parameter again."""
    base = _bases.get(p.__class__)
    if base is not None:
        p.__class__ = base


def release_all(params: Iterable[torch.Tensor]) -> None:
    """``release`` each of ``params`` (a bucket's, once per step)."""
    grad_fields.switch_classes(params, _bases, False)


def forget(apply: Callable[[torch.Tensor], None]) -> None:
    """``apply`` applies no update any more (its owner closed): every parameter it
    was registered for is released and unregistered, also one that left its
    buckets since (the registration would keep the owner's memory alive)."""
    _watchers.pop(apply, None)
    _registered.clear()
    for pid, (ref, fn) in list(_waiting.items()):
        if fn is apply:
            p = ref()
            if p is not None:
                release(p)
            del _waiting[pid]


def resolve(p: torch.Tensor) -> None:
    """Apply ``p``'s pending update now."""
    entry = _waiting.get(id(p))
    registered = entry is not None and entry[0]() is p
    if registered:
        entry[1](p)
    if is_pending(p):  # its synchronizer is gone, or did not release it
        release(p)
        if registered:
            raise HybridCommError(
                "internal error: a deferred update was applied but its "
                "parameter is still marked pending"
            )


def resolve_all() -> None:
    """Apply every pending update in this process."""
    for ref, _ in list(_waiting.values()):
        p = ref()
        if p is not None and is_pending(p):
            resolve(p)


# ---- torch.compile ----------------------------------------------------------------------
_told_compiled = False
# Frames of torch.compile's entry points (torch/_dynamo/eval_frame.py): a compiled
# module's call, a compiled function's wrapper (looked for on a torch without dynamo's
# own flags, below).
_COMPILED_ENTRIES = ("OptimizedModule.__call__", "compile_wrapper")
# dynamo's flag (torch/_dynamo/eval_frame.py) that an OptimizedModule's hooks run under
_IN_COMPILED_MODULE_FLAG = "_is_in_optimized_module"


def _never() -> bool:
    return False


# Whether dynamo traces the caller (folded to True in a trace, False outside one)
_compiling: Callable[[], bool] = (
    getattr(getattr(torch, "compiler", None), "is_compiling", None) or _never
)
# Set on first use of torch.compile's flags (arm_compiled_forward_hook): traced by
# dynamo (a compiled function calling the model, ``model.compile()``), and an
# OptimizedModule's call, whose hooks run outside the trace under a flag of dynamo's.
_tracing: Callable[[], bool] = _never
_in_compiled_module: Callable[[], bool] = _never
# A read traced with no operator to call (torch < 2.4): the update applied eagerly
# (eager_only once armed: a graph break)
_resolve_eagerly: Callable[[torch.Tensor], None] = resolve


def _under_torch_compile() -> bool:
    """Whether this forward was called through torch.compile (an OptimizedModule,
    or a compiled function calling the model): on a torch without dynamo's flags,
    by the frames of its entry points."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    eval_frame = dynamo.eval_frame.__file__
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_filename == eval_frame and getattr(code, "co_qualname", code.co_name).endswith(
            _COMPILED_ENTRIES
        ):
            return True
        f = f.f_back
    return False


def _apply_all_before_compiled() -> None:
    """Every pending update, before a compiled forward (run eagerly: see below)."""
    global _told_compiled
    if not _waiting:
        return
    if not _told_compiled:
        _told_compiled = True
        log.info(
            "hybridcomm: the model's forward is compiled (torch.compile): "
            "forward mode applies the pending updates when it begins, so they "
            "do not overlap the forward"
        )
    resolve_all()


_apply_before_compiled = _apply_all_before_compiled  # (dynamo.disable's once armed)


class ApplyBeforeCompiledForward:
    """The model's forward pre-hook: whether the model's forward is compiled.

    Traced by dynamo (``torch.compile(model)``, ``model.compile()``, a compiled
    function calling the model; ``fullgraph=True`` or not), it marks
    ``compiled_whole`` (a side effect dynamo replays each time the graph runs:
    no graph break), and the synchronizer then applies the model's updates in
    ``step()`` (compiled.py): a pending parameter's reads in that graph would
    each cost an operator call. Run outside the trace, under the flag an
    ``OptimizedModule`` sets around its hooks (a model handed over compiled),
    it applies every pending update before the compiled forward begins. A plain
    object, so the model still deep-copies and pickles; in a copy it only
    applies what is pending, which is never wrong. In an eager forward it costs
    two flag reads (a walk of the frames on a torch without the flags)."""

    compiled_whole = False

    def __call__(self, module, args) -> None:
        if _tracing():
            self.compiled_whole = True
        elif _in_compiled_module():
            _apply_before_compiled()


def _legacy_call(self, module, args) -> None:
    """The hook on a torch without dynamo's flags (dynamo.disable's: never traced)."""
    if _waiting and _under_torch_compile():
        _apply_before_compiled()


def arm_compiled_forward_hook() -> None:
    """Once torch.compile is loaded, the hook reads its flags, and what it applies
    runs outside dynamo's tracing: traced, it would be frozen into the graph
    (``eager_only``, torch._dynamo.disable, makes its call a graph break that
    runs eagerly each time). Checked where updates are deferred and where a
    synchronizer is made (a torch optimizer has imported dynamo by then): importing
    dynamo here would cost every process a second."""
    global _tracing, _in_compiled_module, _apply_before_compiled, _resolve_eagerly
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or getattr(_apply_before_compiled, "_torchdynamo_disable", False):
        return
    _apply_before_compiled = eager_only(_apply_before_compiled)
    _resolve_eagerly = eager_only(resolve)
    in_module = getattr(dynamo.eval_frame, _IN_COMPILED_MODULE_FLAG, None)
    tracing = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if in_module is not None and tracing is not None:
        _tracing, _in_compiled_module = tracing, in_module
    else:  # an older torch: the frame walk, the whole hook outside the trace
        ApplyBeforeCompiledForward.__call__ = eager_only(_legacy_call)
