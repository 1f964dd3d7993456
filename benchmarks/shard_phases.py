"""The phases of a sharded bucket, each algorithm beside the process group's own:
reduce-scatter and all-gather with the ring's schedules, halving-doubling's
(power-of-two worlds) and ``native`` (the transport's own: gloo's
``reduce_scatter_single`` / ``all_gather_single``, NCCL's ``ReduceScatter`` /
``AllGather`` through CuPy), and the whole all-reduce for scale, through the
same executor ``shard=`` uses. Whether ``native`` should be a candidate for
sharded buckets where you train is what this measures (sync/shard.py
``settle_options`` leaves gloo's out: docs/PERFORMANCE.md).

    python benchmarks/shard_phases.py                       # 4 local ranks, gloo, 64K..16M
    python benchmarks/shard_phases.py --nprocs 2 --sizes 4K,1M --json out.json
    torchrun --nproc-per-node 8 benchmarks/shard_phases.py  # one GPU a rank (NCCL)

Prints, per size, each algorithm's ms per call (the median over ``--iters``
calls of the slowest rank), its ratio to ``native``, and whether every rank's
result was right (small integers: exact in any order). fp32, sum.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

ALGORITHMS = ("ring", "halving_doubling", "native")
PHASES = ("reduce_scatter", "all_gather", "all_reduce")


def _values(rank: int, n: int, device) -> torch.Tensor:
    return ((torch.arange(n, device=device) * 7 + 3 * rank) % 11 - 5).float()


def _expected(phase: str, algorithm: str, rank: int, world: int, n: int, device):
    """(the positions this rank checks, their right values)."""
    from hybridcomm.algorithms import SHARD_BOUNDS

    total = sum(_values(r, n, device) for r in range(world))
    if phase == "all_reduce":
        return slice(0, n), total
    lo, hi = SHARD_BOUNDS[algorithm](rank, world, n)
    if phase == "reduce_scatter":
        return slice(lo, hi), total[lo:hi]
    want = torch.empty(n, device=device)  # all-gather: every rank's part of its own values
    for r in range(world):
        a, z = SHARD_BOUNDS[algorithm](r, world, n)
        want[a:z] = _values(r, n, device)[a:z]
    return slice(0, n), want


def _run(rank: int, world: int, args) -> dict | None:
    from hybridcomm.algorithms import equal_padding
    from hybridcomm.comm.executor import reduce_now
    from hybridcomm.comm.transport.select import select_transport
    from hybridcomm.gpu.runtime import runtime_for

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    transport = select_transport(device, None, timeout=args.timeout)
    rt = runtime_for(device)
    algorithms = [a for a in args.algorithms if a != "halving_doubling" or world & (world - 1) == 0]
    rows = []
    for nbytes in args.sizes:
        n = equal_padding(max(nbytes // 4, 1), world)  # equal parts (native's layout)
        for phase in args.phases:
            for algorithm in algorithms:
                buf = torch.empty(n, device=device)

                def call():
                    reduce_now(
                        buf, transport, algorithm, scale=None, timeout=args.timeout, phase=phase
                    )

                times = []
                for i in range(args.warmup + args.iters):
                    buf.copy_(_values(rank, n, device))
                    if rt is not None:
                        rt.synchronize()
                    dist.barrier()
                    t0 = time.perf_counter()
                    call()
                    if rt is not None:
                        rt.synchronize()
                    if i >= args.warmup:
                        times.append(time.perf_counter() - t0)
                where, want = _expected(phase, algorithm, rank, world, n, device)
                right = bool(torch.equal(buf[where], want))
                rows.append(
                    {
                        "bytes": n * 4,
                        "phase": phase,
                        "algorithm": algorithm,
                        "ms": statistics.median(times) * 1e3,
                        "right": right,
                    }
                )
    every = [None] * world
    dist.all_gather_object(every, rows)
    if rank:
        return None
    merged = []
    for i, row in enumerate(every[0]):  # the slowest rank's median; right on every rank
        merged.append(
            dict(row, ms=max(r[i]["ms"] for r in every), right=all(r[i]["right"] for r in every))
        )
    return {
        "world": world,
        "backend": dist.get_backend(),
        "device": device.type,
        "torch": torch.__version__,
        "rows": merged,
    }


def report(doc: dict) -> str:
    lines = [
        f"# sharded phases over {doc['world']} ranks, {doc['backend']} on "
        f"{doc['device']}, fp32 sum, torch {doc['torch']}; ms per call (slowest rank's "
        "median), x native",
        f"{'bytes':>10} {'phase':>15} {'algorithm':>17} {'ms':>9} {'x native':>9} right",
    ]
    native = {(r["bytes"], r["phase"]): r["ms"] for r in doc["rows"] if r["algorithm"] == "native"}
    for r in doc["rows"]:
        base = native.get((r["bytes"], r["phase"]))
        ratio = f"{r['ms'] / base:.2f}" if base else "-"
        lines.append(
            f"{r['bytes']:>10} {r['phase']:>15} {r['algorithm']:>17} "
            f"{r['ms']:>9.3f} {ratio:>9} {'yes' if r['right'] else 'NO'}"
        )
    return "\n".join(lines)


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        doc = _run(rank, world, args)
        if doc is not None:
            with open(out, "w") as f:
                json.dump(doc, f)
    finally:
        dist.destroy_process_group()


def parse_args(argv=None):
    from hybridcomm.base.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=4, help="local ranks (not under torchrun)")
    ap.add_argument(
        "--sizes",
        default="64K,1M,16M",
        help="bytes per buffer, comma-separated (each padded to equal parts)",
    )
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    args.phases = [p for p in args.phases.split(",") if p]
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    bad = [p for p in args.phases if p not in PHASES] + [
        a for a in args.algorithms if a not in ALGORITHMS
    ]
    if bad or not args.sizes or args.iters < 1 or args.warmup < 0 or args.nprocs < 1:
        ap.error(
            f"unknown {bad}; phases from {PHASES}, algorithms from {ALGORITHMS}; "
            "--iters >= 1, --warmup >= 0, --nprocs >= 1, some --sizes"
        )
    return args


def main(argv=None) -> None:
    import tempfile

    import torch.multiprocessing as mp

    args = parse_args(argv)
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):  # torchrun
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
        doc = _run(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = os.path.join(tempfile.mkdtemp(), "phases.json")
        mp.spawn(_worker, args=(args.nprocs, port, args, out), nprocs=args.nprocs)
        with open(out) as f:
            doc = json.load(f)
    if doc is None:
        return
    print(report(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if not all(r["right"] for r in doc["rows"]):
        sys.exit("shard_phases: a result was wrong (see the right column)")


if __name__ == "__main__":
    main()
