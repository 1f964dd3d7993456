"""What one ``TensorAverager`` average costs each rank: its time, the trainer's wait
for it, and the CPU its threads burn (the channel's, gloo's), by compression and
bucket size. DiLoCo averages its pseudo-gradients so; with more ranks than cores,
that CPU comes out of the inner steps.

Each rank averages a model's parameter shapes (``charlm``: benchmarks/charlm.py's
0.47M, ``digits``: benchmarks/compression.py's 1.07M) ``--averages`` times, each
started and then waited for after ``--gap`` seconds of sleep (a stand-in for the
inner steps it runs behind; 0: waited for at once). CPU is the process's user and
system time over the timed averages (every thread), per average; ``main`` is the
calling thread's alone.

    python benchmarks/average_cost.py --model charlm --compression int4 \\
        --fusion-bytes 0,262144            # 0: the averager's default
    python benchmarks/average_cost.py --shape none     # loopback

Needs root for the shaped links (``--shape none``: loopback).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

WORLD = 4


def parameters(name: str):
    torch.manual_seed(0)
    if name == "digits":
        import compression

        return list(compression.DigitsNet().parameters())
    import charlm

    return list(charlm.CharLM().parameters())


def _rank(rank, world, model, compression, fusion_bytes, averages, gap):
    import torch.distributed as dist

    from hybridcomm.averager import TensorAverager

    torch.set_num_threads(1)
    tensors = [p.detach().clone() + rank for p in parameters(model)]
    avg = TensorAverager(timeout=120, compression=compression, fusion_bytes=fusion_bytes or None)
    plan = avg.prepare(tensors)
    for _ in range(3):  # (warm: buffers touched, the schedules made)
        avg.average_(tensors)
    dist.barrier()
    every, main = resource.RUSAGE_SELF, resource.RUSAGE_THREAD
    e0, m0, waited = resource.getrusage(every), resource.getrusage(main), 0.0
    t0 = time.perf_counter()
    for _ in range(averages):
        pending = avg.start_average_(tensors)
        if gap:
            time.sleep(gap)
        w0 = time.perf_counter()
        pending.wait()
        waited += time.perf_counter() - w0
    wall = time.perf_counter() - t0
    e1, m1 = resource.getrusage(every), resource.getrusage(main)
    avg.close()
    ms = 1e3 / averages
    return {
        "buckets": len(plan.buckets),
        "wall_ms": wall * ms,
        "wait_ms": waited * ms,
        "user_ms": (e1.ru_utime - e0.ru_utime) * ms,
        "sys_ms": (e1.ru_stime - e0.ru_stime) * ms,
        "main_ms": (m1.ru_utime + m1.ru_stime - m0.ru_utime - m0.ru_stime) * ms,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("charlm", "digits"), default="charlm")
    ap.add_argument("--compression", default="int4", help="comma-separated; none: fp32")
    ap.add_argument("--fusion-bytes", default="0", help="comma-separated; 0: the default")
    ap.add_argument("--averages", type=int, default=40)
    ap.add_argument("--gap", type=float, default=0.1, help="seconds before each wait")
    ap.add_argument("--shape", default="rate 100mbit", help='tbf shape ("none": loopback)')
    args = ap.parse_args(argv)
    import compression as compression_bench
    from hybridcomm.tools.launch import launch
    from train import shaped_network

    shape = None if args.shape in ("", "none") else args.shape
    net = shaped_network(WORLD, shape) if shape else None
    print(
        f"{args.model}, {WORLD} ranks, network {shape or 'loopback'}, {args.averages} averages, "
        f"each waited for after {args.gap} s; medians over the ranks, per average"
    )
    print(
        f"{'compression':>11} {'fusion B':>9} {'buckets':>7} {'wall ms':>8} {'wait ms':>8} "
        f"{'user ms':>8} {'sys ms':>7} {'main ms':>8}"
    )
    with net if net is not None else compression_bench._nothing() as opened:
        for compression in args.compression.split(","):
            for fusion in [int(f) for f in args.fusion_bytes.split(",")]:
                ranks = launch(
                    _rank,
                    WORLD,
                    args.model,
                    None if compression == "none" else compression,
                    fusion,
                    args.averages,
                    args.gap,
                    setup=opened.setup if opened else None,
                    timeout=600,
                    start_method="forkserver",
                )
                m = {k: statistics.median(r[k] for r in ranks) for k in ranks[0]}
                print(
                    f"{compression:>11} {fusion or 'default':>9} {m['buckets']:>7.0f} "
                    f"{m['wall_ms']:>8.1f} {m['wait_ms']:>8.1f} {m['user_ms']:>8.1f} "
                    f"{m['sys_ms']:>7.1f} {m['main_ms']:>8.1f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
