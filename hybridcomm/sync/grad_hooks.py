"""The two autograd hooks on every reduced parameter: where a gradient enters.

1. **Before autograd adds it** (a tensor hook): the bucket must be writable. A
   reduction in flight is waited for (a *late* gradient: the result is kept and
   the addition reduced again, all-reduce being linear), a deferred
   forward-mode update is applied first, and a ``.grad`` that is None (zeroed
   with ``set_to_none``) is bound to its zeroed view, so autograd adds in
   place. A bucket whose launch the issue order has not reached yet is never
   written: the gradient goes into a tensor of autograd's own and is folded in
   once the launch is done.
2. **After autograd added it** (a post-accumulate hook): a gradient autograd
   put elsewhere (the user rebound ``.grad``) is copied in once. In the step's
   launching pass (passes.py) a bucket is launched as soon as all its
   gradients are in; the end of the pass launches the rest.

Example::

    hooks = GradientHooks(sync)
    hooks.attach(params)          # again after the parameters change
    hooks.detach()                # close()
"""
from __future__ import annotations

from typing import Dict, Iterable

from ..base.errors import HybridCommError
from .bucket_group import Phase
from .passes import LAUNCH


class GradientHooks:
    """Installs and runs the hooks; ``sync`` (the GradientSynchronizer) supplies the
    current bucket group, the pass tracker and the verbs that open and launch."""

    def __init__(self, sync):
        self.sync = sync
        self._handles: Dict[int, list] = {}  # id(param) -> its hook handles

    def attach(self, params: Iterable) -> None:
        """Hooks on every one of ``params``, and on no other parameter."""
        want = {id(p): p for p in params}
        for pid in [pid for pid in self._handles if pid not in want]:
            for h in self._handles.pop(pid):
                h.remove()
        for pid, p in want.items():
            if pid not in self._handles:
                self._handles[pid] = [
                    p.register_hook(lambda grad, p=p: self.before_grad(p)),
                    p.register_post_accumulate_grad_hook(self.after_grad)]

    def detach(self) -> None:
        for handles in self._handles.values():
            for h in handles:
                h.remove()
        self._handles = {}

    def before_grad(self, p) -> None:
        """Autograd is about to add a gradient into ``p.grad``: make that in place
        and safe (tensor hook; returns None: the gradient is left as it is)."""
        sync = self.sync
        where = sync.group.where.get(id(p))
        if where is None:
            return
        s, pos = where
        rt = sync.rt
        if s.phase is Phase.ACCUMULATING and p.grad is not None and rt is None:
            return  # the usual case: autograd adds into the view (or a tensor it was given)
        b = s.bucket
        with sync.watched():
            if s.phase is not Phase.ACCUMULATING:
                if not sync.open(s):  # its launch is still to be issued
                    if b.holds(pos):
                        p.grad = None  # autograd starts a tensor of its own; folded in later
                        s.detached.add(pos)
                    return
            elif p.grad is None:  # zeroed (set_to_none) in the middle of a round
                s.content.discard(pos)
                b.views[pos].zero_()
                b.bind(pos)
            if rt is not None and b.holds(pos):
                rt.expect_write(b.views[pos])  # autograd's in-place add, on this stream

    def after_grad(self, p) -> None:
        """Autograd added this pass's gradient into ``p.grad`` (post-accumulate hook)."""
        sync = self.sync
        where = sync.group.where.get(id(p))
        if where is None:
            return
        s, pos = where
        passes = sync.passes
        with sync.watched():
            if not passes.active or passes.end_due:  # (the plan is read once per pass)
                passes.gradient_arrived(sync.plan.launch_pass, sync.measuring())
            b = s.bucket
            if s.launched:
                return  # waits in autograd's tensor until the launch is done (open)
            if p.grad is not b.views[pos]:  # autograd put it elsewhere (.grad was rebound)
                if p.grad.is_sparse:
                    raise HybridCommError(f"parameter {sync.group.names[b.spec.params[pos]]!r}"
                                          " got a sparse gradient; hybridcomm reduces dense "
                                          "gradients (use sparse=True only on the CPU path)")
                if s.phase is not Phase.ACCUMULATING and not sync.open(s):
                    return
                b.views[pos].copy_(p.grad)
                b.bind(pos)
            s.content.add(pos)
            if s.pass_id != passes.id:
                s.pass_id, s.touched = passes.id, set()
            s.touched.add(pos)
            if passes.kind == LAUNCH:
                if passes.measuring:
                    sync.measure.ready(b.spec.params[pos], sync.clock.stamp())
                if len(s.touched) == len(b.params) and s.launched_epoch != sync.state.epoch:
                    sync.group.open_and_launch(s, sync.open, passes.id)
