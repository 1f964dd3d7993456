"""The two autograd hooks on every reduced parameter: where a gradient enters.

Per parameter and backward pass these are the library's only Python work, so
each is a look-up and a counter in the usual case; what costs more is done once
per bucket (bucket_group.py). The pre-hook (before autograd adds) is armed only
while its bucket must not be added into unchecked; the post-accumulate hook
counts the parameter in and launches a completed bucket. In a steady step only
each bucket's closer keeps its post-accumulate hook (``lean``). The steps, in
order, are in docs/ARCHITECTURE.md ("A gradient's path", overlap="backward").

Example::

    hooks = GradientHooks(sync)
    hooks.attach(params)          # again after the parameters change
    hooks.guard(state, True)      # the bucket left ACCUMULATING/IDLE (BucketGroup.to)
    hooks.review(measured_next=False)   # a step ends: lean in the next one?
    hooks.detach()                # close()
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import OrderedDict
from typing import Dict, Iterable

import torch
from torch.utils.hooks import RemovableHandle

from ..base.compile_boundary import eager_only
from . import grad_fields
from .bucket_group import Phase, kept_apart, wants_guard
from .passes import LAUNCH
from .pending import grad_field
from .scatter import is_released

_ACCUMULATING, _IDLE = Phase.ACCUMULATING, Phase.IDLE
_HOOK_WHY = (
    "the gradient hooks run eagerly, each a graph break in compiled autograd's graph: "
    "leave compiled_autograd_kwargs_override's fullgraph off"
)
log = logging.getLogger("hybridcomm")


@functools.lru_cache(maxsize=None)
def hooks_toggle() -> bool:
    """Whether a tensor's pre-hooks go on and off by assigning its ``_backward_hooks``
    (torch's own dict of them, which its setter hands to autograd): checked once
    on a scratch tensor; where not, the pre-hooks stay armed (correct, slower)."""
    try:
        t, seen = torch.zeros(1, requires_grad=True), []
        with torch.enable_grad():
            t._backward_hooks = {0: lambda g: seen.append(1)}
            t.sum().backward()
            t._backward_hooks = None
            t.sum().backward()
        return seen == [1]
    except Exception:  # noqa: BLE001 - an attribute torch may change: the safe fallback
        return False


class GradientHooks:
    """Installs and runs the hooks; ``sync`` (the GradientSynchronizer) supplies the
    current bucket group, the pass tracker and the verbs that open and launch."""

    def __init__(self, sync):
        self.sync = sync
        # id(param) -> (its post-accumulate hook's handle, torch's dict of them, key, hook)
        self._post: Dict[int, tuple] = {}
        # id(param) -> its pre-hook: a guard of C++, else (param, key, hook, {key: hook})
        self._pre: Dict[int, object] = {}
        self.native = grad_fields.has_extension()  # (guards of C++: add_guard)
        self.always_armed = True  # the pre-hooks are never turned off (set in attach)
        self.lean = False  # only each bucket's closer has its post-accumulate hook
        self.can_lean = False
        self._versions: list = []  # the buckets' buffer versions when the last step ended

    def attach(self, params: Iterable) -> None:
        """Hooks on every one of ``params``, and on no other parameter; each pre-hook
        armed as its bucket's phase in the synchronizer's current group wants."""
        self.set_lean(False)  # (the buckets change: every closer is learned again)
        want = {id(p): p for p in params}
        for pid in [pid for pid in self._post if pid not in want]:
            self._post.pop(pid)[0].remove()
            self._drop([self._pre.pop(pid)])
        # One object for every parameter: compiled autograd's graph calls it (not traced)
        # and dynamo, which compiles the frame that calls it, recompiles it per hook object
        hook = eager_only(self.after_grad, why=_HOOK_WHY)
        for pid, p in want.items():
            if pid not in self._post:
                handle = p.register_post_accumulate_grad_hook(hook)
                self._post[pid] = (handle, p._post_accumulate_grad_hooks, handle.id, hook)
                self._pre[pid] = self._new_pre(p)
        sync = self.sync
        # (the simulated GPU sees each in-place add: its race checks want every one)
        self.always_armed = getattr(sync.rt, "reports_writes", False) or (
            not self.native and not hooks_toggle()
        )
        cfg = sync.config
        self.can_lean = cfg.lean_hooks and not cfg.find_unused_parameters
        for s in sync.group.states:
            s.guards = [self._pre[id(p)] for p in s.bucket.params]
            s.armed = wants_guard(s)
            self._set(s.guards, self.always_armed or s.armed)

    def set_lean(self, on: bool) -> None:
        """Only each bucket's closer keeps its post-accumulate hook (``on``), or every
        parameter has it. The closer (the parameter whose gradient completed the
        bucket) is the same in every pass of a fixed graph, so lean saves a call
        into Python per parameter and pass; a closer whose bucket's gradients are
        not all autograd's own of this step turns every hook back on
        (``after_grad``). The hooks leave and rejoin torch's dict in place: a
        user's own hooks in it stay."""
        if on == self.lean:
            return
        self.lean = on
        log.debug(
            "hybridcomm: the post-accumulate hook on %s",
            "each bucket's closer only" if on else "every parameter",
        )
        if on:
            for s in self.sync.group.states:
                for pos, p in enumerate(s.bucket.params):
                    if pos != s.closer:
                        _, hooks, key, _ = self._post[id(p)]
                        hooks.pop(key, None)
        else:
            for _, hooks, key, hook in self._post.values():
                if key not in hooks:
                    hooks[key] = hook

    def review(self, measured_next: bool) -> None:
        """A step ends: lean in the next one (unless ``measured_next``) if it had one
        backward pass, whose end autograd reported, and that pass completed every
        bucket at the closer of the step before. (A re-plan after this attaches
        again: per parameter.)"""
        sync = self.sync
        passes, states = sync.passes, sync.group.states
        self.set_lean(
            self.can_lean
            and not measured_next
            and passes.any == passes.counted == 1
            and passes.reported
            and all(s.closed_in == passes.id and s.closer_steps >= 2 for s in states)
        )
        self._versions = (
            [-1 if s.bucket.released else s.bucket.buffer._version for s in states]
            if self.lean
            else []
        )

    def gradients_came(self) -> bool:
        """Whether gradients came since the last step: in a pass the hooks saw, set by
        hand (``BucketGroup.set_by_hand``), or, lean, in a pass that reached no
        closer; those two count as a pass of the step (a flush after a re-plan in
        this step launches too)."""
        passes = self.sync.passes
        if passes.any:
            return True
        if self.sync.group.set_by_hand() or self._unseen_pass():
            passes.unseen()
            return True
        return False

    def _unseen_pass(self) -> bool:
        """Lean: whether a pass that reached no closer added into a view in place: a
        pre-hook opened its bucket, or an idle bucket's buffer was written since the
        step ended and since the engine's last write (a reduction still running
        then). What it put in tensors of their own is ``set_by_hand``'s."""
        group = self.sync.group
        version = group.engine.version
        return self.lean and (
            group.needs_round()
            or any(
                s.phase is _IDLE
                and not s.bucket.released
                and s.bucket.buffer._version > max(v, version(s.index))
                for s, v in zip(group.states, self._versions)
            )
        )

    def guard(self, s, on: bool) -> None:
        """Bucket ``s`` entered (``on``) or left the phases where autograd must not add
        into its views unchecked (``BucketGroup.to``). Kept off otherwise: an armed
        Python pre-hook costs autograd a call into Python per parameter and pass;
        a guard of C++ costs a load."""
        if not self.always_armed:
            self._set(s.guards, on)

    def _new_pre(self, p):
        """``p``'s pre-hook, off: a guard of C++ (grad_fields.add_guard), or where
        there is no extension, an entry for torch's Python pre-hooks: (param, key,
        hook, {key: hook})."""
        if self.native:
            return grad_fields.add_guard(p, self._before(p))
        # (eager_only: compiled autograd's graph calls it as it is, not traced)
        key, hook = RemovableHandle(OrderedDict()).id, eager_only(self._before(p), why=_HOOK_WHY)
        # (an OrderedDict, as torch's own: a user's register_hook weak-references it)
        return p, key, hook, OrderedDict({key: hook})

    def _set(self, entries, on: bool) -> None:
        if self.native:
            grad_fields.set_guards(entries, on)
        else:
            (grad_fields.arm if on else grad_fields.disarm)(entries)

    def _drop(self, entries) -> None:
        (grad_fields.drop_guards if self.native else grad_fields.disarm)(entries)

    def detach(self) -> None:
        for entry in self._post.values():
            entry[0].remove()
        self._drop(list(self._pre.values()))
        self._post, self._pre, self.lean = {}, {}, False

    def _before(self, p):
        # (weakly: a guard of C++ holds the hook where Python's collector cannot
        # see it, so a strong reference would keep an unclosed synchronizer alive)
        hooks = weakref.ref(self)

        def hook(grad=None):  # (a guard of C++ calls it with no argument)
            # None (the usual case): autograd keeps it apart. (The field itself: a
            # pending parameter may show None for a view autograd would add into.)
            if grad_field(p) is not None:
                alive = hooks()
                if alive is not None:
                    alive.before_grad(p)

        return hook

    def before_grad(self, p) -> None:
        """Autograd is about to add a gradient into ``p.grad`` (not None): if that is
        the bucket's view, make the in-place add safe. A reduction in flight is
        waited for (a late gradient: the result is kept and the addition reduced
        again, all-reduce being linear), a deferred update applied first."""
        sync = self.sync
        where = sync.group.where.get(id(p))
        if where is None:
            return
        s, pos = where
        b = s.bucket
        rt = sync.rt
        if grad_field(p) is not b.views[pos]:
            if is_released(grad_field(p)):  # (backward kept this rank's part only)
                with sync.watched():
                    sync.open(s)  # whole again, .grad its view: autograd adds into it
                    if rt is not None and p.grad is b.views[pos]:
                        rt.expect_write(b.views[pos])
            return  # else a tensor of autograd's (or the user's): taken in at the launch
        if s.phase is _ACCUMULATING and rt is None:
            return
        with sync.watched():
            if s.phase is not _ACCUMULATING and not sync.open(s):
                # its launch is still to be issued: autograd starts a tensor of its own,
                # added in when the bucket next opens
                p.grad = None
                s.detached.add(pos)
                return
            if p.grad is not b.views[pos]:
                return  # the deferred update it applied took it (zeroed since): None now
            if rt is not None:
                rt.expect_write(b.views[pos])  # autograd's in-place add, on this stream

    def after_grad(self, p) -> None:
        """Autograd added this pass's gradient into ``p.grad`` (post-accumulate hook)."""
        sync = self.sync
        where = sync.group.where.get(id(p))
        if where is None:
            return
        s, pos = where
        passes = sync.passes
        if not passes.active or passes.end_due:  # (the plan is read once per pass)
            passes.gradient_arrived(sync.plan.launch_pass, sync.measuring())
        if s._phase is not _ACCUMULATING:
            with sync.watched():
                if not sync.open(s):
                    return  # launched, not issued: waits in p.grad until it opens again
        if self.lean:  # (the closer: the bucket's other gradients came before it)
            if s.pass_id != passes.id:
                s.kept = kept_apart(s.bucket)  # (absorb takes the list: one read a step)
            if s.kept is not None:
                s.pass_id = passes.id
                try:
                    self._completed(s, pos, passes)
                finally:
                    s.kept = None
                return
            self.set_lean(False)  # (every hook back on; this pass's end launches it)
            s.closer_steps = 0
        touched = s.touched
        if s.pass_id != passes.id:
            s.pass_id = passes.id
            touched = s.touched = set()
        touched.add(pos)
        s.content.add(pos)
        if passes.measuring:  # (a launching pass of a measured step)
            sync.measure.ready(s.bucket.spec.params[pos], sync.clock.stamp())
        if len(touched) == len(s.bucket.params):  # the bucket's last gradient of this pass
            self._completed(s, pos, passes)

    def _completed(self, s, pos: int, passes) -> None:
        """Every gradient of bucket ``s`` is in, ``pos``'s last: take them in (a local
        pass) or launch it (the launching pass); ``pos`` is the bucket's closer."""
        if pos == s.closer:
            s.closer_steps += 1
        else:
            s.closer, s.closer_steps = pos, 1
        s.closed_in = passes.id
        sync = self.sync
        with sync.watched():
            if passes.kind != LAUNCH:
                sync.group.absorb(s)  # (a local pass: the memory autograd held, freed)
            elif s.launched_epoch != sync.state.epoch:
                sync.group.open_and_launch(s, sync.open, passes.id)
                if sync.after_launch is not None:  # host path
                    sync.after_launch()
