"""Layers -> buckets -> (algorithm, issue order): the plan every rank follows.

Rank 0 plans, every rank follows. The inputs: the trainable parameters grouped
into layers (a module's own parameters) in backward order, the cost model and,
once measured, each layer's overlap window, ready time and place in the next
forward. :func:`make_plan` fuses layers into buckets (or lazy pools), splits
large buckets into segments, chooses each bucket's algorithm and compression,
and fixes the issue order. ``print(plan)`` shows the table and the order, and
``plan.notes`` says why each default was chosen. The rules: docs/ARCHITECTURE.md,
"The plan".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..config import env
from ..algorithms import ALGORITHMS, Topology
from ..algorithms.lowrank import POWERSGD, message_numels
from ..algorithms.topk import TOPK, segment_numel, sparse_bytes_sent
from .cost_model import NATIVE, PS, CostModel, bytes_sent
from .layout import ALIGN_BYTES, buffer_numel, equal_parts, layout
from .layout import segments as cut_segments
from .order import drop_split_that_cannot_pay, issue_order, merge_adjacent
from .ownership import WHOLE_BALANCE, assign, balanced, owner_layout
from .records import Bucket, Layer, Plan, plan_from_dict

__all__ = ["Bucket", "Layer", "Plan", "plan_from_dict", "make_plan", "forced_algorithm"]

BUCKET_ALGORITHMS = ALGORITHMS + (NATIVE, PS)
STRATEGY_CANDIDATES = {
    "hybrid": ("ring", "butterfly", NATIVE),
    "auto": BUCKET_ALGORITHMS,
    "sharded": ("ring", "halving_doubling", NATIVE),  # algorithms.SHARDABLE
    "sharded-host": ("ring", "halving_doubling"),
}  # (gloo's is slow: shard.py)
SHARDED_HD_GAIN = 0.25  # "sharded": halving-doubling where this much faster (PERFORMANCE.md)
MIN_FUSION, MAX_FUSION = 64 << 10, 32 << 20
FUSION_BALANCE = 4  # a fused bucket's bytes cost >= 4x its fixed cost (<= 20% overhead)
MIN_SPLIT, MAX_SPLIT = 1 << 20, 256 << 20
SPLIT_BALANCE = 10  # a segment's bytes cost >= 10x its fixed cost (<= 10% overhead)


def forced_algorithm(strategy: str) -> Optional[str]:
    """The algorithm every bucket must use, or None for a per-bucket choice."""
    forced = env.get("HYBRIDCOMM_ALGO")
    if forced:
        return forced
    if strategy in STRATEGY_CANDIDATES:
        return None
    if strategy not in BUCKET_ALGORITHMS:
        raise ValueError(
            f"unknown strategy {strategy!r}; choose one of "
            f"{tuple(STRATEGY_CANDIDATES) + BUCKET_ALGORITHMS}"
        )
    return strategy


def _with_ps(
    candidates: List[str], forced: Optional[str], servers: int, model: CostModel, notes: List[str]
) -> List[str]:
    """``candidates`` plus ``ps`` where the job has servers and the model a line for
    that many; a forced ``ps`` without servers is an error."""
    if forced == PS and not servers:
        raise ValueError(
            "algorithm 'ps' needs summation servers: pass servers= "
            "(hybridcomm.comm.servers.split_world / SummationServers)"
        )
    others = [a for a in candidates if a != PS]
    if not servers or forced:
        return others
    if model.offers(PS, servers):
        return others + [PS]
    notes.append(
        f"ps not a candidate: the cost model has no ps line for {servers} servers"
        + (f" (it was measured with {model.ps_servers})" if model.ps_servers else "")
    )
    return others


def balance_bytes(
    model: CostModel, world_size: int, topology: Optional[Topology] = None, extra_s: float = 0.0
) -> float:
    """Bytes at which one all-reduce's fixed cost (plus ``extra_s`` per call) equals
    its bytes' cost, for the bandwidth algorithm at this world size (the ring;
    hierarchical across nodes). A ring's fixed cost grows with P, so this is about
    P alpha/beta."""
    p = max(world_size, 2)  # one rank sends nothing: size as for two
    topo = Topology(node_size=topology.node_size if topology else None).resolve(p)
    algo = "hierarchical" if 1 < topo.node_size < p else "ring"
    fixed = model.predict(algo, 0, p, topo)
    per_byte = (model.predict(algo, 1 << 20, p, topo) - fixed) / (1 << 20)
    return (fixed + extra_s) / per_byte


def default_fusion(
    model: CostModel,
    notes: List[str],
    world_size: int = 2,
    topology: Optional[Topology] = None,
    call_s: Optional[float] = None,
) -> int:
    """Fuse until a bucket's bytes cost FUSION_BALANCE times its fixed cost,
    clamped to [MIN_FUSION, MAX_FUSION]; a degenerate fit takes a bound. ``call_s``:
    what each call cost beyond the model in the measured steps, added to the fixed
    cost (an idle-link probe does not see the peers' waits and the link's start-up)."""
    if model.beta <= 0:
        notes.append(
            f"the cost model has no per-byte cost (beta = 0), so it cannot size "
            f"buckets: small layers are fused up to {MAX_FUSION} B, a safe bound "
            "(`hybridcomm-bench --calibrate` fits one)"
        )
        return MAX_FUSION
    if model.alpha <= 0:
        notes.append(
            f"the cost model has no per-message cost (alpha = 0), so fusing saves "
            f"nothing it can see: small layers are fused up to {MIN_FUSION} B only "
            "(`hybridcomm-bench --calibrate` fits one)"
        )
        return MIN_FUSION
    balance = balance_bytes(model, world_size, topology, call_s or 0.0)
    if call_s:
        notes.append(
            f"fusion counts the {call_s * 1e3:.2g} ms each all-reduce call cost beyond "
            "the cost model in the measured steps"
        )
    return int(min(MAX_FUSION, max(MIN_FUSION, FUSION_BALANCE * balance)))


def default_split(
    model: CostModel, world_size: int, notes: List[str], topology: Optional[Topology] = None
) -> int:
    """Segments whose extra messages cost < 10% of their transfer, clamped to
    [MIN_SPLIT, MAX_SPLIT]; 0 = no split (a degenerate fit)."""
    if model.beta <= 0 or model.alpha <= 0:
        notes.append(
            "large buckets are not split: the cost model lacks a per-message or a "
            "per-byte cost to weigh a split against"
        )
        return 0
    balance = balance_bytes(model, world_size, topology)
    return int(min(MAX_SPLIT, max(MIN_SPLIT, SPLIT_BALANCE * balance)))


def wire_bytes(layer: Layer, low_rank: Optional[Tuple[int, int]] = None) -> int:
    """Bytes ``layer`` puts on the wire: its gradients, or with PowerSGD's
    ``(rank, start)`` its two low-rank messages (fp32).

        >>> wire_bytes(Layer("fc", [0, 1], 4096 * 256 + 256, shapes=[(256, 4096), (256,)]), (4, 0))
        70664
    """
    if low_rank is None or layer.shapes is None:
        return layer.numel * layer.element_size
    return 4 * sum(message_numels(layer.shapes, low_rank[0]))


def _fuse(
    layers: Sequence[Layer],
    fusion_bytes: int,
    lazy_bytes: Optional[int] = None,
    low_rank: Optional[Tuple[int, int]] = None,
) -> List[List[Layer]]:
    """Consecutive layers of one dtype in one bucket while what they put on the wire
    (:func:`wire_bytes`) stays under ``fusion_bytes``; with ``lazy_bytes``, a pool
    instead takes layers until it has passed ``lazy_bytes`` (the last pool goes when
    backward ends)."""
    groups: List[List[Layer]] = []
    for layer in layers:
        if layer.numel == 0:
            continue
        last = groups[-1] if groups else None
        size = sum(wire_bytes(x, low_rank) for x in last) if last else 0
        nbytes = wire_bytes(layer, low_rank)
        if lazy_bytes is not None:
            joins = size < lazy_bytes
        else:
            # Small layers ride with the large one after them (a BN before its conv):
            # backward makes it right after them and the next forward needs it before
            # them, so they lose nothing and a message is saved.
            joins = size + nbytes <= fusion_bytes or size < fusion_bytes <= nbytes
        if last is not None and last[0].dtype == layer.dtype and joins:
            last.append(layer)
        else:
            groups.append([layer])
    return groups


def explain_lazy(
    layers: Sequence[Layer], pools: Sequence[Sequence[Layer]], model: CostModel, world_size: int
) -> str:
    """Why pooling pays (or not): the predicted time of all per-layer all-reduces
    against the pools', with the model's fastest algorithm for each. Many tiny
    layers pay a message latency each; pools pay it once per pool."""

    def best(nbytes):
        return min(model.predict(a, nbytes, world_size) for a in ALGORITHMS[:3])

    per_layer = sum(best(layer.numel * layer.element_size) for layer in layers if layer.numel)
    pooled = sum(best(sum(x.numel * x.element_size for x in pool)) for pool in pools)
    verdict = "pools win" if pooled < per_layer else "per-layer buckets win"
    return (
        f"lazy: {len(pools)} pools for {sum(1 for x in layers if x.numel)} layers, predicted "
        f"{pooled * 1e3:.2f} ms against {per_layer * 1e3:.2f} ms per layer ({verdict}: "
        f"{world_size}-rank messages cost {model.alpha * 1e6:.0f} us each before any byte)"
    )


@dataclass
class _Shape:
    """Where a bucket's gradients and flags lie in its buffer (:func:`_lay_out`)."""

    params: List[int]  # in buffer order
    offsets: Optional[List[int]]
    grad_numel: Optional[int]  # the gradient region, padding included (None: packed)
    segments: List[Tuple[int, int]]
    owners: Optional[List[int]] = None  # whole parameters: each one's rank, buffer order


