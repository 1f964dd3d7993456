"""A quantized all-reduce's layout and schedules: pure arithmetic that
comm/quantized.py's :class:`~hybridcomm.comm.quantized.QuantizedReduce` runs
and the strategies price.

Integers of 8 or 4 bits cannot be summed on the wire, so the all-reduce is an
exchange of quantized chunks (:func:`exchange_schedule`: rank j gets every
rank's chunk j, sums them in rank order and quantizes the result) followed by
a ring all-gather of the results (:func:`gather_schedule`): copies only, and
every rank decodes the same bytes, so all hold the same bits (Streaming
DiLoCo's and torchft's shape).

Example::

    >>> chunk_numel(1000, 4, 128), segment_numel(256, 4, 128)
    (256, 34)
    >>> bytes_sent(1000, 4, 4, 128)    # against 6,000 for a ring all-reduce of fp32
    816
"""

from __future__ import annotations

from .schedule import Recv, Schedule, Send, Step, build
from .topk import gather_schedule

QUANTIZED = ("int8", "int4")  # compression names: 8 or 4 bits a value on the wire


def bits_of(compression) -> int:
    """8 for ``"int8"``, 4 for ``"int4"``, 0 for any other compression."""
    return {"int8": 8, "int4": 4}.get(compression, 0) if isinstance(compression, str) else 0


def chunk_numel(numel: int, world: int, group: int) -> int:
    """Elements of each rank's chunk: an equal share, rounded up to whole groups
    (the last rank's chunk may be shorter, or empty)."""
    share = -(-numel // world)
    return -(-share // group) * group


def segment_numel(chunk: int, bits: int, group: int) -> int:
    """fp32 words of one chunk's message, ``[scales | codes as bytes]`` (the wire
    carries fp32 everywhere; the codes are bytes viewed as fp32 words). Chunks
    are whole quantization groups, so each chunk's groups are the buffer's."""
    scales = -(-chunk // group)
    code_bytes = (chunk * bits + 7) // 8
    return scales + -(-code_bytes // 4)


def bytes_sent(numel: int, world: int, bits: int, group: int) -> int:
    """Bytes one rank sends: P - 1 segments in the exchange, P - 1 in the gather."""
    seg = segment_numel(chunk_numel(numel, world, group), bits, group)
    return 2 * (world - 1) * seg * 4


def exchange_schedule(rank: int, world: int, seg: int) -> Schedule:
    """One step over a buffer of 2P segments ``[outgoing 0..P-1 | incoming 0..P-1]``:
    outgoing segment j to rank j, rank j's segment for this rank into incoming
    slot j (this rank's own stays in outgoing slot ``rank``)."""
    peers = [j for j in range(world) if j != rank]
    sends = tuple(Send(j, j * seg, (j + 1) * seg) for j in peers)
    recvs = tuple(Recv(j, (world + j) * seg, (world + j + 1) * seg, reduce=False) for j in peers)
    return build("quantized_exchange", rank, world, 2 * world * seg, [Step(sends, recvs)])


__all__ = [
    "QUANTIZED",
    "bits_of",
    "bytes_sent",
    "chunk_numel",
    "exchange_schedule",
    "gather_schedule",
    "segment_numel",
]
