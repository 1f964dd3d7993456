"""The two autograd hooks on every reduced parameter: where a gradient enters.

Per parameter and backward pass these are the library's only Python work, so
each is a look-up and a counter in the usual case; what costs more is done
once per bucket (bucket_group.py).

1. **Before autograd adds it** (a tensor hook). A ``.grad`` that is None
   (``zero_grad()``, the default ``set_to_none=True``) needs nothing: autograd
   puts the gradient in a tensor of its own, as in plain PyTorch (no zeroing,
   no in-place add), and the bucket takes it in once per bucket (below). Only
   a ``.grad`` that is its bucket's view is written in place, so then the
   bucket must be writable: a reduction in flight is waited for (a *late*
   gradient: the result is kept and the addition reduced again, all-reduce
   being linear), a deferred forward-mode update is applied first, and a
   bucket whose launch the issue order has not reached yet is never written:
   the gradient goes into a tensor of autograd's own and is added in when the
   bucket next opens.
2. **After autograd added it** (a post-accumulate hook): the bucket is opened
   if it was not accumulating, and the parameter counted. Once all of a
   bucket's parameters are in, the bucket takes every gradient autograd kept
   apart into its views in one multi-tensor copy (``BucketGroup.absorb``), and
   in the step's launching pass (passes.py) it is launched; the end of the pass
   launches the rest.

Example::

    hooks = GradientHooks(sync)
    hooks.attach(params)          # again after the parameters change
    hooks.detach()                # close()
"""
from __future__ import annotations

from typing import Dict, Iterable

from .bucket_group import Phase
from .passes import LAUNCH

_ACCUMULATING = Phase.ACCUMULATING


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
                self._handles[pid] = [p.register_hook(self._before(p)),
                                      p.register_post_accumulate_grad_hook(self.after_grad)]

    def detach(self) -> None:
        for handles in self._handles.values():
            for h in handles:
                h.remove()
        self._handles = {}

    def _before(self, p):
        before_grad = self.before_grad

        def hook(grad):
            if p.grad is not None:  # None (the usual case): autograd keeps it apart
                before_grad(p)
        return hook

    def before_grad(self, p) -> None:
        """Autograd is about to add a gradient into ``p.grad`` (not None): if that is
        the bucket's view, make the in-place add safe."""
        sync = self.sync
        where = sync.group.where.get(id(p))
        if where is None:
            return
        s, pos = where
        b = s.bucket
        if p.grad is not b.views[pos]:
            return  # a tensor of autograd's (or the user's): taken in at the launch
        rt = sync.rt
        if s.phase is _ACCUMULATING and rt is None:
            return
        with sync.watched():
            if s.phase is not _ACCUMULATING and not sync.open(s):
                # its launch is still to be issued: autograd starts a tensor of its own,
                # added in when the bucket next opens
                p.grad = None
                s.detached.add(pos)
                return
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
        if s.phase is not _ACCUMULATING:
            with sync.watched():
                if not sync.open(s):
                    return  # launched, not issued: waits in p.grad until it opens again
        if s.pass_id != passes.id:
            s.pass_id, s.touched = passes.id, set()
        touched = s.touched
        touched.add(pos)
        s.content.add(pos)
        launching = passes.kind == LAUNCH
        if launching and passes.measuring:
            sync.measure.ready(s.bucket.spec.params[pos], sync.clock.stamp())
        if len(touched) == len(s.bucket.params):  # the bucket's last gradient of this pass
            with sync.watched():
                if not launching:
                    sync.group.absorb(s)  # (a local pass: the memory autograd held, freed)
                elif s.launched_epoch != sync.state.epoch:
                    sync.group.open_and_launch(s, sync.open, passes.id)
