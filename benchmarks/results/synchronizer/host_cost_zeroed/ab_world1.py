"""Added host time per step at world 1, one checkout per launch (for alternating A/B runs).

    python ab_world1.py CHECKOUT [LABEL]

Trains the linear stack of ``benchmarks/sync_overhead.py`` (100 x Linear(64, 64),
batch 32, SGD with momentum, one thread) with plain torch and hybridcomm's three
modes (forward mode with HYBRIDCOMM_DEFER=always, as that script runs it), the
configs interleaved in 40 rounds of 25 steps; prints each config's median ms per
step and its added time over plain, paired by round (median over rounds).
Imports hybridcomm from CHECKOUT, so two checkouts can be alternated launch by
launch on a noisy machine.
"""

import os
import statistics
import sys
import tempfile
import time

if __name__ == "__main__":
    checkout, label = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else sys.argv[1])
    os.environ.setdefault("HYBRIDCOMM_DEFER", "always")
    os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")
    sys.path.insert(0, checkout)
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import hybridcomm

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    runs = {}
    for mode in ("plain", "forward", "backward", "none"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(100)])
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        if mode != "plain":
            opt = hybridcomm.DistributedOptimizer(
                opt, model=model, overlap=mode, cost_model="probe", measure_iters=0
            )
        runs[mode] = (model, torch.randn(32, 64), opt)

    def steps(model, x, opt, n):
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return (time.perf_counter() - t0) / n

    for run in runs.values():
        steps(*run, 100)
    times = {mode: [] for mode in runs}
    for _ in range(40):
        for mode, run in runs.items():
            times[mode].append(steps(*run, 25))
    for mode, ts in times.items():
        added = statistics.median(a - b for a, b in zip(ts, times["plain"]))
        print(
            f"{label} {mode:8s} {statistics.median(ts) * 1e3:.3f} ms/step, "
            f"added {added * 1e3:+.3f} ms"
        )
