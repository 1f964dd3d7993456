"""The plan's records: a :class:`Layer` (a module's own parameters), a
:class:`Bucket` (layers fused into one buffer, its algorithm and segments) and
the :class:`Plan` every rank follows (the buckets and their issue order), as
planner.py makes them and a checkpoint carries them (:meth:`Plan.to_dict`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

from .layout import buffer_numel, flag_stride


@dataclass
class Layer:
    """A module's own trainable parameters (indices into the optimizer's list)."""

    name: str
    params: List[int]
    numel: int
    element_size: int = 4  # of the dtype its bucket carries on the wire
    dtype: str = "torch.float32"
    sizes: Optional[List[int]] = None  # each parameter's numel (for the bucket's layout)
    shapes: Optional[List[Tuple[int, ...]]] = None  # each parameter's shape (low rank's)


@dataclass
class Bucket:
    index: int
    layers: List[str]
    params: List[int]  # parameter indices, in buffer order
    numel: int  # gradient elements (the buffer also holds one flag per parameter)
    nbytes: int
    algorithm: str
    predicted_s: float
    dtype: str = "torch.float32"
    window_s: Optional[float] = None
    segments: List[Tuple[int, int]] = field(default_factory=list)  # over the whole buffer
    need: Optional[int] = None  # position in the next forward's order of need
    offsets: Optional[List[int]] = None  # each gradient's start in the buffer (None: packed)
    grad_numel: Optional[int] = None  # the gradient region, padding included (None: numel)
    compressor: Optional[str] = None  # "powersgd": its messages go with ``algorithm``
    # Usage flags: one copy, or (sharded: reduce-scattered) one a rank, each its own
    # block of the last segment's tail, so that every rank ends with them summed
    flag_copies: int = 1
    # Whole-parameter shards (ownership.py): the rank that owns each parameter, in
    # buffer order (its gradients lie in that rank's part); None: element slices
    owners: Optional[List[int]] = None

    @property
    def flag_stride(self) -> int:
        """Elements a copy of the usage flags takes (layout.py)."""
        return flag_stride(len(self.params), self.flag_copies)

    @property
    def tail(self) -> int:
        """The last segment's tail block a rank (``algorithms.tail_body``), or 0."""
        return 0 if self.flag_copies == 1 else self.flag_stride

    @property
    def buffer_numel(self) -> int:
        """Gradients (with padding), then the usage flags (one per parameter a copy)."""
        return buffer_numel(
            self.numel if self.grad_numel is None else self.grad_numel,
            len(self.params),
            self.flag_copies,
        )


# The footer of every printed plan (docs/API.md explains the same columns).
COLUMNS = (
    "columns: bytes = the bucket's gradient bytes; algorithm = how it is all-reduced "
    "(ring, butterfly, ..., native = the process group's own); pred(us) = the cost "
    "model's time for it; window(us) = measured time from its launch to the first use "
    "of its parameters in the next forward ('-': not measured yet); need = its place "
    "in the next forward's order of use; segs = the parts it is issued in (a large "
    "bucket is split so an urgent one is not stuck behind it); issue order = the one "
    "sequence every rank sends in"
)


@dataclass
class Plan:
    world_size: int
    strategy: str
    buckets: List[Bucket]
    order: List[Tuple[int, int]]  # (bucket, segment): the one issue order of a step
    fusion_bytes: int = 0
    split_bytes: int = 0
    notes: List[str] = field(default_factory=list)
    # The step's learned structure: buckets are launched in the backward pass with
    # this number (counted since the last step(), no_sync passes excluded).
    launch_pass: int = 1
    # Forward mode: updates wait for the first use of their parameters in the next
    # forward (False: nothing was left to overlap with it; step() applies them).
    defer_updates: bool = True

    def to_dict(self) -> dict:
        """Plain types (a checkpoint's): :func:`plan_from_dict` makes the plan again."""
        return asdict(self)

    def decisions(self):
        """What the ranks must agree on (a re-plan that changes none of it is skipped)."""
        return (
            [(b.layers, b.algorithm, b.segments, b.compressor, b.owners) for b in self.buckets],
            self.order,
            self.launch_pass,
            self.defer_updates,
        )

    def __str__(self) -> str:
        head = (
            f"hybridcomm plan: {len(self.buckets)} buckets, world size {self.world_size}, "
            f"strategy {self.strategy}, fusion {self.fusion_bytes} B, split "
            f"{f'{self.split_bytes} B' if self.split_bytes else 'off'}, launched in backward pass {self.launch_pass} "
            f"of a step" + ("" if self.defer_updates else ", updates in step()") + "\n"
        )
        cols = (
            f"{'bucket':>6} {'bytes':>10} {'dtype':>8} {'algorithm':>17} {'pred(us)':>9} "
            f"{'window(us)':>10} {'need':>4} {'segs':>4}  layers\n"
        )
        rows = []
        for b in self.buckets:
            win = "-" if b.window_s is None else f"{b.window_s * 1e6:.0f}"
            need = "-" if b.need is None else str(b.need)
            layers = ", ".join(b.layers)
            layers = layers if len(layers) <= 60 else layers[:57] + "..."
            algo = b.algorithm if b.compressor is None else f"{b.compressor}+{b.algorithm}"
            rows.append(
                f"{b.index:>6} {b.nbytes:>10} {b.dtype.replace('torch.', ''):>8} "
                f"{algo:>17} {b.predicted_s * 1e6:>9.0f} {win:>10} {need:>4} "
                f"{len(b.segments):>4}  {layers}"
            )
        order = " ".join(f"{b}.{s}" for b, s in self.order[:40]) + (
            f" ... ({len(self.order)} in all)" if len(self.order) > 40 else ""
        )
        tail = f"\nissue order (bucket.segment): {order}"
        if self.notes:
            tail += "\nnotes: " + "; ".join(self.notes)
        return head + cols + "\n".join(rows) + tail + "\n" + COLUMNS


def plan_from_dict(d: dict) -> Plan:
    """The plan :meth:`Plan.to_dict` wrote (a checkpoint's).

    >>> p = Plan(2, "hybrid", [Bucket(0, ["fc"], [0], 3, 12, "ring", 1e-4, segments=[(0, 4)])],
    ...          [(0, 0)])
    >>> plan_from_dict(p.to_dict()) == p
    True
    """
    d = dict(d)
    buckets = [
        Bucket(**{**b, "segments": [tuple(s) for s in b["segments"]]}) for b in d.pop("buckets")
    ]
    return Plan(buckets=buckets, order=[tuple(o) for o in d.pop("order")], **d)
