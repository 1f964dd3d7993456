"""Printing, JSON and plots for a sweep: the only place the output format lives.

algbw = bytes / time; busbw = algbw * 2(P-1)/P, the all-reduce's bus factor
(docs/PERFORMANCE.md says why and how to read both).

Noise: a point's ``spread`` is the larger of its iterations' spread (p80 - p20
over the median, the worst rank's) and its ranks' spread (largest minus
smallest rank median, over their mean). Above :data:`NOISE_THRESHOLD` the
summary warns and names the sizes: ratios and the measured crossover there
are unreliable. ``auto`` is checked against the same run: where the algorithm
it chose measured slower than the fastest one timed at that size by more than
both points' spread (at least :data:`AUTO_MARGIN`), the summary says so.
"""

from __future__ import annotations

import json
import statistics
from typing import Dict, Iterable, List, Optional

from ...base.units import format_bytes

# The process group's own all_reduce (gloo's or NCCL's): the rows the others are compared
# with. harness.py runs it under this name, and imports the name from here.
BASELINE = "native"

NOISE_THRESHOLD = 0.25  # a point whose spread exceeds 25% of its time is noisy
AUTO_MARGIN = 0.05  # auto is "slower" only beyond the noise, and never within 5%

COLUMNS = (
    "size",
    "count",
    "type",
    "redop",
    "algo",
    "time(us)",
    "algbw(GB/s)",
    "busbw(GB/s)",
    "#wrong",
)


def bus_factor(world_size: int) -> float:
    """busbw / algbw for all-reduce: each rank must send and receive 2(P-1)/P of the data."""
    return 2.0 * (world_size - 1) / world_size if world_size > 1 else 0.0


