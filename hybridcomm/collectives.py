"""``all_reduce``: the collective, with its input checks and algorithm choice."""
from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .algorithms import ALGORITHMS, TOPOLOGY_AWARE, Topology, get_schedule
from .cost_model import choose_algorithm
from .errors import HybridCommError
from .executor import Workspace, execute
from .kernels import SUPPORTED_DTYPES
from .transport.select import select_transport

log = logging.getLogger("hybridcomm")

OPS = ("sum", "avg")
TRANSPORT_KINDS = ("torch", "cupy")
DEFAULT_TIMEOUT_S = 300.0
_workspace = Workspace()


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in ("0", "false", "no", "off", "")


def default_timeout() -> float:
    """Seconds to wait for a peer: ``HYBRIDCOMM_TIMEOUT`` or 300."""
    return float(os.environ.get("HYBRIDCOMM_TIMEOUT", DEFAULT_TIMEOUT_S))


def resolve_algorithm(algorithm: str, nbytes: int, world_size: int, topology=None) -> str:
    """The concrete algorithm for a request ("auto" honours ``HYBRIDCOMM_ALGO``)."""
    if algorithm == "auto":
        forced = os.environ.get("HYBRIDCOMM_ALGO")
        if forced:
            if forced not in ALGORITHMS:
                raise HybridCommError(f"HYBRIDCOMM_ALGO={forced!r} is not one of {ALGORITHMS}")
            return forced
        return choose_algorithm(nbytes, world_size, topology)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS + ('auto',)}")
    return algorithm


def check_same_call(transport, tensor: torch.Tensor, algorithm: str,
                    op: str, timeout: float, topology: Topology | None = None) -> None:
    """Raise on every rank if the ranks disagree on length, dtype, algorithm, op,
    transport or (for the two-level algorithms) the resolved node size and grid.

    One tiny all-gather; without it a mismatch would hang or corrupt data.
    """
    topo = (topology or Topology()).resolve(transport.world_size) \
        if algorithm in TOPOLOGY_AWARE else Topology(0, (0, 0))
    mine = [tensor.numel(), SUPPORTED_DTYPES.index(tensor.dtype), ALGORITHMS.index(algorithm),
            OPS.index(op), TRANSPORT_KINDS.index(transport.kind), topo.node_size, *topo.grid]
    # On the process group's own device: a gloo group cannot gather CUDA tensors
    # even when the data path (CuPy NCCL) runs on the GPU.
    device = tensor.device if str(dist.get_backend(transport.group)) == "nccl" else "cpu"
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    gathered = torch.empty(transport.world_size * len(mine), dtype=torch.int64, device=device)
    work = dist.all_gather_into_tensor(gathered, local, group=transport.group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout))
    except Exception as e:
        raise HybridCommError(f"rank {transport.rank}: the pre-call agreement check failed "
                              f"(a peer dead or not calling all_reduce?): {e}") from e
    rows = gathered.view(transport.world_size, len(mine)).tolist()
    names = [("numel", None), ("dtype", SUPPORTED_DTYPES), ("algorithm", ALGORITHMS), ("op", OPS),
             ("transport", TRANSPORT_KINDS), ("node_size", None), ("grid rows", None),
             ("grid cols", None)]
    problems = []
    for i, (what, table) in enumerate(names):
        by_value = {}
        for rank, row in enumerate(rows):
            by_value.setdefault(row[i] if table is None else str(table[row[i]]), []).append(rank)
        if len(by_value) > 1:
            problems.append(f"{what} differs: " + ", ".join(
                f"ranks {ranks} have {value}" for value, ranks in by_value.items()))
    if problems:
        raise HybridCommError("all_reduce called with mismatched arguments across ranks: "
                              + "; ".join(problems))


def all_reduce(tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto", group=None, *,
               timeout: float | None = None, check: bool | None = None,
               node_size: int | None = None, grid: tuple[int, int] | None = None) -> torch.Tensor:
    """All-reduce ``tensor`` in place across the ranks of ``group`` and return it.

    Args:
        tensor: fp32, fp16 or bf16, any shape, on CPU (gloo) or CUDA (nccl).
            A non-contiguous tensor is reduced through a contiguous copy.
        op: ``"sum"`` or ``"avg"`` (sum divided by the world size).
        algorithm: one of :data:`hybridcomm.ALGORITHMS` or ``"auto"`` (a size
            rule, overridable with ``HYBRIDCOMM_ALGO``; logged at DEBUG).
        group: a torch.distributed process group (None: the default group).
        timeout: seconds to wait for a peer before raising
            :class:`HybridCommTimeout` (default ``HYBRIDCOMM_TIMEOUT`` or 300).
        check: first agree across ranks on length, dtype, algorithm and op,
            naming the ranks that differ (one tiny all-gather; default on,
            ``HYBRIDCOMM_CHECK=0`` turns it off).
        node_size: ranks per node for ``hierarchical`` (consecutive ranks; the
            last node may be short); default ``LOCAL_WORLD_SIZE``, else one node.
            ``auto`` considers ``hierarchical`` when there are several nodes.
        grid: ``(rows, cols)`` for ``torus2d`` (the last row may be short);
            default the most square factorization of the world size.

    fp16/bf16 partial sums are accumulated in fp32 at each step. Every rank
    ends with bitwise identical values.

    Example::

        >>> import torch, torch.distributed as dist, hybridcomm
        >>> dist.init_process_group("gloo")          # e.g. under torchrun
        >>> g = torch.ones(1000)
        >>> hybridcomm.all_reduce(g, op="avg", algorithm="ring")
        >>> hybridcomm.all_reduce(g, algorithm="hierarchical", node_size=8)  # 8 ranks per node
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_reduce expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"all_reduce does not support dtype {tensor.dtype}; "
                        f"supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {OPS}")
    # CuPy NCCL for CUDA tensors where it imports, else torch.distributed
    # (HYBRIDCOMM_TRANSPORT=auto|cupy|torch; a name asked for never falls back).
    transport = select_transport(tensor.device, group)
    timeout = default_timeout() if timeout is None else float(timeout)
    world = transport.world_size
    topology = Topology(node_size, grid).resolve(world)
    name = resolve_algorithm(algorithm, tensor.numel() * tensor.element_size(), world, topology)
    if algorithm == "auto":
        log.debug("all_reduce: %d bytes over %d ranks -> %s", tensor.numel() * tensor.element_size(),
                  world, name)
    if (_env_flag("HYBRIDCOMM_CHECK", True) if check is None else check) and world > 1:
        check_same_call(transport, tensor, name, op, timeout, topology)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    schedule = get_schedule(name, transport.rank, world, flat.numel(), topology)
    scratch = _workspace.get(schedule.scratch_numel, flat.dtype, flat.device)
    execute(schedule, flat, transport, scale=1.0 / world if op == "avg" else None,
            scratch=scratch, timeout=timeout)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor
