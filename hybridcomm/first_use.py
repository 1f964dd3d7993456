"""Forward mode: apply each bucket's deferred update just before the first use of
one of its parameters in the next iteration.

While watching (from ``step()`` to the end of the next forward, during the
measured steps) a ``TorchFunctionMode`` sees every torch call that reads a
parameter's data and which module's forward is running, so it learns, per
layer, which modules use it first: the owner, or a parent that reads
``self.head.weight`` itself (learned from the layer's first read, whether or
not its update is still pending then: the synchronizer may have applied it
with another bucket's; a layer the watched forward never read keeps its
owners' pre-hooks). A read outside any module's forward (an EMA
between ``step()`` and the forward) marks the layer *eager*: its update is
applied in ``step()`` from then on (logged once). Afterwards only those
modules carry a forward pre-hook; anything still pending when the root
module's forward returns is applied then (a parameter read only by the
loss), and ``model.state_dict()`` applies first.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Set

import torch
from torch.overrides import TorchFunctionMode

from .tensor_access import collect, reads_data

log = logging.getLogger("hybridcomm")


class _Watch(TorchFunctionMode):
    """Sees which watched parameters torch calls read."""

    def __init__(self, on_read: Callable[[int], None], index: Dict[int, int]):
        super().__init__()
        self.on_read, self.index = on_read, index

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if reads_data(getattr(func, "__name__", ""), args):
            for t in collect(kwargs, collect(args, [])):
                i = self.index.get(id(t))
                if i is not None:
                    self.on_read(i)
        return func(*args, **kwargs)


class FirstUse:
    """Where forward mode applies pending updates, for one model.

    The synchronizer tells it the buckets (``set_buckets``) and gives it three
    callables: ``bucket_of(param_index)``, ``pending(bucket)`` and
    ``apply(bucket)``. ``layers_of(bucket)`` names a bucket's layers.
    """

    def __init__(self, model: torch.nn.Module, index: Dict[int, int], names: List[str], *,
                 bucket_of: Callable[[int], int], pending: Callable[[int], bool],
                 apply: Callable[[int], None], apply_all: Callable[[], None]):
        self.model, self.index, self.names = model, index, names
        self.bucket_of, self.pending, self.apply, self.apply_all = \
            bucket_of, pending, apply, apply_all
        self._modules = {id(m): m for m in model.modules()}
        self._first_users: Dict[str, Set[int]] = {}  # layer -> ids of modules using it first
        self._eager_layers: Set[str] = set()  # read between step() and the next forward
        self._watched: Set[str] = set()  # layers that were there while a forward was watched
        self._seen: Set[str] = set()  # layers read so far in the current watch
        self._layers: List[List[str]] = []  # bucket -> its layers
        self._params: List[list] = []  # bucket -> its parameters
        self._appliers: Dict[int, List[int]] = {}  # id(module) -> buckets it applies
        self._applier_hooks: list = []
        self._mode: Optional[_Watch] = None
        self._stack: List[torch.nn.Module] = []
        self._watch_hooks: list = []
        self._hooks = [model.register_forward_hook(self._root_done),
                       model.register_state_dict_pre_hook(lambda *a, **k: self.apply_all())]

    # -- the buckets ---------------------------------------------------------------------
    def set_buckets(self, layers: List[List[str]], params: List[list]) -> None:
        """The buckets' layers and parameters (after every (re)plan)."""
        self._layers, self._params = layers, params
        self._set_appliers()

    def needs_watch(self) -> bool:
        """Whether some layer was never watched (it joined later): watch the next forward."""
        return any(layer not in self._watched for layers in self._layers for layer in layers)

    def eager(self) -> List[int]:
        """Buckets applied in step() (read between step() and the next forward)."""
        return [b for b, layers in enumerate(self._layers) if self._eager_layers & set(layers)]

    @property
    def eager_layers(self) -> Set[str]:
        return set(self._eager_layers)

    def _set_appliers(self) -> None:
        """A pre-hook on the module(s) that first use each bucket applies it: learned
        while watching; for a layer never watched (before the first watch, or one
        that joined later), its parameters' owners. A bucket no module used is
        applied when the root's forward returns."""
        for h in self._applier_hooks:
            h.remove()
        self._applier_hooks, self._appliers = [], {}
        if self._mode is not None:  # while watching, the watch applies
            return
        owners: Dict[int, list] = {}
        for m in self.model.modules():
            for p in m.parameters(recurse=False):
                owners.setdefault(id(p), []).append(id(m))
        for b, layers in enumerate(self._layers):
            mods = set().union(*(self._first_users.get(layer, set()) for layer in layers))
            # Never watched, or not read in the watched forward (a layer used only
            # sometimes): its owners' pre-hooks, and the root's end as the last resort.
            if any(layer not in self._watched or layer not in self._first_users
                   for layer in layers if layer not in self._eager_layers):
                mods |= {mid for p in self._params[b] for mid in owners.get(id(p), ())}
            for mid in mods:
                self._appliers.setdefault(mid, []).append(b)
        self._applier_hooks = [self._modules[mid].register_forward_pre_hook(self._module_pre)
                               for mid in self._appliers]

    def _module_pre(self, module, args) -> None:
        for b in self._appliers.get(id(module), ()):
            if self.pending(b):
                self.apply(b)

    def _root_done(self, module, args, output) -> None:
        # A parameter read only by the loss (or by nothing) is current now too.
        watched_a_forward = self._mode is not None
        self.apply_all()  # (stops the watch)
        if watched_a_forward:
            self._watched |= {layer for layers in self._layers for layer in layers}
            self._set_appliers()

    # -- watching ------------------------------------------------------------------------
    def _on_read(self, i: int) -> None:
        """The watched code is about to read parameter ``i``: its update goes first.
        The first read of each layer is learned whether or not its update is still
        pending (one applied earlier, with another bucket, still has a first user)."""
        b = self.bucket_of(i)
        first = [layer for layer in self._layers[b] if layer not in self._seen]
        if first:
            self._seen.update(first)
            if self._stack:
                user = id(self._stack[-1])
                for layer in first:
                    self._first_users.setdefault(layer, set()).add(user)
            else:  # between step() and the forward
                self._eager_layers.update(first)
                log.info("hybridcomm: bucket %d (%s) is read between step() and the next "
                         "forward (parameter %r); its update is applied in step() from now on",
                         b, ", ".join(first), self.names[i])
        if self.pending(b):
            self.apply(b)

    def watch(self) -> None:
        """From step() to the end of the next forward: see which module first reads each
        pending parameter (the module stack is kept only meanwhile)."""
        if self._mode is not None:
            return
        stack = self._stack = []
        self._seen = set()

        def enter(module, args) -> None:
            stack.append(module)

        def leave(module, args, output) -> None:
            if stack:
                stack.pop()

        self._watch_hooks = []
        for m in self._modules.values():
            self._watch_hooks.append(m.register_forward_pre_hook(enter, prepend=True))
            self._watch_hooks.append(m.register_forward_hook(leave, prepend=True))
        self._mode = _Watch(self._on_read, self.index)
        self._mode.__enter__()
        self._set_appliers()  # none while watching: first uses must be seen

    def stop_watching(self) -> None:
        """End the watch; what it learned counts only if it saw the root forward end
        (``_root_done``): a watch stopped before any forward learned nothing."""
        mode, self._mode = self._mode, None
        if mode is None:
            return
        mode.__exit__(None, None, None)
        for h in self._watch_hooks:
            h.remove()
        self._watch_hooks, self._stack = [], []
        self._set_appliers()

    def close(self) -> None:
        self.stop_watching()
        for h in self._hooks + self._applier_hooks:
            h.remove()
        self._hooks, self._applier_hooks = [], []
