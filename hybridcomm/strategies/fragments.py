"""Streaming DiLoCo's fragments and their sync schedule: which parameters sync
together, and at which inner step each fragment starts its sync and merges it.
Pure bookkeeping, no communication (diloco.py runs it).

``fragments=K`` cuts the model's layers (modules owning parameters, in module
order) into K runs of about equal bytes (:func:`split`); fragment ``k`` syncs
once per period of H inner steps, at its offset (:func:`offsets`), and its
outer update is merged ``delay`` steps later (Douillard et al. 2025).
docs/STRATEGIES.md has the options.

Example::

    >>> s = SyncSchedule(sync_every=4, offsets=offsets(4, 2), delay=1)
    >>> s.offsets, [s.launches_at(t) for t in range(1, 9)], s.merge_step(2)
    ((2, 4), [[], [0], [], [1], [], [0], [], [1]], 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch


@dataclass(frozen=True)
class Layer:
    """A module that owns parameters: its name and its parameters' indices (in the
    synced list) and bytes."""

    name: str
    params: Tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Fragment:
    """Consecutive layers that sync together, at ``offset`` within each period."""

    index: int
    layers: Tuple[str, ...]
    params: Tuple[int, ...]
    nbytes: int
    offset: int


def layers_of(model: torch.nn.Module, params: Sequence[torch.nn.Parameter]) -> List[Layer]:
    """The modules of ``model`` that own some of ``params`` themselves, in module
    order; a parameter shared by two modules counts for the first."""
    index = {id(p): i for i, p in enumerate(params)}
    seen, out = set(), []
    for name, module in model.named_modules():
        mine = []
        for p in module.parameters(recurse=False):
            i = index.get(id(p))
            if i is not None and i not in seen:
                seen.add(i)
                mine.append(i)
        if mine:
            nbytes = sum(params[i].numel() * params[i].element_size() for i in mine)
            out.append(Layer(name or "(root)", tuple(mine), nbytes))
    return out


def cut(sizes: Sequence[int], parts: int) -> List[int]:
    """Boundaries ``[0, b1, ..., len(sizes)]`` cutting ``sizes`` into ``parts`` runs
    of consecutive items, none empty, each boundary where the running total is
    nearest its share (``total * j / parts``; a tie: the earlier).

    >>> cut([1, 1, 8, 1, 1], 2), cut([4, 4, 4, 4], 4), cut([1, 1, 1], 3)
    ([0, 2, 5], [0, 1, 2, 3, 4], [0, 1, 2, 3])
    """
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} items into {parts} non-empty runs")
    running = [0]
    for s in sizes:
        running.append(running[-1] + s)
    total, bounds = running[-1], [0]
    for j in range(1, parts):
        lo, hi = bounds[-1] + 1, n - (parts - j)  # room for the runs still to come
        share = total * j / parts
        bounds.append(min(range(lo, hi + 1), key=lambda i: (abs(running[i] - share), i)))
    bounds.append(n)
    return bounds


def offsets(sync_every: int, fragments: int) -> Tuple[int, ...]:
    """Each fragment's step within the period, ``floor((k + 1) H / K)``: distinct
    when ``H >= K``, the last one ``H``. One fragment every H/K steps, so with
    K = 1 the whole model syncs every H steps as in DiLoCo."""
    return tuple((k + 1) * sync_every // fragments for k in range(fragments))


def split(layers: Sequence[Layer], fragments: int, sync_every: int) -> List[Fragment]:
    """``fragments`` runs of consecutive layers of about equal bytes, each with its offset
    (the paper syncs "groups of layers"; equal bytes give every fragment's sync
    about the same time on the wire)."""
    bounds = cut([layer.nbytes for layer in layers], fragments)
    at = offsets(sync_every, fragments)
    out = []
    for k in range(fragments):
        mine = layers[bounds[k] : bounds[k + 1]]
        out.append(
            Fragment(
                index=k,
                layers=tuple(layer.name for layer in mine),
                params=tuple(i for layer in mine for i in layer.params),
                nbytes=sum(layer.nbytes for layer in mine),
                offset=at[k],
            )
        )
    return out


@dataclass(frozen=True)
class SyncSchedule:
    """When each fragment starts its sync and when its update is merged."""

    sync_every: int
    offsets: Tuple[int, ...]
    delay: int

    def launches_at(self, step: int) -> List[int]:
        """The fragments whose sync starts after inner step ``step`` (1, 2, ...), in
        fragment order (the order every rank issues them in)."""
        if step < 1:
            return []
        phase = step % self.sync_every
        return [k for k, o in enumerate(self.offsets) if o % self.sync_every == phase]

    def merge_step(self, launch_step: int) -> int:
        """The inner step after which a sync started after ``launch_step`` is merged:
        before the fragment's next sync (``delay < H``)."""
        return launch_step + self.delay


def describe(fragments: Sequence[Fragment], schedule: SyncSchedule) -> str:
    """A table of the fragments: what each holds and when it syncs (the choice the
    library made, shown as the plan table shows a plan's)."""
    rows = [
        f"DiLoCo: {len(fragments)} fragment(s), sync every {schedule.sync_every} inner "
        f"steps, delay {schedule.delay}",
        f"{'fragment':>8} {'offset':>6} {'MB':>8}  layers",
    ]
    for f in fragments:
        names = ", ".join(f.layers) if len(f.layers) <= 4 else f"{f.layers[0]} ... {f.layers[-1]}"
        rows.append(f"{f.index:>8} {f.offset:>6} {f.nbytes / 1e6:>8.3f}  {names}")
    return "\n".join(rows)
