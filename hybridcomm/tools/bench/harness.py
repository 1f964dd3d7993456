"""What each rank runs: buffers, warm-up, timing, the data check, and gathering.

One harness for every algorithm, ``torch.distributed.all_reduce`` included (the
baseline, in the same process group and the same run). Per (size, algorithm):
``warmup`` untimed calls, then ``iters`` timed ones, each from a barrier; rank
0 gathers every rank's median (and 20th and 80th percentiles), and one more call
checks the data (``#wrong``). With ``servers`` K > 0 the last K processes are
summation servers (comm/servers.py) and the workers sweep ``ps`` beside the rest.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ...comm.backend import backend_name, comm_device
from . import report
from .report import BASELINE  # the process group's own all_reduce (gloo's or NCCL's)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Config:
    sizes: List[int]  # bytes
    algos: List[str]  # ours, "auto" and/or "native"
    iters: int = 20
    warmup: int = 5
    dtype: str = "float32"
    op: str = "sum"
    check: bool = True
    latency_s: float = 0.0  # emulated, per step, ours only
    timeout_s: float = 300.0
    progress: bool = True
    node_size: Optional[int] = None  # hierarchical (default LOCAL_WORLD_SIZE, else one node)
    grid: Optional[Tuple[int, int]] = None  # torus2d (default the most square)
    shape: Optional[str] = None  # for the header: the tbf spec of each rank link
    network: Optional[str] = None  # for the header: the shaped network, described
    live: bool = True  # rank 0 prints the header, then rows as sizes complete
    servers: int = 0  # summation servers: the last K processes (algorithm ps)


def integer_input(rank: int, count: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Small integers in [-5, 5]: every partial sum over P <= 50 ranks is exact
    even in bf16, in any order."""
    i = torch.arange(count, device=device, dtype=torch.int64)
    return ((i * 7 + rank * 3) % 11 - 5).to(dtype)


def expected_sum(world: int, count: int, device) -> torch.Tensor:
    i = torch.arange(count, device=device, dtype=torch.int64)
    return sum(((i * 7 + r * 3) % 11 - 5) for r in range(world)).to(torch.float64)


def count_wrong(got: torch.Tensor, total: torch.Tensor, op: str, world: int) -> int:
    """Elements of ``got`` that differ from the exact sum ``total`` (the inputs are
    small integers: exact in any order and dtype), or, for ``avg``, by more than
    the scale's one rounding."""
    g = got.to(torch.float64)
    if op == "sum":
        return int((g != total).sum())
    want = total / world
    # avg: the scale 1/P rounds once (exact when P is a power of two).
    tol = 2 * torch.finfo(got.dtype).eps * want.abs()
    return int(((g - want).abs() > tol).sum())


def _sync(device) -> None:
    from ...gpu.runtime import runtime_for

    rt = runtime_for(device)
    if rt is not None:
        rt.synchronize()


