"""A bucket group of P thread ranks over the fake network: the production
``BucketGroup``, ``CommEngine`` and ``HostChannel``, with only the wire faked
(tests/fakes/network.py). Plans are built by hand (the planner's own tests are
tests/test_planner.py), so that a test fixes the buckets and the issue order.

Example::

    net = FakeNetwork(2)
    sizes = [[3, 5], [4]]
    group = bucket_group(net.transport(0), plan_of(2, sizes, order=[(1, 0), (0, 0)]), sizes)
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from hybridcomm.base.timeline import Timeline
from hybridcomm.comm.channel import HostChannel
from hybridcomm.config.config import SyncConfig
from hybridcomm.gpu.clock import HostClock
from hybridcomm.plan.layout import buffer_numel, layout
from hybridcomm.plan.planner import Bucket, Plan
from hybridcomm.sync.bucket_group import BucketGroup, Links, StepState
from hybridcomm.sync.memory import bucket_allocator
from hybridcomm.sync.used import UsedAgreement


def plan_of(
    world: int,
    sizes: Sequence[Sequence[int]],
    order: Optional[List[Tuple[int, int]]] = None,
    algorithm: str = "ring",
    segments: int = 1,
) -> Plan:
    """Bucket k holds parameters of ``sizes[k]`` elements (numbered across buckets);
    each bucket in ``segments`` equal segments; ``order``: the issue order (default:
    bucket by bucket, segment by segment)."""
    buckets, first = [], 0
    for k, ns in enumerate(sizes):
        offsets, grad_numel = layout(list(ns), 4)
        total = buffer_numel(grad_numel, len(ns), 1)
        cuts = [total * i // segments for i in range(segments + 1)]
        buckets.append(
            Bucket(
                index=k,
                layers=[f"layer{first + i}" for i in range(len(ns))],
                params=list(range(first, first + len(ns))),
                numel=sum(ns),
                nbytes=4 * sum(ns),
                algorithm=algorithm,
                predicted_s=0.0,
                segments=list(zip(cuts, cuts[1:])),
                offsets=offsets,
                grad_numel=grad_numel,
            )
        )
        first += len(ns)
    if order is None:
        order = [(k, s) for k in range(len(sizes)) for s in range(segments)]
    return Plan(world, "hybrid", buckets, order)


def bucket_group(
    transport, plan: Plan, sizes: Sequence[Sequence[int]], op: str = "sum", timeout: float = 10.0
) -> BucketGroup:
    """``plan``'s buckets (``plan_of(world, sizes, ...)``) on this rank, over
    ``transport``, with fresh parameters of those sizes."""
    params = [torch.nn.Parameter(torch.zeros(n)) for ns in sizes for n in ns]
    world = transport.world_size
    links = Links(
        channel=HostChannel(timeout=timeout),
        transport=transport,
        alloc=bucket_allocator(None, torch.device("cpu")),
        used=UsedAgreement(False, transport.rank, None, timeout),
        clock=HostClock(),
        timeline=Timeline(enabled=False),
        rank=transport.rank,
        world=world,
        scale=1.0 / world if op == "avg" else None,
    )
    names = [f"p{i}" for i in range(len(params))]
    group = BucketGroup(
        plan,
        params,
        names,
        links,
        SyncConfig(timeout=timeout),
        StepState(),
        measuring_next=lambda: False,
    )
    _made.append(group)
    return group


_made: List[BucketGroup] = []


def close_all() -> None:
    """Close every group made since the last call (a failed rank leaves its group
    open: its channel's thread must not outlive the test)."""
    while _made:
        _made.pop().close()