def _lay_out(
    group: Sequence[Layer],
    *,
    world_size: int,
    copies: int,
    split_bytes: int,
    totals: Optional[List[int]],
) -> _Shape:
    """A bucket's layout (layout.py): its gradients aligned, then the flags' copies;
    with ``totals`` (whole-parameter shards) cut by owner (ownership.py: ``totals``
    is every rank's share so far, updated), in one segment; else cut every
    ``split_bytes`` into segments (0: not cut)."""
    params = [p for layer in group for p in layer.params]
    numel = sum(layer.numel for layer in group)
    esize = group[0].element_size
    sizes = [n for layer in group for n in (layer.sizes or [])]
    if totals is not None:
        if len(sizes) != len(params):
            raise ValueError("whole-parameter shards need each parameter's size (Layer.sizes)")
        owners = assign(sizes, world_size, totals)
        order, offsets, part = owner_layout(sizes, owners, world=world_size, element_size=esize)
        grad_numel = world_size * part
        total = buffer_numel(grad_numel, len(params), copies)
        return _Shape(
            params=[params[i] for i in order],
            offsets=offsets,
            grad_numel=grad_numel,
            segments=[(0, total)],
            owners=[owners[i] for i in order],
        )
    offsets, grad_numel = layout(sizes, esize) if len(sizes) == len(params) else (None, None)
    grads_end = numel if grad_numel is None else grad_numel
    total = buffer_numel(grads_end, len(params), copies)  # the gradients, then the flags
    # segments start aligned (so do their chunks); the flags' copies in the last's tail
    align = max(1, ALIGN_BYTES // esize)
    step = 0 if not split_bytes else max(align, split_bytes // esize // align * align)
    segments = cut_segments(total, total if copies == 1 else grads_end, step)
    return _Shape(params=params, offsets=offsets, grad_numel=grad_numel, segments=segments)


def _choose_algorithm(
    nbytes: int,
    *,
    window: Optional[float],
    world_size: int,
    candidates: Sequence[str],
    model: CostModel,
    topo: Topology,
    shard: bool,
) -> Tuple[str, bool]:
    """The cost model's algorithm for a bucket of ``nbytes`` with overlap ``window``,
    and whether native was predicted faster by less than its uncertainty (ours kept)."""
    # At P <= 2 our algorithms are all one exchange of the same bytes.
    pool = (
        [a for a in candidates if a in ("butterfly", NATIVE, PS)]
        if world_size <= 2 and not shard
        else list(candidates)
    )
    algorithm = model.choose(nbytes, world_size, window, pool or candidates or ["butterfly"], topo)
    kept_ours = model.native_was_faster(algorithm, pool, nbytes, world_size, topo)
    if (
        shard
        and algorithm == "halving_doubling"
        and model.predict(algorithm, nbytes, world_size, topo)
        > (1 - SHARDED_HD_GAIN) * model.predict("ring", nbytes, world_size, topo)
    ):
        algorithm = "ring"
    return algorithm, kept_ours


def _fuse_whole(layers: Sequence[Layer], fusion_bytes: int, world_size: int) -> List[List[Layer]]:
    """Whole-parameter shards: consecutive layers of one dtype in one bucket until it
    holds ``fusion_bytes`` and its parts by owner are within WHOLE_BALANCE of equal
    (ownership.py), so that no rank's part, to which every part is padded on the
    wire, makes the bucket cost much more than its bytes."""
    groups: List[List[Layer]] = []
    for layer in layers:
        if layer.numel == 0:
            continue
        last = groups[-1] if groups else None
        closed = last is not None and (
            sum(wire_bytes(x) for x in last) >= fusion_bytes
            and balanced([n for x in last for n in (x.sizes or [x.numel])], world_size)
        )
        if last is not None and last[0].dtype == layer.dtype and not closed:
            last.append(layer)
        else:
            groups.append([layer])
    return groups


def _whole_notes(buckets: Sequence[Bucket], layers: Sequence[Layer], world: int) -> List[str]:
    """What a plan of whole-parameter shards reports: each rank's share of the state,
    the wire's padding, and any parameter larger than 1/P."""
    sizes = {p: n for x in layers for p, n in zip(x.params, x.sizes or [])}
    share = [0] * world
    padded = grads = 0
    for b in buckets:
        for p, rank in zip(b.params, b.owners):
            share[rank] += sizes[p]
        padded += b.grad_numel
        grads += b.numel
    whole = sum(share) or 1
    notes = [
        "state sharded by whole parameters: ranks hold "
        + ", ".join(f"{100 * s / whole:.1f}%" for s in share)
        + f" of it (the largest {max(share) * world / whole:.2f}x an equal share); each "
        f"bucket's parts by owner are padded to its largest, {padded / max(grads, 1):.3f}x "
        "its gradients on the wire"
    ]
    big = [x.name for x in layers if any(n * world > whole for n in x.sizes or [])]
    if big:
        notes.append(
            f"layer(s) {big[:3]} hold a parameter larger than 1/{world} of the state: "
            "its owner holds more than an equal share"
        )
    return notes


def _sizes(
    layers: Sequence[Layer],
    *,
    fusion_bytes: Optional[int],
    split_bytes: Optional[int],
    world_size: int,
    model: CostModel,
    topo: Topology,
    call_s: Optional[float],
    notes: List[str],
) -> Tuple[int, int]:
    """The fusion and split sizes: the user's, or the defaults for this world and link."""
    if fusion_bytes is None and world_size == 1:
        # Nothing crosses a wire, so nothing overlaps: a bucket only costs host time
        # per step (its launch, its events, its wait)
        fusion_bytes = sum(layer.numel * layer.element_size for layer in layers)
        notes.append(
            "world size 1: nothing is communicated, so the layers share one bucket "
            "per dtype (each bucket costs host time every step); fusion_bytes= "
            "overrides"
        )
    elif fusion_bytes is None:
        fusion_bytes = default_fusion(model, notes, world_size, topo, call_s)
    if split_bytes is None:
        split_bytes = 0 if world_size == 1 else default_split(model, world_size, notes, topo)
    return fusion_bytes, split_bytes


@dataclass
class _Compression:
    """A bucket's algorithm, segments and predicted time once compression is decided."""

    algorithm: str
    segments: List[Tuple[int, int]]
    predicted_s: float
    compressor: Optional[str] = None


def _compression(
    group: Sequence[Layer],
    *,
    algorithm: str,
    segments: List[Tuple[int, int]],
    total: int,
    n_params: int,
    esize: int,
    world_size: int,
    model: CostModel,
    topo: Topology,
    topk: Optional[float],
    low_rank: Optional[Tuple[int, int]],
) -> _Compression:
    """Whether the bucket is sent compressed (PowerSGD, top-k) where that sends fewer
    bytes than the bucket whole; a compressed bucket is never split (one segment of
    ``total`` elements, the layout's)."""
    numel = sum(layer.numel for layer in group)
    nbytes = numel * esize

    def predict(sizes) -> float:
        if not model.offers(algorithm):
            return float("nan")
        return sum(model.predict(algorithm, n, world_size, topo) for n in sizes)

    chosen = _Compression(algorithm, segments, predict([(b - a) * esize for a, b in segments]))
    shapes = [s for layer in group for s in (layer.shapes or [])]
    # PowerSGD where its two messages (the low-rank factors, with the 1-D
    # gradients and flags whole, then the other factors) send fewer bytes with
    # the bucket's algorithm than the bucket whole
    if low_rank and world_size > 1 and len(shapes) == n_params:
        p_numel, q_numel = message_numels(shapes, low_rank[0])
        low_rank_bytes = bytes_sent(algorithm, 4 * p_numel, world_size, topo) + bytes_sent(
            algorithm, 4 * q_numel, world_size, topo
        )
        if low_rank_bytes < bytes_sent(algorithm, nbytes, world_size, topo):
            chosen = _Compression(
                algorithm, [(0, total)], predict([4 * p_numel, 4 * q_numel]), POWERSGD
            )
    if (
        topk
        and world_size > 1
        and sparse_bytes_sent(numel, n_params, topk, world_size)
        < bytes_sent(chosen.algorithm, nbytes, world_size)
    ):
        seg_bytes = segment_numel(numel, n_params, topk) * 4
        chosen = _Compression(
            TOPK,
            [(0, total)],
            (world_size - 1) * (model.alpha + seg_bytes * model.beta),
            chosen.compressor,
        )
    return chosen


def _bucket_ready(
    buckets: Sequence[Bucket], groups: Sequence[Sequence[Layer]], ready: Optional[dict]
) -> Optional[Dict[int, float]]:
    """When each bucket's gradients are ready (its last layer's), where measured."""
    if not ready:
        return None
    out = {}
    for b, group in zip(buckets, groups):
        times = [ready[layer.name] for layer in group if layer.name in ready]
        out[b.index] = max(times) if times else 0.0
    return out


def _measured_notes(
    *, comm_scale: Optional[float], kept_ours: List[int], model: CostModel, defer_pays
) -> List[str]:
    """What the measured steps changed in the plan, for ``print(plan)``."""
    notes = []
    if comm_scale is not None and comm_scale != 1.0:
        notes.append(
            f"in the measured steps communication took {comm_scale:.2f}x the time the "
            "cost model predicts: the issue order is timed with the measured speed"
        )
    if kept_ours:
        notes.append(
            f"bucket(s) {kept_ours}: native predicted faster by less than its "
            f"uncertainty ({model.uncertainty:.0%}): ours (strategy='native' forces it)"
        )
    if defer_pays is False:
        notes.append(
            "forward overlap cannot pay here: in the measured steps every bucket but "
            "the one the next forward needs first was reduced before step(), so (in "
            "forward mode) step() applies the updates at once, in one optimizer call, "
            "as backward mode does"
        )
    return notes


def make_plan(
    layers: Sequence[Layer],
    *,
    world_size: int,
    model: CostModel,
    strategy: str = "hybrid",
    fusion_bytes: Optional[int] = None,
    split_bytes: Optional[int] = None,
    windows: Optional[dict] = None,
    ready: Optional[dict] = None,
    need: Optional[dict] = None,
    topk: Optional[float] = None,
    lazy_bytes: Optional[int] = None,
    topology: Optional[Topology] = None,
    launch_pass: int = 1,
    comm_scale: Optional[float] = None,
    defer_pays: Optional[bool] = None,
    servers: int = 0,
    forward_s: Optional[float] = None,
    low_rank: Optional[Tuple[int, int]] = None,
    call_s: Optional[float] = None,
    shard: bool = False,
    whole_params: bool = False,
) -> Plan:
    """Group ``layers`` (in backward order) into buckets, choose for each, fix the order.

    ``windows`` maps a layer name to its measured overlap window in seconds
    (a bucket's is its smallest layer's); ``ready`` maps it to when its
    gradient is ready, in seconds from the first one (a bucket's is its last
    layer's); ``need`` maps it to its place in the next forward's order;
    ``topology``: the ranks' nodes (default ``Topology()``, from the environment);
    ``launch_pass``: the backward pass buckets are launched in (the synchronizer's
    learned step structure, carried by the plan); ``comm_scale``: measured over
    predicted communication time (the issue order is timed with it);
    ``defer_pays``: whether the measured steps left reductions running at step()
    besides the first-needed bucket's (False: forward mode's deferred updates
    cannot pay, step() applies them); ``servers``: how many summation servers
    the job has (``ps`` a candidate, and allowed forced, only with some);
    ``forward_s``: the next forward's compute in seconds, measured or estimated
    (with ``ready``, a default split is kept only where it can pay);
    ``low_rank``: PowerSGD's ``(rank, start)``: a bucket whose two low-rank
    messages send fewer bytes than it does whole is compressed (compressor
    ``powersgd``; its messages, and the whole bucket in the first ``start``
    steps, go with the bucket's algorithm); ``call_s``: seconds each all-reduce
    call cost beyond the model in the measured steps (the default fusion counts it);
    ``shard``: the buckets are reduce-scattered (sharded state): a copy of the usage
    flags a rank in the last segment's tail (``Bucket.flag_copies``);
    ``whole_params`` (with ``shard``): each parameter is owned whole by one rank
    (``Bucket.owners``, ownership.py), each bucket's buffer cut by owner, one
    segment a bucket; by default its layers are fused until its parts are even.

    Example::

        >>> model = CostModel(alpha=1e-3, beta=1e-9, gamma=1e-10)
        >>> plan = make_plan([Layer("fc", [0, 1], 1 << 22), Layer("conv", [2], 500)],
        ...                  world_size=8, model=model, fusion_bytes=64 << 10)
        >>> [b.algorithm for b in plan.buckets], plan.order[:2]
        (['ring', 'butterfly'], [(0, 0), (1, 0)])
    """
    notes: List[str] = []
    forced = forced_algorithm(strategy)
    topo = (topology or Topology()).resolve(world_size)
    whole_params = whole_params and shard
    fusion_default, split_default = fusion_bytes is None, split_bytes is None
    fusion_bytes, split_bytes = _sizes(
        layers,
        fusion_bytes=fusion_bytes,
        split_bytes=split_bytes,
        world_size=world_size,
        model=model,
        topo=topo,
        call_s=call_s,
        notes=notes,
    )
    candidates = [
        a
        for a in STRATEGY_CANDIDATES.get(strategy, ())
        if model.offers(a)
        and not (a == "halving_doubling" and shard and world_size & (world_size - 1))
    ]
    if whole_params and fusion_default:
        groups = _fuse_whole(layers, fusion_bytes, world_size)
        notes.append(
            f"whole parameters: layers are fused until each bucket holds {fusion_bytes} B "
            f"and its parts by owner are within {WHOLE_BALANCE - 1:.0%} of equal "
            "(fusion_bytes= fuses by size alone)"
        )
    else:
        groups = _fuse(layers, fusion_bytes, lazy_bytes, low_rank)
    if lazy_bytes is not None:
        notes.append(explain_lazy(layers, groups, model, world_size))
    if strategy == "hybrid" and 1 < topo.node_size < world_size:
        candidates.append("hierarchical")  # several nodes: reduce inside them first
    candidates = _with_ps(candidates, forced, servers, model, notes)
    copies = world_size if shard and world_size > 1 else 1
    totals = [0] * world_size if whole_params else None  # each rank's share so far
    buckets, kept_ours = [], []  # (kept_ours: native predicted faster, within uncertainty)
    for i, group in enumerate(groups):
        numel = sum(layer.numel for layer in group)
        esize = group[0].element_size
        nbytes = numel * esize
        shape = _lay_out(
            group, world_size=world_size, copies=copies, split_bytes=split_bytes, totals=totals
        )
        offsets, grad_numel, segments = shape.offsets, shape.grad_numel, shape.segments
        window = min((windows[x.name] for x in group if x.name in (windows or {})), default=None)
        if forced:
            algorithm = forced
        else:
            algorithm, kept = _choose_algorithm(
                # (whole parameters: the parts are padded to the largest on the wire)
                grad_numel * esize if whole_params else nbytes,
                window=window,
                world_size=world_size,
                candidates=candidates,
                model=model,
                topo=topo,
                shard=shard,
            )
            if kept:
                kept_ours.append(i)
        if copies > 1 and algorithm == NATIVE and offsets is None:
            algorithm = "ring"  # (no sizes: no layout of ours to pad into equal parts)
        elif copies > 1 and algorithm == NATIVE:  # the collective's own: one call, equal parts
            grads_end = numel if grad_numel is None else grad_numel
            grad_numel, segments = equal_parts(grads_end, len(shape.params), world_size)
        compression = _compression(
            group,
            algorithm=algorithm,
            segments=segments,
            total=shape.segments[-1][1],
            n_params=len(shape.params),
            esize=esize,
            world_size=world_size,
            model=model,
            topo=topo,
            topk=topk,
            low_rank=low_rank,
        )
        needs = [need[layer.name] for layer in group if need and layer.name in need]
        buckets.append(
            Bucket(
                index=i,
                layers=[layer.name for layer in group],
                params=shape.params,
                numel=numel,
                nbytes=nbytes,
                algorithm=compression.algorithm,
                predicted_s=compression.predicted_s,
                dtype=group[0].dtype,
                window_s=window,
                segments=compression.segments,
                need=min(needs) if needs else None,
                offsets=offsets,
                grad_numel=grad_numel,
                compressor=compression.compressor,
                flag_copies=copies,
                owners=shape.owners,
            )
        )
    if whole_params:
        notes.extend(_whole_notes(buckets, layers, world_size))
    bucket_ready = _bucket_ready(buckets, groups, ready)
    order = merge_adjacent(buckets, issue_order(buckets, bucket_ready, comm_scale))
    if split_default and bucket_ready and forward_s is not None:
        buckets, order, split_bytes = drop_split_that_cannot_pay(
            buckets,
            order=order,
            split_bytes=split_bytes,
            bucket_ready=bucket_ready,
            comm_scale=comm_scale,
            forward_s=forward_s,
            notes=notes,
        )
    for b in buckets:  # fewer segments after the merge: fewer fixed costs
        if b.algorithm not in (TOPK,) and b.compressor is None and model.offers(b.algorithm):
            b.predicted_s = sum(
                model.predict(b.algorithm, (z - a) * b.nbytes // max(b.numel, 1), world_size, topo)
                for a, z in b.segments
            )
    notes.extend(
        _measured_notes(
            comm_scale=comm_scale, kept_ours=kept_ours, model=model, defer_pays=defer_pays
        )
    )
    return Plan(
        world_size=world_size,
        strategy=strategy,
        buckets=buckets,
        order=order,
        fusion_bytes=fusion_bytes,
        split_bytes=split_bytes,
        notes=notes,
        launch_pass=launch_pass,
        defer_updates=defer_pays is not False,
    )
