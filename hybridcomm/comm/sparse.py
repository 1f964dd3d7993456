"""Sparse gradients (``nn.Embedding(sparse=True)``): all-gathered as (index, value)
pairs and coalesced, on the host path.

Each rank's gradient is coalesced, its row count agreed, and the rows padded
to the largest count and all-gathered over gloo; every rank then concatenates
the ranks' rows in rank order and coalesces them (duplicate indices summed in
that one order), so every rank ends with identical bits. ``op="avg"`` divides
by the world size, as for dense buckets. Rows some rank touched are the
result's rows; a rank without a gradient contributes none.

Example::

    >>> emb = torch.nn.Embedding(10, 3, sparse=True)
    >>> emb(torch.tensor([1, 2, 2])).sum().backward()
    >>> g = all_gather_sparse(emb.weight.grad, emb.weight.shape, emb.weight.dtype, None,
    ...                       average=True, timeout=60, what="emb.weight")
    >>> g.indices().tolist(), g.values()[:, 0].tolist()
    ([[1, 2]], [1.0, 2.0])
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .transport.torch_dist import posted, wait_work


def all_gather_sparse(
    grad: Optional[torch.Tensor], shape, dtype, group, *, average: bool, timeout: float, what: str
) -> Optional[torch.Tensor]:
    """The sum (or average) over ranks of sparse ``grad`` (None: nothing from this
    rank), as a coalesced sparse COO tensor of ``shape``; None if no rank had one."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if grad is not None:
        grad = grad.coalesce()
        idx, val = grad.indices()[0], grad.values()
    else:
        idx = torch.empty(0, dtype=torch.int64)
        val = torch.empty((0, *shape[1:]), dtype=dtype)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    mine = torch.tensor([idx.numel()], dtype=torch.int64)

    def wait(post, stage):
        label = f"{what}: {stage}"
        wait_work(posted(post, rank, label), rank, label, timeout)

    wait(lambda: dist.all_gather(counts, mine, group=group, async_op=True), "row counts")
    counts = [int(c[0]) for c in counts]
    longest = max(counts)
    if longest == 0:
        return None
    pad_idx = torch.zeros(longest, dtype=torch.int64)
    pad_idx[: idx.numel()] = idx
    pad_val = torch.zeros((longest, *shape[1:]), dtype=dtype)
    pad_val[: val.shape[0]] = val
    all_idx = [torch.empty_like(pad_idx) for _ in range(world)]
    all_val = [torch.empty_like(pad_val) for _ in range(world)]
    wait(lambda: dist.all_gather(all_idx, pad_idx, group=group, async_op=True), "indices")
    wait(lambda: dist.all_gather(all_val, pad_val, group=group, async_op=True), "values")
    indices = torch.cat([i[:n] for i, n in zip(all_idx, counts)])
    values = torch.cat([v[:n] for v, n in zip(all_val, counts)])
    if average:
        values = values / world
    out = torch.sparse_coo_tensor(
        indices.unsqueeze(0), values, tuple(shape), check_invariants=True
    )  # indices from the wire: check them
    return out.coalesce()


def reduce_sparse_grads(sparse, channel, group, *, average: bool, timeout: float) -> None:
    """``p.grad`` of each ``(param, name)`` in ``sparse`` <- its sum (avg) over ranks,
    through ``channel`` (after whatever it holds: the same order on every rank)."""
    for p, name in sparse:
        out = []
        what = f"sparse gradient of {name!r}"
        fn = lambda p=p, what=what: out.append(
            all_gather_sparse(
                p.grad, p.shape, p.dtype, group, average=average, timeout=timeout, what=what
            )
        )
        channel.wait(channel.submit(fn, what), what)
        p.grad = out[0]
