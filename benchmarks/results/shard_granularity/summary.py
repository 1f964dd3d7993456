"""The granularity runs (run.sh) as one table: per optimizer and config, the median step
time over the launches with its spread (min-max), the state per rank (largest) and its
ratio to an equal share, and each config's time over DDP's and ZeroRedundancyOptimizer's.

    python benchmarks/results/shard_granularity/summary.py launches_a
"""

import glob
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    where = os.path.join(HERE, sys.argv[1]) if len(sys.argv) > 1 else HERE
    print(
        "optimizer  config                               step ms (min-max)   x DDP  x ZeRO  stateMB/rank  x 1/P"
    )
    for opt in ("adam", "adafactor", "muon"):
        runs = [
            json.load(open(f))
            for f in sorted(glob.glob(f"{where}/transformer_100mbit_b32_{opt}_run*.json"))
        ]
        if not runs:
            continue
        by = {}
        for run in runs:
            for r in run["results"]:
                by.setdefault(r["config"], []).append(r)
        med = {c: statistics.median(r["step_ms"] for r in rs) for c, rs in by.items()}
        for config, rs in by.items():
            steps = [r["step_ms"] for r in rs]
            state = max(max(r["opt_state_bytes_per_rank"]) for r in rs) / 1e6
            share = max(r["opt_state_vs_ref"] for r in rs)
            print(
                f"{opt:10} {config:36} {med[config]:7.0f} ({min(steps):5.0f}-{max(steps):5.0f})"
                f"  {med[config] / med['ddp']:5.2f}  {med[config] / med['zero']:5.2f}"
                f"  {state:12.2f}  {share:5.2f}"
            )
        print(
            f"{'':10} ({len(runs)} launches; load average after each: "
            + ", ".join(str(run.get("loadavg_after")) for run in runs)
            + ")"
        )


if __name__ == "__main__":
    main()
