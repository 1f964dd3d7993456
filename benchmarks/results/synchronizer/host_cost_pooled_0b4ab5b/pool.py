"""The figures of several ``sync_overhead.py --json`` files as one measurement: each
figure the median over every launch in them (sync_overhead's own ``figures``), and
in how many launches each mode added no more than that launch's best DDP.

    python benchmarks/results/synchronizer/host_cost_pooled_0b4ab5b/pool.py [FILE ...]

(default: ``full_run*.json`` beside this script).
"""

import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))  # benchmarks/
import sync_overhead as so  # noqa: E402


def main(files) -> None:
    runs = [json.load(open(f)) for f in files]
    launches = [{int(w): v for w, v in l.items()} for r in runs for l in r["launches"]]
    nparams = {res["model"]: res["parameters"] for res in runs[0]["results"]}
    print(
        f"# {len(launches)} launches from {len(files)} runs: {', '.join(map(os.path.basename, files))}"
    )
    for res in so.figures(launches, nparams):
        w, m = res["world"], res["model"]
        so.print_table(res, f"{nparams[m]} parameters")
        per = [l[w][m] for l in launches]
        wins = {
            c: sum(x[c]["added"] <= min(x[d]["added"] for d in so.DDPS) for x in per)
            for c in so.MODES
        }
        print(
            "at or below that launch's best DDP: "
            + ", ".join(f"{c} in {n}/{len(per)} launches" for c, n in wins.items())
        )


if __name__ == "__main__":
    main(sys.argv[1:] or sorted(glob.glob(os.path.join(HERE, "full_run*.json"))))