def bandwidths(nbytes: int, seconds: float, world_size: int):
    """(algbw, busbw) in GB/s (1e9 bytes per second, as nccl-tests)."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * bus_factor(world_size)


def spreads(medians: List[float], p20s: List[float], p80s: List[float]):
    """(iterations' spread, ranks' spread), each relative to the time.

    >>> spreads([100.0, 100.0], [90.0, 80.0], [110.0, 130.0])
    (0.5, 0.0)
    >>> spreads([100.0, 150.0], [100.0, 150.0], [100.0, 150.0])
    (0.0, 0.4)
    """
    iters = max(((hi - lo) / m for m, lo, hi in zip(medians, p20s, p80s) if m > 0), default=0.0)
    mean = sum(medians) / len(medians) if medians else 0.0
    ranks = (max(medians) - min(medians)) / mean if len(medians) > 1 and mean > 0 else 0.0
    return round(iters, 4), round(ranks, 4)


def result_rows(raw: Iterable[dict], world_size: int, latency_s: float) -> List[dict]:
    """Harness rows -> the JSON ``results`` entries."""
    out = []
    for r in raw:
        algbw, busbw = bandwidths(r["bytes"], r["time_s"], world_size)
        medians = r.get("time_s_per_rank") or [r["time_s"]]
        iters, ranks = spreads(
            medians, r.get("p20_s_per_rank") or medians, r.get("p80_s_per_rank") or medians
        )
        row = {
            "algo": r["algo"],
            "bytes": r["bytes"],
            "count": r["count"],
            "time_us": r["time_s"] * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": busbw,
            "wrong": r["wrong"],
            "time_us_per_rank": [t * 1e6 for t in r.get("time_s_per_rank", [])],
            "p20_us_per_rank": [t * 1e6 for t in r.get("p20_s_per_rank", [])],
            "p80_us_per_rank": [t * 1e6 for t in r.get("p80_s_per_rank", [])],
            "iter_spread": iters,
            "rank_spread": ranks,
            "spread": max(iters, ranks),
        }
        if r["algo"] != BASELINE and r.get("chosen", r["algo"]) != r["algo"]:
            row["chosen"] = r["chosen"]
        row["latency_emulated"] = bool(latency_s > 0 and r["algo"] != BASELINE)
        out.append(row)
    return out


def header(doc: dict) -> List[str]:
    lat = doc["latency"]
    lines = [
        f"# hybridcomm-bench: all_reduce over {doc['world_size']} ranks, backend "
        f"{doc['backend']}, device {doc['device']}, {doc['dtype']}, op {doc['op']}",
        f"# iters {doc['iters']} (median per iteration, then the mean over ranks), "
        f"warmup {doc['warmup']}, check {'on' if doc['check'] else 'off'}",
        "# network: "
        + (
            doc.get("network")
            or (
                f"tbf {doc['shape']} on each rank link (namespaces)" if doc["shape"] else "unshaped"
            )
        )
        + (
            f"; EMULATED latency {lat * 1e6:g} us per step on hybridcomm's algorithms only "
            f"(the torch baseline runs without it)"
            if lat
            else ""
        ),
        f"# auto: cost model from {doc['auto_model']['source']}; hierarchical node size "
        f"{doc.get('node_size')}, torus2d grid {'x'.join(map(str, doc.get('grid') or ()))}",
        *(
            [
                f"# ps: {doc['servers']} summation servers (hybridcomm.comm.servers), extra processes beside "
                f"the {doc['world_size']} ranks, each on its own link where shaped"
            ]
            if doc.get("servers")
            else []
        ),
        f"# busbw = algbw * 2(P-1)/P = algbw * {bus_factor(doc['world_size']):.3f}",
        "#",
        f"# {'size':>10} {'count':>11} {'type':>8} {'redop':>5} {'algo':>16} {'time(us)':>11} "
        f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6}  note",
    ]
    return lines


def row_line(r: dict, doc: dict) -> str:
    notes = []
    if "chosen" in r:
        notes.append(f"-> {r['chosen']}")
    elif r["algo"] == BASELINE and doc["latency"]:
        notes.append("no latency emulation")
    if r.get("spread", 0.0) > NOISE_THRESHOLD:
        notes.append(f"noisy ({r['spread'] * 100:.0f}% spread)")
    note = ", ".join(notes)
    wrong = "N/A" if r["wrong"] < 0 else str(r["wrong"])
    return (
        f"  {r['bytes']:>10} {r['count']:>11} {doc['dtype']:>8} {doc['op']:>5} {r['algo']:>16} "
        f"{r['time_us']:>11.1f} {r['algbw_gbps']:>11.3f} {r['busbw_gbps']:>11.3f} "
        f"{wrong:>6}  {note}"
    ).rstrip()


def measured_crossover(results: List[dict], a: str = "butterfly", b: str = "ring") -> Optional[int]:
    """Smallest swept size from which ``b`` is no slower than ``a`` at every larger
    size; None if ``b`` is slower at the largest size (or either is missing)."""
    ta = {r["bytes"]: r["time_us"] for r in results if r["algo"] == a}
    tb = {r["bytes"]: r["time_us"] for r in results if r["algo"] == b}
    sizes = sorted(set(ta) & set(tb))
    if not sizes:
        return None
    cross = None
    for n in reversed(sizes):
        if tb[n] <= ta[n]:
            cross = n
        else:
            break
    return cross


def noisy(results: List[dict], threshold: float = NOISE_THRESHOLD) -> List[dict]:
    """The points whose spread exceeds ``threshold`` (iterations or ranks)."""
    return [r for r in results if r.get("spread", 0.0) > threshold]


def noise_lines(results: List[dict], threshold: float = NOISE_THRESHOLD) -> List[str]:
    """The summary's noise verdict: a WARNING naming the noisy sizes, or one line
    saying every point is within ``threshold``."""
    bad = noisy(results, threshold)
    if not bad:
        return [
            f"# Noise: every point within {threshold * 100:.0f}% (p20..p80 of the "
            "iterations, and the ranks' medians)"
        ]
    sizes = sorted({r["bytes"] for r in bad})
    worst = max(bad, key=lambda r: r["spread"])
    kind = "across iterations" if worst["iter_spread"] >= worst["rank_spread"] else "across ranks"
    return [
        f"# WARNING: noisy measurements at {', '.join(format_bytes(n) for n in sizes)}: "
        f"spread over {threshold * 100:.0f}% of the time (worst: {worst['algo']} at "
        f"{format_bytes(worst['bytes'])}, {worst['spread'] * 100:.0f}% {kind}); the "
        "speed ratios and the crossover verdict at these sizes are unreliable. More "
        "iterations (-n), a quieter machine, or --json for every rank's numbers."
    ]


def auto_check(results: List[dict]) -> List[dict]:
    """Sizes where the algorithm ``auto`` chose measured slower, beyond the noise,
    than the fastest algorithm timed at that size in the same run."""
    out = []
    for a in (r for r in results if r["algo"] == "auto"):
        others = [r for r in results if r["bytes"] == a["bytes"] and r["algo"] != "auto"]
        if not others:
            continue
        best = min(others, key=lambda r: r["time_us"])
        chosen = a.get("chosen", "auto")
        if best["algo"] == chosen:
            continue
        margin = max(a.get("spread", 0.0), best.get("spread", 0.0), AUTO_MARGIN)
        if a["time_us"] > best["time_us"] * (1 + margin):
            out.append(
                {
                    "bytes": a["bytes"],
                    "chosen": chosen,
                    "chosen_us": a["time_us"],
                    "fastest": best["algo"],
                    "fastest_us": best["time_us"],
                    "margin": margin,
                }
            )
    return out


def auto_lines(results: List[dict], model_source: str = "") -> List[str]:
    """The summary's check of auto against this run (nothing when auto was not swept)."""
    if not any(r["algo"] == "auto" for r in results):
        return []
    slow = auto_check(results)
    if not slow:
        return [
            "# auto vs this run: its choice was the fastest measured, within the noise, "
            "at every size"
        ]
    lines = []
    for c in slow:
        lines.append(
            f"# auto at {format_bytes(c['bytes'])} chose {c['chosen']} "
            f"({c['chosen_us']:.0f} us), but {c['fastest']} measured "
            f"{c['fastest_us']:.0f} us in this run "
            f"({c['chosen_us'] / c['fastest_us']:.2f}x faster, beyond the "
            f"{c['margin'] * 100:.0f}% noise)"
        )
    lines.append(
        "#   auto's cost model"
        + (f" ({model_source})" if model_source else "")
        + " mispredicts this machine there: `hybridcomm-bench --calibrate` (or "
        "`python -m hybridcomm calibrate`) fits one to it"
    )
    return lines


