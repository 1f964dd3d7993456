"""Backward passes since the last step, and what each one is for.

The step's structure is learned, never assumed: passes are counted since the
last step, and buckets launch in the plan's ``launch_pass`` (1 at first, then
the most passes a measured step had). A pass is ``"launch"`` (buckets launch as
their gradients complete; also any pass inside ``step(closure)``), ``"late"``
(after the launching one: its end launches every bucket again) or ``"local"``
(before it, under ``no_sync()``, or with ``overlap="none"``). Every rank counts
the same passes (as DDP requires), so every rank launches the same sequence.

Example::

    passes = PassTracker("backward", on_end=print, timeline=Timeline())
    passes.gradient_arrived(launch_pass=1, measuring=False)   # in a hook
    passes.kind
    'launch'
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import torch

from ..base.timeline import Timeline

LAUNCH, LATE, LOCAL = "launch", "late", "local"

_RUN_BACKWARD = torch.autograd.graph._engine_run_backward.__code__
_NODE_APPLY = torch.autograd.function.BackwardCFunction.apply.__code__


def in_nested_backward() -> bool:
    """Whether this gradient hook runs inside a backward started by a node of another
    backward (reentrant checkpointing): its end is not the end of the pass."""
    f, seen = sys._getframe(2), False
    while f is not None:
        if f.f_code is _RUN_BACKWARD:
            seen = True
        elif seen and f.f_code is _NODE_APPLY:
            return True
        f = f.f_back
    return False


class PassTracker:
    """Counts the backward passes of a step and classifies each. A pass begins with
    its first gradient (a post-accumulate hook) and ends in autograd's
    end-of-backward callback (not a nested backward's, :func:`in_nested_backward`).

    ``on_end(kind)`` runs at each pass's end. ``no_sync`` (``opt.no_sync()``)
    and ``closure_depth`` (inside ``step(closure)``) are set by the synchronizer.
    """

    def __init__(self, overlap: str, on_end: Callable[[str], None], timeline: Timeline):
        self.overlap = overlap
        self._on_end = on_end
        self.timeline = timeline
        self.counted = 0  # passes since the last step that count toward the launching one
        self.any = 0  # every pass since the last step
        self.id = 0  # the current (or last) pass's number, ever increasing
        self.active = False
        self.kind = LOCAL
        self.measuring = False  # a launching pass of a measured step: ready times are taken
        self.closure_depth = 0
        self.no_sync = False
        self.end_due = False  # the end-of-backward callback is still to be queued
        self.reported = False  # the current (or last) pass's end came from autograd
        self._t0 = 0.0

    def gradient_arrived(self, launch_pass: int, measuring: bool) -> None:
        """A gradient was added (post-accumulate hook): a pass begins with the first,
        and its end is queued from the first hook outside a nested backward."""
        if not self.active:
            self._begin(launch_pass, measuring)
        elif self.end_due and not in_nested_backward():
            self._queue_end()

    def _begin(self, launch_pass: int, measuring: bool) -> None:
        self.active = True
        self.id += 1
        self._t0 = time.perf_counter()
        self.any += 1
        self.counted += not self.no_sync and self.closure_depth == 0
        if self.overlap == "none" or self.no_sync:
            self.kind = LOCAL
        elif self.closure_depth or self.counted == launch_pass:
            self.kind = LAUNCH
        elif self.counted > launch_pass:
            self.kind = LATE
        else:
            self.kind = LOCAL
        self.measuring = self.kind == LAUNCH and measuring
        self.end_due, self.reported = True, False
        if not in_nested_backward():
            self._queue_end()

    def _queue_end(self) -> None:
        self.end_due = False
        torch.autograd.Variable._execution_engine.queue_callback(self._reported_end)

    def _reported_end(self) -> None:
        self.reported = self.active
        self.end()

    def end(self) -> None:
        """The pass ends (autograd's callback; or a step, a closure, for a pass whose
        end autograd never reported because it ran only in nested backwards)."""
        if not self.active:
            return
        self.active = False
        self._on_end(self.kind)
        self.timeline.add("backward", "compute", self._t0, time.perf_counter())

    def unseen(self) -> None:
        """Gradients came with no hook seeing their pass (set by hand, or a pass that
        reached no closer of lean hooks: grad_hooks.py): it counts for the step."""
        self.any += 1

    def reset(self) -> None:
        """A step ended: counting starts again."""
        self.counted = self.any = 0
