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

``start_average_`` returns at once with the reduction in flight (the channel's
thread, or the comm stream, runs it) and its handle's ``wait`` unpacks the
averages: DiLoCo trains on meanwhile. ``compression`` sends fp16 or bf16 (a
wire copy of each bucket, engine.py) or 8- or 4-bit codes (comm/quantized.py).
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
from .algorithms.quantized import QUANTIZED, bits_of
from .comm.channel import open_channel
from .comm.engine import CommEngine
from .comm.quantized import QuantizedReduce
from .config.config import COMPRESSIONS
from .base.errors import HybridCommError
from .kernels import pack_plan, unpack_plan
from .kernels.quantize import GROUP as QUANTIZE_GROUP
from .plan.planner import MAX_FUSION, Layer, default_fusion, make_plan
from .plan.records import Plan
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
        compression: None, ``"fp16"`` or ``"bf16"`` (the wire dtype: the sums in
            it), or ``"int8"`` / ``"int4"`` (blockwise-scaled integers, summed in
            fp32 between an exchange and a gather: comm/quantized.py, whose
            docstring states the error).
        on_slow: called once with what is waited for (``"bucket 0"``) when a wait
            takes over ``slow_after`` seconds; what it returns (who the wait is
            for: the stall inspector's answer) ends the timeout's message.
        fusion_bytes: tensor bytes fused into one bucket. None: with int8 or
            int4, as many as 32 MiB on the wire (``MAX_FUSION``: one bucket for
            most models); else the planner's default for the link, counted on
            the wire (an fp16 bucket holds twice fp32's values). Converted to
            tensor bytes at the first tensor's dtype.

    Example::

        >>> avg = TensorAverager(timeout=60, cost_model="default")
        >>> w = torch.ones(3)
        >>> avg.average_([w]), w                   # one rank: nothing to send
        (0, tensor([1., 1., 1.]))
        >>> pending = avg.start_average_([w])      # returns at once; the sums in flight
        >>> pending.wait()                         # the averages unpacked into w
        0
    """

    def __init__(
        self,
        group=None,
        *,
        timeout: Optional[float] = None,
        cost_model=None,
        strategy: str = "hybrid",
        compression=None,
        on_slow: Optional[Callable[[str], Optional[str]]] = None,
        slow_after: float = 0.0,
        fusion_bytes: Optional[int] = None,
    ):
        if compression not in COMPRESSIONS and compression not in QUANTIZED:
            raise ValueError(
                f"compression must be None, 'fp16', 'bf16', 'int8' or 'int4', got {compression!r}"
            )
        self.group, self.timeout, self.strategy = group, env.timeout(timeout), strategy
        self.compression = compression
        self.on_slow, self.slow_after = on_slow, slow_after
        self.fusion_bytes = fusion_bytes
        self._cost_model = cost_model
        self._transport = self._channel = None
        self._made: Dict[Tuple, Tuple[List[GradBucket], CommEngine]] = {}
        # (op, buffer address) -> (where its tensors are, the prepared copy)
        self._plans: Dict[Tuple, Tuple[Tuple, Callable]] = {}
        self._in_flight: Dict[Tuple, "PendingAverage"] = {}  # signature -> not waited for

    def average_(self, tensors: Iterable[torch.Tensor]) -> int:
        """Average ``tensors`` in place; the bytes this rank sent."""
        return self.start_average_(tensors).wait()

    def start_average_(self, tensors: Iterable[torch.Tensor]) -> "PendingAverage":
        """Start averaging ``tensors`` (a collective, in the same order on every
        rank) and return at once; the returned handle's ``wait()`` puts the
        averages into ``tensors``. Until then the tensors may change: what was
        sent is what they held now. One average per set of tensors at a time."""
        control.require_initialized("TensorAverager.start_average_")
        tensors = [t for t in tensors if t.numel()]
        if dist.get_world_size(self.group) == 1 or not tensors:
            return PendingAverage(self, None, tensors, None, 0)
        signature = _signature(tensors)
        if signature in self._in_flight:
            raise HybridCommError(
                "start_average_: these tensors' last average was not waited for; call "
                "its wait() first"
            )
        made = self._made_for(tensors, signature)
        buckets, engine = made
        with torch.no_grad(), self._watched(tensors):
            for b in buckets:  # one pack kernel per bucket on a GPU
                self._pack([tensors[i] for i in b.spec.params], b.grads, offsets=b.offsets)
                b.set_flags(set(range(len(b.params))))
            for i in range(len(buckets)):  # issued in the plan's order, on every rank
                engine.launch(i)
        sent, engine.bytes_sent = engine.bytes_sent, 0
        pending = self._in_flight[signature] = PendingAverage(self, signature, tensors, made, sent)
        return pending

    def prepare(self, tensors: Iterable[torch.Tensor]) -> Optional[Plan]:
        """Make now what averaging tensors like ``tensors`` needs (a collective, as
        their first average would be): the cost model's agreement (a start-up probe
        where none is kept: seconds on a slow link), the plan, the buffers. The
        first average then costs what every later one does. Returns the plan (its
        buckets and their algorithms; None with one rank: nothing is sent)."""
        control.require_initialized("TensorAverager.prepare")
        tensors = [t for t in tensors if t.numel()]
        if dist.get_world_size(self.group) == 1 or not tensors:
            return None
        return self._made_for(tensors, _signature(tensors))[1].plan

    def _made_for(self, tensors: List[torch.Tensor], signature: Tuple):
        made = self._made.get(signature)
        if made is None:
            made = self._made[signature] = self._make(tensors)
        return made

    @staticmethod
    def _watched(tensors: List[torch.Tensor]):
        rt = runtime_for(tensors[0].device)
        return contextlib.nullcontext() if rt is None else rt.watched()

    def _finish(self, pending: "PendingAverage") -> None:
        """Wait for each bucket in turn and unpack it (the next one's reduction
        goes on meanwhile)."""
        buckets, engine = pending.made
        tensors = pending.tensors
        try:
            with torch.no_grad(), self._watched(tensors):
                for i, b in enumerate(buckets):
                    engine.wait(i)
                    self._unpack(b.grads, [tensors[j] for j in b.spec.params], offsets=b.offsets)
        finally:
            self._in_flight.pop(pending.signature, None)

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
                layers,
                world_size=world,
                model=self._cost_model,
                strategy=self.strategy,
                fusion_bytes=self._fusion_bytes(tensors[0].element_size(), world),
            ),
            group=self.group,
            timeout=self.timeout,
            what="the averaging plan",
        )
        device = tensors[0].device
        rt = runtime_for(device)
        alloc = bucket_allocator(rt, device, self._transport.stream if rt is not None else None)
        wire = COMPRESSIONS.get(self.compression)
        buckets = [
            GradBucket(
                b, [tensors[i] for i in b.params], tensors[b.params[0]].dtype, wire, alloc=alloc
            )
            for b in plan.buckets
        ]
        bits = bits_of(self.compression)
        for b in buckets if bits else ():
            b.quant = QuantizedReduce(
                b.grads.numel(), bits=bits, rank=dist.get_rank(self.group), world=world, alloc=alloc
            )
        engine = CommEngine(
            plan, buckets, self._channel, self._transport, scale=1.0 / world, timeout=self.timeout
        )
        if self.on_slow is not None:
            on_slow = self.on_slow
            engine.on_slow, engine.slow_after = (lambda i: on_slow(f"bucket {i}")), self.slow_after
        return buckets, engine

    def _fusion_bytes(self, element_size: int, world: int) -> int:
        """The user's ``fusion_bytes``, else by what a bucket travels as.

        Quantized (int8, int4): up to the planner's largest bucket on the wire. Such
        a bucket always goes through the exchange and the gather (comm/quantized.py),
        2 (P - 1) messages whatever its size, and every tensor is ready at once, so
        a small bucket starts nothing earlier. Fused like fp32 values, charlm's int4
        Δ was 8-11 buckets of 9 KB messages (on gloo a rendezvous each, and with more
        ranks than cores gloo's loop thread spinning on their locks): 35 ms of CPU a
        rank an average at 4 ranks over tbf 100mbit, against 11 ms as one bucket
        (benchmarks/average_cost.py).

        Otherwise the planner's default for the link, counted on the wire (an fp16
        bucket holds twice fp32's values), so the plan still picks an algorithm per
        bucket: there one bucket saved little CPU (fp16: 18 ms a rank an average as
        8 buckets, 17 ms as one)."""
        if self.fusion_bytes is not None:
            return self.fusion_bytes
        per_value = wire_bytes_per_value(self.compression, element_size)
        if bits_of(self.compression):
            wire = MAX_FUSION
        else:
            wire = default_fusion(self._cost_model, [], world_size=world)
        return int(wire * element_size / per_value)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._made = {}
        self._plans = {}
        self._in_flight = {}


def wire_bytes_per_value(compression, element_size: int) -> float:
    """Bytes a value costs on the wire under ``compression`` (a quantized value's
    share of its group's fp32 scale included)."""
    bits = bits_of(compression)
    if bits:
        return bits / 8 + 4 / QUANTIZE_GROUP
    wire = COMPRESSIONS.get(compression)
    return element_size if wire is None else torch.finfo(wire).bits / 8


def _signature(tensors: List[torch.Tensor]) -> Tuple:
    """What a set of tensors' buckets are made for: shapes, dtypes, devices, in order."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


class PendingAverage:
    """An average in flight (:meth:`TensorAverager.start_average_`): ``done()``
    never blocks; ``wait()`` blocks until every bucket is reduced (within the
    averager's timeout), unpacks the averages into the tensors and returns the
    bytes this rank sent. Waiting again returns at once."""

    __slots__ = ("averager", "signature", "tensors", "made", "bytes_sent", "_waited")

    def __init__(self, averager, signature, tensors, made, bytes_sent: int):
        self.averager, self.signature, self.tensors = averager, signature, tensors
        self.made, self.bytes_sent = made, bytes_sent
        self._waited = made is None

    def done(self) -> bool:
        """Whether every bucket's reduction has finished (the averages may still
        need ``wait()`` to be unpacked)."""
        if self._waited:
            return True
        buckets, engine = self.made
        return all(engine.done(i) for i in range(len(buckets)))

    def wait(self) -> int:
        if not self._waited:
            self._waited = True
            self.averager._finish(self)
        return self.bytes_sent
