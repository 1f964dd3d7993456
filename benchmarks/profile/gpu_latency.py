"""GPU-only: small-message all-reduce latency over CupyNcclTransport, eager vs
captured in a CUDA graph, and the kernels (Triton, CUDA C++, torch) side by side.

    torchrun --nproc-per-node=2 benchmarks/profile/gpu_latency.py allreduce
    python benchmarks/profile/gpu_latency.py kernels

``allreduce``: per size and algorithm, the median time of one all-reduce
queued on the comm stream (the executor's stream-ordered path) eagerly, and
replayed as one CUDA graph (no Python or launch cost per step); the graph wins
where the per-step host cost dominates (small messages, many steps).
``kernels``: reduce of n elements by each implementation, median of CUDA-event
timings. ``kernels`` ran on one H200 on 2026-11-27 (docs/GPU.md); ``allreduce`` has
not run on a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch


def _time(fn, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)  # us
    return statistics.median(times)


def allreduce(args):
    import torch.distributed as dist

    from hybridcomm.algorithms import get_schedule
    from hybridcomm.comm.executor import execute_async
    from hybridcomm.comm.transport.select import close_transports, select_transport

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = select_transport(torch.device("cuda", local), transport="cupy")
    if rank == 0:
        print(f"{'bytes':>10} {'algo':>17} {'eager(us)':>10} {'graph(us)':>10}")
    for nbytes in (1 << k for k in range(args.min_log2, args.max_log2 + 1, 2)):
        n = max(1, nbytes // 4)
        for algo in ("ring", "butterfly", "halving_doubling"):
            sched = get_schedule(algo, rank, world, n)
            buf = torch.ones(n, device="cuda")

            def once():
                done = execute_async(sched, buf, t)
                torch.cuda.current_stream().wait_event(done)

            for _ in range(5):
                once()
            torch.cuda.synchronize()
            eager = _time(once, args.iters)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                once()
            graphed = _time(graph.replay, args.iters)
            if rank == 0:
                print(f"{nbytes:>10} {algo:>17} {eager:>10.1f} {graphed:>10.1f}")
    close_transports()
    dist.destroy_process_group()


def kernels(args):
    from hybridcomm.gpu import cuda_ext
    from hybridcomm.kernels import reduce, reduce_ref

    ext = cuda_ext.load()
    impls = {"triton": lambda d, s: reduce(d, s), "torch": lambda d, s: reduce_ref(d, s)}
    if ext is not None:
        impls["csrc"] = lambda d, s: ext.reduce(d, s, None, None)
    else:
        print(f"# csrc extension unavailable: {cuda_ext.why_not()}")
    print(f"{'numel':>10} {'dtype':>9} " + " ".join(f"{k + '(us)':>11}" for k in impls))
    for dtype in (torch.float32, torch.bfloat16):
        for k in range(args.min_log2, args.max_log2 + 1, 2):
            n = 1 << k
            d, s = (
                torch.ones(n, dtype=dtype, device="cuda"),
                torch.ones(n, dtype=dtype, device="cuda"),
            )
            row = []
            for fn in impls.values():
                for _ in range(3):
                    fn(d, s)
                row.append(_time(lambda: fn(d, s), args.iters))
            print(
                f"{n:>10} {str(dtype).replace('torch.', ''):>9} "
                + " ".join(f"{x:>11.1f}" for x in row)
            )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("allreduce", "kernels"))
    ap.add_argument("--min-log2", type=int, default=6, help="smallest size, log2 bytes/elements")
    ap.add_argument("--max-log2", type=int, default=22)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_latency.py needs a CUDA GPU; none is available here.", file=sys.stderr)
        return 2
    (allreduce if args.what == "allreduce" else kernels)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
