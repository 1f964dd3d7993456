"""Printing, JSON and plots for a sweep: the only place the output format lives.

algbw = bytes / time; busbw = algbw * 2(P-1)/P, the all-reduce's bus factor
(docs/PERFORMANCE.md says why and how to read both).
"""
from __future__ import annotations

import json
import statistics
from typing import Dict, Iterable, List, Optional

from ..units import format_bytes

# The process group's own all_reduce (gloo's or NCCL's): the rows the others are compared
# with. harness.py runs it under this name, and imports the name from here.
BASELINE = "native"

COLUMNS = ("size", "count", "type", "redop", "algo", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
           "#wrong")


def bus_factor(world_size: int) -> float:
    """busbw / algbw for all-reduce: each rank must send and receive 2(P-1)/P of the data."""
    return 2.0 * (world_size - 1) / world_size if world_size > 1 else 0.0


def bandwidths(nbytes: int, seconds: float, world_size: int):
    """(algbw, busbw) in GB/s (1e9 bytes per second, as nccl-tests)."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * bus_factor(world_size)


def result_rows(raw: Iterable[dict], world_size: int, latency_s: float) -> List[dict]:
    """Harness rows -> the JSON ``results`` entries."""
    out = []
    for r in raw:
        algbw, busbw = bandwidths(r["bytes"], r["time_s"], world_size)
        row = {"algo": r["algo"], "bytes": r["bytes"], "count": r["count"],
               "time_us": r["time_s"] * 1e6, "algbw_gbps": algbw, "busbw_gbps": busbw,
               "wrong": r["wrong"],
               "time_us_per_rank": [t * 1e6 for t in r.get("time_s_per_rank", [])]}
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
        "# network: " + (doc.get("network") or (f"tbf {doc['shape']} on each rank link (namespaces)"
                                                if doc["shape"] else "unshaped"))
        + (f"; EMULATED latency {lat * 1e6:g} us per step on hybridcomm's algorithms only "
           f"(the torch baseline runs without it)" if lat else ""),
        f"# auto: cost model from {doc['auto_model']['source']}; hierarchical node size "
        f"{doc.get('node_size')}, torus2d grid {'x'.join(map(str, doc.get('grid') or ()))}",
        *([f"# ps: {doc['servers']} summation servers (hybridcomm.ps), extra processes beside "
            f"the {doc['world_size']} ranks, each on its own link where shaped"]
          if doc.get("servers") else []),
        f"# busbw = algbw * 2(P-1)/P = algbw * {bus_factor(doc['world_size']):.3f}",
        "#",
        f"# {'size':>10} {'count':>11} {'type':>8} {'redop':>5} {'algo':>16} {'time(us)':>11} "
        f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6}  note",
    ]
    return lines


def row_line(r: dict, doc: dict) -> str:
    note = ""
    if "chosen" in r:
        note = f"-> {r['chosen']}"
    elif r["algo"] == BASELINE and doc["latency"]:
        note = "no latency emulation"
    wrong = "N/A" if r["wrong"] < 0 else str(r["wrong"])
    return (f"  {r['bytes']:>10} {r['count']:>11} {doc['dtype']:>8} {doc['op']:>5} {r['algo']:>16} "
            f"{r['time_us']:>11.1f} {r['algbw_gbps']:>11.3f} {r['busbw_gbps']:>11.3f} "
            f"{wrong:>6}  {note}").rstrip()


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


def summary(doc: dict) -> List[str]:
    results = doc["results"]
    algos = list(dict.fromkeys(r["algo"] for r in results))
    lines = ["#", "# Avg bus bandwidth (GB/s, mean over sizes):"]
    lines.append("#   " + "  ".join(
        f"{a} {statistics.mean(r['busbw_gbps'] for r in results if r['algo'] == a):.3f}"
        for a in algos))
    if BASELINE in algos:
        base = {r["bytes"]: r["time_us"] for r in results if r["algo"] == BASELINE}
        ratios = []
        for a in algos:
            if a == BASELINE:
                continue
            rs = [f"{format_bytes(r['bytes'])} {base[r['bytes']] / r['time_us']:.2f}x"
                  for r in results if r["algo"] == a and r["bytes"] in base]
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
        lines.append(f"# Butterfly/ring crossover (measured): {text}")
    wrong = sum(max(r["wrong"], 0) for r in results)
    lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    return lines


# --- JSON ----------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "required": {"world_size": int, "backend": str, "device": str, "dtype": str, "op": str,
                 "shape": (str, type(None)), "latency": (float, int), "results": list,
                 "calibration": (dict, type(None)), "env": dict},
    "result": {"algo": str, "bytes": int, "count": int, "time_us": (float, int),
               "algbw_gbps": (float, int), "busbw_gbps": (float, int), "wrong": int},
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
    title = (f"all_reduce, {doc['world_size']} ranks, {doc['backend']}/{doc['device']}, "
             f"{doc['dtype']} {doc['op']}")
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
    from .._version import __version__

    return {"host": platform.node(), "platform": platform.platform(), "cpu": cpu,
            "cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
            "hybridcomm": __version__, "cuda": torch.version.cuda,
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "argv": sys.argv}
