"""World 2 (two ranks over gloo on loopback, the larger rank's medians): each
config's added ms over plain against the best DDP of the same launch, per
launch and the median over launches (world2_before_N: 0fa105a, world2_after_N:
one post-accumulate hook per bucket). Launches 1-2 ran --launches 2, 3-6
--launches 1, alternating before and after.

    python benchmarks/results/synchronizer/host_cost_lean/summarize_world2.py
"""

import glob, json, os, statistics

DIR = os.path.dirname(os.path.abspath(__file__))
for tag in ("before", "after"):
    rows = {}
    for f in sorted(glob.glob(os.path.join(DIR, f"world2_{tag}_*.json"))):
        for r in json.load(open(f))["results"]:
            best = min(r["configs"][c]["added_ms"] for c in ("ddp", "ddp-view", "ddp-batch"))
            row = rows.setdefault(r["model"], {"best DDP": []})
            row["best DDP"].append(best)
            for c in ("forward", "backward", "none"):
                row.setdefault(c, []).append(r["configs"][c]["added_ms"] / best)
    for model, row in rows.items():
        ddp = row.pop("best DDP")
        print(
            f"{tag:6s} {model:6s} best DDP +{statistics.median(ddp):.2f} ms | "
            + " | ".join(
                f"{c} {statistics.median(x):.2f}x (launches {', '.join(f'{v:.2f}' for v in x)})"
                for c, x in row.items()
            )
        )
