"""The figures of several ``sync_overhead.py --json`` files as one measurement: each
figure the median over every launch in them (sync_overhead's own ``figures``), and
in how many launches each mode added no more than that launch's best DDP.

    python benchmarks/sync_overhead_pool.py FILE [FILE ...]

e.g. three runs of ``python benchmarks/sync_overhead.py --json full_runN.json``
(benchmarks/reports/2026-12-03-host-cost.md).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
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
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
