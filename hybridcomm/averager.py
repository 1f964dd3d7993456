"""Averaging a set of tensors across ranks (model averaging, optimizer state, ADMM's
consensus) the way gradients are reduced: the planner fuses small tensors into
buckets and picks the butterfly or a ring per bucket, and the engine issues the
buckets through one ordered channel. The strategies (strategies/) use it.

The buckets are made once per signature (shapes and dtypes, in order), after
the ranks agree on it, and reused: each call packs the tensors into their
buckets (one kernel per bucket on a GPU: kernels/pack.py, at the bucket's
aligned offsets), reduces, and unpacks the averages back. A bucket's pack and
unpack are prepared once (``pack_plan``/``unpack_plan``: checked once, no
per-tensor work in the launch) and prepared again only when a tensor or the
bucket's buffer has moved.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .comm import calibration, control
from .config import env
from .sync.buckets import GradBucket
from .sync.memory import bucket_allocator
from .comm.channel import open_channel
from .comm.engine import CommEngine
from .base.errors import HybridCommError
from .kernels import pack_plan, unpack_plan
from .plan.planner import Layer, make_plan
from .gpu.runtime import runtime_for


class TensorAverager:
    """Averages tensors in place across the ranks of ``group``.

    Args:
        group: the process group (None: the world).
        timeout: seconds any wait may take (default ``HYBRIDCOMM_TIMEOUT``).
        cost_model: as ``DistributedOptimizer``'s (None: rank 0's calibration,
            else a probe), agreed on first use.
        strategy: ``"hybrid"`` (butterfly or ring per bucket), ``"auto"`` or one
            algorithm.

    Example::

        >>> avg = TensorAverager(timeout=60, cost_model="default")
        >>> w = torch.ones(3)
        >>> avg.average_([w]), w                   # one rank: nothing to send
        (0, tensor([1., 1., 1.]))
    """

    def __init__(
        self,
        group=None,
        *,
        timeout: Optional[float] = None,
        cost_model=None,
        strategy: str = "hybrid",
    ):
        self.group, self.timeout, self.strategy = group, env.timeout(timeout), strategy
        self._cost_model = cost_model
        self._transport = self._channel = None
        self._made: Dict[Tuple, Tuple[List[GradBucket], CommEngine]] = {}
        # (op, buffer address) -> (where its tensors are, the prepared copy)
        self._plans: Dict[Tuple, Tuple[Tuple, Callable]] = {}

    def average_(self, tensors: Iterable[torch.Tensor]) -> int:
        """Average ``tensors`` in place; the bytes this rank sent."""
        control.require_initialized("TensorAverager.average_")
        tensors = [t for t in tensors if t.numel()]
        if dist.get_world_size(self.group) == 1 or not tensors:
            return 0
        signature = tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)
        made = self._made.get(signature)
        if made is None:
            made = self._made[signature] = self._make(tensors)
        buckets, engine = made
        rt = runtime_for(tensors[0].device)
        pack, unpack = self._pack, self._unpack
        with torch.no_grad(), rt.watched() if rt is not None else contextlib.nullcontext():
            for b in buckets:  # one pack kernel per bucket on a GPU
                pack([tensors[i] for i in b.spec.params], b.grads, offsets=b.offsets)
                b.set_flags(set(range(len(b.params))))
            for i in range(len(buckets)):
                engine.launch(i)
            for i, b in enumerate(buckets):
                engine.wait(i)
                unpack(b.grads, [tensors[j] for j in b.spec.params], offsets=b.offsets)
        sent, engine.bytes_sent = engine.bytes_sent, 0
        return sent

    def _pack(self, tensors: List[torch.Tensor], flat: torch.Tensor, *, offsets=None) -> None:
        """kernels.pack, through a plan kept per buffer (its layout repeats)."""
        self._planned("pack", flat, tensors, offsets)()

    def _unpack(self, flat: torch.Tensor, tensors: List[torch.Tensor], *, offsets=None) -> None:
        """kernels.unpack, through a plan kept per buffer (its layout repeats)."""
        self._planned("unpack", flat, tensors, offsets)()

    def _planned(
        self, op: str, flat: torch.Tensor, tensors: List[torch.Tensor], offsets
    ) -> Callable:
        """The prepared ``op`` between ``flat`` and ``tensors``, prepared again when one
        of them is somewhere else than last time (or no longer contiguous: the plan's
        checks then say so)."""
        where = (
            flat.numel(),
            flat.dtype,
            None if offsets is None else tuple(offsets),
            tuple([(t.data_ptr(), t.numel(), t.is_contiguous()) for t in tensors]),
        )
        held = self._plans.get((op, flat.data_ptr()))
        if held is None or held[0] != where:
            plan = (
                pack_plan(tensors, flat, offsets=offsets)
                if op == "pack"
                else unpack_plan(flat, tensors, offsets=offsets)
            )
            held = self._plans[(op, flat.data_ptr())] = (where, plan)
        return held[1]

    def _make(self, tensors: List[torch.Tensor]):
        """Buckets and an engine for this signature (collective: every rank)."""
        mine = [(tuple(t.shape), str(t.dtype)) for t in tensors]
        everyone = control.all_gather_object(
            mine, group=self.group, timeout=self.timeout, what="the tensors to average"
        )
        for r, theirs in enumerate(everyone):
            if theirs != mine:
                raise HybridCommError(
                    f"average_: rank {r}'s tensors differ from this rank's "
                    f"({len(theirs)} tensors against {len(mine)}, or shapes or "
                    "dtypes differ)"
                )
        if self._channel is None:
            self._transport, self._channel = open_channel(
                tensors[0].device, self.group, self.timeout
            )
            self._cost_model = calibration.resolve(self._cost_model, self.group, self.timeout)
        layers = [
            Layer(
                f"tensor{i}",
                [i],
                t.numel(),
                t.element_size(),
                dtype=str(t.dtype),
                sizes=[t.numel()],
            )
            for i, t in enumerate(tensors)
        ][::-1]
        world = dist.get_world_size(self.group)
        plan = control.rank0_decides(
            lambda: make_plan(
                layers, world_size=world, model=self._cost_model, strategy=self.strategy
            ),
            group=self.group,
            timeout=self.timeout,
            what="the averaging plan",
        )
        device = tensors[0].device
        rt = runtime_for(device)
        alloc = bucket_allocator(rt, device, self._transport.stream if rt is not None else None)
        buckets = [
            GradBucket(
                b, [tensors[i] for i in b.params], tensors[b.params[0]].dtype, None, alloc=alloc
            )
            for b in plan.buckets
        ]
        engine = CommEngine(
            plan, buckets, self._channel, self._transport, scale=1.0 / world, timeout=self.timeout
        )
        return buckets, engine

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._made = {}
        self._plans = {}
