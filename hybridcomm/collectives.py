"""``all_reduce``: the collective, with its input checks and algorithm choice."""

from __future__ import annotations

import logging
import threading
from typing import Set, Tuple

import torch

from .comm import control
from .config import env
from .algorithms import ALGORITHMS, TOPOLOGY_AWARE, Topology
from .plan.auto_model import choose_algorithm
from .plan.cost_model import NATIVE
from .base.errors import HybridCommError
from .comm.executor import reduce_now
from .kernels import SUPPORTED_DTYPES
from .comm.transport.select import select_transport

log = logging.getLogger("hybridcomm")

OPS = ("sum", "avg")
CHECK_MODES = ("always", "first", "off")
_agreed: Set[Tuple] = set()  # (group, call signature) pairs every rank has agreed on
_agreed_lock = threading.Lock()


def resolve_algorithm(
    algorithm: str, nbytes: int, world_size: int, topology=None, *, model=None, candidates=None
) -> str:
    """The concrete algorithm for a request ("auto" honours ``HYBRIDCOMM_ALGO``, else
    :func:`~hybridcomm.plan.auto_model.choose_algorithm` with ``model`` and
    ``candidates``: the DDP hook passes its agreed cost model and ``native``)."""
    if algorithm == "auto":
        forced = env.get("HYBRIDCOMM_ALGO")
        if forced == "ps":  # the summation servers are a DistributedOptimizer option
            raise ValueError(
                "HYBRIDCOMM_ALGO=ps applies to DistributedOptimizer(servers=...); "
                "this all-reduce has no summation servers"
            )
        return forced or choose_algorithm(
            nbytes, world_size, topology, model=model, candidates=candidates
        )
    if algorithm not in ALGORITHMS + (NATIVE,):
        raise ValueError(
            f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS + (NATIVE, 'auto')}"
        )
    return algorithm


def check_mode(check) -> str:
    """``check`` as one of :data:`CHECK_MODES` (None: ``HYBRIDCOMM_CHECK``)."""
    if check is None:
        check = env.get("HYBRIDCOMM_CHECK")
    if check is True or check in ("1", "true", "yes", "on"):
        return "always"
    if check is False or check in ("0", "false", "no", "off"):
        return "off"
    if check not in CHECK_MODES:
        raise ValueError(f"check must be True, False or one of {CHECK_MODES}, got {check!r}")
    return check


def check_same_call(group, signature: Tuple, timeout: float) -> None:
    """Raise on every rank if the ranks' call signatures (numel, dtype, algorithm,
    op, transport, and the resolved node size and grid of a two-level algorithm)
    differ: without this a mismatch would hang or corrupt data."""
    rows = control.all_gather_object(
        signature, group=group, timeout=timeout, what="all_reduce's arguments"
    )
    names = ("numel", "dtype", "algorithm", "op", "transport", "node_size", "grid")
    problems = []
    for i, what in enumerate(names):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            problems.append(f"{what} differs: " + control.describe_difference(values, str))
    if problems:
        raise HybridCommError(
            "all_reduce called with mismatched arguments across ranks: " + "; ".join(problems)
        )


def all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    algorithm: str = "auto",
    group=None,
    *,
    timeout: float | None = None,
    check=None,
    node_size: int | None = None,
    grid: tuple[int, int] | None = None,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place across the ranks of ``group`` and return it.

    Args:
        tensor: fp32, fp16, bf16 or fp64, any shape, on CPU (gloo) or CUDA.
            A non-contiguous tensor is reduced through a contiguous copy.
        op: ``"sum"`` or ``"avg"`` (sum divided by the world size).
        algorithm: one of :data:`hybridcomm.ALGORITHMS`, ``"native"`` (the
            process group's own all-reduce), or ``"auto"`` (the cost model's
            choice, overridable with ``HYBRIDCOMM_ALGO``; logged at DEBUG).
        group: a torch.distributed process group (None: the default group).
        timeout: seconds to wait for a peer before raising
            :class:`HybridCommTimeout` (default ``HYBRIDCOMM_TIMEOUT`` or 300).
        check: agree across ranks on length, dtype, algorithm and op first,
            naming the ranks that differ: ``"first"`` (default: once per
            distinct call, so a steady loop pays nothing), ``"always"``/True,
            or ``"off"``/False; ``HYBRIDCOMM_CHECK`` sets the default.
        node_size: ranks per node for ``hierarchical`` (consecutive ranks; the
            last node may be short); default ``LOCAL_WORLD_SIZE``, else one node.
            ``auto`` considers ``hierarchical`` when there are several nodes.
        grid: ``(rows, cols)`` for ``torus2d`` (the last row may be short);
            default the most square factorization of the world size.

    fp16/bf16 partial sums are accumulated in fp32 at each step. Every rank
    ends with bitwise identical values. On CUDA the call returns once the work
    is queued; the current stream waits for it (no host synchronization).

    Example::

        >>> import torch, hybridcomm          # after dist.init_process_group(...)
        >>> g = torch.ones(1000)
        >>> hybridcomm.all_reduce(g, op="avg", algorithm="ring")[:3]
        tensor([1., 1., 1.])
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_reduce expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"all_reduce does not support dtype {tensor.dtype}; "
            f"supported: {', '.join(map(str, SUPPORTED_DTYPES))}"
        )
    if tensor.is_sparse:
        raise TypeError(
            "all_reduce takes dense tensors; for sparse ones use "
            "torch.distributed.all_gather of indices and values"
        )
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {OPS}")
    mode = check_mode(check)
    timeout = env.timeout(timeout)
    control.require_initialized("hybridcomm.all_reduce")
    transport = select_transport(tensor.device, group, timeout=timeout)
    world = transport.world_size
    topology = Topology(node_size, grid).resolve(world)
    nbytes = tensor.numel() * tensor.element_size()
    name = resolve_algorithm(algorithm, nbytes, world, topology)
    if algorithm == "auto":
        log.debug("all_reduce: %d bytes over %d ranks -> %s", nbytes, world, name)
    if world > 1 and mode != "off":
        topo = (topology.node_size, topology.grid) if name in TOPOLOGY_AWARE else (0, (0, 0))
        signature = (tensor.numel(), str(tensor.dtype), name, op, transport.kind, *topo)
        key = (id(group), signature)
        with _agreed_lock:
            known = key in _agreed
        if mode == "always" or not known:
            check_same_call(group, signature, timeout)
            with _agreed_lock:
                _agreed.add(key)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    reduce_now(
        flat,
        transport,
        name,
        scale=1.0 / world if op == "avg" else None,
        timeout=timeout,
        topology=topology,
        what=f"all_reduce ({name}, {nbytes} bytes)",
    )
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def default_timeout() -> float:
    """Seconds to wait for a peer: ``HYBRIDCOMM_TIMEOUT`` or 300."""
    return env.get("HYBRIDCOMM_TIMEOUT")
