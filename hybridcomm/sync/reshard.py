"""How every rank slices a bucket under ``shard=`` (shard.py), and a re-plan's move
of the optimizer state from the old slicing to the new one.

A rank's slices of a parameter follow from its *placement* (the bucket's
segments and algorithm, the parameter's offset and size); the plans are
agreed, so every rank knows how every rank slices every parameter, before a
re-plan and after (:func:`cut`). :func:`move_state` moves only what changes
owner. How: docs/ARCHITECTURE.md, "Sharded optimizer state".

Example::

    >>> place = ((((0, 100),), "ring", 0), 40, 30)   # a parameter at [40, 70) of a bucket
    >>> cut(place, world=2)                           # rank 0 owns [0, 48) of the bucket
    (((0, 8),), ((8, 30),))
"""

from __future__ import annotations

import bisect
import functools
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..algorithms import SHARD_BOUNDS, tail_body
from ..base.errors import HybridCommError
from ..comm import control

Ranges = Tuple[Tuple[int, int], ...]
log = logging.getLogger("hybridcomm")


def owned_ranges(
    segments, rank: int, world: int, algorithm: str, tail: int = 0
) -> List[Tuple[int, int]]:
    """This rank's parts of a bucket's buffer: its shard of each segment, as the
    bucket's ``algorithm`` reduce-scatters it (the last segment's ``tail``, a
    block a rank of the usage flags' copies, left out).

    >>> owned_ranges([(0, 100), (100, 164)], 1, 2, "ring")
    [(48, 100), (132, 164)]
    """
    bounds = SHARD_BOUNDS[algorithm]
    out = []
    for i, (a, z) in enumerate(segments):
        n = tail_body(world, z - a, tail) if i == len(segments) - 1 else z - a
        lo, hi = bounds(rank, world, n)
        if hi > lo:
            out.append((a + lo, a + hi))
    return out


def placement(spec, offset: int, numel: int) -> tuple:
    """What decides how every rank slices a parameter at ``offset`` of bucket ``spec``."""
    return (tuple(map(tuple, spec.segments)), spec.algorithm, spec.tail), offset, numel


def cut(place: Optional[tuple], world: int, numel: int = 0) -> Tuple[Ranges, ...]:
    """Every rank's (start, stop) ranges of a parameter placed at ``place``; None (it
    left the buckets): the whole of its ``numel`` elements on every rank."""
    if place is None:
        return (((0, numel),),) * world
    bucket, o, n = place
    mine: List[list] = [[] for _ in range(world)]
    for lo, hi, r in _overlapping(_bucket_parts(bucket, world), o, o + n):
        if max(lo, o) < min(hi, o + n):  # (an empty parameter overlaps nothing)
            mine[r].append((max(lo, o) - o, min(hi, o + n) - o))
    return tuple(map(tuple, mine))


@functools.lru_cache(maxsize=256)
def _bucket_parts(bucket: tuple, world: int) -> Tuple[list, list]:
    """Every rank's :func:`owned_ranges` of a bucket ((segments, algorithm, tail)) as
    :func:`_spans` (lo, hi, rank), once per bucket: a parameter's cut is then a
    look-up, not a pass over every rank."""
    segments, algorithm, tail = bucket
    return _spans(
        (lo, hi, r)
        for r in range(world)
        for lo, hi in owned_ranges(segments, r, world, algorithm, tail=tail)
    )


def _per_element(v, sl) -> bool:
    return torch.is_tensor(v) and v.dim() > 0 and v.shape == sl.tensor.shape


