"""Which parameters of a bucket some rank has a gradient for.

A parameter no rank produced a gradient for keeps ``.grad`` None after the step
(as one process on the whole batch would leave it). For an incomplete bucket
this is learnt from the usage flags reduced with the bucket (a host sync per
such bucket and step on a device, warned once), or, with
``find_unused_parameters=True`` on a device, from a small max-reduction on the
host (:class:`~hybridcomm.comm.control.HostMax`). Under ``shard`` each rank
reads its own row of the reduce-scattered flags (``plan/layout.py``).

Example::

    used = UsedAgreement(on_host=True, rank=0, group=None, timeout=60)
    used.mark(state)        # at launch: this rank's positions with a gradient
    used.post(state)        # as the engine issues it
    used.positions(state)   # after the reduction: every rank's, merged
"""

from __future__ import annotations

import logging
from typing import List

from ..comm import control

log = logging.getLogger("hybridcomm")


class UsedAgreement:
    """Answers "which positions of this bucket did some rank use" (a complete
    bucket needs no answer)."""

    def __init__(self, on_host: bool, rank: int, group, timeout: float):
        self.on_host = on_host  # agree on the host (else read the reduced flags)
        self.rank, self.group, self.timeout = rank, group, timeout
        self._warned = False

    def mark(self, state) -> None:
        """Note this launch's content (``state``: the bucket's BucketState) for the
        agreement posted at issue."""
        if state.agreed is not None:  # the last launch's, not waited for (it was complete)
            state.agreed.wait()
            state.agreed = None
        state.marked = sorted(state.content)

    def post(self, state) -> None:
        """The engine issues the bucket (plan order): post the agreement."""
        state.agreed = control.HostMax(
            len(state.bucket.params),
            state.marked,
            group=self.group,
            timeout=self.timeout,
            what=f"which parameters of bucket {state.index} have gradients",
        )

    def positions(self, state, on_device: bool) -> List[int]:
        """The positions some rank had a gradient for (after the reduction)."""
        b = state.bucket
        if state.complete:
            return list(range(len(b.params)))
        if state.agreed is not None:
            agreed, state.agreed = state.agreed, None
            return agreed.positions()
        if on_device and not self._warned:
            self._warned = True
            log.warning(
                "hybridcomm: rank %d has no gradient for some parameters of bucket %d "
                "(%s); reading which ones any rank has costs a host sync per such bucket "
                "and step. find_unused_parameters=True agrees on them on the host "
                "instead.",
                self.rank,
                state.index,
                ", ".join(b.spec.layers),
            )
        return b.used(self.rank)
