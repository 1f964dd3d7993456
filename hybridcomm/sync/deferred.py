"""Forward mode's deferred updates: a bucket's update waits for the first read of
one of its parameters.

``step()`` in forward mode launches what is left and returns; each bucket goes
PENDING with the step's hyper-parameters, and whatever reads one of its
parameters first (the next forward's layer, an EMA, a checkpoint; pending.py)
applies its update before the read. How: docs/ARCHITECTURE.md, the
``overlap="forward"`` section.

Example::

    deferred = DeferredUpdates(group_of, update, measure=measure, state=state,
                               clock=clock, timeline=timeline, rt=rt, momentum=0.0)
    deferred.defer(hyper)                # step(): every reduced bucket PENDING
    model(x)                             # each bucket applied before its first read
    deferred.apply_pending()             # or all now
"""

from __future__ import annotations

import contextlib
import time
from itertools import chain
from operator import attrgetter, is_
from typing import Callable, Dict, Optional

from . import grad_fields, pending
from .bucket_group import BucketGroup, BucketState, Phase, StepState
from .measure import StepMeasurements

# update(params, grads, hyper, momentum_free, bound): bound, every p.grad is already its grad
Update = Callable[[list, list, list, bool, bool], None]
_NO_CONTEXT = contextlib.nullcontext()
_GRAD = attrgetter("grad")


