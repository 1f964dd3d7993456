"""Sharded optimizer state (``DistributedOptimizer(shard="optimizer" | "gradients")``):
each rank keeps and steps the optimizer state of its part of every bucket.

Backward reduce-scatters each bucket (the first half of its algorithm), so a
rank holds the average of its own part; ``step()`` runs the wrapped optimizer
on this rank's slices (views of the parameters, 1/P of the state), then
all-gathers each bucket into the parameters (in forward mode, pending until
their first read). Only an element-wise optimizer is sliced by element; every
other gets whole parameters (granularity.py). ``full_state()`` /
``slice_state()`` convert to and from the plain optimizer's state; DCP gets
each rank's part (dcp.py); a re-plan moves what changes owner (reshard.py).
docs/ARCHITECTURE.md ("Sharded optimizer state") has the path.

Example::

    opt = hybridcomm.DistributedOptimizer(torch.optim.AdamW(model.parameters()),
                                          model=model, shard="optimizer")
    loss_fn(model(x), y).backward(); opt.clip_grad_norm_(1.0); opt.step()
"""

from __future__ import annotations

import functools
import json
import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

import torch.distributed as dist

from ..algorithms import SHARDABLE
from ..base.dtensor import is_dtensor
from ..base.errors import HybridCommError
from ..comm import control
from ..config import env
from ..gpu.runtime import runtime_for
from . import dcp, grad_fields, granularity, pending
from .bucket_group import Phase
from .buckets import copy_into
from .reshard import move_state, owned_ranges, placement
from .scatter import ReleasedGrad, all_gather, is_released, keep_part, unscatter


class Slice:
    """The part ``[start, stop)`` of ``param`` (flattened) in this rank's shard: at
    ``[at, at + stop - start)`` of the buffer of the bucket ``state`` keeps. A
    whole parameter's (``shard_by="parameters"``) has the parameter's shape, and so
    does its gradient: the optimizer steps it as the tensor it is."""

    __slots__ = ("param", "index", "start", "stop", "tensor", "state", "at", "_grad", "_of")

    def __init__(self, param, index: int, start: int, stop: int, state, at: int, whole: bool):
        self.param, self.index, self.start, self.stop = param, index, start, stop
        # the parameter's own memory, so that the optimizer's update lands in it
        self.tensor = param.detach() if whole else param.detach().view(-1)[start:stop]
        self.state, self.at = state, at
        self._grad, self._of = None, None  # the view, and id() of the buffer it views

    @property
    def grad(self) -> torch.Tensor:
        """Its gradient: a view of the bucket's buffer (which "gradients" renews), or
        of the part kept where backward released the rest (scatter.py), made once per
        buffer (a view costs ~1 us; two reads per slice and step)."""
        b = self.state.bucket
        memory = b.buffer if b.buffer is not None else b.part
        if self._of != id(memory):  # (the cached view keeps its memory, and so its id)
            view = b.region(self.at, self.stop - self.start).view(self.tensor.shape)
            self._grad, self._of = view, id(memory)
        return self._grad

    def drop_grad(self) -> None:
        """Before its bucket's memory is released: the cached view would keep it."""
        self._grad = self._of = None


