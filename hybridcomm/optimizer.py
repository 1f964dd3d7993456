"""DistributedOptimizer: the one-line change that turns on hybrid all-reduce.

It subclasses the wrapped optimizer's class on the fly (``isinstance`` and LR
schedulers keep working) and shares its state. Gradients are packed into
per-layer buckets as backward produces them and all-reduced on comm threads,
one lane for small latency-bound buckets and one for the bulk, with the
algorithm per bucket from the cost model (see planner.py).

Overlap modes:

- ``"backward"``: ``step()`` waits for every bucket, writes the reduced
  gradients into ``p.grad`` and updates (as DDP does).
- ``"forward"`` (the thesis's layer overlapping): ``step()`` returns at
  once; each layer's update is applied in a forward pre-hook of the next
  iteration, after waiting for that layer's buckets only. The reduced
  gradient waits in the library's buffer, so the usual
  ``zero_grad(); loss = model(x); loss.backward(); opt.step()`` loop is
  unchanged. The hyper-parameters (lr, ...) are those at ``step()``.
- ``"none"``: nothing overlaps; all buckets are reduced in ``step()``.
"""
from __future__ import annotations

import logging
import time
import warnings
from contextlib import contextmanager
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .collectives import default_timeout
from .errors import HybridCommError
from .overlap import BucketState, CommEngine
from . import cost_model as cm
from .planner import LANES, Layer, Plan, make_plan
from .timeline import Timeline

log = logging.getLogger("hybridcomm")

OVERLAPS = ("forward", "backward", "none")
COMPRESSIONS = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16,
                torch.float16: torch.float16, torch.bfloat16: torch.bfloat16}
# Optimizers whose step needs every gradient at once (or re-evaluates a closure).
_WHOLE_MODEL_OPTIMIZERS = ("LBFGS",)


def _decisions(plan: Plan):
    return [(b.layers, b.algorithm, b.segments) for b in plan.buckets]


def _describe_difference(ours, theirs, rank) -> str:
    """What differs between rank 0's and ``rank``'s (name, shape, dtype) lists."""
    only0 = [n for n, *_ in ours if n not in {t[0] for t in theirs}]
    only_r = [n for n, *_ in theirs if n not in {t[0] for t in ours}]
    parts = [f"only rank 0 has {only0}"] if only0 else []
    parts += [f"only rank {rank} has {only_r}"] if only_r else []
    parts += [f"{a[0]}: rank 0 has {a[1:]}, rank {rank} has {b[1:]}"
              for a, b in zip(ours, theirs) if a[0] == b[0] and a != b]
    return "; ".join(parts) or f"the order differs between rank 0 and rank {rank}"


