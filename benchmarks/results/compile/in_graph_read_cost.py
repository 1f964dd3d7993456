"""What forward mode's last fallback under torch.compile costs: a pending parameter read
inside a graph is preceded by a call of ``hybridcomm::apply_pending_`` (sync/compiled.py).

A compiled function reads ``--params`` parameters (``x = x + p`` each, forward and
backward); timed with the operator before each read (nothing pending: the call and its
bookkeeping alone, as on every read after the first of a bucket) and without, per
backend, the two interleaved. Prints the median of ``--repeats`` timings of ``--calls``
calls each and the difference per read.

    python benchmarks/results/compile/in_graph_read_cost.py > in_graph_read_cost.txt
"""

import argparse
import statistics
import time

import torch

from hybridcomm.sync import compiled  # registers the operator


def timed(fn, x, calls):
    t = time.perf_counter()
    for _ in range(calls):
        fn(x).sum().backward()
    return (time.perf_counter() - t) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=100)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    ps = [torch.nn.Parameter(torch.randn(64)) for _ in range(args.params)]
    op = torch.ops.hybridcomm.apply_pending_

    def reads(x, with_op):
        for p in ps:
            if with_op:
                op(p, id(p))
            x = x + p
        return x

    print(f"# {args.params} parameters read per call, median of {args.repeats} x {args.calls}")
    print("backend     without_ms  with_ms  us_per_read")
    x = torch.randn(64)
    for backend in ("aot_eager", "inductor"):
        fns = [torch.compile(lambda x, w=w: reads(x, w), backend=backend) for w in (False, True)]
        for fn in fns:
            timed(fn, x, 3)  # compile, warm up
        times = ([], [])  # interleaved: drift on a shared machine hits both alike
        for _ in range(args.repeats):
            for fn, out in zip(fns, times):
                out.append(timed(fn, x, args.calls))
        row = [statistics.median(t) for t in times]
        per_read = (row[1] - row[0]) / args.params * 1e6
        print(f"{backend:10} {row[0] * 1e3:10.2f} {row[1] * 1e3:8.2f} {per_read:12.1f}")
    print(f"# compiled.stats(): {compiled.stats()}")


if __name__ == "__main__":
    main()