class Shards:
    """This rank's slices of every bucket of ``group``, its step and its gather."""

    def __init__(
        self,
        group,
        params: List[torch.nn.Parameter],
        rank: int,
        world: int,
        release: bool,
        on_read: Callable[[torch.Tensor], None],
    ):
        self.group, self.release, self.rank, self.world = group, release, rank, world
        self.on_read = on_read  # forward mode: a pending parameter is read (deferred.py)
        self.params = params
        index = {id(p): i for i, p in enumerate(params)}
        self.slices: List[Slice] = []
        self.owned: Dict[int, List[Tuple[int, int]]] = {}  # bucket index -> this rank's parts
        self.placement: Dict[int, tuple] = {}  # id(param) -> how every rank slices it
        for s in group.states:
            b = s.bucket
            self.owned[s.index] = owned_ranges(
                b.spec.segments, rank, world, b.spec.algorithm, tail=b.spec.tail
            )
            for pos, p in enumerate(b.params):
                self.placement[id(p)] = placement(b.spec, b.offsets[pos], b.views[pos].numel())
            whole = b.spec.owners is not None
            for lo, hi in self.owned[s.index]:
                for pos, p in enumerate(b.params):
                    o, n = b.offsets[pos], b.views[pos].numel()
                    start, stop = max(lo, o), min(hi, o + n)
                    if start >= stop:
                        continue
                    if whole and (start, stop, b.spec.owners[pos]) != (o, o + n, rank):
                        raise HybridCommError(
                            f"bucket {s.index}: rank {rank}'s part [{lo}, {hi}) cuts parameter "
                            f"{index[id(p)]} at [{o}, {o + n}) (owner {b.spec.owners[pos]}), "
                            "but its state is sharded by whole parameters: the plan's layout "
                            "and the reduce-scatter's parts disagree"
                        )
                    self.slices.append(
                        Slice(p, index[id(p)], start - o, stop - o, state=s, at=start, whole=whole)
                    )
        self.by_param: Dict[int, List[Slice]] = {}
        self.by_bucket: Dict[int, List[Slice]] = {s.index: [] for s in group.states}
        for sl in self.slices:
            self.by_param.setdefault(id(sl.param), []).append(sl)
            self.by_bucket[sl.state.index].append(sl)
        self._members = (None, None)  # (the param_groups' ids, the slices of each group)
        # The next forward's order of need where measured, else the reverse of the
        # buckets' (made in backward's order): what the forward reads first goes first
        self.gather_order = sorted(
            group.states, key=lambda s: (s.bucket.spec.need is None, s.bucket.spec.need, -s.index)
        )
        # "gradients": each parameter's .grad while its bucket keeps only this rank's part
        self.placeholders = {id(p): ReleasedGrad(p) for p in params} if release else {}

    def drop_grads(self) -> None:
        """Every slice's cached view of its bucket's memory (the buckets are replaced)."""
        for sl in self.slices:
            sl.drop_grad()

    def release_reduced(self) -> None:  # host path
        """``shard="gradients"``, in backward (after a bucket's launch, and at the
        pass's end): each bucket whose reduce-scatter is done is consumed, keeps this
        rank's part and frees the rest of its memory (scatter.py)."""
        g = self.group
        for s in g.states:
            if s.phase is Phase.IN_FLIGHT and g.engine.done(s.index):
                g.consume(s)
                if s.scattered:  # (no slice holds a view of it: the last gather dropped them)
                    keep_part(s, self.owned[s.index], self.placeholders)

    def reserve(self, s):
        """A GPU, ``shard="gradients"``, at bucket ``s``'s launch in backward: where every
        ``.grad`` is its view, memory for this rank's part, and the copy into it that
        runs on the comm stream behind the reduce-scatter (engine.py); None: kept whole.
        The host is ahead of the device there, so waiting to see a reduction done
        would release little before the step."""
        b = s.bucket
        if not (s.complete and s.content and grad_fields.bound(b.params, b.views)):
            return None
        return b.reserve_part(self.owned[s.index])

    def drop(self, s) -> None:
        """Bucket ``s``'s launch is issued: its buffer goes (the allocator reuses the
        memory once the comm stream is past it), its ``.grad`` the placeholders."""
        keep_part(s, (), self.placeholders, reserved=True)

    # ---- the step ------------------------------------------------------------------------
    def step(self, opt, base_step: Callable[[], object]):
        """The wrapped optimizer's step on this rank's slices (after the reduce-scatter),
        then every bucket all-gathered into the parameters."""
        saved = opt.param_groups
        key = [id(g) for g in saved]
        if self._members[0] != key:  # which group each slice is in: once per groups' layout
            group_of = {id(p): i for i, g in enumerate(saved) for p in g["params"]}
            members: List[list] = [[] for _ in saved]
            for sl in self.slices:
                members[group_of[id(sl.param)]].append(sl.tensor)
            self._members = (key, members)
        for sl in self.slices:
            sl.tensor.grad = sl.grad if sl.param.grad is not None else None  # None: unused
        # the live hyper-parameters (an LR schedule's, add_param_group's), this rank's slices
        opt.param_groups = [dict(g, params=m) for g, m in zip(saved, self._members[1])]
        try:
            loss = base_step()
        finally:
            opt.param_groups = saved
            for sl in self.slices:
                sl.tensor.grad = None
        self.gather()
        return loss

    def gather(self) -> None:
        """Every rank's updated slices into every parameter, bucket by bucket, through
        the bucket's buffer (its gradients are used up). Forward mode: each bucket's
        all-gather is queued on the channel, and the first read of one of its
        parameters waits for it (deferred.py, pending.py); else it completes now."""
        g = self.group
        defer = g.config.overlap == "forward"
        for s in self.gather_order:
            if s.bucket.released:  # (in backward, when its reduction was done here: a rank's
                # own timing) what is still a placeholder, as a whole bucket's bound views
                # are its content (settle): zero_grad() since leaves nothing, on every rank
                s.content = {pos for pos in s.content if is_released(s.bucket.params[pos].grad)}
            if not s.content:  # nothing reduced since the last gather (a step without a
                # backward), or no rank had a gradient: the parameters stand, and the
                # buffer holds zeros on every rank (whole: opening it needs no all-gather,
                # which ranks would queue at different points of the next backward)
                if s.scattered:
                    s.scattered = False
                    g.rearm(s)
                continue
            b = s.bucket
            if b.released:  # (released in backward: the updated slices go into a buffer again)
                b.restore()
            mine = self.by_bucket[s.index]
            if mine:
                copy_into([sl.grad for sl in mine], [sl.tensor for sl in mine])
            for p in b.params:
                p.grad = None  # the buffer holds parameters from here on
            s.content.clear()
            s.scattered = False
            g.rearm(s)  # (its .grad is None now: nothing to guard)
            tickets = all_gather(g, s, f"bucket {s.index}'s parameters (all_gather)")
            if not defer:
                self._gathered(s, tickets)
                continue
            s.gathered = functools.partial(self._gathered, s, tickets)
            g.to(s, Phase.PENDING)
            pending.defer(b.params, self.on_read)

    def _gathered(self, s, tickets) -> None:
        """Bucket ``s``'s all-gather is done (``tickets``: waited for here): its
        parameters take their values from the buffer."""
        g, b = self.group, s.bucket
        for t in tickets:
            g.links.channel.wait(t, f"bucket {s.index}'s parameters")
        s.gathered = None
        with torch.no_grad():
            copy_into([p.detach() for p in b.params], list(b.views))
        if s.phase is Phase.PENDING:
            g.to(s, Phase.IDLE)
        if self.release:
            for sl in self.by_bucket[s.index]:
                sl.drop_grad()
            b.release()

    def clip_grad_norm_(self, max_norm: float, norm_type: float, group, timeout: float):
        """The norm of the whole gradient (every rank's part; ``.grad`` None parts
        count nothing) and every part scaled as ``torch.nn.utils.clip_grad_norm_``
        scales the whole. Returns the total norm."""
        grads = [sl.grad for sl in self.slices if sl.param.grad is not None]
        norm_type = float(norm_type)
        dtype = torch.float64
        grads = [g for g in grads if g.numel()]
        # (one host read of this rank's part, however many slices)
        if math.isinf(norm_type):
            local = (
                float(torch.stack([g.abs().max().to(dtype) for g in grads]).max()) if grads else 0.0
            )
            total = max(
                control.all_gather_object(
                    local, group=group, timeout=timeout, what="the gradient's norm"
                )
            )
        else:
            local = (
                float(torch.stack([g.to(dtype).abs().pow(norm_type).sum() for g in grads]).sum())
                if grads
                else 0.0
            )
            total = sum(
                control.all_gather_object(
                    local, group=group, timeout=timeout, what="the gradient's norm"
                )
            ) ** (1 / norm_type)
        coef = max_norm / (total + 1e-6)
        if coef < 1 and grads:
            torch._foreach_mul_(grads, coef)
        return torch.tensor(total)

    # ---- state: this rank's slices <-> the plain optimizer's ---------------------------
    def pieces(self, state: dict, indices=None) -> Dict[int, dict]:
        """This rank's state (parameter index -> key -> (start, tensor piece), or
        (None, value) for what is not per element), on the CPU; of the parameters
        at ``indices`` only, where given."""
        mine: Dict[int, dict] = {}
        for sl in self.slices:
            if indices is not None and sl.index not in indices:
                continue
            for key, v in state.get(sl.tensor, {}).items():
                if torch.is_tensor(v):
                    v = v.detach().cpu()
                piece = torch.is_tensor(v) and v.dim() > 0 and v.shape == sl.tensor.shape
                mine.setdefault(sl.index, {})[key] = (sl.start, v) if piece else (None, v)
        return mine

    def full_state(self, state: dict, group, timeout: float, indices=None) -> Dict[int, dict]:
        """Every parameter's state as the plain optimizer keeps it (its index among
        ``params`` -> dict), put together from every rank's slices (a collective;
        the same on every rank; tensors on the CPU); of the parameters at
        ``indices`` only, where given."""
        return assemble(
            control.all_gather_object(
                self.pieces(state, indices),
                group=group,
                timeout=timeout,
                what="the sharded optimizer state",
            ),
            [p.shape for p in self.params],
        )

    def slice_state(self, state: dict, full: Dict[object, dict]) -> None:
        """``state`` holds this rank's slices' entries, cut from ``full`` (param ->
        the plain optimizer's state of that parameter)."""
        for p, st in full.items():
            for sl in self.by_param.get(id(p), []):
                state[sl.tensor] = {
                    k: (
                        v.reshape(-1)[sl.start : sl.stop]
                        .reshape(sl.tensor.shape)
                        .to(sl.tensor.device)
                        .clone()
                        if torch.is_tensor(v) and v.dim() > 0 and v.shape == p.shape
                        else v
                    )
                    for k, v in st.items()
                }


