"""The gradient synchronizer: the one place a gradient goes from its hook to its update.

Each parameter's ``.grad`` is a view of its bucket's contiguous buffer
(buckets.py); backward accumulates into it in place, the all-reduce runs in
place, and the optimizer reads it: no copy on the data path. A gradient's way:

1. **Before autograd adds it** (a tensor hook): the bucket must be writable.
   A reduction in flight is waited for (a *late* gradient: the result is kept
   and the addition reduced again, all-reduce being linear), a deferred
   forward-mode update is applied first, and a ``.grad`` that is None (zeroed
   with ``set_to_none``) is bound to its zeroed view, so autograd adds in place.
   A bucket whose launch the issue order has not reached yet is never written:
   the gradient goes into a tensor of autograd's own and is folded in once the
   launch is done.
2. **After autograd added it** (a post-accumulate hook): a gradient autograd
   put elsewhere (the user rebound ``.grad``) is copied in once. In the
   step's *launching pass* a bucket is launched as soon as all its gradients
   are in; the end of the pass launches the rest.
3. The engine issues launched buckets in the plan's fixed order (engine.py).
4. ``finish()`` (backward and none modes, ``synchronize()``, a closure's
   backward) launches what is left and waits: ``.grad`` holds the reduced
   gradients. ``defer()`` (forward mode) launches what is left and returns;
   each bucket's update is applied before the first read of one of its
   parameters (pending.py: whatever reads it, in the next forward or not),
   with the hyper-parameters of the step.

**The step's structure is learned, never assumed.** The synchronization point
is the step (or a parameter's first use in forward mode), not a count of
backward passes. Passes are counted since the last step; the buckets are
launched in pass ``plan.launch_pass``: 1 at first, then the most passes a
measured step had (DCGAN's discriminator: G's backward through D, then the
real and the fake pass: launched in the third, and G's pass through D is
never sent). A pass after the launching one is still reduced: its end
launches every bucket again; gradients zeroed before a step used them are
dropped, in flight or not. How often a bucket is launched depends only on what
every rank does alike (the pass count, the agreed plan, the structure of the
backward graph, as DDP requires), never on which gradients this rank happened
to produce, and a bucket is launched again only in a round that launches them
all: every rank issues the same sequence. ``backward_passes_per_step`` fixes
the launching pass instead; ``no_sync()`` passes accumulate locally.

Bucket phases (one value per bucket, only this module changes it)::

    IDLE --first gradient of a round--> ACCUMULATING --launch--> IN_FLIGHT
    IN_FLIGHT --finish (step, synchronize)--> IDLE     .grad: the reduced gradients
    IN_FLIGHT --defer (forward-mode step)--> PENDING --first use--> IDLE
    IN_FLIGHT --another gradient (late pass, or dropped)--> ACCUMULATING
"""
from __future__ import annotations

import contextlib
import enum
import logging
import sys
import time
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..comm import calibration, control
from ..config import env
from . import pending
from .buckets import GradBucket
from ..comm.channel import open_channel
from ..gpu.clock import clock_for
from ..algorithms.topk import TOPK
from ..comm.compression import TopK
from ..comm.engine import CommEngine
from ..base.errors import HybridCommError
from .pending import ApplyBeforeCompiledForward
from .measure import StepMeasurements
from ..plan.planner import Plan, make_plan, plan_from_dict
from .registry import ParamRegistry
from ..gpu.runtime import runtime_for
from ..comm.sparse import all_gather_sparse
from .stall import StallInspector
from ..base.timeline import Timeline
from ..plan.verdict import verdict

log = logging.getLogger("hybridcomm")

# A parameter is reduced by one synchronizer at a time (two would bind its .grad
# to two buffers): id(param) -> (weakref to the param, weakref to its synchronizer).
_owners: Dict[int, tuple] = {}


def _owner(p):
    entry = _owners.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


class Phase(enum.Enum):
    IDLE = "idle"  # not in a round: holds the last reduced gradients, or nothing
    ACCUMULATING = "accumulating"  # backward adds this rank's gradients into the views
    IN_FLIGHT = "in flight"  # launched: neither read nor written until waited for
    PENDING = "pending"  # forward mode: step() took it; the update waits for a first use


class _Slot:
    """A bucket's bookkeeping on the host (its memory is ``bucket``)."""

    __slots__ = ("index", "bucket", "phase", "content", "touched", "pass_id", "launched_pass",
                 "launched_epoch", "launched_at", "complete", "hyper", "taken", "reopened",
                 "detached", "marked", "agreed")

    def __init__(self, index: int, bucket: GradBucket):
        self.index, self.bucket = index, bucket
        self.phase = Phase.IDLE
        self.content: set = set()  # positions whose view holds a gradient (local or reduced)
        self.touched: set = set()  # positions autograd added to in pass ``pass_id``
        self.pass_id = -1
        self.launched_pass = -1
        self.launched_epoch = -1  # the synchronizer's epoch at its last launch
        self.launched_at = None  # a clock stamp, on measured launches only
        self.complete = False  # launched with a gradient at every position
        self.hyper = None  # PENDING: the hyper-parameters of the deferring step()
        self.taken: set = set()  # PENDING: positions whose .grad the step took (not zeroed)
        self.reopened = False  # a gradient came after its launch: it must be launched again
        self.detached: set = set()  # positions whose late additions wait in autograd's tensor
        self.marked: List[int] = []  # the positions this rank launched with a gradient
        self.agreed = None  # control.HostMax over ``marked``, posted as the launch is issued