class DeferredUpdates:
    """Holds forward mode's pending updates and applies them (module doc).

    ``update(params, grads, hyper, momentum_free, bound)`` is the optimizer's step
    on those parameters (``bound``: each ``p.grad`` is already its gradient);
    ``group_of()`` the synchronizer's current bucket group.
    """

    def __init__(
        self,
        group_of: Callable[[], BucketGroup],
        update: Optional[Update],
        measure: StepMeasurements,
        state: StepState,
        clock,
        timeline,
        rt,
        momentum: float,
    ):
        self._group_of, self.update = group_of, update
        self.measure, self.state, self.clock, self.timeline = measure, state, clock, timeline
        self._rt, self._momentum = rt, momentum
        self.on_read = self.read  # one object, so pending.py registers it once per parameter
        pending.watch_grads(self.on_read, self.shown_grad, self.grad_written)

    def _watched(self):
        return self._rt.watched() if self._rt is not None else _NO_CONTEXT

    def defer(self, hyper: list) -> None:
        """Every bucket reduced in this step becomes PENDING (``hyper``: the groups'
        hyper-parameters now); its parameters apply it before their first read."""
        group = self._group_of()
        for s in group.states:
            b = s.bucket
            whole = grad_fields.bound(b.params, b.views)  # not zeroed since
            taken = (
                set(range(len(b.params)))
                if whole
                else {
                    pos for pos, kept in enumerate(map(is_, map(_GRAD, b.params), b.views)) if kept
                }
            )
            if s.launched or (s.phase is Phase.IDLE and taken & s.content):
                s.hyper, s.taken, s.zeroed, s.rebound = hyper, taken, False, False
                group.to(s, Phase.PENDING)
                # (the bucket's own list where it is whole: pending.py knows it from the last step)
                pending.defer(b.params if whole else [b.params[pos] for pos in taken], self.on_read)

    def read(self, p) -> None:
        """Something reads ``p`` while its update is pending (pending.py): apply it."""
        where = self._group_of().where.get(id(p))
        if where is None or where[0].phase is not Phase.PENDING:
            pending.release(p)  # a stale mark (its update was dropped)
            return
        with self._watched():
            self.apply(where[0])

    def shown_grad(self, p, grad):
        """``p.grad`` of a pending ``p`` (pending.py): None where ``zero_grad()`` zeroed
        it since the step took it (the field keeps the view until the update)."""
        where = self._group_of().where.get(id(p))
        if where is not None:
            s, pos = where
            if s.zeroed and s.phase is Phase.PENDING and grad is s.bucket.views[pos]:
                return None
        return grad

    def grad_written(self, p) -> None:
        """``p.grad`` was written while ``p`` is pending (pending.py): its bucket's
        fields are read again where they are needed (``zero_grads``, ``apply``)."""
        where = self._group_of().where.get(id(p))
        if where is not None:
            where[0].rebound = True

    def zero_grads(self, param_groups) -> bool:
        """``zero_grad()`` (``set_to_none=True``) of the optimizer's ``param_groups``
        while updates are pending: a pending bucket's views stay in ``.grad``, read
        as None from now on (``shown_grad``) and set to None once its update has
        taken them, so each field is written once, after the update, instead of
        zeroed now and the view swapped in and out around the update. Every other
        ``.grad`` (a gradient set by hand since the step too) is None now. False,
        and nothing done, where nothing is pending."""
        group = self._group_of()
        states = [s for s in group.states if s.phase is Phase.PENDING and s.gathered is None]
        if not states:
            return False
        with pending.DISABLED():  # (per bucket in C: a pending parameter's reads stay quiet)
            for s in states:
                s.zeroed = True
                b = s.bucket
                if not s.rebound:  # (each field as step() found it: the taken views)
                    if len(s.taken) != len(b.params):
                        for pos, p in enumerate(b.params):
                            if pos not in s.taken and p.grad is not None:
                                p.grad = None
                    continue
                bound = list(map(is_, map(_GRAD, b.params), b.views))
                if len(s.taken) != len(bound) or not all(bound):  # keep taken views only
                    for pos, (p, kept) in enumerate(zip(b.params, bound)):
                        if not (kept and pos in s.taken) and p.grad is not None:
                            p.grad = None
            for p in self._others(group, param_groups, states):
                if p.grad is not None:
                    p.grad = None
        return True

    @staticmethod
    def _others(group: BucketGroup, param_groups, states) -> list:
        """The parameters of ``param_groups`` in none of ``states``' buckets (none, as a
        rule: every trainable parameter is in a bucket), kept on the group from the
        last call while the groups list the same parameters and the same buckets are
        pending."""
        listed = list(chain.from_iterable(g["params"] for g in param_groups))
        indices = [s.index for s in states]
        known = group.zeroing_others
        if (
            known is not None
            and known[0] == indices
            and len(known[1]) == len(listed)
            and all(map(is_, listed, known[1]))
        ):
            return known[2]
        covered = {id(p) for s in states for p in s.bucket.params}
        others = [p for p in listed if id(p) not in covered]
        group.zeroing_others = (indices, listed, others)
        return others

    @staticmethod
    def _zero_taken(s: BucketState) -> None:
        """The bucket's update took its gradients; those ``zero_grad()`` zeroed meanwhile
        are None now (``zero_grads``). ``settle`` left ``content`` the positions whose
        ``.grad`` is the view and the update took, so they are not read again here
        (right after the update's pass over every parameter, a read costs ~0.5 us)."""
        if not s.zeroed:
            return
        s.zeroed = False
        params, content = s.bucket.params, s.content
        # (released: plain parameters, so one call into C++ for the bucket)
        grad_fields.set_grads(
            params if len(content) == len(params) else [params[pos] for pos in content]
        )
        s.content = set()

    def release_dropped(self, s: BucketState) -> None:
        """The bucket's update is dropped (a checkpoint supersedes it): plain again,
        what ``zero_grad()`` zeroed None."""
        self.release(s)
        if s.zeroed:
            s.zeroed = False
            b = s.bucket
            for p, view in zip(b.params, b.views):
                if p.grad is view:
                    p.grad = None

    @staticmethod
    def release(s: BucketState) -> None:
        """The bucket's update is applied or dropped: its parameters are plain again."""
        pending.release_all(s.bucket.params)

    def close(self) -> None:
        """Nothing is deferred any more: every parameter plain, none registered."""
        pending.forget(self.on_read)

    def any_pending(self) -> bool:
        return any(s.phase is Phase.PENDING for s in self._group_of().states)

    def apply_pending(self) -> None:
        """Apply every deferred update now."""
        if not self.any_pending():
            return  # the usual case at step(): the forward applied them all
        group = self._group_of()
        # the last issued first: with it, every other (one optimizer call on a GPU)
        for s in sorted(group.states, key=lambda s: -group.engine.issue_seq(s.index)):
            if s.phase is Phase.PENDING:
                self.apply(s)

    def apply(self, s: BucketState) -> None:
        """Apply bucket ``s``'s deferred update with its reduced gradients. After the
        measured steps, with it every other PENDING bucket whose reduction is done by
        then, in one optimizer call (the multi-tensor path): on the host path those
        already finished, on a GPU those issued before it on the one comm stream
        (the stream waits for them anyway). A plan that
        issues buckets in their order of need takes one call per step; one that
        issues an early-needed bucket sooner takes one more per such break."""
        if s.gathered is not None:  # sharded: the parameters' all-gather (shard.py)
            self.release(s)
            s.gathered()
            return
        t0 = time.perf_counter()
        group = self._group_of()
        measuring = self.measure.measuring(self.state.steps)
        if measuring:
            if s.launched_at is not None:
                self.measure.window(s.bucket.spec.layers, s.launched_at, self.clock.stamp())
            together = [s]  # one by one: each bucket's window and need are measured
        else:
            group.wait(s)  # first: what was issued before it is done by then too
            together = [s] + [
                o
                for o in group.states
                if o is not s
                and o.phase is Phase.PENDING
                and group.engine.done_with(o.index, s.index)
            ]
        for o in together:  # before any update reads them
            self.release(o)
        groups: Dict[bool, tuple] = {}
        for o in together:
            hyper, o.hyper = o.hyper, None
            whole = not o.rebound and len(o.taken) == len(o.bucket.params)
            used = group.settle(o, waited=o is s and not measuring, views_bound=whole)
            group.to(o, Phase.IDLE)
            group.drop_unused(o, used)
            b = o.bucket
            free = b.topk is not None and bool(self._momentum)
            params, grads, _ = groups.setdefault(free, ([], [], hyper))
            if len(used) == len(o.taken) == len(b.params):  # (the usual bucket: all of it)
                params += b.params
                grads += b.views
                continue
            for pos in used:
                if pos in o.taken:
                    params.append(b.params[pos])
                    grads.append(b.views[pos])
        if self.update is not None:  # (bound: no field written since step(), none read)
            bound = not any(o.rebound for o in together)
            for free, (params, grads, hyper) in groups.items():
                if params:
                    self.update(params, grads, hyper, free, bound)  # (an Update: positional)
        for o in together:
            self._zero_taken(o)
        self.timeline.add(
            f"update bucket {s.index}" + (f" (+{len(together) - 1})" if len(together) > 1 else ""),
            "compute",
            t0,
            time.perf_counter(),
        )
