"""Parameter-server-assisted all-reduce, as BytePS does it: summation servers.

The last K ranks of the world serve: each worker pushes partition k of a
tensor to server k, which sums the W partitions in worker order (fp32 for
fp16/bf16) and sends the one sum back to every worker, so every worker ends
bitwise identical. Every rank calls :func:`split_world`; servers then
:func:`serve`, workers use :class:`SummationServers`. When it pays and how the
data moves (chunks, flow control, the pulls' own connections):
docs/PARALLELISM.md, "Parameter-server-assisted all-reduce".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from . import control
from ..config import env
from ..base.errors import HybridCommError
from ..plan.cost_model import PS
from .transport.torch_dist import posted, wait_work

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_OPS = ["sum", "avg"]
_STOP = -1
_TAG_HEADER, _TAG_PUSH, _TAG_PULL = 71, 72, 73


@dataclass(frozen=True)
class Role:
    """This rank's part: a server or a worker, the workers' group and ranks, the
    servers' ranks (global ranks of the default group)."""

    is_server: bool
    workers: List[int]
    servers: List[int]
    worker_group: object  # the workers' process group (None on a server)
    pull_group: object = None  # every rank again: the pulls' own connections


def split_world(num_servers: int) -> Role:
    """Every rank of the default group calls this (it makes the workers' group):
    the last ``num_servers`` ranks are servers, the others workers.

    Example::

        >>> role = split_world(0)                  # one process, no servers
        >>> role.is_server, role.workers, role.servers
        (False, [0], [])
    """
    control.require_initialized("hybridcomm.comm.servers.split_world")
    world, rank = dist.get_world_size(), dist.get_rank()
    if not 0 <= num_servers < world:
        raise ValueError(
            f"num_servers must be in [0, {world}) with {world} ranks, got {num_servers}"
        )
    workers = list(range(world - num_servers))
    servers = list(range(world - num_servers, world))
    group = dist.new_group(workers)
    # New connections for the sums coming back (gloo makes one per pair and group), so
    # each TCP connection carries data one way only: on one connection both ways,
    # each side's acknowledgements queue behind its own data.
    pulls = dist.new_group(list(range(world))) if num_servers else None
    is_server = rank in servers
    return Role(is_server, workers, servers, None if is_server else group, pull_group=pulls)


def partitions(numel: int, k: int) -> List[tuple]:
    """``k`` contiguous (start, end) ranges covering ``numel`` elements, sizes
    differing by at most one (some empty when ``numel < k``).

        >>> partitions(10, 3)
        [(0, 4), (4, 7), (7, 10)]
    """
    base, extra = divmod(numel, k)
    out, at = [], 0
    for i in range(k):
        n = base + (i < extra)
        out.append((at, at + n))
        at += n
    return out


def _wait_all(works, rank: int, label: str, timeout: float) -> None:
    for w in works:
        wait_work(w, rank, label, timeout)