_NO_CONTEXT = contextlib.nullcontext()
_RUN_BACKWARD = torch.autograd.graph._engine_run_backward.__code__
_NODE_APPLY = torch.autograd.function.BackwardCFunction.apply.__code__


def _in_nested_backward() -> bool:
    """Whether this gradient hook runs inside a backward started by a node of another
    backward (reentrant checkpointing): its end is not the end of the pass."""
    f, seen = sys._getframe(2), False
    while f is not None:
        if f.f_code is _RUN_BACKWARD:
            seen = True
        elif seen and f.f_code is _NODE_APPLY:
            return True
        f = f.f_back
    return False


Update = Callable[[list, list, list, bool], None]


class GradientSynchronizer:
    """All-reduces the gradients of an optimizer's parameters, bucket by bucket.

    The fronts (``DistributedOptimizer``, strategies) drive it with a few verbs:
    ``begin_step`` / ``finish`` / ``defer`` / ``end_step``, ``prepare_zero``,
    ``reduce_after(closure)``, ``refresh``, ``apply_pending``, ``close``.

    Args:
        param_groups: the optimizer's ``param_groups`` (its trainable
            parameters are reduced; read again by ``refresh``).
        update: ``update(params, grads, hyper, momentum_free)`` applies the
            optimizer to ``params`` with gradients ``grads`` and per-group
            hyper-parameters ``hyper`` (forward mode's deferred updates).
        model, named_parameters, strategy, overlap, op, backward_passes_per_step,
        compression (the wire dtype, or None), topk (ratio or None),
        correction_momentum, cost_model, process_group, timeout, fusion_bytes,
        split_bytes, lazy_bytes, measure_iters, replan_every, trace,
        find_unused_parameters, servers: as ``DistributedOptimizer`` documents
        them (``servers``: a :class:`~hybridcomm.comm.servers.SummationServers`).

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> sync = GradientSynchronizer(opt.param_groups, update=None, model=model,
        ...                             overlap="backward", cost_model="default", timeout=60)
        >>> x, y = loader[0]; loss_fn(model(x), y).backward()
        >>> sync.begin_step(); sync.finish(); sync.end_step()   # p.grad: averaged over ranks
        >>> sync.close()
    """

    def __init__(self, param_groups, update: Optional[Update], *, model=None,
                 named_parameters=None, strategy="hybrid", overlap="forward", op="avg",
                 backward_passes_per_step: Optional[int] = None, compression=None, topk=None,
                 correction_momentum: float = 0.0, cost_model=None, process_group=None,
                 timeout: float = 300.0, fusion_bytes=None, split_bytes=None, lazy_bytes=None,
                 measure_iters: int = 3, replan_every: int = 200, trace: bool = False,
                 find_unused_parameters: bool = False, servers=None):
        self._param_groups, self._update = param_groups, update
        self.model, self._named = model, named_parameters
        self.overlap, self.strategy = overlap, strategy
        self._defer_always = env.get("HYBRIDCOMM_DEFER") == "always"
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self.scale = 1.0 / self.world if op == "avg" else None
        self.timeout = timeout
        self.wire, self.topk, self.momentum = compression, topk, correction_momentum
        self.fusion_bytes, self.split_bytes, self.lazy_bytes = fusion_bytes, split_bytes, lazy_bytes
        self._fixed_passes = backward_passes_per_step
        self.measure = StepMeasurements(measure_iters, replan_every)
        self.timeline = Timeline(enabled=bool(trace))
        self.last_step_stats: Dict[str, float] = {}

        self.registry = self._registry()
        self._rt = runtime_for(self.registry.device)
        self.servers = servers
        if servers is not None and self._rt is not None:  # ps.py moves host tensors
            raise HybridCommError("servers= (the summation servers, algorithm 'ps') run on the "
                                  "host path only (gloo, CPU tensors); these parameters are on "
                                  f"{self.registry.device}: leave servers out on the GPU path")
        self.clock = clock_for(self._rt)  # the planner's inputs: the GPU's clock there
        # Device path: which parameters some rank has a gradient for is agreed on the
        # host (gloo, posted at issue), not read back from the reduced flags (a host
        # sync). Costs a small host collective per bucket and step, hence opt-in.
        self._agree_used = bool(find_unused_parameters) and self._rt is not None
        self._warned_flags = False
        self.transport, self.channel = open_channel(self.registry.device, process_group, timeout,
                                                    self.timeline,
                                                    issue_thread=env.get("HYBRIDCOMM_ISSUE_THREAD"))
        self.cost_model = calibration.resolve(cost_model, process_group, timeout, servers)
        self.stall = StallInspector(process_group, timeout)
        self._launches = 0  # buckets launched in all (the stall inspector compares them)

        self._steps = 0  # completed steps
        self._step_t0 = time.perf_counter()
        self._epoch = 0  # a step, or a closure call in one: each bucket launched once in it
        self._passes = 0  # counted backward passes since the last step
        self._passes_any = 0  # every backward pass since the last step
        self._pass_id = 0
        self._pass_active = False
        self._pass_kind = "local"  # "launch" | "late" | "local"
        self._measuring_pass = False
        self._round0 = 0  # the engine's rounds of the issue order when this step began
        self._pass_callback_due = False
        self._pass_t0 = 0.0
        self._closure_depth = 0
        self.no_sync_active = False
        self._exposed_s = 0.0  # waited for communication since the last step
        self._hooks: Dict[int, list] = {}  # id(param) -> its hook handles
        self.engine: Optional[CommEngine] = None
        self.slots: List[_Slot] = []
        self._where: Dict[int, Tuple[_Slot, int]] = {}  # id(param) -> (slot, position)
        self._build(self._agree_plan(None, None, None, None))
        # The only hook on the model (a plain object: it deep-copies and pickles)
        self._compiled_hook = model.register_forward_pre_hook(ApplyBeforeCompiledForward()) \
            if model is not None and overlap == "forward" else None
        self._log_plan("initial plan")

    # ---- parameters, plan, buckets ------------------------------------------------------
    @property
    def params(self) -> List[torch.nn.Parameter]:
        return self.registry.params

    def _registry(self) -> ParamRegistry:
        reg = ParamRegistry(self._param_groups, self.model, self._named, wire_dtype=self.wire,
                            group=self.group, timeout=self.timeout,
                            device_path=runtime_for(self._device_of()) is not None)
        for p in reg.params + [p for p, _ in reg.sparse]:
            owner = _owner(p)
            if owner is not None and owner is not self:
                raise HybridCommError(
                    f"parameter {reg.names[reg.index[id(p)]] if id(p) in reg.index else ''!r} "
                    "is already reduced by another DistributedOptimizer: give each optimizer "
                    "its own parameters (or close() the other first)")
        for p in reg.params + [p for p, _ in reg.sparse]:
            _owners[id(p)] = (weakref.ref(p), weakref.ref(self))
        return reg

    def _device_of(self) -> torch.device:
        for g in self._param_groups:
            for p in g["params"]:
                return p.device
        return torch.device("cpu")

    def _agree_plan(self, windows, ready, need, launch_pass, comm_scale=None, defer_pays=None,
                    keep: Optional[Plan] = None) -> Optional[Plan]:
        """Rank 0 makes the plan (from its cost model and measurements); all follow it.
        With ``keep``, None when rank 0's new plan decides nothing differently."""
        plan = None
        if self.rank == 0:
            layers = self.registry.layers
            if ready:
                layers = sorted(layers, key=lambda layer: ready.get(layer.name, float("inf")))
            if self._fixed_passes is not None:
                launch_pass = self._fixed_passes
            elif launch_pass is None:
                launch_pass = keep.launch_pass if keep is not None else 1
            plan = make_plan(layers, world_size=self.world, model=self.cost_model,
                             strategy=self.strategy, fusion_bytes=self.fusion_bytes,
                             split_bytes=self.split_bytes, windows=windows, ready=ready,
                             need=need, topk=self.topk, lazy_bytes=self.lazy_bytes,
                             launch_pass=launch_pass, comm_scale=comm_scale,
                             defer_pays=defer_pays if self.overlap == "forward" else None,
                             servers=len(self.servers.role.servers) if self.servers else 0)
            if keep is not None and plan.decisions() == keep.decisions():
                plan = None
        return control.broadcast_object(plan, group=self.group, timeout=self.timeout,
                                        what="the bucket plan")

    def _alloc(self, n: int, dt: torch.dtype) -> torch.Tensor:
        rt = self._rt
        if rt is None:
            return torch.empty(n, dtype=dt)
        buf = rt.empty(n, dt)  # on the trainer's stream; the comm stream records its use
        rt.record_stream(buf, self.transport.stream)
        return buf

    def _build(self, plan: Plan) -> None:
        """Buckets for ``plan``: the gradients that the old buckets held move into the new
        ones (each ``.grad`` bound to its new view); any other ``.grad`` (a parameter
        that just joined) is folded in when its bucket next opens."""
        params = self.params
        old_where = self._where
        slots, where = [], {}
        for b in plan.buckets:
            ps = [params[i] for i in b.params]
            dtype = getattr(torch, b.dtype.replace("torch.", ""))
            bucket = GradBucket(b, ps, dtype, self.wire, self._alloc)
            if b.algorithm == TOPK:
                bucket.topk = TopK(bucket.grads.numel(), len(ps), self.topk, self.rank,
                                   self.world, self.momentum, self._alloc)
            slot = _Slot(b.index, bucket)
            for pos, p in enumerate(ps):
                where[id(p)] = (slot, pos)
                old = old_where.get(id(p))
                if old is not None and old[0].bucket.holds(old[1]):
                    bucket.views[pos].copy_(old[0].bucket.views[old[1]])
                    bucket.bind(pos)
                    if old[1] in old[0].content:
                        slot.content.add(pos)
                carried = old and bucket.topk and old[0].bucket.topk_state(old[1])
                if carried:  # top-k's error feedback survives a re-plan
                    for new_view, old_view in zip(bucket.topk_state(pos), carried):
                        if new_view is not None and old_view is not None:
                            new_view.copy_(old_view)
            slots.append(slot)
        self.plan, self.slots, self._where = plan, slots, where
        self.engine = CommEngine(plan, [s.bucket for s in slots], self.channel, self.transport,
                                 scale=self.scale, timeout=self.timeout, servers=self.servers)
        if self.stall.enabled:
            self.engine.on_slow, self.engine.slow_after = self._stalled, self.stall.warn_s
        if self._agree_used:
            self.engine.on_issue = self._post_used
        self._hook_params()

    def _hook_params(self) -> None:
        """A tensor hook (before accumulation) and a post-accumulate hook on every
        reduced parameter, and none on the others."""
        want = {id(p): p for p in self.params}
        for pid in [pid for pid in self._hooks if pid not in want]:
            for h in self._hooks.pop(pid):
                h.remove()
        for pid, p in want.items():
            if pid not in self._hooks:
                self._hooks[pid] = [
                    p.register_hook(lambda grad, p=p: self._before_grad(p)),
                    p.register_post_accumulate_grad_hook(self._after_grad)]

    def _log_plan(self, title: str, changed: bool = True) -> None:
        """The plan at INFO on rank 0 when it decides something new (the same on every
        rank: DEBUG elsewhere, and for a re-plan that changed no decision)."""
        log.log(logging.INFO if self.rank == 0 and changed else logging.DEBUG, "%s:\n%s",
                title, self.plan)

    # ---- the hooks -----------------------------------------------------------------------
    def _watched(self):
        """The device runtime's view of host torch calls in autograd hooks (the GPU
        simulator must see them; torch gives hooks no torch-function modes)."""
        return self._rt.watched() if self._rt is not None else _NO_CONTEXT

    def _before_grad(self, p) -> None:
        """Autograd is about to add a gradient into ``p.grad``: make that in place
        and safe (tensor hook; returns None: the gradient is left as it is)."""
        where = self._where.get(id(p))
        if where is None:
            return
        slot, pos = where
        if slot.phase is Phase.ACCUMULATING and p.grad is not None and self._rt is None:
            return  # the usual case: autograd adds into the view (or a tensor it was given)
        b = slot.bucket
        with self._watched():
            if slot.phase is not Phase.ACCUMULATING:
                if not self._open(slot):  # its launch is still to be issued
                    if b.holds(pos):
                        p.grad = None  # autograd starts a tensor of its own; folded in later
                        slot.detached.add(pos)
                    return
            elif p.grad is None:  # zeroed (set_to_none) in the middle of a round
                slot.content.discard(pos)
                b.views[pos].zero_()
                b.bind(pos)
            if self._rt is not None and b.holds(pos):
                self._rt.expect_write(b.views[pos])  # autograd's in-place add, on this stream

    def _after_grad(self, p) -> None:
        """Autograd added this pass's gradient into ``p.grad`` (post-accumulate hook)."""
        where = self._where.get(id(p))
        if where is None:
            return
        slot, pos = where
        with self._watched():
            if not self._pass_active:
                self._begin_pass()
            elif self._pass_callback_due and not _in_nested_backward():
                self._queue_pass_end()
            b = slot.bucket
            if slot.phase is Phase.IN_FLIGHT:
                return  # waits in autograd's tensor until the launch is done (_open)
            if p.grad is not b.views[pos]:  # autograd put it elsewhere (.grad was rebound)
                if p.grad.is_sparse:
                    raise HybridCommError(f"parameter {self.registry.names[b.spec.params[pos]]!r}"
                                          " got a sparse gradient; hybridcomm reduces dense "
                                          "gradients (use sparse=True only on the CPU path)")
                if slot.phase is not Phase.ACCUMULATING and not self._open(slot):
                    return
                b.views[pos].copy_(p.grad)
                b.bind(pos)
            slot.content.add(pos)
            if slot.pass_id != self._pass_id:
                slot.pass_id, slot.touched = self._pass_id, set()
            slot.touched.add(pos)
            if self._pass_kind == "launch":
                if self._measuring_pass:
                    self.measure.ready(b.spec.params[pos], self.clock.stamp())
                if len(slot.touched) == len(b.params) and slot.launched_epoch != self._epoch:
                    self._launch(slot)

    def _begin_pass(self) -> None:
        self._pass_active = True
        self._pass_id += 1
        self._pass_t0 = time.perf_counter()
        self._passes_any += 1
        counted = not self.no_sync_active and self._closure_depth == 0
        self._passes += counted
        if self.overlap == "none" or self.no_sync_active:
            self._pass_kind = "local"
        elif self._closure_depth or self._passes == self.plan.launch_pass:
            self._pass_kind = "launch"
        elif self._passes > self.plan.launch_pass:
            self._pass_kind = "late"
        else:
            self._pass_kind = "local"
        self._measuring_pass = self._pass_kind == "launch" and self.measure.measuring(self._steps)
        self._pass_callback_due = True
        if not _in_nested_backward():
            self._queue_pass_end()

    def _queue_pass_end(self) -> None:
        self._pass_callback_due = False
        torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)

    def _end_pass(self) -> None:
        """The end of a backward pass: the launching pass launches every bucket not
        launched yet in this step; a late pass launches them all again (every rank
        alike: all ranks count the same passes)."""
        if not self._pass_active:
            return
        self._pass_active = False
        with self._watched():
            if self._pass_kind == "launch":
                self._launch_rest()
            elif self._pass_kind == "late":
                self._launch_round()
        self.timeline.add("backward", "compute", self._pass_t0, time.perf_counter())

    def _launch_rest(self) -> None:
        for slot in self.slots:
            if slot.launched_epoch != self._epoch:
                self._launch(slot)

    def _launch_round(self) -> None:
        """Launch every bucket again (a relaunch is always a whole round of the order)."""
        self._launch_rest()
        for slot in self.slots:
            self._launch(slot)

    # ---- phase changes -------------------------------------------------------------------
    def _open(self, slot: _Slot) -> bool:
        """Start (or resume) a round: afterwards backward may add into the bucket.
        False, and nothing changed, when its launch is still to be issued."""
        if slot.phase is Phase.PENDING:
            self._apply(slot)
        elif slot.phase is Phase.IN_FLIGHT:
            if not self.engine.issued(slot.index):
                slot.reopened = True
                return False
            self._settle(slot)  # a late gradient, or a dropped one: the reduction ends first
        b = slot.bucket
        fresh = []
        for pos, p in enumerate(b.params):
            g = p.grad
            if g is b.views[pos]:
                continue
            if pos in slot.detached and g is not None:
                b.views[pos].add_(g)  # what came while the launch was still to be issued
                slot.content.add(pos)
            else:
                slot.content.discard(pos)  # dropped (None) or replaced: the view is stale
                if g is None:
                    fresh.append(pos)
                    continue
                if g.is_sparse:
                    raise HybridCommError(
                        f"parameter {self.registry.names[b.spec.params[pos]]!r} has a sparse "
                        "gradient; hybridcomm reduces dense gradients (sparse=True modules "
                        "only on the CPU path)")
                b.views[pos].copy_(g)
                slot.content.add(pos)
            b.bind(pos)
        slot.detached.clear()
        if fresh:
            b.zero(fresh)
            for pos in fresh:
                b.bind(pos)
        slot.phase = Phase.ACCUMULATING
        return True

    def _launch(self, slot: _Slot) -> None:
        if slot.phase is not Phase.ACCUMULATING and not self._open(slot):
            raise HybridCommError(f"internal error: bucket {slot.index} launched again before "
                                  "its last launch was issued")
        content = slot.content
        slot.complete = len(content) == len(slot.bucket.params)
        if self._agree_used:
            self._mark_used(slot)
        if not self._agree_used or slot.bucket.topk is not None:  # top-k sends its flags
            slot.bucket.set_flags(content)
        slot.phase, slot.reopened = Phase.IN_FLIGHT, False
        slot.launched_pass, slot.launched_epoch = self._pass_id, self._epoch
        # A stamp only where the next forward's use is measured (an event each on a GPU)
        slot.launched_at = self.clock.stamp() if self.measure.measuring(self._steps + 1) \
            else None
        self._launches += 1
        self.engine.launch(slot.index)

    def _mark_used(self, slot: _Slot) -> None:
        """Note this launch's content for the agreement posted at issue."""
        if slot.agreed is not None:  # the last launch's, not waited for (it was complete)
            slot.agreed.wait()
            slot.agreed = None
        slot.marked = sorted(slot.content)

    def _post_used(self, index: int) -> None:
        """The engine issues bucket ``index`` (plan order): post the agreement on which
        of its parameters some rank has a gradient for."""
        slot = self.slots[index]
        slot.agreed = control.HostMax(len(slot.bucket.params), slot.marked, group=self.group,
                                      timeout=self.timeout,
                                      what=f"which parameters of bucket {index} have gradients")

    def _used(self, slot: _Slot) -> List[int]:
        """The positions some rank had a gradient for (after the reduction)."""
        b = slot.bucket
        if slot.complete:
            return list(range(len(b.params)))
        if slot.agreed is not None:
            agreed, slot.agreed = slot.agreed, None
            return agreed.positions()
        if self._rt is not None and not self._warned_flags:
            self._warned_flags = True
            log.warning("hybridcomm: rank %d has no gradient for some parameters of bucket %d "
                        "(%s); reading which ones any rank has costs a host sync per such bucket "
                        "and step. find_unused_parameters=True agrees on them on the host "
                        "instead.", self.rank, slot.index, ", ".join(b.spec.layers))
        return b.used()

    def _stalled(self, index: int) -> Optional[str]:
        """A wait on bucket ``index`` turned slow: name the ranks behind, if any (logged,
        and returned for the timeout's message)."""
        layers = ", ".join(self.plan.buckets[index].layers)
        try:
            why = self.stall.explain(f"bucket {index} ({layers})", self._launches, self._steps)
        except Exception as e:  # noqa: BLE001 - the inspector must never break a wait
            why = f"hybridcomm stall: bucket {index} ({layers}) is slow; the inspector failed: {e}"
        if why:
            log.warning(why)
        return why

    def _wait(self, slot: _Slot) -> None:
        waited = self.engine.wait(slot.index)
        self._exposed_s += waited
        if waited > 1e-5:
            now = time.perf_counter()
            self.timeline.add(f"wait bucket {slot.index}", "wait", now - waited, now)

    def _settle(self, slot: _Slot) -> List[int]:
        """Wait for the bucket's reduction; its content is now the reduced gradients
        of the positions some rank used. Returns those positions."""
        self._wait(slot)
        b = slot.bucket
        if b.buffer._version != self.engine.version(slot.index):
            raise HybridCommError(
                f"bucket {slot.index} ({', '.join(b.spec.layers)}): a gradient was written in "
                "place while it was being all-reduced or while its update waited for the next "
                "forward (e.g. p.grad.zero_() or zero_grad(set_to_none=False) on the module "
                "after backward, or a torch.distributed.pipelining schedule's gradient scaling: "
                "build it with scale_grads=False and divide the loss by the micro-batch count): "
                "modify gradients only after opt.synchronize(), and zero them with zero_grad() "
                "(set_to_none=True, the default)")
        used = self._used(slot)
        slot.content = {pos for pos in used if b.holds(pos)}
        slot.phase = Phase.ACCUMULATING
        return used

    def _consume(self, slot: _Slot) -> None:
        """``.grad`` <- the reduced gradients; None where no rank had one (as one
        process on the whole batch would leave it)."""
        used = set(self._settle(slot))
        b = slot.bucket
        for pos, p in enumerate(b.params):
            if p.grad is b.views[pos]:
                if pos not in used:
                    p.grad = None
            elif p.grad is not None and pos in used:
                raise HybridCommError(
                    f"p.grad of {self.registry.names[b.spec.params[pos]]!r} was replaced while "
                    "it was being all-reduced: gradients are reduced in place; change them "
                    "after opt.synchronize() (then step inside opt.skip_synchronize())")
        slot.phase = Phase.IDLE

    def _apply(self, slot: _Slot) -> None:
        """Forward mode: apply a bucket's deferred update with its reduced gradients;
        after the measured steps, with it every other deferred bucket whose reduction
        is done by then, in one optimizer call (the multi-tensor path): on the host
        path those already finished, on a GPU those issued before it on the one comm
        stream (the stream waits for them anyway). A plan that issues buckets in
        their order of need takes one call per step; one that issues an early-needed
        bucket sooner (so that it is not held up) takes one more per such break."""
        t0 = time.perf_counter()
        if self.measure.measuring(self._steps):
            if slot.launched_at is not None:
                self.measure.window(slot.bucket.spec.layers, slot.launched_at, self.clock.stamp())
            together = [slot]  # one by one: each bucket's window and need are measured
        else:
            self._wait(slot)  # first: what was issued before it is done by then too
            together = [slot] + [s for s in self.slots if s is not slot and
                                 s.phase is Phase.PENDING and
                                 self.engine.done_with(s.index, slot.index)]
        for s in together:  # before any update reads them
            self._release(s)
        groups: Dict[bool, tuple] = {}
        for s in together:
            hyper, s.hyper = s.hyper, None
            used = self._settle(s)
            s.phase = Phase.IDLE
            b = s.bucket
            for pos, p in enumerate(b.params):
                if pos not in used and p.grad is b.views[pos]:
                    p.grad = None
            free = b.topk is not None and bool(self.momentum)
            params, grads, _ = groups.setdefault(free, ([], [], hyper))
            for pos in used:
                if pos in s.taken:
                    params.append(b.params[pos])
                    grads.append(b.views[pos])
        if self._update is not None:
            for free, (params, grads, hyper) in groups.items():
                if params:
                    self._update(params, grads, hyper, free)
        self.timeline.add(f"update bucket {slot.index}" + (f" (+{len(together) - 1})"
                                                          if len(together) > 1 else ""),
                          "compute", t0, time.perf_counter())

    # ---- the verbs of the fronts -------------------------------------------------------
    @property
    def defers(self) -> bool:
        """Whether step() defers the updates to the first uses in the next forward
        (forward mode, unless the plan found that nothing is left to overlap)."""
        return self.overlap == "forward" and (self.plan.defer_updates or self._defer_always)

    def begin_step(self) -> None:
        """A step begins: a pass whose end autograd never reported (it ran only in
        nested backwards) ends now; parameters that joined are taken in."""
        self._step_t0 = time.perf_counter()
        if self._pass_active:
            self._end_pass()
        if self.measure.measuring(self._steps) and self._passes_any:
            self.measure.running_at_step([
                s.bucket.spec.layers for s in self.slots if s.launched_epoch != self._epoch
                or (s.phase is Phase.IN_FLIGHT and not self.engine.done(s.index))])
        if self.registry.trainable_changed():
            self.refresh()

    def _set_by_hand(self) -> bool:
        """Whether some ``.grad`` is neither None nor its view: set without a backward
        pass (``p.grad = g`` after ``torch.autograd.grad``), to be reduced too."""
        return any(p.grad is not None and p.grad is not s.bucket.views[pos]
                   for s in self.slots for pos, p in enumerate(s.bucket.params))

    def _flush(self) -> None:
        """Launch every bucket this step has not; if a gradient came after some
        bucket's launch, launch them all again (nothing when no backward pass ran
        since the last step and no gradient was set by hand)."""
        if self._passes_any == 0 and not self._set_by_hand():
            return
        with self._watched():
            self._launch_rest()
            if any(s.reopened or s.phase is Phase.ACCUMULATING for s in self.slots):
                self._launch_round()

    def finish(self) -> None:
        """Every gradient of this step reduced, in ``.grad`` (backward and none modes,
        synchronize(), a closure's backward). Deferred updates are applied first."""
        self.apply_pending()
        self._flush()
        with self._watched():
            for slot in self.slots:
                if slot.phase is Phase.IN_FLIGHT:
                    self._consume(slot)
                elif slot.phase is Phase.ACCUMULATING:  # opened, never added to: a no-op round
                    slot.phase = Phase.IDLE
        self._reduce_sparse()

    def defer(self, hyper: list) -> None:
        """Forward mode's step: launch what is left; each bucket's update waits for the
        first read of one of its parameters (``hyper``: the groups' hyper-parameters
        now). An update still pending from the last step is applied first: this step
        may update the same parameters again (a step() on the same gradients)."""
        self.apply_pending()
        self._flush()
        self._reduce_sparse()
        sparse = [p for p, _ in self.registry.sparse if p.grad is not None]
        if sparse and self._update is not None:  # not deferred: no first use to wait for
            self._update(sparse, [p.grad for p in sparse], hyper, False)
        for slot in self.slots:
            b = slot.bucket
            taken = {pos for pos in range(len(b.params)) if b.holds(pos)}  # not zeroed since
            if slot.phase is Phase.IN_FLIGHT or (slot.phase is Phase.IDLE and taken & slot.content):
                slot.hyper, slot.taken, slot.phase = hyper, taken, Phase.PENDING
                pending.defer([b.params[pos] for pos in taken], self._read)

    def _read(self, p) -> None:
        """Something reads ``p`` while its update is pending (pending.py): apply it."""
        where = self._where.get(id(p))
        if where is None or where[0].phase is not Phase.PENDING:
            pending.release(p)  # a stale mark (its update was dropped)
            return
        with self._watched():
            self._apply(where[0])

    def _release(self, slot: _Slot) -> None:
        """The slot's update is applied or dropped: its parameters are plain again."""
        for p in slot.bucket.params:
            pending.release(p)

    def apply_pending(self) -> None:
        """Apply every deferred update now (forward mode)."""
        if not any(slot.phase is Phase.PENDING for slot in self.slots):
            return  # the usual case at step(): the forward applied them all
        # the last issued first: with it, every other (one optimizer call on a GPU)
        for slot in sorted(self.slots, key=lambda s: -self.engine.issue_seq(s.index)):
            if slot.phase is Phase.PENDING:
                self._apply(slot)

    def end_step(self) -> None:
        """A step ended: statistics, measurements, re-plan."""
        t0 = self._step_t0
        busy = self.channel.take_busy()
        self._exposed_s += self.channel.take_exposed()  # GPU: stream waits, on its clock
        sent, self.engine.bytes_sent = self.engine.bytes_sent, 0
        self.last_step_stats = {"exposed_comm_s": self._exposed_s, "comm_busy_s": busy,
                                "hidden_comm_s": max(0.0, busy - self._exposed_s),
                                "step_call_s": time.perf_counter() - t0, "bytes_sent": sent}
        log.debug("hybridcomm step %d: comm %.2f ms, exposed %.2f ms, %d bytes sent, "
                  "%d backward passes", self._steps, busy * 1e3, self._exposed_s * 1e3, sent,
                  self._passes)
        self.timeline.add("step", "compute", t0, time.perf_counter())
        if self._passes_any:
            self.measure.passes(self._passes)
        if self.measure.measuring(self._steps) and self.engine.round - self._round0 == 1:
            self.measure.comm(busy, sum(b.predicted_s for b in self.plan.buckets
                                        if b.predicted_s == b.predicted_s))
        self._exposed_s = 0.0
        self._passes = self._passes_any = 0
        self._steps += 1
        self.stall.publish(self._launches, self._steps)
        self._epoch += 1
        if self.measure.replan_due(self._steps):
            self._replan()
        self._round0 = self.engine.round

    def reduce_after(self, closure: Callable):
        """``closure`` wrapped so that the backward passes it runs are reduced before it
        returns (``step(closure)``: the optimizer reads ``.grad`` right after)."""
        def reduced(*args, **kwargs):
            self.finish()  # what came before this call is reduced (and in .grad) already
            self._epoch += 1
            self._closure_depth += 1
            try:
                loss = closure(*args, **kwargs)
            finally:
                self._closure_depth -= 1
            if self._pass_active:
                self._end_pass()
            self.finish()
            return loss
        return reduced

    def prepare_zero(self) -> None:
        """Before gradients are zeroed in place (``zero_grad(set_to_none=False)``): a
        deferred update is applied and a reduction in flight waited for; a bucket
        whose launch is still to be issued keeps its content, and its gradients
        become separate zero tensors (its result is dropped when it is done)."""
        self.apply_pending()
        with self._watched():
            for slot in self.slots:
                if slot.phase is not Phase.IN_FLIGHT:
                    continue
                if self.engine.issued(slot.index):
                    self._settle(slot)
                    continue
                slot.reopened = True
                b = slot.bucket
                for pos, p in enumerate(b.params):
                    if b.holds(pos):
                        p.grad = torch.zeros_like(p)
                        slot.detached.discard(pos)

    def drop(self) -> None:
        """A loaded checkpoint supersedes whatever is in flight or deferred."""
        self._flush()
        for slot in self.slots:
            if slot.phase in (Phase.IN_FLIGHT, Phase.PENDING):
                slot.hyper = None
                self._release(slot)
                self._settle(slot)
            slot.phase = Phase.IDLE

    # ---- sparse gradients ----------------------------------------------------------------
    def _reduce_sparse(self) -> None:
        """p.grad of each sparse parameter <- its sum (avg) over ranks, through the
        channel, after this step's dense buckets (the same order on every rank)."""
        for p, name in self.registry.sparse:
            out = []
            fn = (lambda p=p, name=name: out.append(all_gather_sparse(
                p.grad, p.shape, p.dtype, self.transport.group,
                average=self.scale is not None, timeout=self.timeout,
                what=f"sparse gradient of {name!r}")))
            ticket = self.channel.submit(fn, f"sparse gradient of {name!r}")
            self.channel.wait(ticket, f"sparse gradient of {name!r}")
            p.grad = out[0]

    # ---- re-planning ---------------------------------------------------------------------
    def _quiesce(self) -> None:
        """Nothing in flight or deferred: the buckets are about to change."""
        self.apply_pending()
        self._flush()
        with self._watched():
            for slot in self.slots:
                if slot.phase is Phase.IN_FLIGHT:
                    self._settle(slot)
                slot.phase = Phase.IDLE

    def _replan(self) -> None:
        """Re-plan from rank 0's measurements: always the first time, later only if
        they change a decision."""
        windows, ready, need, launch_pass, comm_scale, defer_pays = \
            self.measure.take(self.registry.layers, self.clock)
        first = self._steps == self.measure.measure_iters
        if first and self.rank == 0:
            stats = self.last_step_stats
            log.info("hybridcomm: %s", verdict(
                total_bytes=sum(b.nbytes for b in self.plan.buckets), world=self.world,
                model=self.cost_model, busy_s=stats.get("comm_busy_s", 0.0),
                exposed_s=stats.get("exposed_comm_s", 0.0),
                backward_s=max(ready.values()) if ready else 0.0, comm_scale=comm_scale))
        plan = self._agree_plan(windows, ready, need, launch_pass, comm_scale, defer_pays,
                                keep=None if first else self.plan)
        if plan is None:
            return
        changed = plan.decisions() != self.plan.decisions()
        self._quiesce()
        self._build(plan)
        self._log_plan(f"re-planned after {self._steps} steps" if changed else
                       f"re-planned after {self._steps} steps (the same decisions, with the "
                       "measured windows)", changed)

    def refresh(self) -> None:
        """The optimizer's trainable parameters changed (a group added, requires_grad
        flipped): take the new set (collective), re-plan and rebuild. At a step, every
        bucket is then launched again (a whole round), with what joined."""
        self._quiesce()
        old = {id(p) for p in self.params}
        for p in self.params + [p for p, _ in self.registry.sparse]:
            _owners.pop(id(p), None)
        self.registry = self._registry()
        joined = sum(1 for p in self.params if id(p) not in old)
        plan = self._agree_plan(None, None, None, None, keep=None)
        self._build(plan)
        self._log_plan(f"re-planned: the trainable parameters changed ({joined} joined)")

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The agreed plan and the step count, as plain types, and this rank's top-k
        error feedback (per-rank state: only this rank's own). No collective: one
        rank alone may call it (``if rank == 0: torch.save(opt.state_dict(), f)``)."""
        state = {"plan": self.plan.to_dict(), "steps": self._steps,
                 "params": list(self.registry.names)}
        with self._watched():
            flat = self._topk_flat()
        if flat is not None:
            if self._rt is not None:
                self._rt.synchronize()  # a checkpoint may wait for the device
            state["topk"] = {"rank": self.rank, "world": self.world, "residuals": flat.cpu()}
        return state

    def _topk_views_flat(self) -> List[torch.Tensor]:
        return [v for _, residual, velocity in self.topk_views()
                for v in (residual, velocity) if v is not None]

    def _topk_flat(self) -> Optional[torch.Tensor]:
        views = self._topk_views_flat()
        return torch.cat([v.reshape(-1).float() for v in views]) if views else None

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Adopt a checkpoint's plan and step count. No collective: every rank that
        loads the same checkpoint adopts the same plan; a rank loading alone (rank 0,
        Horovod's resume) is followed by ``broadcast_optimizer_state``, which hands
        its state, plan included, to the others. A checkpoint made for another
        world size or other parameters keeps the current plan (logged). ``None`` (a
        state without hybridcomm's part) changes nothing."""
        if state is None:
            return
        saved = plan_from_dict(state["plan"])
        why = None
        if saved.world_size != self.world:
            why = f"it was made for {saved.world_size} ranks, this job has {self.world}"
        elif list(state.get("params", [])) != list(self.registry.names):
            why = "it was made for other parameters"
        if why:
            log.warning("hybridcomm: the checkpoint's plan is not used (%s): the current plan "
                        "stays", why)
            return
        self._quiesce()
        self._build(saved)
        self._steps = int(state["steps"])
        self._load_topk(state)
        self._epoch += 1
        self._log_plan("the checkpoint's plan")

    def _load_topk(self, state: dict) -> None:
        """This rank's top-k error feedback from a checkpoint, if it holds this rank's
        and fits (a checkpoint of format 1 held every rank's)."""
        views = self._topk_views_flat()
        if not views:
            return
        mine = None
        if "topk_per_rank" in state:
            per_rank = state["topk_per_rank"]
            mine = per_rank[self.rank] if per_rank and len(per_rank) == self.world else None
        elif "topk" in state:
            saved = state["topk"]
            if saved["rank"] == self.rank and saved["world"] == self.world:
                mine = saved["residuals"]
        else:
            return  # no residuals in it (broadcast_optimizer_state): this rank keeps its own
        total = sum(v.numel() for v in views)
        if mine is None or mine.numel() != total:
            log.warning("hybridcomm: the checkpoint holds no top-k residuals of rank %d for this "
                        "plan: its error feedback stays as it is (save every rank's "
                        "opt.state_dict() to resume top-k exactly)", self.rank)
            return
        at = 0
        with self._watched():
            for v in views:
                v.copy_(mine[at:at + v.numel()].view(v.shape))
                at += v.numel()

    # ---- inspection and teardown ---------------------------------------------------------
    def topk_views(self):
        """(param, residual view, velocity view or None) of every top-k bucket: the
        optimizer keeps them in its state so that state_dict saves them."""
        return [(p, *slot.bucket.topk_state(pos)) for slot in self.slots
                if slot.bucket.topk is not None for pos, p in enumerate(slot.bucket.params)]

    def momentum_free(self) -> set:
        """ids of parameters whose momentum was applied before sparsifying (DGC's
        momentum correction): the optimizer steps them with momentum 0."""
        if not self.momentum:
            return set()
        return {id(p) for s in self.slots if s.bucket.topk is not None for p in s.bucket.params}

    def close(self) -> None:
        """Finish what is pending, stop the channel, remove the hooks. Never raises a
        communication error: what cannot be finished is dropped with a warning."""
        if self.engine is None:
            return
        try:
            if self.channel.failure is None:
                self.apply_pending()
                for slot in self.slots:
                    if slot.phase is Phase.IN_FLIGHT:
                        self._settle(slot)
        except HybridCommError as e:
            log.warning("hybridcomm: close(): pending updates dropped: %s", e)
        finally:
            engine, self.engine = self.engine, None
            engine.close()
            for handles in self._hooks.values():
                for h in handles:
                    h.remove()
            self._hooks = {}
            for slot in self.slots:  # what could not be applied is dropped
                self._release(slot)
            if self._compiled_hook is not None:
                self._compiled_hook.remove()
            for p in self.params + [p for p, _ in self.registry.sparse]:
                if _owner(p) is self:
                    del _owners[id(p)]
