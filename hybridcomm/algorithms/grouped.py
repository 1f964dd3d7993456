"""Two-level all-reduce over groups of consecutive ranks (``hierarchical``, ``torus2d``).

Groups of ``g`` consecutive ranks (nodes, or grid rows; the last may be short)
reduce-scatter inside, all-reduce each chunk across the groups among its owners,
and all-gather inside (:func:`two_level`). Each element's final value is
computed once and copied everywhere, so all ranks are bitwise identical.
"""

from __future__ import annotations

from itertools import zip_longest
from typing import List, Sequence

from . import ring
from .schedule import Recv, Schedule, Send, Step, build, check_args


def embed(steps: Sequence[Step], ranks: Sequence[int], offset: int = 0) -> List[Step]:
    """``steps`` of a schedule among ``len(ranks)`` ranks over a sub-buffer,
    as steps among the global ``ranks`` over ``[offset, offset + sub-length)``."""
    return [
        None
        if st is None
        else Step(
            tuple(Send(ranks[s.peer], s.start + offset, s.stop + offset) for s in st.sends),
            tuple(
                Recv(ranks[r.peer], r.start + offset, r.stop + offset, r.reduce, final=r.final)
                for r in st.recvs
            ),
        )
        for st in steps
    ]


def runs(g: int, s: int) -> List[int]:
    """Chunk boundaries of the ``s`` runs a group of ``s`` ranks owns: run j is
    chunks ``[b[j], b[j+1])`` of ``g`` (one chunk each when s == g)."""
    return [j * g // s for j in range(s + 1)]


def two_level(name: str, rank: int, world_size: int, numel: int, g: int, topology=None) -> Schedule:
    """Schedule of ``rank`` for groups of ``g`` consecutive ranks; the buffer is cut
    into ``g`` chunks, in three phases:

    1. reduce-scatter inside each group (ring): in a full group local rank j ends
       with the group's sum of chunk j; in a short group of ``s`` ranks, local
       rank j owns a run of whole chunks (``g // s`` or one more, :func:`runs`);
    2. for each chunk, a ring all-reduce among its owners, one per group (mapped
       onto their global ranks, :func:`embed`); a rank owning several chunks runs
       their rings side by side, step for step;
    3. all-gather inside each group (ring).

    The final reduction is phase 2's, or phase 1's when there is a single group."""
    check_args(rank, world_size, numel)
    ngroups = -(-world_size // g)
    first = rank - rank % g
    members = list(range(first, min(first + g, world_size)))
    s, local = len(members), rank - first
    bounds = runs(g, s)

    def at(c):  # start of chunk c of g
        return c * numel // g

    def part(i):  # run i of this group, as a range of the buffer
        i %= s
        return at(bounds[i]), at(bounds[i + 1])

    def owner(group, c):  # global rank owning chunk c in ``group``
        size = min(g, world_size - group * g)
        b = runs(g, size)
        return group * g + next(j for j in range(size) if b[j] <= c < b[j + 1])

    steps = embed(ring.reduce_scatter(local, s, part, final=ngroups == 1), members)
    across = []
    for c in range(bounds[local], bounds[local + 1]):
        owners = [owner(k, c) for k in range(ngroups)]
        sub = ring.schedule(rank // g, ngroups, at(c + 1) - at(c))
        across.append(embed(sub.steps, owners, at(c)))
    for side_by_side in zip_longest(*across):
        mine = [st for st in side_by_side if st is not None]
        steps.append(Step(sum((st.sends for st in mine), ()), sum((st.recvs for st in mine), ())))
    steps += embed(ring.all_gather(local, s, part), members)
    return build(name, rank, world_size, numel, steps=steps, topology=topology)
