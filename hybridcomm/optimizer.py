"""DistributedOptimizer: the one-line change that turns on hybrid all-reduce.

A thin front over the gradient synchronizer (sync/synchronizer.py), which wires
the buckets, the hooks, forward mode's deferred updates, measurement,
re-planning and the engine. This module maps the optimizer API onto it
(``step``, ``synchronize``, ``zero_grad``, ``add_param_group``, GradScaler,
closures): docs/API.md has each verb's meaning, docs/ARCHITECTURE.md the path
under each.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Optional

import torch
from torch.amp.grad_scaler import OptState
from torch.distributed.algorithms.join import Join, Joinable

from . import broadcast
from .comm import control
from .comm import servers as ps
from .base.compile_boundary import eager_only
from .base.errors import HybridCommError
from .config.config import SyncConfig
from .plan.planner import forced_algorithm
from .sync import grad_fields
from .sync import shard as sharding
from .sync.pending import drop_grads
from .sync.registry import refuse_wrapped
from .sync.synchronizer import GradientSynchronizer

# Optimizers whose step needs every gradient at once (LBFGS: it re-evaluates a
# closure) or updates every parameter it holds (ZeroRedundancyOptimizer: its
# shard, then it broadcasts): stepped whole, never per bucket.
_WHOLE_MODEL_OPTIMIZERS = ("LBFGS", "ZeroRedundancyOptimizer")

# The verbs a compiled training step calls (``torch.compile(train_step)``): each runs
# eagerly where dynamo meets it (a graph break), never traced (compile_boundary.py).
_EAGER_VERBS = (
    "step",
    "zero_grad",
    "synchronize",
    "add_param_group",
    "state_dict",
    "load_state_dict",
    "close",
)
_EAGER_WHY = (
    "DistributedOptimizer.{}() runs eagerly, never inside a graph (it drives threads and "
    "the communication channel): compile the model, or the training step without "
    "fullgraph=True"
)


def _hyper_is_now(groups: list, hyper: list) -> bool:
    """Whether ``hyper`` (each group's hyper-parameters, as ``_hc_hyper`` took them at a
    ``step()``) is what ``groups`` hold now: the same keys, each value the same
    object or equal."""
    return all(
        len(h) == len(g) - 1 and all(k in g and (g[k] is v or g[k] == v) for k, v in h.items())
        for g, h in zip(groups, hyper)
    )


def evaluates_closure_once(base: type) -> bool:
    """Whether ``base.step(closure)`` is one of torch.optim's steps that evaluate
    the closure once, before anything else (every one but LBFGS's): then the
    closure can be evaluated before the step instead. A subclass that overrides
    ``step`` may do anything with it: no.

    >>> evaluates_closure_once(torch.optim.AdamW), evaluates_closure_once(torch.optim.LBFGS)
    (True, False)
    """
    step = getattr(base, "step", None)
    return (
        getattr(step, "__module__", "").startswith("torch.optim.")
        and getattr(step, "__qualname__", "").split(".")[0] not in _WHOLE_MODEL_OPTIMIZERS
    )


class _JoinableOptimizer:
    """torch's ``Joinable`` protocol, for uneven inputs (sync/join.py)."""

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """A context in which ranks that run out of data shadow the others until
        every rank has, as DDP's ``model.join()`` (the same options and defaults).

        A rank that leaves the loop contributes zeros to each round of the ranks
        still training; the average divides by the initial world size
        (``divide_by_initial_world_size=False``: by the ranks still training).
        ``throw_on_early_termination=True``: every rank raises torch's
        ``RuntimeError`` at the first step after a rank ran out, instead. At the
        end, every rank has the parameters, buffers and optimizer state of a rank
        that joined last. ``Join([opt])`` (torch.distributed.algorithms.join)
        works alike, with the optimizer first in the list.

        Example::

            >>> opt = hybridcomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
            ...                                       model=model)
            >>> with opt.join():
            ...     for x, y in loader:          # its length may differ between ranks
            ...         opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
            >>> opt.close()
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs):
        if type(self).__name__ == "ZeroRedundancyOptimizer":
            raise HybridCommError(
                "join: a ZeroRedundancyOptimizer inside a DistributedOptimizer "
                "communicates in its step, which a joined rank cannot shadow: "
                "wrap a plain optimizer to train with uneven inputs"
            )
        return self._hc_sync.joining.hook(
            self, self._hc_copy_state, kwargs.get("divide_by_initial_world_size", True)
        )

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")  # the notices go over gloo

    @property
    def join_process_group(self):
        return self._hc_sync.joining.group

    @property
    def _join_config(self):
        return self._hc_sync.joining.config

    @_join_config.setter
    def _join_config(self, config) -> None:
        self._hc_sync.joining.configure(config)

    def _hc_copy_state(self, root: int) -> None:
        """Every rank gets rank ``root``'s parameters, buffers and optimizer state."""
        sync = self._hc_sync
        broadcast.broadcast_parameters(
            self._hc_named_values(sync.model),
            root_rank=root,
            process_group=sync.process_group,
            timeout=sync.timeout,
        )
        broadcast.broadcast_optimizer_state(
            self, root_rank=root, process_group=sync.process_group, timeout=sync.timeout
        )


class _DistributedOptimizer(_JoinableOptimizer, sharding.ShardedOptimizer):
    """Mixin placed in front of the user's optimizer class; see DistributedOptimizer()."""

    # GradScaler then hands itself to step(), so the inf check sees reduced gradients.
    _step_supports_amp_scaling = True

    def _hc_init(
        self, model, agree: bool, named_parameters, servers, process_group, **options
    ) -> None:
        control.require_initialized("DistributedOptimizer")
        forced_algorithm(options["strategy"])  # every rank refuses a bad name alike
        refuse_wrapped(model)  # (every rank alike: no collective has started)
        if options["shard"]:
            options = sharding.settle_options(
                options,
                optimizer_class=type(self).__bases__[1],
                process_group=process_group,
                servers=servers,
                param_groups=self.param_groups,
            )
        overlap = options["overlap"]
        if overlap == "forward" and model is None:
            warnings.warn(
                "hybridcomm: overlap='forward' needs model= to hook its forward; "
                "using overlap='backward'",
                stacklevel=3,
            )
            overlap = "backward"
        if overlap == "forward" and type(self).__name__ in _WHOLE_MODEL_OPTIMIZERS:
            warnings.warn(
                f"hybridcomm: {type(self).__name__} steps all its parameters at once "
                "(forward mode steps one bucket at a time); using "
                "overlap='backward'",
                stacklevel=3,
            )
            overlap = "backward"
        config = SyncConfig.build(**dict(options, overlap=overlap))  # checks every value
        config = config.replace(correction_momentum=self._hc_correction_momentum(config.topk))
        servers, process_group, self._hc_own_servers = ps.resolve(
            servers, process_group, config.strategy, config.timeout
        )
        self._hc_skip = self._hc_synchronized = False
        self._hc_closure_first = evaluates_closure_once(type(self).__bases__[1])  # wrapped class
        self._hc_zero_grad_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"
        sync = None
        try:
            sync = self._hc_sync = GradientSynchronizer(
                self.param_groups,
                self._hc_update,
                config,
                model=model,
                named_parameters=named_parameters,
                process_group=process_group,
                servers=servers,
            )
            # after the synchronizer agreed on the parameters' names and shapes
            self._hc_agree_values(model, agree, process_group, config.timeout)
            self._hc_link_topk_state()  # (and this rank's shard)
        except BaseException:
            if sync is not None:
                sync.close()
            if self._hc_own_servers is not None:  # else the servers wait for us until timeout
                try:
                    self._hc_own_servers.close()
                except HybridCommError:
                    pass  # the construction's error is the one to raise
            raise

    def _hc_agree_values(self, model, broadcast_parameters: bool, group, timeout) -> None:
        """Every rank starts from rank 0's parameters and buffers (as DDP's
        constructor does), or, with ``broadcast_parameters=False``, from equal
        ones: a difference is refused on every rank, naming the first."""
        named = self._hc_named_values(model)
        if broadcast_parameters:
            broadcast.broadcast_parameters(named, root_rank=0, process_group=group, timeout=timeout)
        else:
            broadcast.check_parameters_agree(named, process_group=group, timeout=timeout)

    def _hc_named_values(self, model) -> list:
        """(name, tensor) of the model's parameters and buffers, else the optimizer's."""
        if model is not None:
            return list(model.named_parameters()) + list(model.named_buffers())
        return [
            (f"param_groups[{g}][{i}]", p)
            for g, group_ in enumerate(self.param_groups)
            for i, p in enumerate(group_["params"])
        ]

    # ---- what the synchronizer shows -----------------------------------------------------
    @property
    def plan(self):
        """The bucket plan: ``print(opt.plan)`` for the table (algorithm, window, order)."""
        return self._hc_sync.plan

    @property
    def last_step_stats(self):
        """Exposed, hidden and busy communication seconds and bytes sent, last step."""
        return self._hc_sync.last_step_stats

    @property
    def timeline(self):
        return self._hc_sync.timeline

    def export_trace(self, path: str) -> None:
        """Write the Chrome-trace timeline (needs ``trace=True``)."""
        self._hc_sync.timeline.write(path)

    # ---- the optimizer API ---------------------------------------------------------------
    def step(self, closure=None, grad_scaler=None):
        """All-reduce what backward produced and update (or defer, in forward mode).

        A ``closure`` that the wrapped optimizer evaluates once, first thing
        (torch.optim's but LBFGS), is evaluated first, and the step goes on as
        without one (forward mode still defers: Lightning always passes a
        closure); with any other optimizer, each backward pass the closure
        runs is reduced before the optimizer reads ``.grad``. With ``torch.amp.GradScaler``,
        ``scaler.step(opt)`` passes itself here: the inf check runs on the
        reduced gradients, identically on every rank, and the update is applied
        at once, as in backward mode.
        """
        loss = None
        if closure is not None and self._hc_closure_first:
            # Its forward and backward are this step's last pass, as in a loop
            # without a closure (and may call synchronize(), to clip).
            with torch.enable_grad():
                loss = closure()
            closure = None
        sync = self._hc_sync
        sync.begin_step()
        synchronized, self._hc_synchronized = self._hc_synchronized, False
        if closure is not None:
            sync.finish()
            loss = self._hc_base_step(sync.reduce_after(closure), grad_scaler)
        elif sync.defers and grad_scaler is None and not synchronized and not self._hc_skip:
            sync.defer(self._hc_hyper())
        else:
            if not self._hc_skip:
                sync.finish()  # after synchronize(): only what a backward added since
            base_loss = self._hc_base_step(None, grad_scaler)
            loss = base_loss if base_loss is not None else loss
        sync.end_step()
        if sync.plan is not self._hc_linked_plan:  # re-planned: new buckets, new views
            self._hc_link_topk_state()
        return loss

    def _hc_base_step(self, closure, grad_scaler):
        """The wrapped optimizer's step on the reduced ``.grad`` (this rank's shard of it)."""
        if grad_scaler is not None:
            self._hc_make_whole()  # (shard) the inf check reads every gradient
            state = grad_scaler._per_optimizer_states[id(self)]
            if state["stage"] is not OptState.UNSCALED:  # the user may have unscaled to clip
                grad_scaler.unscale_(self)
            # The gradients are reduced (identical on every rank), so is the verdict.
            if sum(v.item() for v in state["found_inf_per_device"].values()):
                return None
        if self._hc_shards is not None:
            return self._hc_shard_step(closure, super().step)
        free = self._hc_sync.momentum_free()
        if free:
            if closure is not None or grad_scaler is not None:
                raise HybridCommError(
                    "compression='topk' with momentum correction takes no "
                    "closure or GradScaler in step()"
                )
            hyper = self._hc_hyper()
            for momentum_free in (True, False):
                params = [
                    p
                    for g in self.param_groups
                    for p in g["params"]
                    if p.grad is not None and (id(p) in free) == momentum_free
                ]
                if params:
                    self._hc_update(params, [p.grad for p in params], hyper, momentum_free)
            return None
        return super().step(closure) if closure is not None else super().step()

    def _hc_hyper(self) -> list:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def _hc_update(self, params, grads, hyper, momentum_free=False, bound=False) -> None:
        """The wrapped optimizer's step for ``params`` alone, with gradients ``grads``
        and per-group hyper-parameters ``hyper`` (as at the step() that deferred it);
        ``momentum_free``: momentum 0 (DGC applied it); ``bound``: each .grad is grads'."""
        if momentum_free:
            hyper = [dict(h, momentum=0.0) for h in hyper]
        # What would change nothing is skipped (the usual deferred update: every
        # parameter, its .grad the reduced view, the hyper-parameters of now)
        swap_grads = not bound and not grad_fields.bound(params, grads)
        if swap_grads:
            saved_grads = [p.grad for p in params]
            for p, g in zip(params, grads):
                p.grad = g
        saved_groups = self.param_groups
        every_param = len(params) == sum(len(g["params"]) for g in saved_groups)
        if not (every_param and _hyper_is_now(saved_groups, hyper)):
            # a step of these parameters alone, with the hyper-parameters of then
            chosen = {id(p) for p in params}
            groups = [
                dict(h, params=[p for p in g["params"] if id(p) in chosen])
                for g, h in zip(saved_groups, hyper)
            ]
            self.param_groups = [g for g in groups if g["params"]]
        try:
            super().step()
        finally:
            self.param_groups = saved_groups
            if swap_grads:
                for p, g in zip(params, saved_grads):
                    p.grad = g

    def synchronize(self) -> None:
        """Finish all communication and every pending update; ``.grad`` then holds
        the reduced gradients (e.g. to clip them), and the next ``step()`` uses
        ``.grad`` as it is. Parameters are current afterwards. With ``shard`` on,
        the gradients are all-gathered too (``clip_grad_norm_`` needs no more than
        each rank's part)."""
        self._hc_sync.begin_step()
        self._hc_sync.finish()
        self._hc_make_whole()
        self._hc_synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside updates from ``.grad`` as it is (after ``synchronize()``)."""
        self._hc_skip = True
        try:
            yield
        finally:
            self._hc_skip = False

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, with no communication."""
        self._hc_sync.set_no_sync(True)
        try:
            yield
        finally:
            self._hc_sync.set_no_sync(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients no step used yet; forward mode's pending updates stay."""
        if not set_to_none:
            self._hc_sync.prepare_zero()  # (applies the pending updates first)
        if type(self).__bases__[1].zero_grad is not torch.optim.Optimizer.zero_grad:
            super().zero_grad(set_to_none=set_to_none)  # the user's own: it may read anything
        elif not set_to_none:  # (a pending parameter's class need not see these calls)
            with torch._C.DisableTorchFunctionSubclass():
                super().zero_grad(set_to_none=False)
        elif not self._hc_sync.zero_grads(self.param_groups):  # (forward mode: a pending
            # update's gradients go None once it took them); torch.optim's, in C
            with torch.autograd.profiler.record_function(self._hc_zero_grad_name):
                drop_grads(self.param_groups)

    def add_param_group(self, param_group) -> None:
        """Add a group; its parameters join the reduction (collective: every rank adds it)."""
        super().add_param_group(param_group)
        sync = getattr(self, "_hc_sync", None)
        if sync is not None and not sync.closed:
            sync.refresh()
            self._hc_link_topk_state()

    def state_dict(self):
        """The wrapped optimizer's state, every update step() accepted applied, and
        hybridcomm's own under ``"hybridcomm"`` (the agreed plan and the step
        count, plain types: ``torch.load(weights_only=True)`` reads it), so that a
        resumed run reduces exactly as the uninterrupted one would. No collective:
        rank 0 alone may save it. Top-k's error feedback is per rank: each rank's
        state holds its own.

        Example (Horovod's resume: rank 0 saves, rank 0 loads, every rank
        broadcasts)::

            if rank == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
            ...
            if rank == 0:
                ckpt = torch.load(path)
                model.load_state_dict(ckpt["model"]); opt.load_state_dict(ckpt["opt"])
            hybridcomm.broadcast_parameters(model.state_dict(), root_rank=0)
            hybridcomm.broadcast_optimizer_state(opt, root_rank=0)
        """
        self._hc_sync.apply_pending()  # the state must include every update step() accepted
        if self._hc_shards is None:
            state = super().state_dict()
        elif sharding.dcp.asked_by_dcp():  # (torch.distributed.checkpoint: each rank its part)
            return self._hc_dcp_state_dict(super().state_dict)
        else:
            state = self._hc_sharded_state_dict(super().state_dict)
        state["hybridcomm"] = self._hc_sync.state_dict()
        return state

    def load_state_dict(self, state_dict) -> None:
        """Load a state from :meth:`state_dict`. No collective: every rank may load the
        same checkpoint, or rank 0 alone, followed by ``broadcast_optimizer_state``
        on every rank (Horovod's resume); a plan for another world size or other
        parameters is not adopted (the current one stays)."""
        state_dict = dict(state_dict)
        ours = state_dict.pop("hybridcomm", None)
        groups = [dict(g) for g in state_dict.get("param_groups", [])]
        in_group = [sharding.from_group(g.pop(sharding.DCP_GROUP_KEY, None)) for g in groups]
        dcp_form = any(in_group)  # (a DCP state: hybridcomm's part rides in the first group)
        if dcp_form:
            ours = {k: v for k, v in next(filter(None, in_group)).items() if k != "form"}
        state_dict["param_groups"] = groups
        self._hc_sync.drop()  # superseded by the loaded state
        if self._hc_shards is not None:  # (their views would keep the buffers a new plan frees)
            self._hc_shards.drop_grads()
        if dcp_form and self._hc_shards is not None:
            self._hc_load_dcp_state_dict(state_dict)
        else:
            super().load_state_dict(state_dict)
            if self._hc_shards is not None:
                self._hc_unshard_loaded()
        if ours is not None:  # each rank's own residuals come from hybridcomm's part
            for st in self.state.values():
                st.pop("hc_topk_residual", None)
                st.pop("hc_topk_velocity", None)
        self._hc_sync.load_state_dict(ours)
        self._hc_link_topk_state()  # the optimizer's state points at the buckets' views

    def close(self) -> None:
        """Finish pending work, stop the channel and remove the hooks.

        Cleanup never raises a communication error: if pending updates cannot be
        finished (a peer failed), they are dropped with a warning and everything
        is released anyway. Call ``synchronize()`` first to have such a failure
        raised. Summation servers the optimizer made from a ``Role`` are told
        this worker is done (those given as ``SummationServers`` are the caller's)."""
        try:
            self._hc_sync.close()
        finally:
            if self._hc_own_servers is not None:
                self._hc_own_servers.close()

    # ---- top-k compression: residuals in the optimizer state -----------------------------
    def _hc_correction_momentum(self, topk) -> float:
        """DGC's momentum correction applies to SGD with (plain) momentum: the momentum
        of its groups, which must agree; 0 (error feedback alone) otherwise."""
        if not topk or type(self).__name__ != "SGD":
            return 0.0
        found = {
            (g.get("momentum", 0.0), bool(g.get("nesterov", False))) for g in self.param_groups
        }
        if len(found) != 1:
            raise ValueError(
                "compression='topk:...' with SGD needs one momentum for all "
                f"parameter groups, got {sorted(found)}"
            )
        momentum, nesterov = found.pop()
        return 0.0 if nesterov else float(momentum)

    def _hc_link_topk_state(self) -> None:
        """Each parameter's residual (and velocity) is a view of its bucket's, kept in
        ``self.state[p]`` so that ``state_dict`` saves it; values found there (a
        re-plan, a loaded checkpoint) are copied in first. With ``shard``: this
        rank's slices of the new buckets."""
        self._hc_linked_plan = self._hc_sync.plan
        if self._hc_sync.config.shard:
            self._hc_reshard()
        for p, residual, velocity in self._hc_sync.topk_views():
            state = self.state[p]
            for key, view in (("hc_topk_residual", residual), ("hc_topk_velocity", velocity)):
                if view is None:
                    continue
                old = state.get(key)
                if old is not None and old.data_ptr() != view.data_ptr():
                    view.copy_(old)
                state[key] = view


Joinable.register(_DistributedOptimizer)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    model: Optional[torch.nn.Module] = None,
    named_parameters=None,
    strategy: str = "hybrid",
    overlap: str = "forward",
    op: str = "avg",
    backward_passes_per_step: Optional[int] = None,
    compression=None,
    cost_model=None,
    process_group=None,
    timeout: Optional[float] = None,
    fusion_bytes: Optional[int] = None,
    split_bytes: Optional[int] = None,
    measure_iters: int = 3,
    replan_every: int = 200,
    trace: bool = False,
    lazy_bytes: Optional[int] = None,
    find_unused_parameters: bool = False,
    servers=None,
    broadcast_parameters: bool = True,
    shard: Optional[str] = None,
    shard_by: Optional[str] = None,
):
    """Wrap ``optimizer`` so each step's gradients are all-reduced across ranks.

    Any training loop that runs in one process runs unchanged: several backward
    passes per step (accumulation, GANs, multi-loss), backward through a model
    whose gradients are then zeroed, ``step(closure)``, clipping after
    ``synchronize()``, GradScaler, activation checkpointing, parameter groups
    added or layers unfrozen mid-training, several wrapped optimizers.

    Args:
        optimizer: any torch optimizer; the wrapper is an instance of its class
            and shares its state.
        model: the module being trained (needed for ``overlap="forward"`` and
            for per-layer buckets; without it each parameter is a layer).
        named_parameters: names for the parameters (default: ``model``'s).
        strategy: ``"hybrid"`` (butterfly or ring per bucket, from the cost
            model and the bucket's window), ``"auto"`` (the same among all
            algorithms) or one algorithm for every bucket (``"native"``: the
            process group's own); ``HYBRIDCOMM_ALGO`` overrides all.
        overlap: ``"forward"`` (each bucket's update waits for the first use of
            its parameters in the next forward: communication overlaps the
            backward and the next forward), ``"backward"`` (it overlaps the
            backward; ``step()`` waits) or ``"none"`` (all in ``step()``).
        op: ``"avg"`` (gradients averaged: same numbers as one process on the
            whole batch) or ``"sum"``.
        backward_passes_per_step: the backward pass of each step in which the
            buckets are launched (earlier passes accumulate locally). Default
            None: learned from the measured steps (the most passes a step had),
            1 until then. A pass after it is still reduced, at a cost: the
            buckets are sent again.
        compression: ``None``, ``"fp16"`` or ``"bf16"`` (the wire dtype),
            ``"topk:RATIO"``: send each bucket's largest RATIO of entries, with
            error feedback and DGC's momentum correction (compression.py), or
            ``"powersgd:RANK[:START]"``: PowerSGD's rank-RANK factors with error
            feedback, after START exact steps (powersgd.py); with ``"+fp16"`` or
            ``"+bf16"`` (``"powersgd:4:10+fp16"``) what it sends whole (the
            exact steps, buckets it leaves uncompressed) goes in that dtype.
        cost_model: a ``CostModel``; None (default): rank 0's saved calibration
            (``hybridcomm-bench --calibrate``), else a quick probe; ``"probe"``:
            always probe; ``"default"``: built-in constants.
        process_group: torch.distributed group (default: the world).
        timeout: seconds any blocking call waits for a peer (default
            ``HYBRIDCOMM_TIMEOUT``, 300): agreement, re-plans, waits, close.
        fusion_bytes / split_bytes: bucket fusion and split thresholds
            (default: from the cost model, see planner.py).
        lazy_bytes: lazy all-reduce: gradients collect in pools all-reduced once
            past this many bytes, whatever the layer boundaries (pays with many
            tiny layers; the plan's notes give the predicted gain).
        measure_iters: steps measured (passes per step, gradient order, windows,
            first uses, each call's cost) before the plan is re-made (0: never);
            with PowerSGD, the steps after its exact ones.
        replan_every: measure again every this many steps and re-plan if the
            measurements change a decision (drift); 0: only once.
        trace: record a timeline; ``opt.export_trace("trace.json")``.
        find_unused_parameters: on GPUs, a rank that lacks a parameter's
            gradient learns whether another rank had one from the reduced
            flags: a host sync (warned about once). ``True`` agrees on it on
            the host instead (a small gloo collective per bucket and step,
            posted as the bucket is issued), so no step syncs the host. As in
            DDP, off by default. Parameters no rank used are left alone either
            way (``.grad`` None, as one process leaves them).
        servers: the job's summation servers (comm/servers.py, host path only):
            a ``Role`` from ``hybridcomm.comm.servers.split_world`` (the optimizer
            makes the ``SummationServers``, closed in ``close()``) or those
            servers. ``ps`` then competes per bucket (where the cost model has a
            line for that many servers; a probe adds one) and ``strategy="ps"``
            forces it; the reduction runs over the workers' group. A server rank
            runs ``hybridcomm.comm.servers.serve(role)`` instead of training.
        broadcast_parameters: ``True`` (default): the model's parameters and
            buffers (without ``model``, the optimizer's parameters) are copied
            from rank 0 of the group to every rank, as DDP's constructor does,
            so ranks that were seeded apart train together. ``False``: they
            must already be equal (a digest per tensor is compared; a
            difference raises ``HybridCommError`` on every rank naming it).
        shard: ``None`` (default): every rank keeps the whole optimizer state.
            ``"optimizer"`` (ZeRO-1): each bucket is reduce-scattered in
            backward, each rank steps and keeps the state of its 1/P of every
            bucket, and the parameters are all-gathered: in ``step()``, or in
            forward mode before the first read of one of the bucket's
            parameters (sync/shard.py). ``"gradients"`` (ZeRO-2): also the
            buckets' gradient memory is freed from ``step()`` to the next
            backward. ``.grad`` is released by ``step()``; clip with
            ``opt.clip_grad_norm_``; ``state_dict()`` is the plain optimizer's
            (a collective; ``torch.distributed.checkpoint`` gets each rank's part
            alone). docs/API.md lists what is not combined with it yet.
        shard_by: how ``shard`` cuts the state. ``None`` (default): ``"elements"``
            (each rank a 1/P slice of every bucket, stepped as a tensor) for
            torch's element-wise optimizers (SGD, Adam, AdamW, Adamax, NAdam,
            RAdam, Adagrad, Adadelta, RMSprop, Rprop, ASGD), ``"parameters"``
            (each parameter's state and step on one rank, balanced by size) for
            every other (Adafactor, Muon, a LARS, any optimizer of your own).
            Pass ``"elements"`` to declare your own optimizer element-wise;
            ``print(opt.plan)`` says which was chosen and why.

    Raises:
        HybridCommError: on every rank, naming the parameters, if the ranks'
            parameters differ or one cannot be reduced (complex, sparse
            gradients on a GPU, unsupported dtype, several devices), or if a
            parameter is already reduced by another DistributedOptimizer.

    ``print(opt.plan)`` shows every bucket's algorithm, window, the issue order
    and the backward pass buckets are launched in; the plan is logged at INFO
    (``HYBRIDCOMM_LOG_LEVEL``). Gradients are reduced in place in ``.grad``:
    between ``backward()`` and ``step()`` read or change them only after
    ``synchronize()``.

    Example::

        >>> opt = hybridcomm.DistributedOptimizer(
        ...     torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model)
        >>> for x, y in loader:
        ...     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

    With summation servers (W workers + K servers, e.g. ``torchrun
    --nproc-per-node W+K``; host path)::

        role = hybridcomm.comm.servers.split_world(num_servers=K)    # every rank
        if role.is_server:
            hybridcomm.comm.servers.serve(role)                      # until the workers close
        else:
            opt = hybridcomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                  model=model, servers=role)
            ...                                            # train; print(opt.plan) shows ps
            opt.close()                                    # tells the servers
    """
    if isinstance(optimizer, _DistributedOptimizer):
        raise HybridCommError("this optimizer is already a DistributedOptimizer")
    base = type(optimizer)
    # (made here, not in the class body: the wrapped optimizer has imported dynamo by now)
    verbs = {
        name: eager_only(getattr(_DistributedOptimizer, name), why=_EAGER_WHY.format(name))
        for name in _EAGER_VERBS
    }
    cls = type(
        base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__, **verbs}
    )
    opt = cls.__new__(cls)
    # Share the wrapped optimizer's state, but not a `step` an LR scheduler may
    # have patched onto the instance: it would call the unwrapped step.
    opt.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    opt._hc_init(
        model,
        agree=broadcast_parameters,
        named_parameters=named_parameters,
        servers=servers,
        process_group=process_group,
        overlap=overlap,
        backward_passes_per_step=backward_passes_per_step,
        compression=compression,
        strategy=strategy,
        op=op,
        cost_model=cost_model,
        timeout=timeout,
        fusion_bytes=fusion_bytes,
        split_bytes=split_bytes,
        lazy_bytes=lazy_bytes,
        measure_iters=measure_iters,
        replan_every=replan_every,
        trace=trace,
        find_unused_parameters=find_unused_parameters,
        shard=shard,
        shard_by=shard_by,
    )
    return opt