def assemble(parts, shapes) -> Dict[int, dict]:
    """Every rank's :meth:`Shards.pieces` put together: parameter index -> the plain
    optimizer's state of that parameter (``shapes``: each parameter's)."""
    out: Dict[int, dict] = {}
    for theirs in parts:
        for index, entries in theirs.items():
            st = out.setdefault(index, {})
            for key, (start, v) in entries.items():
                if start is None:
                    st.setdefault(key, v)
                else:
                    st.setdefault(key, []).append((start, v))
    for index, st in out.items():
        shape = shapes[index]
        for key, v in st.items():
            if isinstance(v, list):  # pieces of a per-element tensor, in order
                whole = torch.cat([t.reshape(-1) for _, t in sorted(v, key=lambda x: x[0])])
                if whole.numel() != shape.numel():
                    raise HybridCommError(
                        f"the shards of state {key!r} of parameter {index} "
                        f"cover {whole.numel()} of {shape.numel()} elements: "
                        "pass every rank's sharded_state_dict()"
                    )
                st[key] = whole.view(shape)
    return out


def settle_options(
    options: dict, optimizer_class: type, process_group, servers, param_groups
) -> dict:
    """``DistributedOptimizer``'s options with ``shard`` on: what cannot be combined
    with it yet is refused on every rank alike (before any collective), naming the
    option; every bucket is reduce-scattered with an algorithm that has a phase of
    its own (``algorithms.SHARDABLE``), chosen per bucket by the cost model unless
    forced: on the host path not gloo's own (``native``: with it a transformer's
    step took 1.23x the ring's at 100 Mbit/s, docs/PERFORMANCE.md). The state is
    cut into element slices or whole parameters (granularity.py)."""
    shard, why = options["shard"], []
    optimizer_name = optimizer_class.__name__
    shard_by, reason = granularity.choose(optimizer_class, options.get("shard_by"))
    if options.get("compression") is not None:
        why.append(f"compression={options['compression']!r} (leave it None)")
    if options.get("lazy_bytes"):
        why.append("lazy_bytes (a pool crosses the parameters' shards)")
    if optimizer_name in ("LBFGS", "ZeroRedundancyOptimizer"):
        why.append(f"{optimizer_name} (its step needs whole tensors, or shards itself)")
    forced = env.get("HYBRIDCOMM_ALGO") or options.get("strategy")
    params = [p for g in param_groups for p in g["params"]]
    host = not params or runtime_for(params[0].device) is None
    # (per bucket, by the cost model)
    chosen = forced if forced in SHARDABLE else "sharded-host" if host else "sharded"
    world = dist.get_world_size(process_group)
    if servers is not None:
        why.append("servers= (the summation servers sum whole buckets)")
    if forced not in (None, "", "hybrid", "auto") and forced not in SHARDABLE:
        why.append(
            f"the algorithm {forced!r} (strategy or HYBRIDCOMM_ALGO): buckets are "
            f"reduce-scattered with one of {SHARDABLE}"
        )
    elif forced == "halving_doubling" and world & (world - 1):
        why.append(
            f"the algorithm 'halving_doubling' at {world} ranks (its reduce-scatter "
            "alone needs a power of two)"
        )
    if why:
        raise HybridCommError(f"shard={shard!r} cannot be combined with " + "; ".join(why))
    return dict(options, strategy=chosen, shard_by=shard_by, shard_by_reason=reason)


