"""World 2, one launch: each rank's median total per round for chosen configs, and
each config's paired added time (sync_overhead.py's ``added``, the larger rank's);
``backward-native`` / ``none-native`` are those modes with ``strategy="native"``
(gloo's own all-reduce instead of the plan's).

    python benchmarks/results/synchronizer/host_cost_pooled_0b4ab5b/world2_rounds.py \\
        --model conv --configs plain,ddp-batch,backward,none,backward-native,none-native
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import sync_overhead as so  # noqa: E402

for _mode in ("backward", "none"):
    so.CONFIGS[f"{_mode}-native"] = (
        "hybrid",
        dict(so.HYBRID, overlap=_mode, strategy="native"),
        {},
    )


def _rank(rank, world, args):  # launch()'s function: module level
    """sync_overhead.measure's interleaved rounds, keeping each round's median total."""
    import statistics
    import torch

    torch.set_num_threads(1)
    runs = [so._Run(c, args.model, args) for c in args.configs]
    for run in runs:
        run.steps(args.warmup, keep=False)
    for _ in range(args.rounds):
        for run in runs:
            run.steps(args.steps // args.rounds, keep=True)
    for run in runs:
        run.close()
    added = {run.config: run.medians(runs[0])["added"] for run in runs}
    rounds = {run.config: [statistics.median(r["total"]) * 1e3 for r in run.rounds] for run in runs}
    return added, rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="conv")
    parser.add_argument(
        "--configs", default="plain,ddp-batch,backward,none,backward-native,none-native"
    )
    so.add_model_arguments(parser)
    args = parser.parse_args()
    args.configs = args.configs.split(",")
    if args.configs[0] != "plain":
        parser.error("--configs starts with plain (added is over it)")
    args.steps, args.warmup, args.rounds = 100, 10, 10
    os.environ["HYBRIDCOMM_DEFER"] = "always"
    os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")
    from hybridcomm.tools.launch import launch

    ranks = launch(_rank, 2, args, backend="gloo", timeout=600)
    for rk, (_, rounds) in enumerate(ranks):
        print(f"rank {rk}: median total per round, ms")
        for c, per_round in rounds.items():
            print(f"  {c:16s}" + " ".join(f"{t:5.1f}" for t in per_round))
    print("added over plain (paired by round, the larger rank's), ms:")
    for c in args.configs:
        print(f"  {c:16s}{max(added[c] for added, _ in ranks):+6.2f}")


if __name__ == "__main__":
    main()
