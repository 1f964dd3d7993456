"""``make demo``: 4 local ranks all-reduce a few sizes with every algorithm.

Prints, per algorithm and size, the median time next to torch.distributed's
all_reduce in the same run, and whether the result was exact (integer-valued
inputs, so the sum is exact in any order).

    python -m hybridcomm.demo [--nprocs 4] [--iters 10]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from . import ALGORITHMS, all_reduce
from .launch import launch

SIZES = (4 << 10, 256 << 10, 4 << 20)


def _time(fn, iters):
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(rank, world, iters):
    rows = []
    for nbytes in SIZES:
        n = nbytes // 4
        x = ((torch.arange(n) + rank) % 13).float()
        expected = sum(((torch.arange(n) + r) % 13).float() for r in range(world))
        for algo in ALGORITHMS + ("torch",):
            if algo == "torch":
                run = lambda: dist.all_reduce(buf)  # noqa: E731
            else:
                run = lambda: all_reduce(buf, algorithm=algo, check=False)  # noqa: E731
            buf = x.clone()
            run()  # warm-up, and the result we check
            exact = torch.equal(buf, expected)
            t = _time(lambda: (buf.copy_(x), run()), iters)
            rows.append((nbytes, algo, t, exact))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    per_rank = launch(_rank, args.nprocs, args.iters, backend="gloo")
    print(f"all_reduce, {args.nprocs} ranks on CPU (gloo), fp32 sum, median of {args.iters}; "
          "time averaged across ranks")
    print(f"{'size':>10} {'algorithm':>17} {'time(us)':>10} {'vs torch':>9} {'exact':>6}")
    for i, (nbytes, algo, _, _) in enumerate(per_rank[0]):
        t = statistics.mean(r[i][2] for r in per_rank) * 1e6
        base = statistics.mean(r[j][2] for r in per_rank for j, row in enumerate(r)
                               if row[0] == nbytes and row[1] == "torch") * 1e6
        exact = all(r[i][3] for r in per_rank)
        print(f"{nbytes:>10} {algo:>17} {t:>10.0f} {base / t:>8.2f}x {str(exact):>6}")
    if not all(row[3] for r in per_rank for row in r):
        raise SystemExit("some results were not exact")


if __name__ == "__main__":
    main()
