"""Sharded state (shard="optimizer") at world 2, backward mode: hybridcomm's added ms
over plain with the post-accumulate hook on every parameter (HYBRIDCOMM_LEAN_HOOKS=0)
and lean (one per bucket), both in the same launch, interleaved in rounds
(benchmarks/sync_overhead.py's loop and figures). Two launches per model.

    python benchmarks/results/synchronizer/host_cost_lean/shard_lean.py
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[".."] * 4))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT, os.path.join(ROOT, "tests")]
os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")
from multiproc import run_ranks  # noqa: E402


def rank(rank, world, model):
    import torch
    import sync_overhead as so

    torch.set_num_threads(1)

    class A:
        layers, width, batch, channels, image, conv_batch = 100, 64, 32, 8, 16, 8

    kind, options, zero = so.CONFIGS["backward"]
    so.CONFIGS["shard"] = (kind, dict(options, shard="optimizer"), zero)
    runs = {"plain": so._Run("plain", model, A)}
    os.environ["HYBRIDCOMM_LEAN_HOOKS"] = "0"
    runs["per parameter"] = so._Run("shard", model, A)
    os.environ["HYBRIDCOMM_LEAN_HOOKS"] = "1"
    runs["lean"] = so._Run("shard", model, A)
    for r in runs.values():
        r.steps(20, keep=False)
    for _ in range(10):
        for r in runs.values():
            r.steps(20, keep=True)
    out = {c: r.medians(runs["plain"])["added"] for c, r in runs.items() if c != "plain"}
    lean = runs["lean"].opt._hc_sync.hooks.lean
    for r in runs.values():
        r.close()
    return out, lean


if __name__ == "__main__":
    for model in ("linear", "conv"):
        for launch in range(2):
            added, lean = run_ranks(2, rank, model, timeout=300)[1]
            figures = ", ".join(f"{k} {v:+.2f}" for k, v in added.items())
            print(
                f"{model} launch {launch + 1}: added ms (rank 1) {figures}; lean at the end: {lean}"
            )
