"""A bucket's quantized all-reduce, 8 or 4 bits a value on the wire
(``TensorAverager(compression="int8" | "int4")``; Streaming DiLoCo sends its
pseudo-gradients so, Douillard et al. 2025).

The layout and the two schedules are algorithms/quantized.py's; this holds the
buffers and the arithmetic between the two exchanges (kernels/quantize.py):
quantize the chunks, sum this rank's chunk from every rank's message in rank
order, quantize the average, and decode every rank's gathered segment. The
engine (engine.py) runs it as one operation on the channel's side (its thread
on the host path, the comm stream on a GPU), as it runs a top-k or a PowerSGD
bucket.

Each value goes through two roundings (the rank's message, then the owner's
average), so the result is within ``(mean over ranks of each rank's group
scale + the average's group scale) / 2`` of the exact mean, per element, plus
fp32's own rounding (:func:`~hybridcomm.kernels.quantize.error_bound`); every
rank holds the same bits. The usage flags are not reduced: the averager's
buckets have none to agree on.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..algorithms.quantized import chunk_numel, exchange_schedule, gather_schedule, segment_numel
from ..kernels import dequantize, quantize
from ..kernels.quantize import GROUP


class QuantizedReduce:
    """One bucket's quantized all-reduce: its message buffers and schedules.

    ``numel``: the bucket's values; ``alloc(numel, dtype)`` makes device memory
    (the bucket's allocator, so the comm stream owns it on a GPU).

    Example::

        >>> alloc = lambda n, dtype: torch.zeros(n, dtype=dtype)
        >>> q = QuantizedReduce(1000, bits=4, rank=0, world=1, alloc=alloc)
        >>> g = torch.linspace(-1, 1, 1000); q.encode(g); q.reduce_own(scale=None)
        >>> q.decode(g); round(g[-1].item(), 3), q.bytes_sent
        (1.0, 0)
    """

    def __init__(
        self,
        numel: int,
        *,
        bits: int,
        rank: int,
        world: int,
        alloc: Callable[[int, torch.dtype], torch.Tensor],
        group: int = GROUP,
    ):
        self.numel, self.bits, self.rank, self.world, self.group = numel, bits, rank, world, group
        self.chunk = chunk_numel(numel, world, group)
        self.seg = seg = segment_numel(self.chunk, bits, group)
        self._codes_at = -(-self.chunk // group)  # a segment's codes start after its scales
        # [outgoing chunk 0..P-1 | incoming from rank 0..P-1], then the gathered averages
        self.exchanged = alloc(2 * world * seg, torch.float32)
        self.gathered = alloc(world * seg, torch.float32)
        self.exchanged.zero_()
        self.gathered.zero_()
        self.total = alloc(self.chunk, torch.float32)  # this rank's chunk, summed
        self.exchange = exchange_schedule(rank, world, seg)
        self.gather = gather_schedule(rank, world, seg)

    @property
    def bytes_sent(self) -> int:
        return 2 * (self.world - 1) * self.seg * 4

    def _bounds(self, j: int):
        a = min(j * self.chunk, self.numel)
        return a, min(a + self.chunk, self.numel)

    def _parts(self, segment: torch.Tensor, n: int):
        """(codes, scales) of ``n`` values in one fp32 segment: scales first."""
        codes = segment[self._codes_at :].view(torch.uint8)
        return codes[: (n * self.bits + 7) // 8], segment[: -(-n // self.group)]

    def encode(self, values: torch.Tensor) -> None:
        """This rank's messages: each chunk of ``values`` quantized into its outgoing slot."""
        out = self.exchanged
        for j in range(self.world):
            a, z = self._bounds(j)
            codes, scales = self._parts(out[j * self.seg : (j + 1) * self.seg], z - a)
            quantize(values[a:z], codes, scales, bits=self.bits, group=self.group)

    def reduce_own(self, scale) -> None:
        """After the exchange: this rank's chunk summed over the ranks in rank order
        (its own message from the outgoing slot), times ``scale``, quantized into
        its segment of the gathered buffer."""
        a, z = self._bounds(self.rank)
        n, total, seg, buf = z - a, self.total[: z - a], self.seg, self.exchanged
        for j in range(self.world):
            slot = self.rank if j == self.rank else self.world + j
            codes, scales = self._parts(buf[slot * seg : (slot + 1) * seg], n)
            dequantize(codes, scales, total, bits=self.bits, group=self.group, accumulate=j > 0)
        if scale is not None:
            total.mul_(scale)
        mine = self.gathered[self.rank * seg : (self.rank + 1) * seg]
        codes, scales = self._parts(mine, n)
        quantize(total, codes, scales, bits=self.bits, group=self.group)

    def decode(self, values: torch.Tensor) -> None:
        """After the gather: every chunk's average into ``values`` (cast to its dtype)."""
        fp32 = values.dtype == torch.float32
        for j in range(self.world):
            a, z = self._bounds(j)
            if z == a:
                continue
            codes, scales = self._parts(self.gathered[j * self.seg : (j + 1) * self.seg], z - a)
            out = values[a:z] if fp32 else self.total[: z - a]
            dequantize(codes, scales, out, bits=self.bits, group=self.group)
            if not fp32:
                values[a:z].copy_(out)