def move_state(old, new, state: dict, group, timeout: float, run_bytes: int) -> None:
    """``state`` (the optimizer's) from ``old``'s slices (a ``Shards``) to ``new``'s:
    a collective where some parameter's slicing changed; a parameter of ``old``
    that ``new`` lacks (frozen) gets its whole state on every rank, keyed by itself.

    A parameter every rank slices as before keeps its state, re-keyed (no copy,
    nothing sent). For the others, each rank sends every other the part of its
    old slices' state that the other's new slices cover, in one all-to-all of
    bytes per run of ``run_bytes`` (after a small exchange of keys, dtypes and
    step counts): a rank holds one run's buffers beside its state, never a
    parameter's state whole."""
    world = new.world
    todo, size, kept, moved = [], 0, 0, 0
    for p in old.params:
        was, now = old.placement.get(id(p)), new.placement.get(id(p))
        if was == now or cut(was, world, p.numel()) == cut(now, world, p.numel()):
            _keep(old, new, p, state)
            kept += 1
            continue
        todo.append(p)
        moved += 1
        size += p.numel() * p.element_size()
        if size >= run_bytes:
            _exchange(old, new, todo, state, group=group, timeout=timeout)
            todo, size = [], 0
    if todo:
        _exchange(old, new, todo, state, group=group, timeout=timeout)
    log.debug(
        "hybridcomm re-plan: %d parameters keep their slices' state, %d have it "
        "moved to their new owners (runs of %d bytes)",
        kept,
        moved,
        run_bytes,
    )


def _keep(old, new, p, state: dict) -> None:
    """``p`` is sliced as before on every rank: each old slice's entry re-keyed."""
    if id(p) not in new.placement:  # left, at one rank: its one slice is the whole
        for sl in old.by_param.get(id(p), []):
            if sl.tensor in state:
                state[p] = {
                    k: v.view(p.shape) if _per_element(v, sl) else v
                    for k, v in state.pop(sl.tensor).items()
                }
        return
    starts = {sl.start: sl for sl in new.by_param.get(id(p), [])}
    for sl in old.by_param.get(id(p), []):
        if sl.tensor in state:
            state[starts[sl.start].tensor] = state.pop(sl.tensor)


