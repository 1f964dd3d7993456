"""Uneven inputs: torch's join protocol (``torch.distributed.algorithms.join``)
for the synchronizer, so that ranks that run out of data shadow the others.

A rank still training notifies before each round of buckets and each step's
end; a joined rank's :class:`ShadowHook` answers each notice with zeros (or the
step's end), so every rank issues the same operations. The average divides by
the initial world size unless ``divide_by_initial_world_size=False``; once all
have joined, every rank takes the state of a rank that joined last. How:
docs/ARCHITECTURE.md, "Uneven inputs".

Example::

    with opt.join():
        for x, y in my_shard_of_the_data:        # some ranks have fewer batches
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook, Joinable, _JoinConfig

from ..base.errors import HybridCommError
from ..comm import control

ROUND, STEP_END = 1, 2


class JoinState:
    """One synchronizer's part in a join: its gloo group (made at the first join, a
    collective), the context's options, and whether this rank has joined.

    ``links.joining`` is this object while this rank trains inside an enabled join
    context (the bucket group and ``end_step`` then notify), None otherwise.
    """

    def __init__(self, sync):
        self.sync = sync
        self.group = None
        self.config = _JoinConfig.construct_disabled_join_config()
        self.joinable: Optional[Joinable] = None
        self.divide_by_initial = True

    def hook(
        self,
        joinable: Joinable,
        copy_state: Callable[[int], None],
        divide_by_initial_world_size: bool = True,
    ) -> "ShadowHook":
        """The hook for a join context about to be made (every rank makes it alike);
        ``copy_state(root)`` copies rank ``root``'s state to every rank at the end."""
        sync = self.sync
        if sync.config.shard:
            raise HybridCommError(
                f"join: with shard={sync.config.shard!r} each rank steps and gathers its own part "
                "of the parameters, which a rank out of data cannot: train with even inputs "
                "(drop the last uneven batches), or leave shard out"
            )
        if sync.registry.sparse:
            raise HybridCommError(
                "join: parameters with sparse gradients ("
                + ", ".join(repr(n) for _, n in sync.registry.sparse)
                + ") are reduced outside the buckets and cannot be shadowed; make them dense "
                "(sparse=False) to train with uneven inputs"
            )
        if self.group is None:
            self.group = control.new_group_like(sync.process_group, timeout=sync.timeout)
        self.joinable = joinable
        self.divide_by_initial = bool(divide_by_initial_world_size)
        return ShadowHook(self, copy_state)

    def configure(self, config: _JoinConfig) -> None:
        """torch's ``Join`` sets the config of each joinable as it is made."""
        if config.enable and not config.is_first_joinable:
            raise HybridCommError(
                "join: the DistributedOptimizer must come first in Join([...]): its notices "
                "are the join context's own (Join([opt, other]))"
            )
        self.config = config
        self.sync._links.joining = self if config.enable else None

    # ---- a rank still training ---------------------------------------------------------
    def notify(self, what: int) -> None:
        """Tell the joined ranks what comes next (``ROUND`` or ``STEP_END``), before
        any operation of it is issued: a rank that waits on a reduction then never
        waits for a joined rank that has not heard of it."""
        work = Join.notify_join_context(self.joinable)  # raises on every rank if told to throw
        both = torch.tensor([1, what], dtype=torch.int64)
        self._all_reduce(both)
        if work is not None:
            work.wait()
        self._training(int(both[0]))

    # ---- a joined rank ------------------------------------------------------------------
    def shadow(self) -> None:
        """One notice's share, on a joined rank (it sends nothing of its own)."""
        self.sync._links.joining = None  # this rank no longer notifies
        both = torch.zeros(2, dtype=torch.int64)
        self._all_reduce(both)
        training = int(both[0])
        self._training(training)
        what, disagree = divmod(int(both[1]), training)
        sync = self.sync
        if what == ROUND and not disagree:  # every bucket, holding nothing of this rank's
            with sync.watched():
                sync.group.launch_nothing(sync.open, sync.passes.id)
        elif what == STEP_END and not disagree:
            sync.begin_step()
            sync.finish()
            sync.end_step()
        else:
            raise HybridCommError(
                "join: the ranks still training disagree on what comes next "
                "(a round of buckets, or a step's end): each must run the "
                "same loop"
            )

    def finish(self, is_last_joiner: bool, copy_state: Callable[[int], None]) -> None:
        """Every rank joined: pending updates applied, the scale restored, and
        ``copy_state(root)`` from a rank that joined last (the highest)."""
        sync = self.sync
        sync._links.joining = None
        self.config = _JoinConfig.construct_disabled_join_config()
        sync.apply_pending()
        sync.group.engine.scale = sync._links.scale
        rank = torch.tensor([sync.rank if is_last_joiner else -1], dtype=torch.int64)
        self._all_reduce(rank, dist.ReduceOp.MAX)
        copy_state(int(rank[0]))

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """A notice's all-reduce on the join's group, within the optimizer's timeout
        (a dead or stalled peer is hybridcomm's error naming it, not gloo's)."""
        control.wait_work(
            lambda: dist.all_reduce(t, op=op, group=self.group, async_op=True),
            self.sync.timeout,
            "a join's notice",
        )

    def _training(self, ranks: int) -> None:
        """The next operations average over the ranks still training, if asked to."""
        if not self.divide_by_initial and self.sync.config.op == "avg":
            self.sync.group.engine.scale = 1.0 / ranks


class ShadowHook(JoinHook):
    """torch's join hook: ``main_hook`` for each notice while some rank trains,
    ``post_hook`` once all have joined."""

    def __init__(self, state: JoinState, copy_state: Callable[[int], None]):
        self.state = state
        self.copy_state = copy_state

    def main_hook(self) -> None:
        self.state.shadow()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.state.finish(is_last_joiner, self.copy_state)