class _Runners:
    """Callables that all-reduce ``buf`` in place with one algorithm."""

    def __init__(self, world: int, rank: int, cfg: Config, device, group=None, servers=None):
        from ...comm.executor import Workspace
        from ...comm.transport.latency import LatencyTransport
        from ...algorithms import Topology
        from ...comm.transport.select import select_transport

        self.world, self.rank, self.cfg, self.device = world, rank, cfg, device
        self.group, self.servers = group, servers
        # The transport the optimizer and all_reduce use on this device (CuPy NCCL
        # on GPUs), so the sweep and --calibrate measure the real data path.
        base = select_transport(device, group)
        if cfg.latency_s > 0 and base.stream_ordered:
            raise SystemExit(
                "error: --latency emulates per-message delay on the host path "
                "only; it cannot wrap a stream-ordered (GPU) transport"
            )
        self.topology = Topology(cfg.node_size, cfg.grid).resolve(world)
        self.transport = LatencyTransport(base, cfg.latency_s) if cfg.latency_s > 0 else base
        self.workspace = Workspace()
        self.scale = 1.0 / world if cfg.op == "avg" else None
        self.torch_op = dist.ReduceOp.SUM if cfg.op == "sum" else dist.ReduceOp.AVG

    def resolve(self, algo: str, nbytes: int) -> str:
        from ...collectives import resolve_algorithm

        return (
            algo
            if algo in (BASELINE, "ps")
            else resolve_algorithm(algo, nbytes, self.world, self.topology)
        )

    def make(self, algo: str, buf: torch.Tensor):
        if algo == BASELINE:
            op, group = self.torch_op, self.group
            return lambda: dist.all_reduce(buf, op=op, group=group)
        if algo == "ps":
            servers, op = self.servers, self.cfg.op
            return lambda: servers.all_reduce(buf, op=op)
        from ...algorithms import get_schedule
        from ...comm.executor import execute

        schedule = get_schedule(algo, self.rank, self.world, buf.numel(), topology=self.topology)
        scratch = self.workspace.get(schedule.scratch_numel, buf.dtype, buf.device)
        transport, scale, timeout = self.transport, self.scale, self.cfg.timeout_s
        return lambda: execute(
            schedule, buf, transport, scale=scale, scratch=scratch, timeout=timeout
        )


def percentiles(times: List[float]) -> Tuple[float, float, float]:
    """(p20, median, p80) of the iterations' times (one time: that time thrice).

    >>> percentiles([5.0, 1.0, 2.0, 3.0, 4.0])
    (1.8, 3.0, 4.2)
    """
    if len(times) < 2:
        return times[0], times[0], times[0]
    p20, _, _, p80 = statistics.quantiles(times, n=5, method="inclusive")
    return p20, statistics.median(times), p80


