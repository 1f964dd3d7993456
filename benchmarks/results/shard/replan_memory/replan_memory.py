"""Resident memory a re-plan under shard raises, against the other steps (issue 40).

A re-plan (after ``measure_iters`` steps, or when a layer freezes or joins) moves
the sharded optimizer state from the old slices to the new ones. Each step's
rise of the process's peak resident memory (``ru_maxrss``, the high-water mark)
is printed per rank; the re-plan is step 3 (``measure_iters=3``).

Model: 10 x Linear(1024, 1024) (10.5M parameters, 42 MB; Adam's state 84 MB
whole, 42 MB per rank at world 2), ``shard="optimizer"``, backward mode, gloo on
loopback, 2 ranks.

    python benchmarks/results/shard/replan_memory/replan_memory.py [checkout]
"""

import os
import resource
import sys

ROOT = os.path.abspath(
    sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), *[".."] * 4)
)
sys.path.insert(0, ROOT)
os.environ["HYBRIDCOMM_LOG_LEVEL"] = "WARNING"
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import hybridcomm  # noqa: E402
from hybridcomm.tools.launch import launch  # noqa: E402


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rank(r, w):
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
    rises, prev = [], _peak_mb()
    for _ in range(6):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        now = _peak_mb()
        rises.append(now - prev)
        prev = now
    opt.close()
    return rises


if __name__ == "__main__":
    res = launch(rank, 2, backend="gloo", timeout=600)
    print(f"checkout {ROOT}  HYBRIDCOMM_RESHARD_BYTES={os.environ.get('HYBRIDCOMM_RESHARD_BYTES')}")
    for i, rises in enumerate(res):
        print(f"rank {i}: peak RSS rise per step (MB): " + " ".join(f"{x:.0f}" for x in rises))
