"""The parameters a synchronizer reduces: the optimizer's trainable ones, named,
checked to be the same on every rank, and grouped into layers.

A parameter joins when it is in one of the optimizer's parameter groups and
requires a gradient; tied parameters (listed twice) count once. The set is
taken again when it may have changed (``add_param_group``, ``requires_grad``
flipped between steps): :meth:`ParamRegistry.trainable_changed` is a cheap
check of identities, the rebuild is collective (every rank checks the new set).
"""

from __future__ import annotations

from itertools import chain
from operator import is_
from typing import Dict, List, Sequence, Tuple

import torch
from torch.nn.parameter import is_lazy

from ..comm import control
from ..base.dtensor import group_problem, local_numel, local_shape
from ..base.errors import HybridCommError
from ..kernels import SUPPORTED_DTYPES
from ..plan.planner import Layer
from . import grad_fields


def trainable(param_groups) -> List[torch.nn.Parameter]:
    """The optimizer's trainable parameters, each once, in group order."""
    out, seen = [], set()
    for g in param_groups:
        for p in g["params"]:
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                out.append(p)
    return out


def sparse_owned(model) -> set:
    """ids of the parameters of modules that make sparse gradients (sparse=True)."""
    if model is None:
        return set()
    return {
        id(p)
        for m in model.modules()
        if getattr(m, "sparse", False) is True
        for p in m.parameters(recurse=False)
    }


def describe_param_difference(ours, theirs, rank) -> str:
    """What differs between rank 0's and ``rank``'s (name, shape, dtype) lists."""
    only0 = [n for n, *_ in ours if n not in {t[0] for t in theirs}]
    only_r = [n for n, *_ in theirs if n not in {t[0] for t in ours}]
    parts = [f"only rank 0 has {only0}"] if only0 else []
    parts += [f"only rank {rank} has {only_r}"] if only_r else []
    parts += [
        f"{a[0]}: rank 0 has {a[1:]}, rank {rank} has {b[1:]}"
        for a, b in zip(ours, theirs)
        if a[0] == b[0] and a != b
    ]
    return "; ".join(parts) or f"the order differs between rank 0 and rank {rank}"


