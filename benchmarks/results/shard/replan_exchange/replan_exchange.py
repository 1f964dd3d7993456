"""What a re-plan under shard costs: each step's peak resident memory rise and wall time.

A re-plan (after ``measure_iters=3`` steps, or when a layer freezes or joins) moves
the sharded optimizer state from the old slices to the new ones. Two cases:

- ``measured``: the re-plan after the measured steps (step 3);
- ``frozen``: also the first layer frozen before step 5 (its state made whole on
  every rank; it is the end of the last bucket, so the others keep their slices);
- ``frozen-last``: the last layer frozen instead (the start of the first bucket:
  every other parameter moves up, and each rank's slices of it change).

Per rank: each step's rise of the process's peak resident memory (``ru_maxrss``,
MB) and its wall time (ms). Model: 10 x Linear(1024, 1024) (10.5M parameters, 42 MB;
Adam's state 84 MB whole, 84/P MB per rank), ``shard="optimizer"``, backward mode,
gloo on loopback.

    python benchmarks/results/shard/replan_exchange/replan_exchange.py [checkout] [world] [case]
"""

import os
import resource
import sys
import time

ROOT = os.path.abspath(
    sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), *[".."] * 4)
)
WORLD = int(sys.argv[2]) if len(sys.argv) > 2 else 2
CASE = sys.argv[3] if len(sys.argv) > 3 else "measured"
sys.path.insert(0, ROOT)
os.environ["HYBRIDCOMM_LOG_LEVEL"] = "WARNING"
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import hybridcomm  # noqa: E402
from hybridcomm.tools.launch import launch  # noqa: E402

STEPS = 7


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rank(r, w, case):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(10)])
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-4),
        model=model,
        overlap="backward",
        shard="optimizer",
        measure_iters=3,
        cost_model="default",
        timeout=120,
    )
    x = torch.randn(8, 1024)
    rises, times, prev = [], [], _peak_mb()
    for step in range(STEPS):
        if case.startswith("frozen") and step == 5:
            model[9 if case == "frozen-last" else 0].requires_grad_(False)
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
        now = _peak_mb()
        rises.append(now - prev)
        prev = now
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    opt.close()
    return rises, times, checksum


if __name__ == "__main__":
    res = launch(rank, WORLD, CASE, backend="gloo", timeout=600)
    print(
        f"checkout {ROOT}  world {WORLD}  case {CASE}  "
        f"HYBRIDCOMM_RESHARD_BYTES={os.environ.get('HYBRIDCOMM_RESHARD_BYTES')}  "
        f"checksum {res[0][2]:.6f}"
    )
    for i, (rises, times, _) in enumerate(res):
        print(
            f"rank {i}: peak RSS rise per step (MB): "
            + " ".join(f"{x:.0f}" for x in rises)
            + "   ms per step: "
            + " ".join(f"{t:.0f}" for t in times)
        )
