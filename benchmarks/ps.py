"""Parameter-server-assisted all-reduce against ring and native, one run.

W workers (default 4) and K summation servers (hybridcomm/ps.py) for each K
in ``--servers`` (default 0,2,4; K = 0 runs only ring and native), every
process in its own network namespace with a tbf-shaped link (``--shape``,
needs root; loopback otherwise): the servers have links of their own, as
BytePS's servers use spare NICs. Within each launch the workers time ring
(hybridcomm), native (gloo's all-reduce) and ps over the same W workers, so
each row's baseline ran on the same network in the same launch.

    python benchmarks/ps.py --shape "rate 100mbit"
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _time(fn, buf, iters, group):
    fn(buf)  # warm-up (connections, first-use)
    times = []
    for _ in range(iters):
        dist.barrier(group=group)  # the workers start together (the servers serve)
        t0 = time.perf_counter()
        fn(buf)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _raw_exchange(role, nbytes, pull):
    """ps's traffic without ps: every worker isends its 1/K of ``nbytes`` to each
    server (and, with ``pull``, receives as much back at the same time) as plain
    gloo point-to-point: what the network gives this pattern of flows."""
    n = nbytes // 4 // len(role.servers)
    works = []
    if role.is_server:
        for worker in role.workers:
            works.append(dist.irecv(torch.empty(n), worker, tag=91))
            if pull:
                works.append(dist.isend(torch.ones(n), worker, tag=92))
    else:
        for server in role.servers:
            works.append(dist.isend(torch.ones(n), server, tag=91))
            if pull:
                works.append(dist.irecv(torch.empty(n), server, tag=92))
    for work in works:
        work.wait()


def _rank(rank, world, servers, sizes, iters, chunk_bytes):
    import hybridcomm
    import hybridcomm.ps as ps

    role = ps.split_world(servers)
    group = role.worker_group
    out = [{"bytes": nbytes} for nbytes in sizes]
    if servers:  # the raw pattern first, every rank (the servers serve after it)
        for row in out:
            for name, pull in (("push", False), ("pushpull", True)):
                row[name] = _time(lambda b, p=pull: _raw_exchange(role, row["bytes"], p), None,
                                  iters, None)
    if role.is_server:
        ps.serve(role, timeout=1800)
        return out
    srv = ps.SummationServers(role, timeout=1800, chunk_bytes=chunk_bytes) if servers else None
    algos = {
        "ring": lambda b: hybridcomm.all_reduce(b, algorithm="ring", group=group, timeout=1800),
        "native": lambda b: dist.all_reduce(b, group=group),
    }
    for row in out:
        buf = torch.ones(row["bytes"] // 4)
        for name, fn in algos.items():
            row[name] = _time(fn, buf, iters, group)
    if srv is not None:
        for row in out:
            row["ps"] = _time(lambda b: srv.all_reduce(b), torch.ones(row["bytes"] // 4), iters,
                              group)
        srv.close()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=None, help='tbf spec per link, e.g. "rate 100mbit"')
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--servers", type=lambda s: [int(x) for x in s.split(",")],
                        default=[0, 2, 4])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1 << 20, 4 << 20, 16 << 20], help="bytes (fp32)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=64 << 10, help="ps chunk bytes")
    args = parser.parse_args(argv)

    from hybridcomm.launch import launch
    from train import shaped_network

    where = f"tbf {args.shape} on every process's link" if args.shape else "loopback"
    print(f"all-reduce over {args.workers} workers (fp32), CPU/gloo, {where}; median of "
          f"{args.iters} after a warm-up; ring/native/ps timed in the same launch; "
          f"ps = BytePS-style summation servers (hybridcomm.ps, {args.chunk} B chunks)")
    print("raw push / raw push+pull: ps's flows as plain gloo isend/irecv (no summing, "
          "no pipelining): what this network gives that pattern")
    print(f"{'servers':>7} {'bytes':>10} {'ring ms':>9} {'native ms':>9} {'ps ms':>9} "
          f"{'ring/ps':>7} {'native/ps':>9} {'raw push':>9} {'raw p+p':>8}")
    for k in args.servers:
        nprocs = args.workers + k
        network = shaped_network(nprocs, args.shape) if args.shape else contextlib.nullcontext()
        with network as net:
            per_rank = launch(_rank, nprocs, k, args.sizes, args.iters, args.chunk, backend="gloo",
                              setup=net and net.setup, timeout=3600)
        for i, nbytes in enumerate(args.sizes):
            rows = [r[i] for r in per_rank[:args.workers]]
            ring = max(r["ring"] for r in rows) * 1e3
            native = max(r["native"] for r in rows) * 1e3
            if k:
                p = max(r["ps"] for r in rows) * 1e3
                push = max(x[i]["push"] for x in per_rank)
                both = max(x[i]["pushpull"] for x in per_rank)
                print(f"{k:>7} {nbytes:>10} {ring:>9.1f} {native:>9.1f} {p:>9.1f} "
                      f"{ring / p:>7.2f} {native / p:>9.2f} {push * 1e3:>9.1f} "
                      f"{both * 1e3:>8.1f}")
            else:
                print(f"{k:>7} {nbytes:>10} {ring:>9.1f} {native:>9.1f} {'-':>9} {'-':>7} "
                      f"{'-':>9}")


if __name__ == "__main__":
    main()