class SummationServers:
    """A worker's side: all-reduce over the workers through the servers.

    Args:
        role: from :func:`split_world` (this rank a worker).
        timeout: seconds any transfer may take (default ``HYBRIDCOMM_TIMEOUT``).
        chunk_bytes: a partition moves in chunks of this size, pipelined.
        window: chunks pushed to one server ahead of the sums back from it.
    """

    def __init__(
        self,
        role: Role,
        *,
        timeout: Optional[float] = None,
        chunk_bytes: int = 64 << 10,
        window: int = 4,
    ):
        if role.is_server:
            raise HybridCommError(
                "SummationServers is the workers' side: a server calls "
                "hybridcomm.comm.servers.serve(role)"
            )
        if not role.servers:
            raise HybridCommError("no servers: split_world(num_servers=K) with K >= 1")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if window < 1:
            raise ValueError(f"window must be >= 1 chunk, got {window}")
        self.window = window
        self.role, self.timeout, self.chunk_bytes = role, env.timeout(timeout), chunk_bytes
        self.rank = dist.get_rank()
        self.closed = False

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``tensor`` <- its sum (or mean, ``op="avg"``) over the workers, in place;
        bitwise identical on every worker."""
        if self.closed:
            raise HybridCommError("all_reduce after close()")
        if op not in _OPS:
            raise ValueError(f"op must be one of {_OPS}, got {op!r}")
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"dtype {tensor.dtype} not supported; one of {_DTYPES}")
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        parts = partitions(flat.numel(), len(self.role.servers))
        step = max(1, self.chunk_bytes // flat.element_size())
        sends, pulls, window = [], self.role.pull_group, self.window
        chunks, recvs = [], []  # per server, in order
        for server, (a, z) in zip(self.role.servers, parts):
            header = torch.tensor([z - a, _DTYPES.index(flat.dtype), _OPS.index(op), step])
            sends.append(
                posted(
                    lambda h=header, s=server: dist.isend(h, s, tag=_TAG_HEADER),
                    self.rank,
                    f"header to server {server}",
                )
            )
            chunks.append([flat[c0 : min(c0 + step, z)] for c0 in range(a, z, step)])
            # Every pull posted at once (gloo moves a message only once its receive is posted)
            recvs.append(
                [
                    posted(
                        lambda c=c, s=server: dist.irecv(c, s, group=pulls, tag=_TAG_PULL),
                        self.rank,
                        f"pull of {z - a} x {flat.dtype} from server {server}",
                    )
                    for c in chunks[-1]
                ]
            )

        def push(k: int, j: int):
            server = self.role.servers[k]
            sends.append(
                posted(
                    lambda c=chunks[k][j], s=server: dist.isend(c, s, tag=_TAG_PUSH),
                    self.rank,
                    f"push of a chunk to server {server}",
                )
            )

        for k in range(len(chunks)):  # the first `window` chunks to each server
            for j in range(min(window, len(chunks[k]))):
                push(k, j)
        # Then one more chunk per sum back: a server sums chunk j once every worker's is in,
        # so a worker running ahead would only queue (credit-based flow control).
        for j in range(max(map(len, chunks), default=0)):
            for k in range(len(chunks)):
                if j < len(chunks[k]):
                    wait_work(recvs[k][j], self.rank, "pull from the servers", self.timeout)
                    if j + window < len(chunks[k]):
                        push(k, j + window)
        _wait_all(sends, self.rank, "push to the servers", self.timeout)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def close(self) -> None:
        """Tell every server this worker is done (each server stops once all are)."""
        if self.closed:
            return
        self.closed = True
        stop = torch.tensor([_STOP, 0, 0, 0])
        works = [
            posted(
                lambda s=s: dist.isend(stop, s, tag=_TAG_HEADER), self.rank, f"stop to server {s}"
            )
            for s in self.role.servers
        ]
        _wait_all(works, self.rank, "stop to the servers", self.timeout)


def serve(role: Role, *, timeout: Optional[float] = None) -> int:
    """A server's loop: sum what the workers push, send the sums back, until every
    worker has closed. Returns how many partitions it summed.

    ``timeout`` bounds the wait for the workers' next header too (default
    ``HYBRIDCOMM_TIMEOUT``): a server whose workers went quiet for that long
    raises instead of waiting forever."""
    if not role.is_server:
        raise HybridCommError("serve() runs on a server rank (split_world made this a worker)")
    timeout = env.timeout(timeout)
    rank, workers, served = dist.get_rank(), role.workers, 0
    while True:
        headers = [torch.empty(4, dtype=torch.int64) for _ in workers]
        _wait_all(
            [
                posted(
                    lambda h=h, w=w: dist.irecv(h, w, tag=_TAG_HEADER),
                    rank,
                    f"header from worker {w}",
                )
                for h, w in zip(headers, workers)
            ],
            rank,
            "the workers' next header",
            timeout,
        )
        got = {tuple(h.tolist()) for h in headers}
        if any(h[0] == _STOP for h in got):
            if len(got) != 1:
                raise HybridCommError(
                    f"server {rank}: some workers closed while others pushed ({sorted(got)})"
                )
            return served
        if len(got) != 1:
            raise HybridCommError(
                f"server {rank}: the workers pushed different partitions "
                f"(count, dtype, op): {[tuple(h.tolist()) for h in headers]}"
            )
        numel, dtype_i, op_i, step = got.pop()
        dtype, avg = _DTYPES[dtype_i], _OPS[op_i] == "avg"
        # Every chunk's receives posted at once (gloo moves a message only once its
        # receive is posted), then each chunk summed and sent back as soon as it is in.
        chunks = []
        for c0 in range(0, numel, step):
            bufs = [torch.empty(min(step, numel - c0), dtype=dtype) for _ in workers]
            chunks.append(
                (
                    bufs,
                    [
                        posted(
                            lambda b=b, w=w: dist.irecv(b, w, tag=_TAG_PUSH),
                            rank,
                            f"push from worker {w}",
                        )
                        for b, w in zip(bufs, workers)
                    ],
                )
            )
        sends, outs = [], []  # outs: alive until their sends are done
        for bufs, works in chunks:
            _wait_all(works, rank, "the workers' pushes", timeout)
            outs.append(_sum(bufs, avg))
            sends += [
                posted(
                    lambda o=outs[-1], w=w: dist.isend(o, w, group=role.pull_group, tag=_TAG_PULL),
                    rank,
                    f"sum to worker {w}",
                )
                for w in workers
            ]
        _wait_all(sends, rank, "the sums to the workers", timeout)
        served += numel > 0


def _sum(bufs: List[torch.Tensor], avg: bool) -> torch.Tensor:
    """The workers' chunks summed in worker order (the same bits whatever order
    they arrived in), in fp32 for fp16/bf16, rounded once."""
    dtype = bufs[0].dtype
    total = bufs[0].to(torch.float64 if dtype == torch.float64 else torch.float32)
    for b in bufs[1:]:
        total.add_(b)
    if avg:
        total.div_(len(bufs))
    return total.to(dtype)


def resolve(given, process_group, strategy: str, timeout: float):
    """``DistributedOptimizer(servers=...)``: (the SummationServers to use or None,
    the process group to reduce over, the servers made here from a Role or None):
    the workers' group when ``process_group`` is left out. Every rank raises alike:
    a forced ``ps`` without servers, a group that is not the workers'.

        >>> resolve(None, None, "hybrid", 60)
        (None, None, None)
    """
    forced = env.get("HYBRIDCOMM_ALGO") or strategy
    if given is None:
        if forced == PS:
            raise HybridCommError(
                "algorithm 'ps' needs the summation servers: pass servers= "
                "(a hybridcomm.comm.servers.Role from split_world, or "
                "SummationServers)"
            )
        return None, process_group, None
    if isinstance(given, Role):
        made = SummationServers(given, timeout=timeout)
        servers = made
    elif isinstance(given, SummationServers):
        made, servers = None, given
    else:
        raise TypeError(
            "servers must be a hybridcomm.comm.servers.Role (split_world) or "
            f"SummationServers, got {type(given).__name__}"
        )
    workers = servers.role.workers
    if process_group is None:
        process_group = servers.role.worker_group
    elif dist.get_world_size(process_group) != len(workers):
        raise HybridCommError(
            f"process_group has {dist.get_world_size(process_group)} "
            f"ranks but the summation servers' workers are {len(workers)}: "
            "leave process_group out (the workers' group is used)"
        )
    return servers, process_group, made
