"""Added host time per step at world 1, one checkout per launch, placement-fair.

    python ab_rotated.py CHECKOUT [LABEL]

As ``../host_cost_zeroed/ab_world1.py`` (the linear stack of
``benchmarks/sync_overhead.py``, plain torch and hybridcomm's three modes,
forward mode with HYBRIDCOMM_DEFER=always, 40 rounds of 25 steps, the added
time paired by round), with two changes found on this VM: a sacrificial
hybridcomm config (backward mode, not reported) is built right after plain, and
the configs' order rotates by one each round. In one process the hybridcomm
optimizer built first ran 0.1-0.2 ms a step slower than an identical one built
after it, whatever its mode (``ab_world1.py`` builds forward mode first).
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
    for name in ("plain", "sacrificial", "forward", "backward", "none"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(100)])
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        if name != "plain":
            mode = "backward" if name == "sacrificial" else name
            opt = hybridcomm.DistributedOptimizer(opt, model=model, overlap=mode,
                                                  cost_model="probe", measure_iters=0)
        runs[name] = (model, torch.randn(32, 64), opt)

    def steps(model, x, opt, n):
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return (time.perf_counter() - t0) / n

    for run in runs.values():
        steps(*run, 100)
    times = {name: [] for name in runs}
    order = list(runs)
    for r in range(40):
        k = r % len(order)
        for name in order[k:] + order[:k]:
            times[name].append(steps(*runs[name], 25))
    for name, ts in times.items():
        if name == "sacrificial":
            continue
        added = statistics.median(a - b for a, b in zip(ts, times["plain"]))
        print(f"{label} {name:8s} {statistics.median(ts) * 1e3:.3f} ms/step, "
              f"added {added * 1e3:+.3f} ms")
