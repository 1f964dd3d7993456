"""The median over every launch of several sync_overhead.py --json files (default: full_run*.json here)."""
import glob, json, os, statistics, sys
files = sorted(glob.glob(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "full_run*.json")))
launches = [l for f in files for l in json.load(open(f))["launches"]]
print(f"{len(launches)} launches from {len(files)} runs")
for w in ["1", "2"]:
    for m in ["linear", "conv"]:
        L = [l[w][m] for l in launches if w in l]
        med = {c: statistics.median(x[c]["added"] for x in L) for c in L[0]}
        ddps = [c for c in med if c.startswith("ddp")]
        best = min(ddps, key=med.get)
        ratio = {c: med[c] / med[best] for c in ("forward", "backward", "none")}
        wins = {c: sum(x[c]["added"] <= min(x[d]["added"] for d in ddps) for x in L) for c in ratio}
        print(f"world {w} {m:6s}: best DDP {best} +{med[best]:.2f} ms; " +
              ", ".join(f"{c} +{med[c]:.2f} ({ratio[c]:.2f}x, <= best DDP in {wins[c]}/{len(L)})" for c in ratio))