def _exchange(old, new, params: Sequence, state: dict, group, timeout: float) -> None:
    """The state of ``params`` (the same run on every rank) to its new owners."""
    world, rank = new.world, new.rank
    # 1. what each rank holds: per parameter, per old slice with state, its entries in
    # order (a per-element tensor's dtype, or the value itself: a step count)
    mine: Dict[int, list] = {}
    for j, p in enumerate(params):
        for sl in old.by_param.get(id(p), []):
            st = state.get(sl.tensor)
            if st:
                mine.setdefault(j, []).append(
                    (
                        sl.start,
                        sl.stop,
                        [
                            (k, True, v.dtype)
                            if _per_element(v, sl)
                            else (k, False, _kept(v) if torch.is_tensor(v) else v)
                            for k, v in st.items()
                        ],
                    )
                )
    held = control.all_gather_object(
        mine, group=group, timeout=timeout, what="which optimizer state each rank holds (re-plan)"
    )
    cuts = [cut(new.placement.get(id(p)), world, p.numel()) for p in params]
    # 2. the pieces this rank sends and receives, per peer, in one order both ends share
    # (parameter, sender's slice, receiver's range, key): (j, key, dtype, sender's slice
    # start, offset in it, receiver's range, offset in it, elements)
    new_spans = [_spans((a, z, r) for r, ranges in enumerate(c) for a, z in ranges) for c in cuts]
    old_spans: List[list] = [[] for _ in params]
    for src, theirs in enumerate(held):
        for j, slices in theirs.items():
            old_spans[j].extend((start, stop, src, entries) for start, stop, entries in slices)
    old_spans = [_spans(x) for x in old_spans]
    sends: List[list] = [[] for _ in range(world)]
    recvs: List[list] = [[] for _ in range(world)]
    for j in range(len(params)):
        mine_now = _spans((a, z, rank) for a, z in cuts[j][rank])
        for start, stop, src, entries in old_spans[j][0]:
            # (what this rank sends goes anywhere; what others send, only what it gets)
            for a, z, dst in _overlapping(new_spans[j] if src == rank else mine_now, start, stop):
                lo, hi = max(start, a), min(stop, z)
                for key, elements, dtype in entries:
                    if elements:
                        piece = (j, key, dtype, start, lo - start, (a, z), lo - a, hi - lo)
                        if src == rank:
                            sends[dst].append(piece)
                        if dst == rank:
                            recvs[src].append(piece)
    # j -> the entries of the holder of its first elements: the key order, the values
    first = {j: spans[0][0][3] for j, spans in enumerate(old_spans) if spans[0]}
    send_bytes = [sum(n * dt.itemsize for _j, _k, dt, *_, n in ps) for ps in sends]
    recv_bytes = [sum(n * dt.itemsize for _j, _k, dt, *_, n in ps) for ps in recvs]
    # 3. this rank's pieces out, its old entries dropped, the exchange
    by_start = {
        (j, sl.start): sl for j, p in enumerate(params) for sl in old.by_param.get(id(p), [])
    }
    send, at = torch.empty(sum(send_bytes), dtype=torch.uint8), 0
    for ps in sends:
        for j, key, dtype, start, o, _rng, _w, n in ps:
            v = state[by_start[(j, start)].tensor][key].detach().reshape(-1)[o : o + n]
            send[at : at + n * dtype.itemsize].copy_(v.cpu().view(torch.uint8))
            at += n * dtype.itemsize
    for sl in by_start.values():
        state.pop(sl.tensor, None)
    got = control.all_to_all(
        send,
        send_bytes,
        recv_bytes,
        group=group,
        timeout=timeout,
        what="the optimizer state that changes owner (re-plan)",
    )
    del send
    # 4. this rank's new slices put together from what it got, in the senders' order
    made: Dict[Tuple[int, Tuple[int, int]], dict] = {}
    filled: Dict[tuple, int] = {}
    at = 0
    for ps in recvs:
        for j, key, dtype, _start, _o, (a, z), w, n in ps:
            entry = made.setdefault((j, (a, z)), {})
            if key not in entry:
                entry[key] = torch.empty(z - a, dtype=dtype)
            nb = n * dtype.itemsize
            entry[key].view(torch.uint8)[w * dtype.itemsize : w * dtype.itemsize + nb].copy_(
                got[at : at + nb]
            )
            at += nb
            filled[(j, a, z, key)] = filled.get((j, a, z, key), 0) + n
    for j, entries in first.items():  # (every element of each new slice came)
        for a, z in cuts[j][rank]:
            for key, elements, _ in entries:
                n = filled.get((j, a, z, key), 0) if elements else z - a
                if n != z - a:
                    raise HybridCommError(
                        f"re-plan: the optimizer state {key!r} of a parameter of shape "
                        f"{tuple(params[j].shape)} covers {n} of the {z - a} elements of "
                        "this rank's new slice"
                    )
    # 5. the new entries, in the first holder's key order; what is not per element (a
    # step count) is the first holder's
    for j, entries in first.items():
        p = params[j]
        left = id(p) not in new.placement  # (keyed by itself, whole)
        targets = (
            [(p, (0, p.numel()))]
            if left
            else [(sl.tensor, (sl.start, sl.stop)) for sl in new.by_param.get(id(p), [])]
        )
        for key_tensor, rng in targets:
            got_here = made.get((j, rng), {})
            state[key_tensor] = {
                k: got_here[k].view(key_tensor.shape).to(p.device)
                if elements
                # (a frozen parameter's step count on its device, too)
                else _restored(v, p.device if left else None)
                if _is_kept(v)
                else v
                for k, elements, v in entries
            }


def _kept(v: torch.Tensor) -> tuple:
    """A state tensor that is not per element (a step count, Adafactor's factored
    moments) as sent: on the CPU, with the device it goes back to (plain types, so
    the peers' safe unpickling takes it)."""
    return ("hybridcomm-kept", v.detach().cpu(), str(v.device))


def _is_kept(v) -> bool:
    return isinstance(v, tuple) and len(v) == 3 and v[0] == "hybridcomm-kept"


def _restored(v: tuple, device: Optional[torch.device]) -> torch.Tensor:
    return v[1].to(device or torch.device(v[2]))


def _spans(items) -> Tuple[list, list]:
    """Ranges (start, stop, ...) of one parameter sorted by start, and their stops: the
    ranks' ranges of one slicing, so the stops are sorted too (or all the same: whole
    on every rank)."""
    spans = sorted(items, key=lambda x: (x[0], x[2]))
    return spans, [x[1] for x in spans]


def _overlapping(spans, start: int, stop: int):
    """The ranges of ``spans`` (:func:`_spans`) that overlap [start, stop)."""
    ranges, stops = spans
    for i in range(bisect.bisect_right(stops, start), len(ranges)):
        if ranges[i][0] >= stop:
            break
        yield ranges[i]