class _DistributedOptimizer:
    """Mixin placed in front of the user's optimizer class; see DistributedOptimizer()."""

    # GradScaler then hands itself to step(), so the inf check sees reduced gradients.
    _step_supports_amp_scaling = True

    # ---- set-up -------------------------------------------------------------------------
    def _hc_init(self, model, named_parameters, strategy, overlap, op, backward_passes_per_step,
                 compression, cost_model, process_group, timeout, fusion_bytes, split_bytes,
                 measure_iters, replan_every, trace):
        if not dist.is_available() or not dist.is_initialized():
            raise HybridCommError("torch.distributed is not initialized: call "
                                  "torch.distributed.init_process_group(...) first")
        if overlap not in OVERLAPS:
            raise ValueError(f"overlap must be one of {OVERLAPS}, got {overlap!r}")
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of None, 'fp16', 'bf16', got {compression!r}")
        if overlap == "forward" and model is None:
            warnings.warn("hybridcomm: overlap='forward' needs model= to hook its forward; "
                          "using overlap='backward'", stacklevel=3)
            overlap = "backward"
        if overlap == "forward" and type(self).__name__ in _WHOLE_MODEL_OPTIMIZERS:
            warnings.warn(f"hybridcomm: {type(self).__name__} needs all gradients at once; "
                          "using overlap='backward'", stacklevel=3)
            overlap = "backward"
        self._hc_group = process_group
        self._hc_rank = dist.get_rank(process_group)
        self._hc_world = dist.get_world_size(process_group)
        self._hc_overlap, self._hc_strategy = overlap, strategy
        self._hc_scale = 1.0 / self._hc_world if op == "avg" else None
        self._hc_passes = backward_passes_per_step
        self._hc_timeout = default_timeout() if timeout is None else float(timeout)
        self._hc_cost_model = self._hc_resolve_cost_model(cost_model)
        self._hc_fusion_bytes, self._hc_split_bytes = fusion_bytes, split_bytes
        self._hc_measure_iters = measure_iters
        if replan_every and replan_every <= measure_iters:
            raise ValueError(f"replan_every ({replan_every}) must exceed measure_iters "
                             f"({measure_iters}), or be 0")
        self._hc_replan_every = replan_every
        self.timeline = Timeline(enabled=bool(trace))

        self._hc_params, names = self._hc_collect_params(model, named_parameters)
        self._hc_index = {id(p): i for i, p in enumerate(self._hc_params)}
        self._hc_check_same_params(names)
        dtypes = {p.dtype for p in self._hc_params}
        self._hc_dtype = COMPRESSIONS[compression] or (dtypes.pop() if len(dtypes) == 1 else None)
        if self._hc_dtype is None:
            raise HybridCommError(f"parameters have several dtypes {sorted(map(str, dtypes))}; "
                                  "pass compression='fp16' or 'bf16' to reduce them in one")
        self._hc_layers = self._hc_make_layers(model, names)
        # Each lane gets its own communicator: made here, in the same order on every rank.
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        self._hc_lane_groups = {lane: dist.new_group(ranks) for lane in LANES}

        self._hc_engine: Optional[CommEngine] = None
        self._hc_iteration = 0
        self._hc_passes_done = 0
        self._hc_backward_active = False
        self._hc_launching_this_backward = False
        self._hc_no_sync = False
        self._hc_skip_sync = False
        self._hc_synchronized = False
        self._hc_exposed_s = 0.0  # waited for communication since the last step
        self._hc_wait_total = 0.0  # ... ever
        self._hc_ready_times: Dict[int, tuple] = {}  # param index -> (when packed, wait total)
        self._hc_order_times: Dict[int, float] = {}  # the same, kept for the gradient order
        self._hc_windows: Dict[str, List[float]] = {}
        self.last_step_stats: Dict[str, float] = {}
        self._hc_build(self._hc_agree_plan(windows=None, order=None))
        self._hc_hooks = [p.register_post_accumulate_grad_hook(self._hc_on_grad)
                          for p in self._hc_params]
        if model is not None:
            self._hc_hooks += [m.register_forward_pre_hook(self._hc_make_pre_hook(name, idx))
                               for name, m, idx in self._hc_owners(model)]
        log.debug("hybridcomm plan:\n%s", self.plan)

    def _hc_resolve_cost_model(self, cost_model) -> cm.CostModel:
        """A CostModel; None: rank 0's calibration, else a probe (``cost_model.agree``)."""
        if isinstance(cost_model, cm.CostModel):
            return cost_model
        if cost_model == "default":
            return cm.DEFAULT_MODEL
        if cost_model == "probe":
            return cm.probe(self._hc_group)
        if cost_model is None:
            return cm.agree(group=self._hc_group)
        raise ValueError(f"cost_model must be a CostModel, None, 'probe' or 'default', "
                         f"got {cost_model!r}")

    def _hc_collect_params(self, model, named_parameters):
        in_opt = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None and model is not None:
            named_parameters = model.named_parameters()
        by_id = {id(p): n for n, p in (named_parameters or [])}
        params, names, seen = [], [], set()
        for i, p in enumerate(in_opt):
            if id(p) in seen or not p.requires_grad:
                continue  # tied (listed twice) or frozen
            seen.add(id(p))
            if by_id and id(p) not in by_id:
                raise HybridCommError(f"optimizer parameter #{i} (shape {tuple(p.shape)}) is not "
                                      "among the model's named parameters")
            params.append(p)
            names.append(by_id.get(id(p), f"param{i}"))
        return params, names

    def _hc_check_same_params(self, names):
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(names, self._hc_params)]
        everyone = [None] * self._hc_world
        dist.all_gather_object(everyone, mine, group=self._hc_group)
        for r, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                raise HybridCommError("the trainable parameters differ across ranks: "
                                      + _describe_difference(everyone[0], theirs, r))

    def _hc_make_layers(self, model, names) -> List[Layer]:
        """Layers (a module's own parameters), last module first: backward's order."""
        index = {id(p): i for i, p in enumerate(self._hc_params)}
        layers, placed = [], set()
        if model is not None:
            for mname, m in model.named_modules():
                own = [index[id(p)] for p in m.parameters(recurse=False)
                       if id(p) in index and id(p) not in placed]
                if own:
                    placed.update(id(self._hc_params[i]) for i in own)
                    layers.append(Layer(mname or "<root>", own,
                                        sum(self._hc_params[i].numel() for i in own)))
        for i, p in enumerate(self._hc_params):
            if id(p) not in placed:
                layers.append(Layer(names[i], [i], p.numel()))
        return layers[::-1]

    def _hc_owners(self, model):
        """(layer name, module, parameter indices) for every module that owns
        trainable parameters (a tied parameter: under each of its modules)."""
        for name, m in model.named_modules():
            own = [self._hc_index[id(p)] for p in m.parameters(recurse=False)
                   if id(p) in self._hc_index]
            if own:
                yield name or "<root>", m, own

    def _hc_agree_plan(self, windows, order, keep: Optional[Plan] = None) -> Optional[Plan]:
        """Rank 0 makes the plan (from its cost model and measurements); all follow it.
        With ``keep``, None when rank 0's new plan decides nothing differently."""
        plan = None
        if self._hc_rank == 0:
            layers = self._hc_layers
            if order:
                layers = sorted(layers, key=lambda l: order.get(l.name, float("inf")))
            plan = make_plan(layers, world_size=self._hc_world,
                             element_size=torch.empty((), dtype=self._hc_dtype).element_size(),
                             model=self._hc_cost_model, strategy=self._hc_strategy,
                             fusion_bytes=self._hc_fusion_bytes, split_bytes=self._hc_split_bytes,
                             windows=windows, ready=order)
            if keep is not None and _decisions(plan) == _decisions(keep):
                plan = None
        box = [plan]
        src = dist.get_global_rank(self._hc_group, 0) if self._hc_group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self._hc_group)
        return box[0]

    def _hc_phase(self) -> int:
        """Position in the measuring cycle: steps 1..measure_iters of every
        ``replan_every`` are measured (only the first cycle when it is 0)."""
        if self._hc_replan_every:
            return self._hc_iteration % self._hc_replan_every
        return self._hc_iteration

    def _hc_build(self, plan: Plan) -> None:
        if self._hc_engine is not None:
            self._hc_engine.close()
        self.plan = plan
        device = self._hc_params[0].device if self._hc_params else torch.device("cpu")
        self._hc_states = [BucketState(b, [self._hc_params[i] for i in b.params], self._hc_dtype,
                                       device) for b in plan.buckets]
        self._hc_where = {}  # param index -> (state, position in bucket)
        for st in self._hc_states:
            for pos, i in enumerate(st.bucket.params):
                self._hc_where[i] = (st, pos)
        self._hc_engine = CommEngine(plan, self._hc_states, self._hc_lane_groups,
                                     scale=self._hc_scale, timeout=self._hc_timeout,
                                     timeline=self.timeline)

    # ---- hooks --------------------------------------------------------------------------
    def _hc_launching(self) -> bool:
        return (not self._hc_no_sync and self._hc_overlap != "none"
                and self._hc_passes_done == self._hc_passes - 1)

    def _hc_on_grad(self, p) -> None:
        if not self._hc_backward_active:
            if self._hc_passes_done >= self._hc_passes and not self._hc_no_sync:
                raise HybridCommError(
                    f"gradients were computed more than backward_passes_per_step="
                    f"{self._hc_passes} times before step(); to accumulate locally, raise "
                    "backward_passes_per_step or use no_sync()")
            self._hc_backward_active = True
            self._hc_counted_pass = not self._hc_no_sync  # no_sync passes are extra
            self._hc_backward_t0 = time.perf_counter()
            self._hc_launching_this_backward = self._hc_launching()
            torch.autograd.Variable._execution_engine.queue_callback(self._hc_on_backward_end)
        if not self._hc_launching_this_backward:
            return
        i = self._hc_index[id(p)]
        st, pos = self._hc_where[i]
        if st.pending_update:  # last iteration's update never met a forward: apply it first
            self._hc_apply(st)
        st.pack(pos)
        now = time.perf_counter()
        self._hc_ready_times[i] = (now, self._hc_wait_total)
        self._hc_order_times[i] = now
        if len(st.packed) == len(st.params):
            self._hc_engine.launch(st)

    def _hc_on_backward_end(self) -> None:
        self._hc_backward_active = False
        if self._hc_launching_this_backward:
            self._hc_flush()  # buckets with unused parameters go now, not at step()
        self.timeline.add("backward", "compute", self._hc_backward_t0, time.perf_counter())
        self._hc_passes_done += self._hc_counted_pass

    def _hc_make_pre_hook(self, layer, indices):
        def pre_hook(module, args):
            now = time.perf_counter()
            for i in indices:
                st, _ = self._hc_where[i]
                if 0 < self._hc_phase() <= self._hc_measure_iters and i in self._hc_ready_times:
                    # The window is compute time: time spent waiting for
                    # communication in between does not count.
                    ready, waited = self._hc_ready_times.pop(i)
                    window = now - ready - (self._hc_wait_total - waited)
                    self._hc_windows.setdefault(layer, []).append(window)
                if st.pending_update:
                    self._hc_apply(st)
        return pre_hook

    # ---- the data path ------------------------------------------------------------------
    def _hc_flush(self) -> None:
        """Launch every bucket not yet launched this iteration (missing gradients: zeros)."""
        for st in self._hc_states:
            if st.pending_update:
                self._hc_apply(st)
            if not st.armed:
                for pos in range(len(st.params)):
                    if pos not in st.packed:
                        st.pack(pos)
                self._hc_engine.launch(st)

    def _hc_wait(self, st: BucketState) -> None:
        waited = self._hc_engine.wait(st)
        self._hc_exposed_s += waited
        self._hc_wait_total += waited

    def _hc_consume(self, st: BucketState) -> List[int]:
        """Wait for a bucket; start its next iteration; the indices some rank used."""
        self._hc_wait(st)
        st.packed.clear()
        st.armed = False
        return st.used()

    def _hc_write_grads(self, st: BucketState) -> None:
        for pos in self._hc_consume(st):
            p = st.params[pos]
            if p.grad is None:
                p.grad = st.views[pos].to(p.dtype, copy=True)
            else:
                p.grad.copy_(st.views[pos])  # casts back from a compressed wire dtype

    def _hc_apply(self, st: BucketState) -> None:
        """Forward mode: apply a bucket's deferred update with its reduced gradients."""
        t0 = time.perf_counter()
        st.pending_update = False
        used = self._hc_consume(st)
        if not used:
            return
        params = [st.params[pos] for pos in used]
        saved_grads = [p.grad for p in params]
        for pos, p in zip(used, params):
            p.grad = st.views[pos].to(p.dtype)  # a view, unless compressed
        chosen = {id(p) for p in params}
        saved_groups = self.param_groups
        self.param_groups = [dict(hyper, params=[p for p in g["params"] if id(p) in chosen])
                             for g, hyper in zip(saved_groups, st.hyper)]
        self.param_groups = [g for g in self.param_groups if g["params"]]
        try:
            super().step()
        finally:
            self.param_groups = saved_groups
            for p, g in zip(params, saved_grads):
                p.grad = g
        self.timeline.add(f"update bucket {st.bucket.index}", "compute", t0, time.perf_counter())

    def _hc_apply_all_pending(self) -> None:
        for st in self._hc_states:
            if st.pending_update:
                self._hc_apply(st)

    # ---- the optimizer API --------------------------------------------------------------
    def step(self, closure=None, grad_scaler=None):
        """All-reduce what backward produced and update (or defer, in forward mode).

        With ``torch.amp.GradScaler``, ``scaler.step(opt)`` passes itself here
        and the inf check runs on the reduced gradients, identically on every
        rank; the update is then applied at once, as in backward mode.
        """
        t0 = time.perf_counter()
        loss = None
        if self._hc_skip_sync or self._hc_synchronized:
            # The user synchronized (and maybe clipped) p.grad: update from it as it is.
            self._hc_synchronized = False
            loss = self._hc_base_step(closure, grad_scaler)
        else:
            self._hc_flush()
            deferred = (self._hc_overlap == "forward" and closure is None and grad_scaler is None)
            if deferred:
                hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
                for st in self._hc_states:
                    st.hyper, st.pending_update = hyper, True
            else:
                for st in self._hc_states:
                    self._hc_write_grads(st)
                loss = self._hc_base_step(closure, grad_scaler)
        self._hc_passes_done = 0
        self._hc_end_iteration(t0)
        return loss

    def _hc_base_step(self, closure, grad_scaler):
        if grad_scaler is None:
            return super().step(closure) if closure is not None else super().step()
        # Gradients are reduced (and identical on every rank) by now, so is the verdict.
        grad_scaler.unscale_(self)
        found = sum(v.item() for v in grad_scaler._per_optimizer_states[id(self)]
                    ["found_inf_per_device"].values())
        if found:
            return None
        return super().step(closure) if closure is not None else super().step()

    def _hc_end_iteration(self, t0: float) -> None:
        engine = self._hc_engine
        with engine.cond:
            busy, engine.busy_s = engine.busy_s, 0.0
        # Communication that finished since the last step, and how much of it the
        # training thread waited for; the rest ran behind compute.
        self.last_step_stats = {"exposed_comm_s": self._hc_exposed_s, "comm_busy_s": busy,
                                "hidden_comm_s": max(0.0, busy - self._hc_exposed_s),
                                "step_call_s": time.perf_counter() - t0}
        log.debug("hybridcomm step %d: comm %.2f ms, exposed %.2f ms", self._hc_iteration,
                  busy * 1e3, self._hc_exposed_s * 1e3)
        self.timeline.add("step", "compute", t0, time.perf_counter())
        self._hc_exposed_s = 0.0
        self._hc_iteration += 1
        if self._hc_measure_iters > 0 and self._hc_phase() == self._hc_measure_iters:
            self._hc_replan(first=self._hc_iteration == self._hc_measure_iters)

    def _hc_replan(self, first: bool) -> None:
        """Re-plan from rank 0's measured order, ready times and windows: always
        the first time, later only if the measurements change a decision."""
        windows = {k: sorted(v)[len(v) // 2] for k, v in self._hc_windows.items()}
        order = None
        if self._hc_order_times:
            order = {}
            first_ready = min(self._hc_order_times.values())
            for layer in self._hc_layers:
                times = [self._hc_order_times[i] for i in layer.params if i in self._hc_order_times]
                if times:
                    order[layer.name] = max(times) - first_ready  # seconds into backward
        self._hc_windows.clear()
        self._hc_ready_times.clear()
        self._hc_order_times.clear()
        plan = self._hc_agree_plan(windows or None, order, keep=None if first else self.plan)
        if plan is None:
            return
        for st in self._hc_states:  # quiesce: the buffers are about to be replaced
            if st.pending_update:
                self._hc_apply(st)
            elif st.armed:
                self._hc_consume(st)
        self._hc_build(plan)
        log.debug("hybridcomm re-plan after %d iterations:\n%s", self._hc_iteration, self.plan)

    def synchronize(self) -> None:
        """Finish all communication and every pending update; p.grad then holds
        the reduced gradients (e.g. to clip them), and the next step() uses p.grad
        as it is. Parameters are current afterwards."""
        self._hc_apply_all_pending()
        started = any(st.armed or st.packed for st in self._hc_states)
        if started:
            self._hc_flush()
            for st in self._hc_states:
                self._hc_write_grads(st)
            self._hc_synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside updates from p.grad as it is (after a ``synchronize()``)."""
        self._hc_skip_sync = True
        try:
            yield
        finally:
            self._hc_skip_sync = False

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, with no communication."""
        self._hc_no_sync = True
        try:
            yield
        finally:
            self._hc_no_sync = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(st.armed and not st.pending_update for st in self._hc_states):
            raise HybridCommError("zero_grad() while this iteration's gradients are being "
                                  "all-reduced would lose them: call step() or synchronize() first")
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        self._hc_apply_all_pending()  # the state must include every update step() accepted
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        for st in self._hc_states:
            if st.armed:
                self._hc_consume(st)
            st.pending_update = False  # superseded by the loaded state
            st.packed.clear()
        super().load_state_dict(state_dict)

    def export_trace(self, path: str) -> None:
        """Write the Chrome-trace timeline (needs ``trace=True``)."""
        self.timeline.write(path)

    def close(self) -> None:
        """Finish pending work, stop the comm threads and remove the hooks."""
        if self._hc_engine is None:
            return
        self._hc_apply_all_pending()
        for st in self._hc_states:
            if st.armed:
                self._hc_consume(st)
        self._hc_engine.close()
        self._hc_engine = None
        for h in self._hc_hooks:
            h.remove()


def DistributedOptimizer(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module] = None,
                         named_parameters=None, strategy: str = "hybrid", overlap: str = "forward",
                         op: str = "avg", backward_passes_per_step: int = 1, compression=None,
                         cost_model=None, process_group=None, timeout: Optional[float] = None,
                         fusion_bytes: Optional[int] = None, split_bytes: Optional[int] = None,
                         measure_iters: int = 3, replan_every: int = 200, trace: bool = False):
    """Wrap ``optimizer`` so each step's gradients are all-reduced across ranks.

    Args:
        optimizer: any torch optimizer; the wrapper is an instance of its class
            and shares its state.
        model: the module being trained (needed for ``overlap="forward"`` and
            for per-layer buckets; without it each parameter is a layer).
        named_parameters: names for the parameters (default: ``model``'s).
        strategy: ``"hybrid"`` (butterfly or ring per bucket, from the cost
            model and the bucket's window), ``"auto"`` (the same among all
            three algorithms) or one algorithm for every bucket;
            ``HYBRIDCOMM_ALGO`` overrides all.
        overlap: ``"forward"``, ``"backward"`` or ``"none"`` (module docstring).
        op: ``"avg"`` (gradients averaged: same numbers as one process on the
            whole batch) or ``"sum"``.
        backward_passes_per_step: backward passes accumulated locally per step.
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the wire dtype.
        cost_model: a ``CostModel``; None (default): rank 0's saved calibration
            (``hybridcomm-bench --calibrate``), else a quick probe (~36 small
            all-reduces); ``"probe"``: always probe; ``"default"``: built-in
            constants.
        process_group: torch.distributed group (default: the world).
        timeout: seconds to wait for a peer (default ``HYBRIDCOMM_TIMEOUT``).
        fusion_bytes / split_bytes: bucket fusion and split thresholds.
        measure_iters: re-plan after this many steps, from the measured
            gradient order, ready times and overlap windows (0: never).
        replan_every: measure again every this many steps and re-plan if the
            measurements change a decision (drift); 0: only once.
        trace: record a timeline; ``opt.export_trace("trace.json")``.

    ``print(opt.plan)`` shows every bucket's algorithm, lane and window.

    Example::

        >>> opt = hybridcomm.DistributedOptimizer(
        ...     torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model)
        >>> for x, y in loader:
        ...     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """
    if isinstance(optimizer, _DistributedOptimizer):
        raise HybridCommError("this optimizer is already a DistributedOptimizer")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    opt = cls.__new__(cls)
    # Share the wrapped optimizer's state, but not a `step` an LR scheduler may
    # have patched onto the instance: it would call the unwrapped step.
    opt.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    opt._hc_init(model, named_parameters, strategy, overlap, op, backward_passes_per_step,
                 compression, cost_model, process_group, timeout, fusion_bytes, split_bytes,
                 measure_iters, replan_every, trace)
    return opt


def broadcast_parameters(params, root_rank: int = 0, process_group=None) -> None:
    """Copy ``root_rank``'s parameters (a state_dict or (name, tensor) pairs) to every rank.

    Example::

        >>> hybridcomm.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    for _, t in items:
        if isinstance(t, torch.Tensor):
            dist.broadcast(t.data, src=root_rank, group=process_group)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_group=None) -> None:
    """Make every rank's optimizer state (and hyper-parameters) equal ``root_rank``'s.

    Example::

        >>> hybridcomm.broadcast_optimizer_state(opt, root_rank=0)
    """
    box = [optimizer.state_dict() if dist.get_rank() == root_rank else None]
    dist.broadcast_object_list(box, src=root_rank, group=process_group)
    if dist.get_rank() != root_rank:
        optimizer.load_state_dict(box[0])
