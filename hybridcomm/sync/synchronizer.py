"""The gradient synchronizer: the wiring of its parts and the verbs the fronts call.

The hooks (grad_hooks.py) put each gradient into its bucket's view and launch
a full bucket; the bucket group (bucket_group.py) holds the phases; the engine
(comm/engine.py) issues buckets in the plan's order. ``finish()`` launches what
is left and waits (``.grad`` holds the reduced gradients); ``defer()`` (forward
mode) launches what is left and returns, each update applied at its
parameters' first read (deferred.py, pending.py). The step's structure is
learned, never assumed (passes.py). docs/ARCHITECTURE.md draws the path whole.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..base.errors import HybridCommError
from ..base.timeline import Timeline
from ..comm import calibration
from ..comm.channel import open_channel
from ..comm.sparse import reduce_sparse_grads
from ..config.config import SyncConfig
from ..gpu.clock import clock_for
from ..gpu.runtime import runtime_for
from ..plan.planner import Plan
from . import checkpoint, ownership
from .bucket_group import BucketGroup, BucketState, Links, Phase, StepState
from .compiled import CompiledReads
from .deferred import DeferredUpdates, Update
from .grad_hooks import GradientHooks
from .join import STEP_END, JoinState
from .measure import StepMeasurements, op_samples
from .memory import bucket_allocator
from .passes import LATE, LAUNCH, PassTracker
from .pending import ApplyBeforeCompiledForward
from .planning import Planning
from .registry import ParamRegistry
from .stall import StallInspector
from .used import UsedAgreement

log = logging.getLogger("hybridcomm")
_NO_CONTEXT = contextlib.nullcontext()

__all__ = ["GradientSynchronizer", "Phase", "SyncConfig", "Update"]


class GradientSynchronizer:
    """All-reduces the gradients of an optimizer's parameters, bucket by bucket.

    The fronts (``DistributedOptimizer``, strategies) drive it with a few verbs:
    ``begin_step`` / ``finish`` / ``defer`` / ``end_step``, ``prepare_zero``,
    ``reduce_after(closure)``, ``refresh``, ``apply_pending``, ``drop``,
    ``state_dict`` / ``load_state_dict``, ``close``.

    Args:
        param_groups: the optimizer's ``param_groups`` (its trainable
            parameters are reduced; read again by ``refresh``).
        update: ``update(params, grads, hyper, momentum_free)`` applies the
            optimizer to ``params`` with gradients ``grads`` and per-group
            hyper-parameters ``hyper`` (forward mode's deferred updates).
        config: a :class:`~hybridcomm.config.config.SyncConfig`; or leave it out
            and give its fields as keywords (``options``, with ``compression``
            as ``DistributedOptimizer`` takes it).
        model, named_parameters, process_group, servers: as ``DistributedOptimizer``
            documents them (``servers``: a :class:`~hybridcomm.comm.servers.SummationServers`).

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> sync = GradientSynchronizer(opt.param_groups, update=None, model=model,
        ...                             overlap="backward", cost_model="default", timeout=60)
        >>> x, y = loader[0]; loss_fn(model(x), y).backward()
        >>> sync.begin_step(); sync.finish(); sync.end_step()   # p.grad: averaged over ranks
        >>> sync.close()
    """

    def __init__(
        self,
        param_groups,
        update: Optional[Update],
        config: Optional[SyncConfig] = None,
        *,
        model=None,
        named_parameters=None,
        process_group=None,
        servers=None,
        **options,
    ):
        self.config = cfg = config if config is not None else SyncConfig.build(**options)
        self._param_groups, self.model, self._named = param_groups, model, named_parameters
        self.overlap, self.strategy, self.timeout = cfg.overlap, cfg.strategy, cfg.timeout
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self.state = StepState()
        # PowerSGD's exact steps are not what the plan will carry: measured after them
        self.measure = StepMeasurements(
            cfg.measure_iters, cfg.replan_every, after=cfg.low_rank[1] if cfg.low_rank else 0
        )
        self.timeline = Timeline(enabled=bool(cfg.trace))
        self.last_step_stats: Dict[str, float] = {}
        self._step_t0 = time.perf_counter()
        self._round0 = 0  # the engine's rounds of the issue order when this step began

        self.registry = self._take_params()
        self.rt = runtime_for(self.registry.device)
        self.servers = servers
        if servers is not None and self.rt is not None:  # servers.py moves host tensors
            raise HybridCommError(
                "servers= (the summation servers, algorithm 'ps') run on the "
                "host path only (gloo, CPU tensors); these parameters are on "
                f"{self.registry.device}: leave servers out on the GPU path"
            )
        self.clock = clock_for(self.rt)  # the planner's inputs: the GPU's clock there
        self.transport, self.channel = open_channel(
            self.registry.device,
            process_group,
            cfg.timeout,
            self.timeline,
            issue_thread=cfg.issue_thread,
        )
        cost_model = calibration.resolve(cfg.cost_model, process_group, cfg.timeout, servers)
        self.stall = StallInspector(process_group, cfg.timeout)
        self._links = self._make_links(servers)
        self.planning = Planning(
            cfg,
            cost_model,
            world=self.world,
            rank=self.rank,
            group=process_group,
            servers=len(servers.role.servers) if servers else 0,
        )
        self.passes = PassTracker(cfg.overlap, self._pass_ended, self.timeline)
        self.after_launch: Optional[Callable[[], None]] = None  # shard="gradients" (shard.py)
        self.hooks = GradientHooks(self)
        self._links.guard = self.hooks.guard
        self.joining = JoinState(self)
        self.group: Optional[BucketGroup] = None
        self.deferred = DeferredUpdates(
            lambda: self.group,
            update,
            measure=self.measure,
            state=self.state,
            clock=self.clock,
            timeline=self.timeline,
            rt=self.rt,
            momentum=cfg.correction_momentum,
        )
        # The only hook on the model (a plain object: it deep-copies and pickles), and
        # entries on its compiled blocks (compiled.py)
        forward = model is not None and cfg.overlap == "forward"
        whole = ApplyBeforeCompiledForward() if forward else None
        self._compiled_hook = model.register_forward_pre_hook(whole) if forward else None
        self.compiled = CompiledReads(model if forward else None, whole)
        self.compiled.scan()
        self._build(self.planning.agree(self.registry.layers))
        self.planning.log(self.plan, "initial plan")

    # ---- parameters, plan, buckets ------------------------------------------------------
    @property
    def params(self) -> List[torch.nn.Parameter]:
        return self.registry.params

    @property
    def plan(self) -> Plan:
        return self.group.plan

    @property
    def cost_model(self):
        """The cost model the plans are made from (rank 0's is everyone's)."""
        return self.planning.cost_model

    @property
    def closed(self) -> bool:
        return self.group is None or self.group.engine is None

    def set_no_sync(self, active: bool) -> None:
        """``opt.no_sync()``: backward passes accumulate locally while ``active``."""
        self.passes.no_sync = active

    def _all_params(self) -> list:
        return self.registry.params + [p for p, _ in self.registry.sparse]

    def _take_params(self) -> ParamRegistry:
        """The registry of the optimizer's trainable parameters, claimed for this
        synchronizer (a parameter another one reduces is refused)."""
        groups = self._param_groups
        device = next((p.device for g in groups for p in g["params"]), torch.device("cpu"))
        reg = ParamRegistry(
            groups,
            self.model,
            self._named,
            wire_dtype=self.config.wire_dtype,
            group=self.process_group,
            timeout=self.config.timeout,
            device_path=runtime_for(device) is not None,
        )
        ownership.claim(
            reg.params + [p for p, _ in reg.sparse],
            self,
            list(reg.names) + [name for _, name in reg.sparse],
        )
        return reg

    def _make_links(self, servers) -> Links:
        """What the bucket groups talk to."""
        cfg, rt = self.config, self.rt
        # Device path: which parameters some rank has a gradient for is agreed on the
        # host (gloo, posted at issue), not read back from the reduced flags (a host
        # sync). Costs a small host collective per bucket and step, hence opt-in.
        # (under shard each rank reads its own copy of the flags: plan/layout.py)
        used = UsedAgreement(
            cfg.find_unused_parameters and rt is not None,
            self.rank,
            self.process_group,
            cfg.timeout,
        )
        return Links(
            channel=self.channel,
            transport=self.transport,
            used=used,
            clock=self.clock,
            alloc=bucket_allocator(
                rt, self.registry.device, self.transport.stream if rt is not None else None
            ),
            timeline=self.timeline,
            rank=self.rank,
            world=self.world,
            scale=1.0 / self.world if cfg.op == "avg" else None,
            servers=servers,
            on_device=rt is not None,
            on_slow=self._stalled if self.stall.enabled else None,
            slow_after=self.stall.warn_s,
        )

    def _build(self, plan: Plan) -> None:
        """Buckets for ``plan``, taking over the current ones' gradients."""
        if self.group is not None:
            self.group.release_unheld()
        old, self.group = (
            self.group,
            BucketGroup(
                plan,
                self.params,
                names=self.registry.names,
                links=self._links,
                config=self.config,
                state=self.state,
                measuring_next=lambda: self.measure.measuring(self.state.steps + 1),
                carry=self.group,
            ),
        )
        if old is not None:
            old.retire()
        self.group.engine.round_end_waits = not self.defers  # (step() waits for the round)
        self.hooks.attach(self.params)
        self.compiled.review(self.group, again=True)
        self._note_compiled()

    def _note_compiled(self) -> None:
        """The plan's notes on forward mode under torch.compile (compiled.py)."""
        for note in (self.compiled.entry_note(), self.compiled.note):
            if note is not None and note not in self.plan.notes:
                self.plan.notes.append(note)

    def watched(self):
        """The device runtime's view of host torch calls in autograd hooks (the GPU
        simulator must see them; torch gives hooks no torch-function modes)."""
        return self.rt.watched() if self.rt is not None else _NO_CONTEXT

    def measuring(self) -> bool:
        return self.measure.measuring(self.state.steps)

    # ---- opening and launching (with the hooks) ---------------------------------------------
    def open(self, s: BucketState) -> bool:
        """Bucket ``s`` writable for backward (False: its launch is still to be issued)."""
        return self.group.open(s, self.deferred.apply)

    def _pass_ended(self, kind: str) -> None:
        """The launching pass launches every bucket not launched yet in this step; a
        late pass launches them all again (every rank counts the same passes)."""
        with self.watched():
            if kind == LAUNCH:
                self.group.launch_rest(self.open, self.passes.id)
                if self.after_launch is not None:  # host path (the reduced: their part)
                    self.after_launch()
            elif kind == LATE:
                self.group.launch_round(self.open, self.passes.id)

    def _stalled(self, index: int) -> Optional[str]:
        return self.stall.bucket_is_slow(self.plan, index, self.state.launches, self.state.steps)

    # ---- the verbs of the fronts -------------------------------------------------------
    @property
    def defers(self) -> bool:
        """Whether step() defers the updates to the first reads in the next forward
        (forward mode, unless the plan found that nothing is left to overlap; under
        ``shard`` the step is not deferred, the parameters' all-gather is: shard.py)."""
        return (
            self.overlap == "forward"
            and not self.config.shard
            and (self.plan.defer_updates or self.config.defer_always)
            and not self.compiled.whole  # (compiled.py: the updates are applied in step())
        )

    def begin_step(self) -> None:
        """A step begins: a pass whose end autograd never reported (it ran only in
        nested backwards) ends now; parameters that joined are taken in."""
        self._step_t0 = time.perf_counter()
        self.passes.end()
        if self.compiled.review(self.group):  # forward mode: what compiled code read since
            self.group.engine.round_end_waits = not self.defers
            self._note_compiled()
        if self.measuring() and self.passes.any:
            self.measure.running_at_step(self.group.running())
        if self.registry.trainable_changed():
            self.refresh()

    def _flush(self, waited: bool = True) -> None:
        """Launch every bucket this step has not (all again if a gradient came after a
        launch; nothing if none came); ``waited``: the caller waits for them next."""
        if not self.hooks.gradients_came():
            return
        with self.watched(), self.group.engine.waited_at_once(waited):
            self.group.launch_rest(self.open, self.passes.id)
            if self.group.needs_round():
                self.group.launch_round(self.open, self.passes.id)

    def finish(self) -> None:
        """Every gradient of this step reduced, in ``.grad`` (backward and none modes,
        synchronize(), a closure's backward). Deferred updates are applied first."""
        self.apply_pending()
        self._flush()
        with self.watched():
            self.group.finish()
        self._reduce_sparse()

    def defer(self, hyper: list) -> None:
        """Forward mode's step: launch what is left; each bucket's update waits for the
        first read of one of its parameters (``hyper``: the groups' hyper-parameters
        now). An update still pending from the last step is applied first: this step
        may update the same parameters again (a step() on the same gradients)."""
        self.apply_pending()
        self._flush(waited=False)  # (the updates wait for them in the next forward)
        self._reduce_sparse()
        sparse = [p for p, _ in self.registry.sparse if p.grad is not None]
        if sparse and self.deferred.update is not None:  # not deferred: no first read to wait for
            self.deferred.update(sparse, [p.grad for p in sparse], hyper, False)
        self.deferred.defer(hyper)
        self.apply_read_in_compiled_code()

    def apply_read_in_compiled_code(self) -> None:
        """Forward mode: the buckets whose parameters compiled code reads with no eager
        point before the reads are updated now (compiled.py); the others wait for
        their first reads."""
        for s in self.compiled.in_step_states:
            if s.phase is Phase.PENDING:
                self.deferred.apply(s)

    def apply_pending(self) -> None:
        """Apply every deferred update now (forward mode)."""
        self.deferred.apply_pending()

    def end_step(self) -> None:
        """A step ended: statistics, measurements, re-plan."""
        if self._links.joining is not None:  # the joined ranks end it too (join.py)
            self._links.joining.notify(STEP_END)
        t0, state, engine = self._step_t0, self.state, self.group.engine
        busy = self.channel.take_busy()
        ops = self.channel.take_ops()  # after take_busy: on a GPU it reads their events
        state.exposed_s += self.channel.take_exposed()  # GPU: stream waits, on its clock
        sent, engine.bytes_sent = engine.bytes_sent, 0
        self.last_step_stats = {
            "exposed_comm_s": state.exposed_s,
            "comm_busy_s": busy,
            "hidden_comm_s": max(0.0, busy - state.exposed_s),
            "step_call_s": time.perf_counter() - t0,
            "bytes_sent": sent,
        }
        log.debug(
            "hybridcomm step %d: comm %.2f ms, exposed %.2f ms, %d bytes sent, %d backward passes",
            state.steps,
            busy * 1e3,
            state.exposed_s * 1e3,
            sent,
            self.passes.counted,
        )
        self.timeline.add("step", "compute", t0, time.perf_counter())
        if self.passes.any:
            self.measure.passes(self.passes.counted)
        if self.measuring():
            self.measure.ops(op_samples(self.plan, ops))
        if self.measuring() and engine.round - self._round0 == 1:
            self.measure.comm(
                busy,
                sum(b.predicted_s for b in self.plan.buckets if b.predicted_s == b.predicted_s),
            )
        state.exposed_s = 0.0
        self.hooks.review(self.measure.measuring(state.steps + 1))  # (a re-plan undoes it)
        self.passes.reset()
        state.steps += 1
        self.stall.publish(state.launches, state.steps)
        state.epoch += 1
        if self.measure.replan_due(state.steps):
            self._replan()
        self._round0 = self.group.engine.round

    def reduce_after(self, closure: Callable):
        """``closure`` wrapped so that the backward passes it runs are reduced before it
        returns (``step(closure)``: the optimizer reads ``.grad`` right after)."""

        def reduced(*args, **kwargs):
            self.finish()  # what came before this call is reduced (and in .grad) already
            self.state.epoch += 1
            self.passes.closure_depth += 1
            try:
                loss = closure(*args, **kwargs)
            finally:
                self.passes.closure_depth -= 1
            self.passes.end()
            self.finish()
            return loss

        return reduced

    def zero_grads(self, param_groups) -> bool:
        """``zero_grad()`` (``set_to_none=True``, torch's own) of ``param_groups`` where
        forward mode's updates are pending (deferred.py); False, nothing done, where
        none is."""
        return self.deferred.zero_grads(param_groups)

    def prepare_zero(self) -> None:
        """Before ``zero_grad(set_to_none=False)``: updates applied, reductions waited for."""
        self.apply_pending()
        with self.watched():
            self.group.zero_in_place()

    def drop(self) -> None:
        """A loaded checkpoint supersedes whatever is in flight or deferred."""
        self._flush()
        self.group.drop(self.deferred.release_dropped)

    def _reduce_sparse(self) -> None:
        """Sparse gradients, after this step's dense buckets (comm/sparse.py)."""
        reduce_sparse_grads(
            self.registry.sparse,
            self.channel,
            self.transport.group,
            average=self.config.op == "avg",
            timeout=self.timeout,
        )

    # ---- re-planning ---------------------------------------------------------------------
    def _settle_all(self) -> None:
        """Nothing in flight or deferred: the buckets are about to change."""
        self.apply_pending()
        self._flush()
        with self.watched():
            self.group.quiesce()

    def rebuild(self, plan: Plan, title: str, changed: bool = True) -> None:
        """Settle everything in flight or deferred, then follow ``plan`` (logged)."""
        self._settle_all()
        self._build(plan)
        self.planning.log(plan, title, changed)

    def _replan(self) -> None:
        """Re-plan from rank 0's measurements: always the first time, later only if
        they change a decision."""
        measured = self.measure.take(self.registry.layers, self.clock)
        first = self.measure.first_replan(self.state.steps)
        if first:
            self.planning.say_verdict(self.plan, measured, self.last_step_stats)
        plan = self.planning.agree(
            self.registry.layers, measured, keep=None if first else self.plan
        )
        if plan is None:
            return
        changed = plan.decisions() != self.plan.decisions()
        title = f"re-planned after {self.state.steps} steps"
        self.rebuild(
            plan,
            title if changed else f"{title} (the same decisions, with the measured windows)",
            changed,
        )

    def refresh(self) -> None:
        """The optimizer's trainable parameters changed (a group added, requires_grad
        flipped): take the new set (collective), re-plan and rebuild. At a step, every
        bucket is then launched again (a whole round), with what joined."""
        self._settle_all()
        old = {id(p) for p in self.params}
        ownership.release(self._all_params(), self)
        self.registry = self._take_params()
        joined = sum(1 for p in self.params if id(p) not in old)
        self._build(self.planning.agree(self.registry.layers))
        self.planning.log(self.plan, f"re-planned: the trainable set changed ({joined} joined)")

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The agreed plan, the step count and this rank's top-k error feedback
        (checkpoint.py). No collective: one rank alone may call it."""
        return checkpoint.save(self)

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Adopt a checkpoint's plan and step count (checkpoint.py; no collective).
        ``None`` (a state without hybridcomm's part) changes nothing."""
        checkpoint.load(self, state)

    # ---- inspection and teardown ---------------------------------------------------------
    def topk_views(self):
        """(param, residual view, velocity view or None) of every top-k bucket: the
        optimizer keeps them in its state so that state_dict saves them."""
        return self.group.topk_views()

    def momentum_free(self) -> set:
        """ids of parameters whose momentum was applied before sparsifying (DGC's
        momentum correction): the optimizer steps them with momentum 0."""
        return self.group.topk_param_ids() if self.config.correction_momentum else set()

    def close(self) -> None:
        """Finish what is pending, stop the channel, remove the hooks. Never raises a
        communication error: what cannot be finished is dropped with a warning."""
        if self.closed:
            return
        try:
            if self.channel.failure is None:
                self.apply_pending()
                for s in self.group.states:
                    if s.phase is Phase.IN_FLIGHT:
                        self.group.settle(s)
        except HybridCommError as e:
            log.warning("hybridcomm: close(): pending updates dropped: %s", e)
        finally:
            self.group.close()
            self.hooks.detach()
            self.stall.close()
            self.deferred.close()  # (what could not be applied is dropped)
            if self._compiled_hook is not None:
                self._compiled_hook.remove()
            self.compiled.close()
            ownership.release(self._all_params(), self)