class ParamRegistry:
    """One snapshot of the reduced parameters (dense, and sparse ones apart).

    Args:
        param_groups: the optimizer's ``param_groups`` (read, never changed).
        model: names and layers come from its modules (None: each parameter is
            a layer named ``param<i>``).
        named_parameters: names to use instead of ``model``'s.
        wire_dtype: the dtype gradients travel in (None: each parameter's own).
        group, timeout: for the agreement across ranks.
        device_path: whether gradients live on a (simulated) GPU.

    Raises ``HybridCommError`` on every rank when the ranks' sets differ or a
    parameter cannot be reduced (complex, sparse on a GPU, unsupported dtype,
    several devices), naming it.
    """

    def __init__(
        self,
        param_groups,
        model,
        named_parameters,
        *,
        wire_dtype,
        group,
        timeout: float,
        device_path: bool,
    ):
        self._groups, self.model, self._named = param_groups, model, named_parameters
        self.wire_dtype = wire_dtype
        params, names = self._collect()
        self._ids = [id(p) for p in params]
        self._listed = [p for g in param_groups for p in g["params"]]  # for trainable_changed
        self._requires = [p.requires_grad for p in self._listed]
        self._check(params, names, group, timeout, device_path=device_path)
        sparse = sparse_owned(model)
        self.sparse: List[Tuple[torch.nn.Parameter, str]] = [
            (p, n) for p, n in zip(params, names) if id(p) in sparse
        ]
        self.params = [p for p in params if id(p) not in sparse]
        self.names = [n for p, n in zip(params, names) if id(p) not in sparse]
        self.index: Dict[int, int] = {id(p): i for i, p in enumerate(self.params)}
        self.layers = self._layers()

    @property
    def device(self) -> torch.device:
        ps = self.params or [p for p, _ in self.sparse]
        return ps[0].device if ps else torch.device("cpu")

    def trainable_changed(self) -> bool:
        """Whether the optimizer's trainable parameters are no longer these (cheap when
        nothing changed: the same groups' lists and the same requires_grad flags)."""
        listed = list(chain.from_iterable(g["params"] for g in self._groups))
        # (per parameter and step: compared in C, map over operator.is_)
        if (
            len(listed) == len(self._listed)
            and all(map(is_, listed, self._listed))
            and grad_fields.requires_grad(listed) == self._requires
        ):
            return False
        return [id(p) for p in trainable(self._groups)] != self._ids

    def _collect(self):
        named = self._named
        if named is None and self.model is not None:
            named = self.model.named_parameters()
        by_id = {id(p): n for n, p in (named or [])}
        params, names = [], []
        for i, p in enumerate(trainable(self._groups)):
            if by_id and id(p) not in by_id:
                raise HybridCommError(
                    f"optimizer parameter #{i} (shape {tuple(p.shape)}) is not "
                    "among the model's named parameters"
                )
            params.append(p)
            names.append(by_id.get(id(p), f"param{i}"))
        return params, names

    def _check(self, params, names, group, timeout, device_path) -> None:
        """Every rank: the same parameters, and none we cannot reduce; else the same
        HybridCommError on every rank, naming the parameters and what to do."""
        owned = sparse_owned(self.model)
        problems = []
        lazy = [n for n, p in zip(names, params) if is_lazy(p)]
        if lazy:  # (no shape to agree on: the other checks would fail on it)
            problems.append(
                f"{', '.join(map(repr, lazy[:5]))} "
                f"{'is' if len(lazy) == 1 else 'are'} not initialized yet (a lazy "
                "module: nn.LazyLinear, ...): run one forward pass (a dummy batch) "
                "before making the DistributedOptimizer"
            )
            params = [p for p in params if not is_lazy(p)]
            names = [n for n in names if n not in lazy]
        for n, p in zip(names, params):
            if p.is_complex():
                problems.append(
                    f"{n!r} is complex ({p.dtype}): not supported; keep it as a "
                    "real parameter of twice the size (torch.view_as_real) and "
                    "build the complex tensor in forward"
                )
            elif p.dtype not in SUPPORTED_DTYPES:
                problems.append(
                    f"{n!r} has dtype {p.dtype}; supported: {', '.join(map(str, SUPPORTED_DTYPES))}"
                )
            if id(p) in owned and device_path:
                problems.append(
                    f"{n!r} belongs to a module with sparse=True: sparse gradients "
                    "are reduced on the CPU (gloo) path only; on GPUs use "
                    "sparse=False"
                )
            if p.is_sparse:
                problems.append(f"{n!r} is a sparse tensor: not supported")
            problem = group_problem(p, n, group)
            if problem:
                problems.append(problem)
        devices = {p.device for p in params}
        if len(devices) > 1:
            where = {
                str(d): [n for n, p in zip(names, params) if p.device == d][:3] for d in devices
            }
            problems.append(
                f"parameters are on several devices {where}: one DistributedOptimizer "
                "per device (data parallelism keeps a whole replica on each)"
            )
        mine = [(n, tuple(local_shape(p)), str(p.dtype)) for n, p in zip(names, params)]
        everyone = control.all_gather_object(
            (mine, problems), group=group, timeout=timeout, what="the trainable parameters"
        )
        bad = [f"rank {r}: {msg}" for r, (_, probs) in enumerate(everyone) for msg in probs]
        if bad:
            raise HybridCommError("hybridcomm cannot reduce these parameters: " + "; ".join(bad))
        for r, (theirs, _) in enumerate(everyone):
            if theirs != everyone[0][0]:
                raise HybridCommError(
                    "the trainable parameters differ across ranks: "
                    + describe_param_difference(everyone[0][0], theirs, r)
                )

    def wire(self, p) -> torch.dtype:
        return self.wire_dtype or p.dtype

    def _layers(self) -> List[Layer]:
        """Layers (a module's own parameters, one dtype each), last module first:
        backward's order. A bucket keeps its parameters' dtype; the wire dtype
        only groups them (so one bucket has one wire dtype)."""
        index, params = self.index, self.params
        groups, placed = [], set()
        if self.model is not None:
            for mname, m in self.model.named_modules():
                own = [
                    index[id(p)]
                    for p in m.parameters(recurse=False)
                    if id(p) in index and id(p) not in placed
                ]
                placed.update(id(params[i]) for i in own)
                by_dtype: Dict[Tuple[torch.dtype, torch.dtype], list] = {}
                for i in own:
                    by_dtype.setdefault((params[i].dtype, self.wire(params[i])), []).append(i)
                for (dt, _), idx in by_dtype.items():
                    suffix = f"[{str(dt).replace('torch.', '')}]" if len(by_dtype) > 1 else ""
                    groups.append((f"{mname or '<root>'}{suffix}", idx))
        for i, p in enumerate(params):
            if id(p) not in placed:
                groups.append((self.names[i], [i]))
        return [self._layer(n, idx) for n, idx in groups][::-1]

    def _layer(self, name: str, idx: Sequence[int]) -> Layer:
        p = self.params[idx[0]]
        wire = self.wire(p)
        sizes = [local_numel(self.params[i]) for i in idx]  # a DTensor: this rank's shard
        return Layer(
            name,
            list(idx),
            sum(sizes),
            torch.empty((), dtype=wire).element_size(),
            dtype=str(p.dtype),
            sizes=sizes,
            shapes=[tuple(local_shape(self.params[i])) for i in idx],
        )


def refuse_wrapped(model) -> None:
    """A model (or a module in it) that DDP or FSDP already synchronizes: both would
    write the gradients, DDP's average into the buckets while hybridcomm's is in
    flight. Refused on every rank alike, naming the wrapper and the fix."""
    if model is None:
        return
    from torch.nn.parallel import DistributedDataParallel

    kinds = [DistributedDataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        kinds.append(FullyShardedDataParallel)
        from torch.distributed.fsdp import FSDPModule  # fully_shard (FSDP2)

        kinds.append(FSDPModule)
    except ImportError:
        pass
    for name, m in model.named_modules():
        if isinstance(m, tuple(kinds)):
            where = f"the module {name!r}" if name else "the model"
            raise HybridCommError(
                f"{where} is wrapped in {type(m).__name__}, which synchronizes gradients "
                "itself: hybridcomm.DistributedOptimizer replaces it. Pass the plain module "
                "(ddp_model.module) and drop the wrapper; to keep DDP, register hybridcomm's "
                "all-reduce as its comm hook instead (hybridcomm.ddp.register)"
            )