def summary(doc: dict) -> List[str]:
    results = doc["results"]
    algos = list(dict.fromkeys(r["algo"] for r in results))
    lines = ["#", "# Avg bus bandwidth (GB/s, mean over sizes):"]
    lines.append(
        "#   "
        + "  ".join(
            f"{a} {statistics.mean(r['busbw_gbps'] for r in results if r['algo'] == a):.3f}"
            for a in algos
        )
    )
    if BASELINE in algos:
        base = {r["bytes"]: r["time_us"] for r in results if r["algo"] == BASELINE}
        ratios = []
        for a in algos:
            if a == BASELINE:
                continue
            rs = [
                f"{format_bytes(r['bytes'])} {base[r['bytes']] / r['time_us']:.2f}x"
                for r in results
                if r["algo"] == a and r["bytes"] in base
            ]
            ratios.append(f"#   {a:>16}: " + ", ".join(rs))
        lines.append("# Speed vs torch (torch time / our time; > 1 is faster):")
        lines += ratios
    if "butterfly" in algos and "ring" in algos:
        c = measured_crossover(results)
        sizes = sorted({r["bytes"] for r in results})
        if c is None:
            text = f"ring is slower than butterfly up to {format_bytes(sizes[-1])} (no crossover)"
        elif c == sizes[0]:
            text = f"ring is no slower than butterfly at every size from {format_bytes(c)}"
        else:
            text = f"ring is no slower than butterfly from {format_bytes(c)} up"
        shaky = sorted({r["bytes"] for r in noisy(results) if r["algo"] in ("butterfly", "ring")})
        if shaky:
            text += " (UNRELIABLE: noisy at " + ", ".join(format_bytes(n) for n in shaky) + ")"
        lines.append(f"# Butterfly/ring crossover (measured): {text}")
    lines += noise_lines(results)
    lines += auto_lines(results, (doc.get("auto_model") or {}).get("source", ""))
    wrong = sum(max(r["wrong"], 0) for r in results)
    lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    return lines


# --- JSON ----------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "required": {
        "world_size": int,
        "backend": str,
        "device": str,
        "dtype": str,
        "op": str,
        "shape": (str, type(None)),
        "latency": (float, int),
        "results": list,
        "calibration": (dict, type(None)),
        "env": dict,
    },
    "result": {
        "algo": str,
        "bytes": int,
        "count": int,
        "time_us": (float, int),
        "algbw_gbps": (float, int),
        "busbw_gbps": (float, int),
        "wrong": int,
    },
}


def validate(doc: dict) -> None:
    """Raise ValueError if ``doc`` does not have the documented ``--json`` shape."""
    for key, kind in SCHEMA["required"].items():
        if key not in doc:
            raise ValueError(f"missing key {key!r}")
        if not isinstance(doc[key], kind):
            raise ValueError(f"{key!r} is {type(doc[key]).__name__}, expected {kind}")
    for i, r in enumerate(doc["results"]):
        for key, kind in SCHEMA["result"].items():
            if key not in r or not isinstance(r[key], kind) or isinstance(r[key], bool):
                raise ValueError(f"results[{i}][{key!r}] missing or not {kind}")


def write_json(path: str, doc: dict) -> None:
    validate(doc)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


# --- plot ----------------------------------------------------------------------------------


def plot(path: str, doc: dict) -> None:
    """busbw and time against size, one line per algorithm (matplotlib, no display)."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'hybridcomm[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    algos = list(dict.fromkeys(r["algo"] for r in results))
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    for a in algos:
        rs = sorted((r for r in results if r["algo"] == a), key=lambda r: r["bytes"])
        x = [r["bytes"] for r in rs]
        style = {"linestyle": "--", "color": "black"} if a == BASELINE else {}
        ax_bw.plot(x, [r["busbw_gbps"] for r in rs], marker="o", label=a, **style)
        ax_t.plot(x, [r["time_us"] for r in rs], marker="o", label=a, **style)
    sizes = sorted({r["bytes"] for r in results})
    for ax in (ax_bw, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([format_bytes(s) for s in sizes], rotation=45)
        ax.set_xlabel("size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_bw.set_ylabel("busbw (GB/s)")
    ax_t.set_ylabel("time (us)")
    ax_t.set_yscale("log")
    title = (
        f"all_reduce, {doc['world_size']} ranks, {doc['backend']}/{doc['device']}, "
        f"{doc['dtype']} {doc['op']}"
    )
    if doc["shape"]:
        title += f", tbf {doc['shape']}"
    if doc["latency"]:
        title += f", emulated latency {doc['latency'] * 1e6:g} us (not on torch)"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_info() -> Dict:
    """The machine, for a result file: host, CPU, core count, versions, GPUs."""
    import os
    import platform
    import sys

    import torch

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    from ..._version import __version__

    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "hybridcomm": __version__,
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "argv": sys.argv,
    }
