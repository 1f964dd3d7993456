"""World 2: how one all-reduce's time spreads on this machine, run after run (the start-up probe's noise).

Two fresh ranks (gloo on loopback) run each of the butterfly and ``native`` at
4 KiB and 1 MiB 200 times back to back; printed: percentiles of each, and the
first 40 runs in order (stalls come in bursts, which is why the probe times its
points in rounds).

    python benchmarks/results/synchronizer/probe_rounds/stalls.py
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))

RUNS = 200


def _rank(rank, world, _):  # launch()'s function: module level
    from hybridcomm.comm.executor import reduce_now
    from hybridcomm.comm.transport.select import select_transport

    torch.set_num_threads(1)
    transport = select_transport(torch.device("cpu"), None, timeout=60)
    out = {}
    for algo in ("butterfly", "native"):
        for nbytes in (4 << 10, 1 << 20):
            buf = torch.zeros(nbytes // 4)
            times = []
            for _ in range(RUNS):
                t0 = time.perf_counter()
                reduce_now(buf, transport, algo, scale=None, timeout=60)
                times.append((time.perf_counter() - t0) * 1e6)
            out[f"{algo} {nbytes} B"] = times
    return out


def main() -> None:
    from hybridcomm.tools.launch import launch

    for what, times in launch(_rank, 2, None, backend="gloo", timeout=120)[0].items():
        s = sorted(times)
        pct = " ".join(f"p{q}={s[q * (len(s) - 1) // 100]:.0f}" for q in (10, 25, 50, 75, 90, 99))
        print(f"{what}: us {pct}")
        print("   first 40:", " ".join(f"{t:.0f}" for t in times[:40]))


if __name__ == "__main__":
    main()
