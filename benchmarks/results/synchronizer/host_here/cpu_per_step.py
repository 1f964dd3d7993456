"""World 2: each config's process CPU time per step (user + system, every thread of
the rank: the trainer, hybridcomm's channel, gloo's) beside its wall time, medians
of 20 interleaved rounds of 10 steps, one line per rank. On 2 cores shared by 2
ranks, CPU a rank spends is time the other rank's compute may lose.

    python benchmarks/results/synchronizer/host_here/cpu_per_step.py --model conv
"""
import os, sys, time, resource, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import sync_overhead as so
import torch
from hybridcomm.tools.launch import launch
CONF = ["plain", "ddp-batch", "ddp-view", "backward", "none"]
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
def _rank(rank, world, args):
    torch.set_num_threads(1)
    args.timeout = 600
    cost_model = so.shared_probe(args)  # (every mode plans from one probe, as sync_overhead)
    runs = [so._Run(c, args.model, args, cost_model) for c in CONF]
    for run in runs: run.steps(10, keep=False)
    cpus = {c: [] for c in CONF}; walls = {c: [] for c in CONF}
    for _ in range(20):
        for run in runs:
            c0, w0 = cpu(), time.perf_counter()
            run.steps(10, keep=False)
            cpus[run.config].append((cpu() - c0) / 10 * 1e3); walls[run.config].append((time.perf_counter() - w0) / 10 * 1e3)
    for run in runs: run.close()
    return {c: (statistics.median(cpus[c]), statistics.median(walls[c])) for c in CONF}
if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(); so.add_model_arguments(p); p.add_argument("--model", default="conv")
    args = p.parse_args(); os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")
    for r, res in enumerate(launch(_rank, 2, args, backend="gloo", timeout=600)):
        print("rank", r, "  ".join(f"{c}: cpu {a:.2f} wall {b:.2f}" for c, (a, b) in res.items()))
