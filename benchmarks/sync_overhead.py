"""The synchronizer's own host cost per step, one rank, no communication to wait for.

A stack of ``--layers`` Linear(``--width``, ``--width``) layers (docs/PERFORMANCE.md:
100), batch ``--batch``; forward, backward and step timed separately with
``time.perf_counter`` and reported as medians over ``--steps`` steps after
``--warmup``, in ``--rounds`` interleaved rounds, for plain PyTorch and for hybridcomm's three overlap modes (forward
mode with ``HYBRIDCOMM_DEFER=always``, so its deferred updates are applied in the
next forward, as on a network where forward overlap pays; its forward column
holds them). All in one process, so the figures compare within the run.

    python benchmarks/sync_overhead.py
    python benchmarks/sync_overhead.py --layers 100 --width 64 --steps 200
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


class _Run:
    """One config's model and optimizer, stepped ``steps`` at a time."""

    def __init__(self, config: str, args):
        import hybridcomm

        self.config, self.args = config, args
        self.model = _model(args.layers, args.width)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9)
        if config != "plain":
            self.opt = hybridcomm.DistributedOptimizer(self.opt, model=self.model, overlap=config,
                                                       cost_model="default", measure_iters=0)
        self.x = torch.randn(args.batch, args.width)
        self.times = {"forward": [], "backward": [], "step": []}

    def steps(self, n: int, keep: bool) -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            self.opt.zero_grad()
            loss = self.model(self.x).square().mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            self.opt.step()
            t3 = time.perf_counter()
            if keep:
                for key, dt in zip(self.times, (t1 - t0, t2 - t1, t3 - t2)):
                    self.times[key].append(dt)

    def medians(self) -> dict:
        if self.config != "plain":
            self.opt.close()
        return {k: statistics.median(v) * 1e3 for k, v in self.times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds of steps")
    args = parser.parse_args(argv)
    os.environ["HYBRIDCOMM_DEFER"] = "always"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1),
                                rank=0, world_size=1)
        try:
            runs = [_Run(c, args) for c in ("plain", "forward", "backward", "none")]
            for run in runs:
                run.steps(args.warmup, keep=False)
            for _ in range(args.rounds):  # interleaved: drift on a shared machine hits all
                for run in runs:
                    run.steps(args.steps // args.rounds, keep=True)
            rows = {run.config: run.medians() for run in runs}
        finally:
            dist.destroy_process_group()
    print(f"# {args.layers} x Linear({args.width}, {args.width}), batch {args.batch}, one rank, "
          f"median of {args.steps} steps (ms); forward mode with HYBRIDCOMM_DEFER=always")
    print(f"{'config':<10} {'forward':>9} {'backward':>9} {'step':>9} {'total':>9} {'vs plain':>9}")
    base = sum(rows["plain"].values())
    for config, r in rows.items():
        total = sum(r.values())
        print(f"{config:<10} {r['forward']:>9.2f} {r['backward']:>9.2f} {r['step']:>9.2f} "
              f"{total:>9.2f} {total - base:>+9.2f}")


if __name__ == "__main__":
    main()
