"""The synchronizer's settings, read once from the arguments and the environment.

``DistributedOptimizer`` (and LocalSGD) build one :class:`SyncConfig` from their
keywords and the ``HYBRIDCOMM_*`` variables, checked once at construction, and
hand it down: the synchronizer's parts read their settings here.

Example::

    >>> cfg = SyncConfig.build(overlap="backward", compression="fp16", timeout=60)
    >>> cfg.overlap, cfg.wire_dtype, cfg.topk, cfg.timeout
    ('backward', torch.float16, None, 60.0)
    >>> SyncConfig.build(compression="topk:0.01").topk
    0.01
    >>> SyncConfig.build(compression="powersgd:4:100").low_rank     # (rank, start)
    (4, 100)
    >>> cfg = SyncConfig.build(compression="powersgd:4:100+fp16")  # exact steps in fp16
    >>> cfg.low_rank, cfg.wire_dtype
    ((4, 100), torch.float16)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from ..algorithms.lowrank import parse_powersgd
from ..algorithms.topk import parse_topk
from . import env

OVERLAPS = ("forward", "backward", "none")
OPS = ("sum", "avg")
# compression= -> the wire dtype (top-k is parsed apart: "topk:RATIO")
COMPRESSIONS = {
    None: None,
    "none": None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    torch.float16: torch.float16,
    torch.bfloat16: torch.bfloat16,
}


def split_wire(compression) -> Tuple[Any, Optional[str]]:
    """``"powersgd:4+fp16"`` -> ``("powersgd:4", "fp16")``: PowerSGD with what it
    sends whole (its first START steps, buckets it leaves uncompressed) in a
    16-bit wire dtype; anything without ``+`` is returned as is.

        >>> split_wire("powersgd:4:10+bf16"), split_wire("fp16")
        (('powersgd:4:10', 'bf16'), ('fp16', None))
    """
    if not isinstance(compression, str) or "+" not in compression:
        return compression, None
    base, wire = compression.rsplit("+", 1)
    if wire not in ("fp16", "bf16") or parse_powersgd(base) is None:
        raise ValueError(
            f"compression={compression!r}: only PowerSGD takes a wire dtype, "
            "as 'powersgd:RANK[:START]+fp16' or '+bf16'"
        )
    return base, wire


@dataclass(frozen=True)
class SyncConfig:
    """What a :class:`~hybridcomm.sync.synchronizer.GradientSynchronizer` does;
    the fields are ``DistributedOptimizer``'s keywords of the same names
    (``compression`` split into ``wire_dtype``, ``topk`` and ``low_rank``), plus:

    Attributes:
        defer_always: forward mode defers updates even where the plan finds
            nothing to overlap (``HYBRIDCOMM_DEFER=always``).
        issue_thread: buckets are issued by the channel's own thread, not in
            autograd's hooks (``HYBRIDCOMM_ISSUE_THREAD``, default on).
        lean_hooks: in a steady step only the parameter that completes each
            bucket keeps its post-accumulate hook (``HYBRIDCOMM_LEAN_HOOKS``,
            default on; sync/grad_hooks.py).
    """

    overlap: str = "forward"
    strategy: str = "hybrid"
    op: str = "avg"
    backward_passes_per_step: Optional[int] = None
    wire_dtype: Optional[torch.dtype] = None
    topk: Optional[float] = None
    low_rank: Optional[Tuple[int, int]] = None  # PowerSGD's (rank, start)
    correction_momentum: float = 0.0
    cost_model: Any = None  # a CostModel, a path, "default", or None (probe or saved)
    timeout: float = 300.0
    fusion_bytes: Optional[int] = None
    split_bytes: Optional[int] = None
    lazy_bytes: Optional[int] = None
    measure_iters: int = 3
    replan_every: int = 200
    trace: bool = False
    find_unused_parameters: bool = False
    defer_always: bool = False
    issue_thread: bool = True
    lean_hooks: bool = True
    shard: Optional[str] = None  # None, "optimizer" or "gradients" (sync/shard.py)
    # How shard= cuts the state: "elements" or "parameters" (sync/granularity.py), and why
    shard_by: Optional[str] = None
    shard_by_reason: str = ""

    def __post_init__(self):
        if self.overlap not in OVERLAPS:
            raise ValueError(f"overlap must be one of {OVERLAPS}, got {self.overlap!r}")
        if self.op not in OPS:
            raise ValueError(f"op must be 'sum' or 'avg', got {self.op!r}")
        if self.backward_passes_per_step is not None and self.backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1 (or None: learned)")
        if self.shard not in (None, "optimizer", "gradients"):
            raise ValueError(f"shard must be None, 'optimizer' or 'gradients', got {self.shard!r}")
        if self.shard_by not in (None, "elements", "parameters"):
            raise ValueError(
                f"shard_by must be None, 'elements' or 'parameters', got {self.shard_by!r}"
            )
        if self.shard_by is not None and self.shard is None:
            raise ValueError(
                f"shard_by={self.shard_by!r} needs shard='optimizer' or 'gradients' "
                "(without shard= every rank keeps the whole state)"
            )
        if self.lazy_bytes is not None and self.lazy_bytes <= 0:
            raise ValueError(f"lazy_bytes must be > 0 bytes, got {self.lazy_bytes}")

    @classmethod
    def build(
        cls, *, compression=None, timeout: Optional[float] = None, **arguments
    ) -> "SyncConfig":
        """From ``DistributedOptimizer``'s keywords and the environment."""
        compression, wire = split_wire(compression)
        topk, low_rank = parse_topk(compression), parse_powersgd(compression)
        if compression not in COMPRESSIONS and topk is None and low_rank is None:
            raise ValueError(
                f"compression must be one of None, 'fp16', 'bf16', 'topk:RATIO', "
                "'powersgd:RANK[:START]', 'powersgd:RANK[:START]+fp16' (or +bf16), "
                f"got {compression!r}"
            )
        return cls(
            wire_dtype=COMPRESSIONS[wire if topk or low_rank else compression],
            topk=topk,
            low_rank=low_rank,
            timeout=env.timeout(timeout),
            defer_always=env.get("HYBRIDCOMM_DEFER") == "always",
            issue_thread=env.get("HYBRIDCOMM_ISSUE_THREAD"),
            lean_hooks=env.get("HYBRIDCOMM_LEAN_HOOKS"),
            **arguments,
        )

    def replace(self, **changes) -> "SyncConfig":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)
