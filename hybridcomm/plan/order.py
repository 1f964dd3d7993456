"""The issue order: the one (bucket, segment) sequence every rank sends a step's
reductions in, ahead of time, so that no rank's local timing can reorder them
(ByteScheduler's priority idea, fixed in the plan). Segments issued back to back
are merged again; a default split is dropped where it cannot pay.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Dict, List, Optional, Sequence, Tuple

from .records import Bucket


def issue_order(
    buckets: Sequence[Bucket],
    ready: Optional[Dict[int, float]] = None,
    comm_scale: Optional[float] = None,
) -> List[Tuple[int, int]]:
    """The fixed (bucket, segment) sequence. Without ``ready`` (bucket -> seconds into
    backward when its gradients are ready): backward order. With it: a priority
    queue run under the buckets' predicted times (times ``comm_scale``: how much
    slower the measured communication ran than predicted), the bucket needed first
    going first. (ByteScheduler's idea, fixed ahead so that every rank issues the
    same sequence whatever its local timing.)"""
    if not ready:
        return [(b.index, s) for b in buckets for s in range(len(b.segments))]
    todo = {b.index: 0 for b in buckets}
    now, order = 0.0, []
    by_index = {b.index: b for b in buckets}
    while todo:
        avail = [i for i in todo if ready.get(i, 0.0) <= now]
        if not avail:
            now = min(ready.get(i, 0.0) for i in todo)
            continue
        i = min(
            avail,
            key=lambda i: (
                by_index[i].need if by_index[i].need is not None else len(buckets) + i,
                i,
            ),
        )
        b, s = by_index[i], todo[i]
        now += _share(b, s, comm_scale)
        order.append((i, s))
        todo[i] += 1
        if todo[i] == len(b.segments):
            del todo[i]
    return order


def _share(b: Bucket, s: int, comm_scale: Optional[float]) -> float:
    """Predicted seconds of segment ``s`` of ``b`` (times ``comm_scale``; 0 if unknown)."""
    a, z = b.segments[s]
    share = b.predicted_s * (z - a) / max(b.segments[-1][1], 1) * (comm_scale or 1.0)
    return share if share == share else 0.0  # nan: the model cannot predict it


def completion(
    buckets: Sequence[Bucket],
    order: Sequence[Tuple[int, int]],
    ready: Dict[int, float],
    comm_scale: Optional[float] = None,
) -> Dict[int, float]:
    """When each bucket's last segment is done, in seconds from the first gradient,
    if the channel runs ``order`` as every rank does: each segment once the one
    before it is done and its bucket is ready, at the predicted (scaled) speed.

        >>> b = [Bucket(0, ["fc"], [0], 9, 36, "ring", 2.0, segments=[(0, 4), (4, 10)]),
        ...      Bucket(1, ["conv"], [1], 1, 4, "ring", 1.0, segments=[(0, 2)])]
        >>> completion(b, [(0, 0), (1, 0), (0, 1)], {0: 0.0, 1: 1.5})
        {1: 2.5, 0: 3.7}
    """
    by_index = {b.index: b for b in buckets}
    now, done = 0.0, {}
    for i, s in order:
        now = max(now, ready.get(i, 0.0)) + _share(by_index[i], s, comm_scale)
        if s == len(by_index[i].segments) - 1:
            done[i] = round(now, 9)
    return done


def merge_adjacent(
    buckets: Sequence[Bucket], order: Sequence[Tuple[int, int]]
) -> List[Tuple[int, int]]:
    """Segments of a bucket that ``order`` issues back to back become one segment (and
    ``buckets``' segments are rewritten to match): a split pays only where another
    bucket goes between its parts; elsewhere it would only add calls.

        >>> b = [Bucket(0, ["fc"], [0], 9, 36, "ring", 0.0, segments=[(0, 4), (4, 8), (8, 10)]),
        ...      Bucket(1, ["conv"], [1], 1, 4, "ring", 0.0, segments=[(0, 2)])]
        >>> merge_adjacent(b, [(0, 0), (0, 1), (1, 0), (0, 2)]), b[0].segments
        ([(0, 0), (1, 0), (0, 1)], [(0, 8), (8, 10)])
    """
    runs: List[Tuple[int, int, int]] = []  # (bucket, first segment, last segment)
    for b, seg in order:
        if runs and runs[-1][0] == b and runs[-1][2] == seg - 1:
            runs[-1] = (b, runs[-1][1], seg)
        else:
            runs.append((b, seg, seg))
    by_index = {b.index: b for b in buckets}
    merged: Dict[int, List[Tuple[int, int]]] = {}
    out = []
    for b, first, last in runs:
        segs = by_index[b].segments
        merged.setdefault(b, []).append((segs[first][0], segs[last][1]))
        out.append((b, len(merged[b]) - 1))
    for b, segs in merged.items():
        by_index[b].segments = segs
    return out


def _unsplit(buckets: Sequence[Bucket]) -> List[Bucket]:
    """Copies of ``buckets``, each in one segment."""
    return [Bucket(**{**asdict(b), "segments": [(0, b.segments[-1][1])]}) for b in buckets]


def _queued_behind_first_need(
    buckets: Sequence[Bucket],
    order: Sequence[Tuple[int, int]],
    ready: Dict[int, float],
    comm_scale: Optional[float],
) -> float:
    """Predicted seconds of reduction still to run once the bucket the next forward
    needs first is done: what that forward's compute can overlap."""
    needed = [b for b in buckets if b.need is not None]
    if not needed:
        return 0.0
    done = completion(buckets, order, ready, comm_scale)
    first = min(needed, key=lambda b: b.need).index
    return max(done.values()) - done[first]


def drop_split_that_cannot_pay(
    buckets: List[Bucket],
    *,
    order: List[Tuple[int, int]],
    split_bytes: int,
    bucket_ready: Dict[int, float],
    comm_scale: Optional[float],
    forward_s: float,
    notes: List[str],
) -> Tuple[List[Bucket], List[Tuple[int, int]], int]:
    """A default split is dropped where it cannot pay: if, without it, the reductions
    queued behind the first-needed bucket outlast the next forward's compute, that
    forward overlaps them either way, and a split only adds collectives (and, on a
    busy machine, rounds in which the ranks wait for each other mid-backward)."""
    if not any(len(b.segments) > 1 for b in buckets):
        return buckets, order, split_bytes
    whole = _unsplit(buckets)
    whole_order = issue_order(whole, bucket_ready, comm_scale)
    behind = _queued_behind_first_need(whole, whole_order, bucket_ready, comm_scale)
    if behind < forward_s:
        return buckets, order, split_bytes
    notes.append(
        f"no split: without one, {behind * 1e3:.0f} ms of reductions are "
        "still queued behind the bucket the next forward needs first, more "
        f"than that forward's ~{forward_s * 1e3:.0f} ms of compute, so it "
        "overlaps them either way and a split would only add collectives"
    )
    return whole, whole_order, 0
