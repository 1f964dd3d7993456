"""The medians over the alternating launches in this folder, or in the folder
given (before_N and after_N: the two versions its README names; here 48b7870
and the hot-path changes of this folder's README), per model: each config's
added ms over plain, per parameter, and against the best DDP of the same
launches (the minimum of the three DDP configs, per launch).

    python benchmarks/results/synchronizer/host_cost_hooks/summarize.py
    python benchmarks/results/synchronizer/host_cost_hooks/summarize.py \
        benchmarks/results/synchronizer/host_cost_lean
"""

import glob, json, os, statistics, sys

DIR = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
out = {}
for tag in ("before", "after"):
    rows = {}
    for f in sorted(glob.glob(os.path.join(DIR, f"{tag}_*.json"))):
        d = json.load(open(f))
        for r in d["results"]:
            key = (r["model"], r["world"])
            best = min(
                r["configs"][c]["added_ms"]
                for c in ("ddp", "ddp-view", "ddp-batch")
                if c in r["configs"]
            )
            rows.setdefault(key, {}).setdefault("best DDP", []).append(best)
            for c in ("forward", "backward", "none"):
                rows[key].setdefault(c, []).append(r["configs"][c]["added_ms"])
            rows[key]["params"] = r["parameters"]
    out[tag] = rows
for key in out["after"]:
    n = out["after"][key]["params"]
    print(
        f"## {key[0]} ({n} params), world {key[1]}: ms added over plain, median of {len(out['after'][key]['best DDP'])} launches (us/param; x best DDP of the same runs)"
    )
    for tag in ("before", "after"):
        rows = out[tag][key]
        ddp = statistics.median(rows["best DDP"])
        cells = [f"best DDP +{ddp:.2f} ({ddp / n * 1e3:.1f})"]
        for c in ("forward", "backward", "none"):
            m = statistics.median(rows[c])
            cells.append(f"{c} +{m:.2f} ({m / n * 1e3:.1f}; {m / ddp:.2f}x)")
        print(f"{tag:6s}  " + " | ".join(cells))
