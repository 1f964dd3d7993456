"""World 2: each config's process CPU time per step (user + system, every thread of
the rank: the trainer, hybridcomm's channel, gloo's) beside its wall time, medians
of 20 interleaved rounds of 10 steps, one line per rank. On 2 cores shared by 2
ranks, CPU a rank spends is time the other rank's compute may lose. Every mode
plans from one probe, as in sync_overhead.py.

    python benchmarks/results/synchronizer/host_here/cpu_per_step.py --model conv
"""

import argparse
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import sync_overhead as so  # noqa: E402

CONFIGS = ["plain", "ddp-batch", "ddp-view", "backward", "none"]


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rank(rank, world, args):  # launch()'s function: module level
    torch.set_num_threads(1)
    cost_model = so.shared_probe(args)
    runs = [so._Run(c, args.model, args, cost_model) for c in CONFIGS]
    for run in runs:
        run.steps(10, keep=False)
    cpu, wall = {c: [] for c in CONFIGS}, {c: [] for c in CONFIGS}
    for _ in range(20):
        for run in runs:
            c0, w0 = _cpu_s(), time.perf_counter()
            run.steps(10, keep=False)
            cpu[run.config].append((_cpu_s() - c0) / 10 * 1e3)
            wall[run.config].append((time.perf_counter() - w0) / 10 * 1e3)
    for run in runs:
        run.close()
    return {c: (statistics.median(cpu[c]), statistics.median(wall[c])) for c in CONFIGS}


def main() -> None:
    from hybridcomm.tools.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    so.add_model_arguments(parser)
    parser.add_argument("--model", default="conv")
    args = parser.parse_args()
    args.timeout = 600
    os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")
    for r, res in enumerate(launch(_rank, 2, args, backend="gloo", timeout=args.timeout)):
        print(
            f"rank {r} " + "  ".join(f"{c}: cpu {a:.2f} wall {b:.2f}" for c, (a, b) in res.items())
        )


if __name__ == "__main__":
    main()
