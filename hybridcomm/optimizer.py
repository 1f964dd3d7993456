"""DistributedOptimizer: the one-line change that turns on hybrid all-reduce.

It subclasses the wrapped optimizer's class on the fly (``isinstance`` and LR
schedulers keep working) and shares its state. Gradients are packed into
per-layer buckets as backward produces them and all-reduced through one
ordered channel, with the algorithm per bucket from the cost model
(planner.py); the bucket lifecycle and the channel are overlap.py.

Overlap modes:

- ``"backward"``: ``step()`` waits for every bucket, points ``p.grad`` at the
  reduced gradients and updates (as DDP does).
- ``"forward"`` (the thesis's layer overlapping): ``step()`` returns at
  once; each bucket's update is applied just before the first use of one of
  its parameters in the next iteration, after waiting for that bucket only.
  The reduced gradient waits in the library's buffer, so the usual
  ``zero_grad(); loss = model(x); loss.backward(); opt.step()`` loop is
  unchanged. Hyper-parameters (lr, ...) are those at ``step()``.
- ``"none"``: nothing overlaps; all buckets are reduced in ``step()``.

Where forward mode applies an update: during the measured steps a
``TorchFunctionMode`` watches, from ``step()`` to the end of the next
forward, which module's forward first touches each parameter (also
``F.linear(x, self.head.weight)`` in a parent, or a read between ``step()``
and the forward, e.g. an EMA). Afterwards each bucket is applied in the
pre-hook of those modules (and of its owners); anything still pending when
the root module's forward returns is applied then (a parameter read only by
the loss); ``model.state_dict()`` and ``opt.state_dict()`` apply first. A
bucket read between ``step()`` and the next forward is applied in ``step()``
(logged once).
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from contextlib import contextmanager
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from . import calibration, control, env
from . import cost_model as cm
from .errors import HybridCommError
from .kernels import SUPPORTED_DTYPES, unpack
from .compression import TOPK, TopK, parse_topk
from .overlap import BucketState, CommEngine, HostChannel, Phase, StreamChannel
from .planner import Layer, Plan, make_plan
from .runtime import runtime_for
from .sparse import all_gather_sparse
from .tensor_access import collect, reads_data
from .timeline import Timeline
from .transport.select import select_transport
from .transport.torch_dist import TorchDistTransport

log = logging.getLogger("hybridcomm")

OVERLAPS = ("forward", "backward", "none")
COMPRESSIONS = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16,
                torch.float16: torch.float16, torch.bfloat16: torch.bfloat16}
# Optimizers whose step needs every gradient at once (or re-evaluates a closure).
_WHOLE_MODEL_OPTIMIZERS = ("LBFGS",)


class _FirstUse(TorchFunctionMode):
    """Watches which parameters torch calls read, so a pending update is applied
    just before the first one (and where it happened is learned)."""

    def __init__(self, opt):
        super().__init__()
        self.opt = opt

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if reads_data(getattr(func, "__name__", ""), args):
            index = self.opt._hc_index
            for t in collect(kwargs, collect(args, [])):
                i = index.get(id(t))
                if i is not None:
                    self.opt._hc_first_use(i)
        return func(*args, **kwargs)


class _DistributedOptimizer:
    """Mixin placed in front of the user's optimizer class; see DistributedOptimizer()."""

    # GradScaler then hands itself to step(), so the inf check sees reduced gradients.
    _step_supports_amp_scaling = True

    # ---- set-up -------------------------------------------------------------------------
    def _hc_init(self, model, named_parameters, strategy, overlap, op, backward_passes_per_step,
                 compression, cost_model, process_group, timeout, fusion_bytes, split_bytes,
                 measure_iters, replan_every, trace, lazy_bytes=None):
        if not dist.is_available() or not dist.is_initialized():
            raise HybridCommError("torch.distributed is not initialized: call "
                                  "torch.distributed.init_process_group(...) first")
        if overlap not in OVERLAPS:
            raise ValueError(f"overlap must be one of {OVERLAPS}, got {overlap!r}")
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self._hc_topk = parse_topk(compression)
        if compression not in COMPRESSIONS and self._hc_topk is None:
            raise ValueError(f"compression must be one of None, 'fp16', 'bf16', 'topk:RATIO', "
                             f"got {compression!r}")
        if replan_every and replan_every <= measure_iters:
            raise ValueError(f"replan_every ({replan_every}) must exceed measure_iters "
                             f"({measure_iters}), or be 0")
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
        self._hc_timeout = env.timeout(timeout)
        self._hc_wire = None if self._hc_topk else COMPRESSIONS[compression]
        self._hc_momentum = self._hc_correction_momentum()
        self._hc_fusion_bytes, self._hc_split_bytes = fusion_bytes, split_bytes
        if lazy_bytes is not None and lazy_bytes <= 0:
            raise ValueError(f"lazy_bytes must be > 0 bytes, got {lazy_bytes}")
        self._hc_lazy_bytes = lazy_bytes
        self._hc_measure_iters, self._hc_replan_every = measure_iters, replan_every
        self.timeline = Timeline(enabled=bool(trace))
        self._hc_model = model
        self._hc_modules = {id(m): m for m in model.modules()} if model is not None else {}

        params, names = self._hc_collect_params(model, named_parameters)
        device = params[0].device if params else torch.device("cpu")
        self._hc_runtime = runtime_for(device)
        self._hc_check_params(model, params, names)
        # Sparse gradients (modules with sparse=True) take their own path (sparse.py).
        sparse = _sparse_owned(model)
        self._hc_sparse = [(p, n) for p, n in zip(params, names) if id(p) in sparse]
        self._hc_params = [p for p in params if id(p) not in sparse]
        self._hc_names = names = [n for p, n in zip(params, names) if id(p) not in sparse]
        self._hc_index = {id(p): i for i, p in enumerate(self._hc_params)}
        if self._hc_runtime is not None:  # CUDA, or the simulated GPU: the comm stream
            self._hc_transport = select_transport(device, process_group, timeout=self._hc_timeout)
            self._hc_channel = StreamChannel(self._hc_transport, self.timeline)
        else:  # CPU: a gloo group of its own, so the user's collectives never interleave
            self._hc_transport = TorchDistTransport(control.new_group_like(process_group,
                                                                           self._hc_timeout))
            self._hc_channel = HostChannel(self._hc_timeout, self.timeline)
        self._hc_cost_model = self._hc_resolve_cost_model(cost_model)
        self._hc_layers = self._hc_make_layers(model, names)

        self._hc_engine: Optional[CommEngine] = None
        self._hc_iteration = 0
        self._hc_passes_done = 0
        self._hc_backward_active = False
        self._hc_launching_this_backward = False
        self._hc_no_sync = self._hc_skip_sync = self._hc_synchronized = False
        self._hc_exposed_s = 0.0  # waited for communication since the last step
        self._hc_wait_total = 0.0  # ... ever
        self._hc_ready_times: Dict[int, float] = {}  # param index -> when its gradient was ready
        self._hc_windows: Dict[str, List[float]] = {}
        self._hc_need: Dict[str, int] = {}  # layer -> order the next forward needed it in
        self._hc_first_users: Dict[int, set] = {}  # bucket -> ids of modules that used it first
        self._hc_eager: set = set()  # buckets applied in step() (read before the next forward)
        self._hc_mode: Optional[_FirstUse] = None
        self._hc_module_stack: List[torch.nn.Module] = []
        self._hc_learned = False  # whether a forward was watched yet
        self._hc_appliers: Dict[int, list] = {}  # id(module) -> bucket states it applies
        self.last_step_stats: Dict[str, float] = {}
        self._hc_build(self._hc_agree_plan(windows=None, ready=None, need=None))
        self._hc_hooks = [p.register_post_accumulate_grad_hook(self._hc_on_grad)
                          for p in self._hc_params]
        if model is not None and overlap == "forward":
            self._hc_hook_model(model)
        self._hc_log_plan("initial plan")

    def _hc_resolve_cost_model(self, cost_model) -> cm.CostModel:
        """A CostModel; None: rank 0's calibration, else a probe (``calibration.agree``)."""
        if isinstance(cost_model, cm.CostModel):
            return cost_model
        if cost_model == "default":
            return cm.DEFAULT_MODEL
        if cost_model == "probe":
            return calibration.probe(self._hc_group, timeout=self._hc_timeout)
        if cost_model is None:
            return calibration.agree(group=self._hc_group, timeout=self._hc_timeout)
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
                continue  # tied (listed twice) or frozen (integer parameters are frozen too)
            seen.add(id(p))
            if by_id and id(p) not in by_id:
                raise HybridCommError(f"optimizer parameter #{i} (shape {tuple(p.shape)}) is not "
                                      "among the model's named parameters")
            params.append(p)
            names.append(by_id.get(id(p), f"param{i}"))
        return params, names

    def _hc_check_params(self, model, params, names) -> None:
        """Every rank: the same parameters, and none we cannot reduce; else the same
        HybridCommError on every rank, naming the parameters and what to do."""
        sparse_owned = _sparse_owned(model)
        problems = []
        devices = {p.device for p in params}
        for n, p in zip(names, params):
            if p.is_complex():
                problems.append(f"{n!r} is complex ({p.dtype}): not supported; keep it as a "
                                "real parameter of twice the size (torch.view_as_real) and "
                                "build the complex tensor in forward")
            elif p.dtype not in SUPPORTED_DTYPES:
                problems.append(f"{n!r} has dtype {p.dtype}; supported: "
                                f"{', '.join(map(str, SUPPORTED_DTYPES))}")
            if id(p) in sparse_owned and self._hc_runtime is not None:
                problems.append(f"{n!r} belongs to a module with sparse=True: sparse gradients "
                                "are reduced on the CPU (gloo) path only; on GPUs use "
                                "sparse=False")
            if p.is_sparse:
                problems.append(f"{n!r} is a sparse tensor: not supported")
        if len(devices) > 1:
            where = {str(d): [n for n, p in zip(names, params) if p.device == d][:3]
                     for d in devices}
            problems.append(f"parameters are on several devices {where}: one DistributedOptimizer "
                            "per device (data parallelism keeps a whole replica on each)")
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(names, params)]
        everyone = control.all_gather_object((mine, problems), group=self._hc_group,
                                             timeout=self._hc_timeout,
                                             what="the trainable parameters")
        bad = [f"rank {r}: {msg}" for r, (_, probs) in enumerate(everyone) for msg in probs]
        if bad:
            raise HybridCommError("hybridcomm cannot reduce these parameters: " + "; ".join(bad))
        for r, (theirs, _) in enumerate(everyone):
            if theirs != everyone[0][0]:
                raise HybridCommError("the trainable parameters differ across ranks: "
                                      + describe_param_difference(everyone[0][0], theirs, r))

    def _hc_wire_dtype(self, p) -> torch.dtype:
        return self._hc_wire or p.dtype

    def _hc_make_layers(self, model, names) -> List[Layer]:
        """Layers (a module's own parameters, one dtype each), last module first:
        backward's order."""
        index = self._hc_index
        groups, placed = [], set()
        if model is not None:
            for mname, m in model.named_modules():
                own = [index[id(p)] for p in m.parameters(recurse=False)
                       if id(p) in index and id(p) not in placed]
                placed.update(id(self._hc_params[i]) for i in own)
                by_dtype: Dict[torch.dtype, list] = {}
                for i in own:
                    by_dtype.setdefault(self._hc_wire_dtype(self._hc_params[i]), []).append(i)
                for k, (dt, idx) in enumerate(by_dtype.items()):
                    suffix = f"[{str(dt).replace('torch.', '')}]" if len(by_dtype) > 1 else ""
                    groups.append((f"{mname or '<root>'}{suffix}", idx, dt))
        for i, p in enumerate(self._hc_params):
            if id(p) not in placed:
                groups.append((names[i], [i], self._hc_wire_dtype(p)))
        layers = [Layer(n, idx, sum(self._hc_params[i].numel() for i in idx),
                        torch.empty((), dtype=dt).element_size(), str(dt))
                  for n, idx, dt in groups]
        return layers[::-1]

    def _hc_agree_plan(self, windows, ready, need, keep: Optional[Plan] = None) -> Optional[Plan]:
        """Rank 0 makes the plan (from its cost model and measurements); all follow it.
        With ``keep``, None when rank 0's new plan decides nothing differently."""
        plan = None
        if self._hc_rank == 0:
            layers = self._hc_layers
            if ready:
                layers = sorted(layers, key=lambda l: ready.get(l.name, float("inf")))
            plan = make_plan(layers, world_size=self._hc_world, model=self._hc_cost_model,
                             strategy=self._hc_strategy, fusion_bytes=self._hc_fusion_bytes,
                             split_bytes=self._hc_split_bytes, windows=windows, ready=ready,
                             need=need, topk=self._hc_topk, lazy_bytes=self._hc_lazy_bytes)
            if keep is not None and plan.decisions() == keep.decisions():
                plan = None
        return control.broadcast_object(plan, group=self._hc_group, timeout=self._hc_timeout,
                                        what="the bucket plan")

    def _hc_phase(self) -> int:
        """Position in the measuring cycle: steps 1..measure_iters of every
        ``replan_every`` are measured (only the first cycle when it is 0)."""
        if self._hc_replan_every:
            return self._hc_iteration % self._hc_replan_every
        return self._hc_iteration

    def _hc_measuring(self) -> bool:
        return 0 < self._hc_phase() <= self._hc_measure_iters

    def _hc_build(self, plan: Plan) -> None:
        self.plan = plan
        rt = self._hc_runtime
        if rt is not None:
            def alloc(n, dt):
                buf = rt.empty(n, dt)  # on the trainer's stream; the comm stream records its use
                rt.record_stream(buf, self._hc_transport.stream)
                return buf
        else:
            def alloc(n, dt):
                return torch.zeros(n, dtype=dt)
        self._hc_states = [BucketState(b, [self._hc_params[i] for i in b.params],
                                       getattr(torch, b.dtype.replace("torch.", "")), alloc)
                           for b in plan.buckets]
        self._hc_where = {}  # param index -> (state, position in bucket)
        for st in self._hc_states:
            for pos, i in enumerate(st.bucket.params):
                self._hc_where[i] = (st, pos)
            if st.bucket.algorithm == TOPK:
                st.topk = TopK(st.bucket.numel, len(st.params), self._hc_topk, self._hc_rank,
                               self._hc_world, self._hc_momentum, alloc)
        self._hc_link_topk_state()
        self._hc_engine = CommEngine(plan, self._hc_states, self._hc_channel, self._hc_transport,
                                     scale=self._hc_scale, timeout=self._hc_timeout)
        self._hc_set_appliers()

    # ---- top-k compression: residuals in the optimizer state -----------------------------
    def _hc_correction_momentum(self) -> float:
        """DGC's momentum correction applies to SGD with (plain) momentum: the momentum
        of its groups, which must agree; 0 (error feedback alone) otherwise."""
        if not self._hc_topk or type(self).__name__ != "SGD":
            return 0.0
        found = {(g.get("momentum", 0.0), bool(g.get("nesterov", False)))
                 for g in self.param_groups}
        if len(found) != 1:
            raise ValueError("compression='topk:...' with SGD needs one momentum for all "
                             f"parameter groups, got {sorted(found)}")
        momentum, nesterov = found.pop()
        return 0.0 if nesterov else float(momentum)

    def _hc_link_topk_state(self) -> None:
        """Each parameter's residual (and velocity) is a view of its bucket's, kept in
        ``self.state[p]`` so that ``state_dict`` saves it; values found there (a
        re-plan, a loaded checkpoint) are copied in first."""
        for st in self._hc_states:
            if st.topk is None:
                continue
            offset = 0
            for p in st.params:
                n = p.numel()
                state = self.state[p]
                for key, buf in (("hc_topk_residual", st.topk.residual),
                                 ("hc_topk_velocity", st.topk.velocity)):
                    if buf is None:
                        continue
                    view = buf[offset:offset + n].view(p.shape)
                    old = state.get(key)
                    if old is not None and old.data_ptr() != view.data_ptr():
                        view.copy_(old)
                    state[key] = view
                offset += n

    def _hc_hyper(self, hyper, st) -> list:
        """``hyper`` for stepping ``st``'s parameters: momentum 0 where it was applied
        before sparsifying (DGC's momentum correction)."""
        if st.topk is None or not self._hc_momentum:
            return hyper
        return [dict(h, momentum=0.0) for h in hyper]

    # ---- forward mode: where updates are applied ---------------------------------------
    def _hc_hook_model(self, model) -> None:
        self._hc_root = model
        self._hc_hooks.append(model.register_forward_hook(self._hc_root_done))
        self._hc_hooks.append(model.register_state_dict_pre_hook(
            lambda *args, **kwargs: self._hc_apply_all_pending()))

    def _hc_set_appliers(self) -> None:
        """A pre-hook on the module(s) that first use each bucket applies it: learned
        while watching (the measured steps); before that, on its parameters' owners.
        A bucket no module used is applied when the root's forward returns."""
        for h in getattr(self, "_hc_applier_hooks", ()):
            h.remove()
        self._hc_applier_hooks, self._hc_appliers = [], {}
        if getattr(self, "_hc_model", None) is None or self._hc_overlap != "forward" \
                or self._hc_mode is not None:  # while watching, the watch applies
            return
        owners: Dict[int, list] = {}
        for m in self._hc_model.modules():
            for p in m.parameters(recurse=False):
                owners.setdefault(id(p), []).append(id(m))
        for st in self._hc_states:
            if st.bucket.index in self._hc_first_users:
                mods = self._hc_first_users[st.bucket.index]
            elif not self._hc_learned:
                mods = {mid for p in st.params for mid in owners.get(id(p), ())}
            else:
                mods = set()
            for mid in mods:
                self._hc_appliers.setdefault(mid, []).append(st)
        self._hc_applier_hooks = [self._hc_modules[mid].register_forward_pre_hook(
            self._hc_module_pre) for mid in self._hc_appliers]

    def _hc_module_pre(self, module, args) -> None:
        for st in self._hc_appliers.get(id(module), ()):
            if st.phase is Phase.PENDING:
                self._hc_apply(st)

    def _hc_root_done(self, module, args, output) -> None:
        # A parameter read only by the loss (or by nothing) is current now too.
        self._hc_apply_all_pending()
        self._hc_stop_watching()

    def _hc_first_use(self, i: int) -> None:
        """The watched code is about to read parameter ``i``: its update goes first."""
        st, _ = self._hc_where[i]
        if st.phase is not Phase.PENDING:
            return
        if self._hc_module_stack:
            user = self._hc_module_stack[-1]
            self._hc_first_users.setdefault(st.bucket.index, set()).add(id(user))
        elif st.bucket.index not in self._hc_eager:  # read between step() and the forward
            self._hc_eager.add(st.bucket.index)
            log.info("hybridcomm: bucket %d (%s) is read between step() and the next forward "
                     "(parameter %r); its update is applied in step() from now on",
                     st.bucket.index, ", ".join(st.bucket.layers), self._hc_names[i])
        self._hc_apply(st)

    def _hc_watch(self) -> None:
        """From step() to the end of the next forward: see which module first reads each
        pending parameter (the module stack is kept only meanwhile)."""
        if self._hc_mode is not None or getattr(self, "_hc_model", None) is None:
            return
        stack = self._hc_module_stack = []

        def enter(module, args) -> None:
            stack.append(module)

        def leave(module, args, output) -> None:
            if stack:
                stack.pop()

        self._hc_watch_hooks = []
        for m in self._hc_modules.values():
            self._hc_watch_hooks.append(m.register_forward_pre_hook(enter, prepend=True))
            self._hc_watch_hooks.append(m.register_forward_hook(leave, prepend=True))
        self._hc_mode = _FirstUse(self)
        self._hc_mode.__enter__()
        self._hc_set_appliers()  # none while watching: first uses must be seen

    def _hc_stop_watching(self) -> None:
        mode, self._hc_mode = self._hc_mode, None
        if mode is None:
            return
        mode.__exit__(None, None, None)
        for h in self._hc_watch_hooks:
            h.remove()
        self._hc_watch_hooks, self._hc_module_stack = [], []
        self._hc_learned = True
        self._hc_set_appliers()

    # ---- hooks --------------------------------------------------------------------------
    def _hc_launching(self) -> bool:
        return (not self._hc_no_sync and self._hc_overlap != "none"
                and self._hc_passes_done == self._hc_passes - 1)

    def _hc_on_grad(self, p) -> None:
        with self._hc_watched():
            self._hc_grad_ready(p)

    def _hc_watched(self):
        """The device runtime's view of host torch calls in autograd hooks (the GPU
        simulator must see them; torch gives hooks no torch-function modes)."""
        return self._hc_runtime.watched() if self._hc_runtime is not None \
            else contextlib.nullcontext()

    def _hc_grad_ready(self, p) -> None:
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
        if p.grad is not None and p.grad.is_sparse:
            raise HybridCommError(f"parameter {self._hc_names[self._hc_index[id(p)]]!r} got a "
                                  "sparse gradient; hybridcomm reduces dense gradients")
        if not self._hc_launching_this_backward:
            return
        i = self._hc_index[id(p)]
        st, pos = self._hc_where[i]
        if st.phase is Phase.PENDING:  # last iteration's update never met a forward
            self._hc_apply(st)
        elif st.phase is Phase.IN_FLIGHT:
            raise HybridCommError(f"parameter {self._hc_names[i]!r} got a gradient while its "
                                  "bucket is still being reduced: call step() between backward "
                                  "passes (or use backward_passes_per_step / no_sync())")
        st.phase = Phase.FILLING
        st.ready.add(pos)
        if self._hc_measuring():
            self._hc_ready_times[i] = time.perf_counter()
        if st.all_ready:
            self._hc_launch(st)

    def _hc_on_backward_end(self) -> None:
        self._hc_backward_active = False
        if self._hc_launching_this_backward:
            with self._hc_watched():
                self._hc_flush()  # buckets with unused parameters go now, not at step()
        self.timeline.add("backward", "compute", self._hc_backward_t0, time.perf_counter())
        self._hc_passes_done += self._hc_counted_pass

    def _hc_launch(self, st: BucketState) -> None:
        self._hc_engine.launch(st)

    # ---- the data path ------------------------------------------------------------------
    def _hc_flush(self) -> None:
        """Launch every bucket not yet launched this iteration (missing gradients: zeros)."""
        for st in self._hc_states:
            if st.phase is Phase.PENDING:
                self._hc_apply(st)
            if st.phase in (Phase.IDLE, Phase.FILLING):
                self._hc_launch(st)

    def _hc_wait(self, st: BucketState) -> None:
        waited = self._hc_engine.wait(st)
        self._hc_exposed_s += waited
        self._hc_wait_total += waited

    def _hc_consume(self, st: BucketState) -> List[int]:
        """Wait for a bucket; free it for the next iteration; the positions some rank used."""
        self._hc_wait(st)
        used = st.used()
        st.phase = Phase.IDLE
        st.ready.clear()
        return used

    def _hc_write_grads(self, st: BucketState) -> None:
        """Backward mode: p.grad <- the reduced gradients (views into the bucket, or
        one unpack launch back to the parameters' dtype under compression)."""
        used = self._hc_consume(st)
        params = [st.params[pos] for pos in used]
        if not params:
            return
        if all(st.views[pos].dtype == p.dtype for pos, p in zip(used, params)):
            for pos, p in zip(used, params):
                p.grad = st.views[pos]
            return
        if len(used) == len(st.params) and all(p.grad is not None and p.grad.is_contiguous()
                                               for p in params):
            unpack(st.buffer[:st.bucket.numel], [p.grad for p in params])
            return
        for pos, p in zip(used, params):
            p.grad = st.views[pos].to(p.dtype)

    def _hc_apply(self, st: BucketState) -> None:
        """Forward mode: apply a bucket's deferred update with its reduced gradients."""
        t0 = time.perf_counter()
        if self._hc_measuring() and st.launched_at:
            window = t0 - st.launched_at
            for layer in st.bucket.layers:
                self._hc_windows.setdefault(layer, []).append(window)
                self._hc_need.setdefault(layer, len(self._hc_need))
        used = self._hc_consume(st)
        if not used:
            return
        params = [st.params[pos] for pos in used]
        grads = [st.views[pos] if st.views[pos].dtype == p.dtype else st.views[pos].to(p.dtype)
                 for pos, p in zip(used, params)]
        self._hc_step_only(params, grads, self._hc_hyper(st.hyper, st))
        self.timeline.add(f"update bucket {st.bucket.index}", "compute", t0, time.perf_counter())

    def _hc_step_only(self, params, grads, hyper) -> None:
        """The wrapped optimizer's step for ``params`` alone, with gradients ``grads``
        and the hyper-parameters ``hyper`` (per group, as at the step() that deferred it)."""
        saved_grads = [p.grad for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        chosen = {id(p) for p in params}
        saved_groups = self.param_groups
        self.param_groups = [dict(h, params=[p for p in g["params"] if id(p) in chosen])
                             for g, h in zip(saved_groups, hyper)]
        self.param_groups = [g for g in self.param_groups if g["params"]]
        try:
            super().step()
        finally:
            self.param_groups = saved_groups
            for p, g in zip(params, saved_grads):
                p.grad = g

    def _hc_apply_all_pending(self) -> None:
        for st in self._hc_states:
            if st.phase is Phase.PENDING:
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
            self._hc_reduce_sparse()
            deferred = (self._hc_overlap == "forward" and closure is None and grad_scaler is None)
            if deferred:
                hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
                sparse = [p for p, _ in self._hc_sparse if p.grad is not None]
                if sparse:  # updated now: they are not deferred
                    self._hc_step_only(sparse, [p.grad for p in sparse], hyper)
                for st in self._hc_states:
                    st.hyper, st.phase = hyper, Phase.PENDING
                for st in self._hc_states:
                    if st.bucket.index in self._hc_eager:
                        self._hc_apply(st)
                if self._hc_phase() < self._hc_measure_iters:  # watch the next forward
                    self._hc_watch()
            else:
                for st in self._hc_states:
                    self._hc_write_grads(st)
                corrected = [st for st in self._hc_states if st.topk is not None] \
                    if self._hc_momentum else []
                if corrected:
                    if closure is not None or grad_scaler is not None:
                        raise HybridCommError("compression='topk' with momentum correction "
                                              "takes no closure or GradScaler in step()")
                    loss = self._hc_corrected_step(corrected)
                else:
                    loss = self._hc_base_step(closure, grad_scaler)
        self._hc_passes_done = 0
        self._hc_end_iteration(t0)
        return loss

    def _hc_corrected_step(self, corrected) -> None:
        """The optimizer's step with momentum 0 for the momentum-corrected buckets."""
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        done = {id(p) for st in corrected for p in st.params}
        for st in corrected:
            params = [p for p in st.params if p.grad is not None]
            if params:
                self._hc_step_only(params, [p.grad for p in params], self._hc_hyper(hyper, st))
        rest = [p for g in self.param_groups for p in g["params"]
                if id(p) not in done and p.grad is not None]
        if rest:
            self._hc_step_only(rest, [p.grad for p in rest], hyper)

    def _hc_reduce_sparse(self) -> None:
        """p.grad of each sparse parameter <- its sum (avg) over ranks, through the
        channel, after this step's dense buckets (the same order on every rank)."""
        for p, name in self._hc_sparse:
            out = []
            fn = (lambda p=p, name=name: out.append(all_gather_sparse(
                p.grad, p.shape, p.dtype, self._hc_transport.group,
                average=self._hc_scale is not None, timeout=self._hc_timeout,
                what=f"sparse gradient of {name!r}")))
            ticket = self._hc_channel.submit(fn, f"sparse gradient of {name!r}")
            self._hc_channel.wait(ticket, f"sparse gradient of {name!r}")
            p.grad = out[0]

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
        busy = self._hc_channel.take_busy()
        sent, self._hc_engine.bytes_sent = self._hc_engine.bytes_sent, 0
        # Communication that finished since the last step, and how much of it the
        # training thread waited for; the rest ran behind compute.
        self.last_step_stats = {"exposed_comm_s": self._hc_exposed_s, "comm_busy_s": busy,
                                "hidden_comm_s": max(0.0, busy - self._hc_exposed_s),
                                "step_call_s": time.perf_counter() - t0, "bytes_sent": sent}
        log.debug("hybridcomm step %d: comm %.2f ms, exposed %.2f ms, %d bytes sent",
                  self._hc_iteration, busy * 1e3, self._hc_exposed_s * 1e3, sent)
        self.timeline.add("step", "compute", t0, time.perf_counter())
        self._hc_exposed_s = 0.0
        self._hc_iteration += 1
        if self._hc_measure_iters > 0 and self._hc_phase() == self._hc_measure_iters:
            self._hc_replan(first=self._hc_iteration == self._hc_measure_iters)

    def _hc_replan(self, first: bool) -> None:
        """Re-plan from rank 0's measured order, ready times, windows and need order:
        always the first time, later only if the measurements change a decision."""
        windows = {k: _quantize(sorted(v)[len(v) // 2]) for k, v in self._hc_windows.items()}
        ready = None
        if self._hc_ready_times:
            first_ready = min(self._hc_ready_times.values())
            ready = {}
            for layer in self._hc_layers:
                times = [self._hc_ready_times[i] for i in layer.params if i in self._hc_ready_times]
                if times:
                    ready[layer.name] = _quantize(max(times) - first_ready)
        need = dict(self._hc_need) or None
        self._hc_windows.clear()
        self._hc_ready_times.clear()
        self._hc_need.clear()
        plan = self._hc_agree_plan(windows or None, ready, need, keep=None if first else self.plan)
        if plan is None:
            return
        self._hc_quiesce()
        old_first_users = self._hc_first_users
        # Learned first users are per bucket: map them through the layers to the new plan.
        by_layer = {layer: users for st in self._hc_states for layer in st.bucket.layers
                    for users in [old_first_users.get(st.bucket.index, set())]}
        eager_layers = {layer for st in self._hc_states if st.bucket.index in self._hc_eager
                        for layer in st.bucket.layers}
        self._hc_first_users = {b.index: set().union(*(by_layer.get(l, set()) for l in b.layers))
                                for b in plan.buckets}
        self._hc_eager = {b.index for b in plan.buckets if eager_layers & set(b.layers)}
        self._hc_build(plan)
        self._hc_log_plan(f"re-planned after {self._hc_iteration} steps")

    def _hc_log_plan(self, title: str) -> None:
        """The plan at INFO on rank 0 (the same on every rank: DEBUG elsewhere)."""
        log.log(logging.INFO if self._hc_rank == 0 else logging.DEBUG, "%s:\n%s", title, self.plan)

    def _hc_quiesce(self) -> None:
        """Consume everything in flight: buffers are about to change."""
        for st in self._hc_states:
            if st.phase is Phase.PENDING:
                self._hc_apply(st)
            elif st.phase is Phase.IN_FLIGHT:
                self._hc_write_grads(st)

    def synchronize(self) -> None:
        """Finish all communication and every pending update; p.grad then holds
        the reduced gradients (e.g. to clip them), and the next step() uses p.grad
        as it is. Parameters are current afterwards."""
        self._hc_stop_watching()
        self._hc_apply_all_pending()
        started = any(st.phase is not Phase.IDLE for st in self._hc_states)
        if started:
            self._hc_flush()
            self._hc_reduce_sparse()
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
        if any(st.phase is Phase.IN_FLIGHT for st in self._hc_states):
            raise HybridCommError("zero_grad() while this iteration's gradients are being "
                                  "all-reduced would lose them: call step() or synchronize() first")
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        self._hc_apply_all_pending()  # the state must include every update step() accepted
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        for st in self._hc_states:
            if st.phase in (Phase.IN_FLIGHT, Phase.PENDING):
                self._hc_consume(st)  # superseded by the loaded state
            st.phase = Phase.IDLE
            st.ready.clear()
        super().load_state_dict(state_dict)
        self._hc_link_topk_state()  # the loaded residuals into the buckets

    def export_trace(self, path: str) -> None:
        """Write the Chrome-trace timeline (needs ``trace=True``)."""
        self.timeline.write(path)

    def close(self) -> None:
        """Finish pending work, stop the channel and remove the hooks.

        Cleanup never raises a communication error: if pending updates cannot be
        finished (a peer failed), they are dropped with a warning and everything
        is released anyway. Call ``synchronize()`` first to have such a failure
        raised."""
        if self._hc_engine is None:
            return
        try:
            self._hc_stop_watching()
            if self._hc_channel.failure is None:
                self._hc_apply_all_pending()
                for st in self._hc_states:
                    if st.phase is Phase.IN_FLIGHT:
                        self._hc_consume(st)
        except HybridCommError as e:
            log.warning("hybridcomm: close(): pending updates dropped: %s", e)
        finally:
            engine, self._hc_engine = self._hc_engine, None
            engine.close()
            for h in self._hc_hooks + getattr(self, "_hc_applier_hooks", []):
                h.remove()
            self._hc_hooks, self._hc_applier_hooks = [], []


def _sparse_owned(model) -> set:
    """ids of the parameters of modules that make sparse gradients (sparse=True)."""
    if model is None:
        return set()
    return {id(p) for m in model.modules() if getattr(m, "sparse", False) is True
            for p in m.parameters(recurse=False)}


def _quantize(seconds: float) -> float:
    """A measured time rounded to 2 significant digits, so that plans repeat."""
    return float(f"{seconds:.1e}")


def describe_param_difference(ours, theirs, rank) -> str:
    """What differs between rank 0's and ``rank``'s (name, shape, dtype) lists."""
    only0 = [n for n, *_ in ours if n not in {t[0] for t in theirs}]
    only_r = [n for n, *_ in theirs if n not in {t[0] for t in ours}]
    parts = [f"only rank 0 has {only0}"] if only0 else []
    parts += [f"only rank {rank} has {only_r}"] if only_r else []
    parts += [f"{a[0]}: rank 0 has {a[1:]}, rank {rank} has {b[1:]}"
              for a, b in zip(ours, theirs) if a[0] == b[0] and a != b]
    return "; ".join(parts) or f"the order differs between rank 0 and rank {rank}"


def DistributedOptimizer(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module] = None,
                         named_parameters=None, strategy: str = "hybrid", overlap: str = "forward",
                         op: str = "avg", backward_passes_per_step: int = 1, compression=None,
                         cost_model=None, process_group=None, timeout: Optional[float] = None,
                         fusion_bytes: Optional[int] = None, split_bytes: Optional[int] = None,
                         measure_iters: int = 3, replan_every: int = 200, trace: bool = False,
                         lazy_bytes: Optional[int] = None):
    """Wrap ``optimizer`` so each step's gradients are all-reduced across ranks.

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
        overlap: ``"forward"``, ``"backward"`` or ``"none"`` (module docstring).
        op: ``"avg"`` (gradients averaged: same numbers as one process on the
            whole batch) or ``"sum"``.
        backward_passes_per_step: backward passes accumulated locally per step.
        compression: ``None``, ``"fp16"`` or ``"bf16"`` (the wire dtype), or
            ``"topk:RATIO"``: send each bucket's largest RATIO of entries, with
            error feedback and DGC's momentum correction (compression.py).
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
        measure_iters: steps measured (gradient order, windows, first uses)
            before the plan is re-made (0: never).
        replan_every: measure again every this many steps and re-plan if the
            measurements change a decision (drift); 0: only once.
        trace: record a timeline; ``opt.export_trace("trace.json")``.

    Raises:
        HybridCommError: on every rank, naming the parameters, if the ranks'
            parameters differ or one cannot be reduced (complex, sparse
            gradients, unsupported dtype, several devices).

    ``print(opt.plan)`` shows every bucket's algorithm, window and the issue
    order; the plan is logged at INFO (``HYBRIDCOMM_LOG_LEVEL``).

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
                 measure_iters, replan_every, trace, lazy_bytes)
    return opt


def _signature(items):
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in items]


def broadcast_parameters(params, root_rank: int = 0, process_group=None,
                         timeout: Optional[float] = None) -> None:
    """Copy ``root_rank``'s parameters (a state_dict or (name, tensor) pairs) to every rank.

    The ranks first agree that they hold the same names, shapes and dtypes; a
    difference is a HybridCommError on every rank naming it (never a crash or
    a partial copy). Every wait honours ``timeout``.

    Example::

        >>> hybridcomm.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    timeout = env.timeout(timeout)
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    items = [(n, t) for n, t in items if isinstance(t, torch.Tensor)]
    sigs = control.all_gather_object(_signature(items), group=process_group, timeout=timeout,
                                     what="the parameters to broadcast")
    root = sigs[root_rank]
    for r, theirs in enumerate(sigs):
        if theirs != root:
            raise HybridCommError(f"broadcast_parameters: the tensors differ between rank "
                                  f"{root_rank} and rank {r}: "
                                  + describe_param_difference(root, theirs, r).replace(
                                      "rank 0", f"rank {root_rank}"))
    src = dist.get_global_rank(process_group, root_rank) if process_group is not None else root_rank
    for name, t in items:
        control.wait_work(lambda: dist.broadcast(t.data, src=src, group=process_group,
                                                 async_op=True),
                          timeout, f"broadcasting {name!r}")


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_group=None, timeout: Optional[float] = None) -> None:
    """Make every rank's optimizer state (and hyper-parameters) equal ``root_rank``'s.

    The ranks first agree on the optimizer's parameter groups (sizes, shapes,
    dtypes); a difference is a HybridCommError on every rank naming it.

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> hybridcomm.broadcast_optimizer_state(opt, root_rank=0)
    """
    timeout = env.timeout(timeout)
    mine = [[(tuple(p.shape), str(p.dtype)) for p in g["params"]] for g in optimizer.param_groups]
    groups = control.all_gather_object(mine, group=process_group, timeout=timeout,
                                       what="the optimizer's parameter groups")
    for r, theirs in enumerate(groups):
        if theirs != groups[root_rank]:
            raise HybridCommError(
                f"broadcast_optimizer_state: rank {r}'s parameter groups differ from rank "
                f"{root_rank}'s: {len(theirs)} groups of sizes {[len(g) for g in theirs]} vs "
                f"{len(groups[root_rank])} of sizes {[len(g) for g in groups[root_rank]]}"
                + ("" if [len(g) for g in theirs] != [len(g) for g in groups[root_rank]]
                   else " (same sizes, different shapes or dtypes)"))
    rank = dist.get_rank(process_group)
    state = control.broadcast_object(_to_cpu(optimizer.state_dict()) if rank == root_rank else None,
                                     group=process_group, root=root_rank, timeout=timeout,
                                     what="the optimizer state")
    if rank != root_rank:
        optimizer.load_state_dict(state)