def _time_one(run, buf, inp, cfg: Config, device, group=None) -> Tuple[float, float, float]:
    """(p20, median, p80) seconds of ``cfg.iters`` timed calls, after the warm-up."""
    for _ in range(cfg.warmup):
        buf.copy_(inp)
        run()
    times = []
    for _ in range(cfg.iters):
        buf.copy_(inp)
        _sync(device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return percentiles(times)


def _merge(per_rank_rows: List[List[dict]]) -> List[dict]:
    """Rows of every rank -> one row each: the time averaged over the ranks (as
    nccl-tests reports it), the wrong elements summed, each rank's median and
    percentiles kept."""
    out = []
    for i, row in enumerate(per_rank_rows[0]):
        per_rank = [rows[i] for rows in per_rank_rows]
        wrong = -1 if row["wrong"] < 0 else sum(r["wrong"] for r in per_rank)
        out.append(
            {
                **row,
                "time_s": statistics.mean(r["time_s"] for r in per_rank),
                "wrong": wrong,
                "time_s_per_rank": [r["time_s"] for r in per_rank],
                "p20_s_per_rank": [r.get("p20_s", r["time_s"]) for r in per_rank],
                "p80_s_per_rank": [r.get("p80_s", r["time_s"]) for r in per_rank],
            }
        )
    return out


def _header_doc(world, device, cfg: Config, model, topology) -> dict:
    return {
        "world_size": world,
        "backend": backend_name(),
        "device": device.type,
        "servers": cfg.servers,
        "dtype": cfg.dtype,
        "op": cfg.op,
        "iters": cfg.iters,
        "warmup": cfg.warmup,
        "check": cfg.check,
        "latency": cfg.latency_s,
        "shape": cfg.shape,
        "network": cfg.network,
        "node_size": topology.node_size,
        "grid": list(topology.grid),
        "auto_model": {"source": model.source},
    }


def run_rank(rank: int, world: int, cfg: Config) -> Optional[dict]:
    """The sweep on this rank; rank 0 returns the gathered results, others None.
    With ``cfg.servers``, the last K ranks serve (and return None) and the
    workers sweep over their own group."""
    if not cfg.servers:
        return _sweep(rank, world, cfg, None, servers=None)
    from ...comm import servers as ps

    role = ps.split_world(cfg.servers)
    if role.is_server:
        ps.serve(role, timeout=cfg.timeout_s)
        return None
    servers = ps.SummationServers(role, timeout=cfg.timeout_s)
    try:
        return _sweep(
            dist.get_rank(role.worker_group),
            len(role.workers),
            cfg,
            role.worker_group,
            servers=servers,
        )
    finally:
        servers.close()  # the servers stop once every worker has closed


def _sweep(rank: int, world: int, cfg: Config, group, servers) -> Optional[dict]:
    from ...comm import calibration, control

    device = comm_device(group)
    dtype = DTYPES[cfg.dtype]
    esize = torch.empty((), dtype=dtype).element_size()
    # auto must choose the same on every rank: rank 0's model for all.
    model = calibration.agree(group=group, timeout=cfg.timeout_s)
    if cfg.latency_s > 0:  # the emulated network is slower per message: auto knows it
        model = model.with_latency(cfg.latency_s)
        calibration.set_active(model)
    runners = _Runners(world, rank, cfg, device, group=group, servers=servers)

    rows = []
    start = time.perf_counter()
    # Warm-up at the largest and the smallest size first (connections, caches).
    for nbytes in sorted({max(cfg.sizes), min(cfg.sizes)}, reverse=True):
        n = max(nbytes // esize, 1)
        buf = integer_input(rank, n, dtype, device)
        for algo in cfg.algos:
            runners.make(runners.resolve(algo, n * esize), buf)()
    if cfg.live and rank == 0:
        for line in report.header(
            _header_doc(world, device, cfg, model, topology=runners.topology)
        ):
            print(line, flush=True)
    for k, nbytes in enumerate(cfg.sizes):
        count = max(nbytes // esize, 1)
        inp = integer_input(rank, count, dtype, device)
        total = expected_sum(world, count, device) if cfg.check else None
        buf = torch.empty_like(inp)
        first = len(rows)
        for algo in cfg.algos:
            chosen = runners.resolve(algo, count * esize)
            run = runners.make(chosen, buf)
            p20, t, p80 = _time_one(run, buf, inp, cfg, device=device, group=group)
            wrong = -1
            if cfg.check:
                buf.copy_(inp)
                run()
                _sync(device)
                wrong = count_wrong(buf, total, cfg.op, world)
            rows.append(
                {
                    "algo": algo,
                    "chosen": chosen,
                    "bytes": count * esize,
                    "count": count,
                    "time_s": t,
                    "p20_s": p20,
                    "p80_s": p80,
                    "wrong": wrong,
                }
            )
        if cfg.live:  # as nccl-tests: this size's rows now, times averaged over the ranks
            every = control.all_gather_object(
                rows[first:], group=group, timeout=cfg.timeout_s, what="the benchmark rows"
            )
            if rank == 0:
                merged = report.result_rows(_merge(every), world, cfg.latency_s)
                for r in merged:
                    print(
                        report.row_line(
                            r, {"dtype": cfg.dtype, "op": cfg.op, "latency": cfg.latency_s}
                        ),
                        flush=True,
                    )
        elif cfg.progress and rank == 0 and len(cfg.sizes) > 3:
            print(
                f"# progress: {k + 1}/{len(cfg.sizes)} sizes, up to {count * esize} bytes, "
                f"{time.perf_counter() - start:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    gathered = control.all_gather_object(
        rows, group=group, timeout=cfg.timeout_s, what="the benchmark rows"
    )
    if rank != 0:
        return None
    results = _merge(gathered)
    return {
        "world_size": world,
        "backend": backend_name(group),
        "device": device.type,
        "servers": cfg.servers,
        "node_size": runners.topology.node_size,
        "grid": list(runners.topology.grid),
        "results": results,
        "auto_model": {
            "alpha_s": model.alpha,
            "beta_s_per_byte": model.beta,
            "gamma_s_per_byte": model.gamma,
            "inter_alpha_s": model.inter_alpha,
            "inter_beta_s_per_byte": model.inter_beta,
            "source": model.source,
        },
    }