# The key of hybridcomm's own state (JSON) in the first parameter group of a DCP state
DCP_GROUP_KEY = "hybridcomm"


def from_group(value) -> Optional[dict]:
    """hybridcomm's own state as :meth:`ShardedOptimizer._hc_dcp_state_dict` put it in
    a parameter group, or None for anything else."""
    try:
        ours = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        return None
    return ours if isinstance(ours, dict) and ours.get("form") == "dcp" else None


class ShardedOptimizer:
    """The optimizer API's sharded parts, mixed into ``DistributedOptimizer``
    (``self._hc_shards``: the :class:`Shards` of its buckets, or None)."""

    _hc_shards = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, on the
        reduced gradients: reduces what backward produced first (as
        ``synchronize()``), then clips; the next ``step()`` uses the clipped
        gradients. With ``shard`` on, the norm is the whole gradient's (every
        rank's part) and each rank scales its part, with no all-gather of the
        gradients (``synchronize()`` then torch's function gives the same, at the
        cost of one). Returns the total norm.

        Example::

            >>> opt = hybridcomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
            ...                                       model=model, overlap="backward")
            >>> x, y = loader[0]; loss_fn(model(x), y).backward()
            >>> float(opt.clip_grad_norm_(1e9)) > 0
            True
            >>> opt.step(); opt.close()
        """
        sync = self._hc_sync
        sync.begin_step()
        sync.finish()
        self._hc_synchronized = True
        if self._hc_shards is None:
            return torch.nn.utils.clip_grad_norm_(
                [p for g in self.param_groups for p in g["params"]], max_norm, norm_type
            )
        self._hc_reshard()
        return self._hc_shards.clip_grad_norm_(
            max_norm, norm_type, sync.process_group, sync.timeout
        )

    def _hc_reshard(self) -> None:
        """Slices for the current buckets (a new plan, or parameters that joined):
        the state moves over from the old slices (a collective), or, the first
        time, from the optimizer's own (Adagrad makes it in its constructor)."""
        sync, old = self._hc_sync, self._hc_shards
        if old is not None and old.group is sync.group:
            return
        odd = [
            sync.registry.names[i]
            for i, p in enumerate(sync.params)
            if is_dtensor(p) or not p.is_contiguous()
        ]
        if odd:  # (every rank alike: the parameters agree)
            raise HybridCommError(
                f"shard={sync.config.shard!r} needs plain contiguous "
                f"parameters; {odd[:3]} are not (channels_last: keep the "
                "parameters contiguous; DTensor (tensor-parallel) parameters "
                "are not sharded yet)"
            )
        release = sync.config.shard == "gradients"
        new = Shards(
            sync.group,
            sync.params,
            sync.rank,
            sync.world,
            release=release,
            on_read=sync.deferred.on_read,
        )
        if release and env.get("HYBRIDCOMM_RELEASE_IN_BACKWARD"):
            if sync.channel.stream_ordered:  # in flight: on the comm stream
                sync.group.in_flight_release = new
            else:  # host path: once done
                sync.after_launch = self._hc_release_reduced
        # the optimizer's own per-parameter state (Adagrad makes it in its constructor;
        # a parameter frozen since kept it whole) joins the shards with its parameter
        new.slice_state(self.state, {p: self.state.pop(p) for p in sync.params if p in self.state})
        if old is not None:  # the old slices' state to the new ones (a collective where
            # some parameter's slicing changed; a frozen one's whole: reshard.py)
            move_state(
                old,
                new,
                self.state,
                sync.process_group,
                timeout=sync.timeout,
                run_bytes=env.get("HYBRIDCOMM_RESHARD_BYTES"),
            )
        self._hc_shards = new

    def _hc_release_reduced(self) -> None:  # host path
        """In backward: the buckets whose reduce-scatter is done keep this rank's part
        only (``shard="gradients"``; not after a re-plan until the next step's slices)."""
        shards = self._hc_shards
        if shards is not None and shards.group is self._hc_sync.group:
            shards.release_reduced()

    def _hc_shard_step(self, closure, base_step):
        if closure is not None:
            raise HybridCommError(
                "shard= takes no closure that the optimizer evaluates itself in step()"
            )
        self._hc_reshard()
        loss = self._hc_shards.step(self, base_step)
        self._hc_sync.apply_read_in_compiled_code()  # (forward mode: deferred all-gathers)
        return loss

    def _hc_make_whole(self) -> None:
        """After ``synchronize()`` (to clip, or for GradScaler's inf check): under
        ``shard`` every bucket's parts all-gathered, so that ``.grad`` is the whole
        reduced gradient on every rank, as without it (an all-gather more; the
        step still takes this rank's part)."""
        if self._hc_shards is not None:
            for s in self._hc_sync.group.states:
                if s.scattered:
                    unscatter(self._hc_sync.group, s)

    def _hc_sharded_state_dict(self, base_state_dict: Callable[[], dict]) -> dict:
        """The plain optimizer's state_dict, put together from every rank's slices (a
        collective: every rank calls it, every rank gets it)."""
        sync, shards = self._hc_sync, self._hc_shards
        full = shards.full_state(self.state, sync.process_group, sync.timeout)
        saved = self.state
        slices = {id(sl.tensor) for sl in shards.slices}
        self.state = type(saved)(saved.default_factory) if hasattr(saved, "default_factory") else {}
        self.state.update({p: st for p, st in saved.items() if id(p) not in slices})  # frozen
        self.state.update(
            {
                shards.params[i]: {
                    k: v.to(shards.params[i].device) if torch.is_tensor(v) and v.dim() else v
                    for k, v in st.items()
                }
                for i, st in full.items()
            }
        )
        try:
            return base_state_dict()
        finally:
            self.state = saved

    def _hc_dcp_state_dict(self, base_state_dict: Callable[[], dict]) -> dict:
        """This rank's part of the state, for ``torch.distributed.checkpoint`` (dcp.py):
        no collective, nothing gathered; hybridcomm's own state rides in the first
        parameter group (DCP's ``get_state_dict`` keeps the groups, not other keys), as
        JSON."""
        sync, shards = self._hc_sync, self._hc_shards
        entries = dcp.save_entries(shards, self.state)
        slices = {id(sl.tensor) for sl in shards.slices}
        saved = self.state
        self.state = {p: st for p, st in saved.items() if id(p) not in slices}  # frozen, whole
        self.state.update(entries)
        try:
            state = base_state_dict()
        finally:
            self.state = saved
        if state["param_groups"]:
            # one string: DCP stores it whole (a nested plan would be a key per field,
            # which a job whose plan differs could not load); plain types only under shard
            ours = json.dumps(dict(sync.state_dict(), form="dcp"))
            state["param_groups"][0][DCP_GROUP_KEY] = ours
        return state

    def _hc_load_dcp_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`_hc_dcp_state_dict` gave DCP, once DCP filled it in (or a
        consolidated state in that form): the hyper-parameters and a frozen
        parameter's whole state through the plain optimizer, each slice's from its
        pieces (dcp.py). No collective."""
        shards = self._hc_shards
        saved_keys = [k for g in state_dict["param_groups"] for k in g["params"]]
        mine = [p for g in self.param_groups for p in g["params"]]
        if len(saved_keys) != len(mine):
            raise HybridCommError(
                f"load_state_dict: the checkpoint has {len(saved_keys)} parameters, "
                f"this optimizer {len(mine)}"
            )
        by_key = dict(zip(saved_keys, mine))
        sharded = {id(p) for p in shards.params}
        loaded = {by_key[k]: v for k, v in state_dict["state"].items()}
        kept = self.state
        super().load_state_dict(
            {
                "state": {
                    k: v for k, v in state_dict["state"].items() if id(by_key[k]) not in sharded
                },
                "param_groups": state_dict["param_groups"],
            }
        )
        for sl in shards.slices:  # (the plain optimizer's load replaced the state)
            if sl.tensor in kept:
                self.state[sl.tensor] = kept[sl.tensor]
        dcp.load_entries(shards, self.state, {p: v for p, v in loaded.items() if id(p) in sharded})

    def sharded_state_dict(self) -> dict:
        """This rank's part of the optimizer state, with no collective (each rank
        saves its own); :meth:`load_sharded_state_dict` takes every rank's, at
        any world size. Tensors on the CPU; ``torch.load(weights_only=True)``
        reads it.

        Example::

            torch.save(opt.sharded_state_dict(), f"opt.{rank}.pt")      # every rank
            ...
            opt.load_sharded_state_dict([torch.load(f"opt.{r}.pt", weights_only=True)
                                         for r in range(saved_world)])
        """
        sync, shards = self._hc_sync, self._hc_shards
        if shards is None:
            raise HybridCommError("sharded_state_dict() needs shard=; use state_dict()")
        sync.apply_pending()
        slices = {id(sl.tensor) for sl in shards.slices}
        saved = self.state
        self.state = {p: st for p, st in saved.items() if id(p) not in slices}  # frozen, whole
        try:
            state = super().state_dict()  # the groups, and what is kept whole
        finally:
            self.state = saved
        state["hybridcomm_shard"] = {
            "rank": sync.rank,
            "world": sync.world,
            "names": list(sync.registry.names),
            "pieces": shards.pieces(saved),
        }
        state["hybridcomm"] = sync.state_dict()
        return state

    def load_sharded_state_dict(self, states) -> None:
        """Load every rank's :meth:`sharded_state_dict` (a list, any order), saved at
        any world size; no collective (every rank passes them all)."""
        sync, shards = self._hc_sync, self._hc_shards
        states = list(states)
        if shards is None or not states or any("hybridcomm_shard" not in st for st in states):
            raise HybridCommError(
                "load_sharded_state_dict() takes every rank's "
                "sharded_state_dict(), into an optimizer with shard="
            )
        first = states[0]["hybridcomm_shard"]
        ranks = sorted(st["hybridcomm_shard"]["rank"] for st in states)
        if ranks != list(range(first["world"])):
            raise HybridCommError(
                f"load_sharded_state_dict(): the checkpoint has "
                f"{first['world']} ranks' parts, {ranks} were given"
            )
        if first["names"] != list(sync.registry.names):
            raise HybridCommError(
                "load_sharded_state_dict(): the checkpoint's parameters "
                "differ from this optimizer's"
            )
        full = assemble(
            [st["hybridcomm_shard"]["pieces"] for st in states], [p.shape for p in sync.params]
        )
        position = {
            id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])
        }
        plain = {k: v for k, v in states[0].items() if k != "hybridcomm_shard"}
        plain["state"] = dict(plain["state"])
        plain["state"].update({position[id(sync.params[i])]: st for i, st in full.items()})
        self.load_state_dict(plain)

    def _hc_unshard_loaded(self) -> None:
        """After the plain optimizer's ``load_state_dict``: its per-parameter state cut
        into this rank's slices."""
        shards = self._hc_shards
        plain = {p: self.state.pop(p) for p in shards.params if p in self.state}
        shards.slice_state(self.state, plain)
