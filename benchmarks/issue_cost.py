"""Host time the gradient hooks spend issuing buckets: in the hooks vs on the channel's thread.

Issue 20's defect 3: issuing a bucket (ring: 2(P-1) NCCL group calls and P-1
reduction launches, in Python) from the gradient hook delays autograd's
thread, which on a GPU launches the next backward kernels. With the channel's
issue thread (the default) the hook only records the ready event and queues
the bucket. This measures, on the simulated GPU (HYBRIDCOMM_SIMULATE_GPU=1:
the library's own Python issue path, the NCCL and kernel costs of the
simulator, not a GPU's), the host seconds per bucket launch spent in the
hook (``BucketGroup.launch``) and the backward pass's wall time,
both ways, in the same run.

    python benchmarks/issue_cost.py                  # 4 ranks, ring, 8 buckets
    python benchmarks/issue_cost.py --ranks 2 --steps 20

A GPU run (nsys: the NVTX ranges of benchmarks/profile/nsys_train.sh) is what
settles the effect on backward kernels; none was available here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _rank(rank: int, world: int, threaded: bool, steps: int, layers: int, width: int):
    os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    os.environ["HYBRIDCOMM_ISSUE_THREAD"] = "1" if threaded else "0"
    import hybridcomm
    from hybridcomm.plan.cost_model import CostModel
    from hybridcomm.sync.bucket_group import BucketGroup

    spent = []
    launch = BucketGroup.launch

    def timed(self, s, pass_id):
        t0 = time.perf_counter()
        launch(self, s, pass_id)
        spent.append(time.perf_counter() - t0)

    BucketGroup.launch = timed

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3),
        model=model,
        overlap="backward",
        strategy="ring",
        fusion_bytes=0,
        cost_model=CostModel(2e-5, 1e-9, 1e-10),
        measure_iters=0,
        timeout=120,
    )
    x = torch.randn(16, width)
    backward = []
    for s in range(steps):
        if s == 2:  # after the first uses (connection set-up)
            spent.clear()
            backward.clear()
        opt.zero_grad()
        loss = model(x).square().mean()
        t0 = time.perf_counter()
        loss.backward()
        backward.append(time.perf_counter() - t0)
        opt.step()
    buckets = len(opt.plan.buckets)
    opt.close()
    return statistics.mean(spent), statistics.mean(backward), buckets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    args = ap.parse_args()
    from hybridcomm.tools.launch import launch

    rows = []
    for threaded in (False, True):
        out = launch(
            _rank,
            args.ranks,
            threaded,
            args.steps,
            args.layers,
            args.width,
            backend="gloo",
            timeout=600,
        )
        hook = statistics.mean(o[0] for o in out)
        bwd = statistics.mean(o[1] for o in out)
        rows.append(("channel thread" if threaded else "in the hook", hook, bwd, out[0][2]))
    print(
        f"# issue cost on the simulated GPU: {args.ranks} ranks, ring, {args.layers} "
        f"Linear({args.width}, {args.width}) layers, {args.steps - 2} measured steps"
    )
    print(f"{'issued':>15} {'buckets':>7} {'hook us/bucket':>15} {'backward ms':>12}")
    for name, hook, bwd, buckets in rows:
        print(f"{name:>15} {buckets:>7} {hook * 1e6:>15.0f} {bwd * 1e3:>12.2f}")
    print(
        f"hook time per bucket: {rows[0][1] / rows[1][1]:.1f}x less on the channel's thread; "
        f"backward wall {rows[0][2] / rows[1][2]:.2f}x"
    )


if __name__ == "__main__":
    main()
