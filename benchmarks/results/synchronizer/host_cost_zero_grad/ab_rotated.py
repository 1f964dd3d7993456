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

import statistics
import sys
import time

from world1 import linear_stack, start, steps

if __name__ == "__main__":
    checkout, label = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else sys.argv[1])
    hybridcomm = start(checkout)
    modes = {
        "plain": None,
        "sacrificial": "backward",
        "forward": "forward",
        "backward": "backward",
        "none": "none",
    }
    runs = {name: linear_stack(hybridcomm, mode) for name, mode in modes.items()}

    def timed(run, n):
        t0 = time.perf_counter()
        steps(*run, n)
        return (time.perf_counter() - t0) / n

    for run in runs.values():
        steps(*run, 100)
    times = {name: [] for name in runs}
    order = list(runs)
    for r in range(40):
        k = r % len(order)
        for name in order[k:] + order[:k]:
            times[name].append(timed(runs[name], 25))
    for name, ts in times.items():
        if name == "sacrificial":
            continue
        added = statistics.median(a - b for a, b in zip(ts, times["plain"]))
        print(
            f"{label} {name:8s} {statistics.median(ts) * 1e3:.3f} ms/step, "
            f"added {added * 1e3:+.3f} ms"
        )
