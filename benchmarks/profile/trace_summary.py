"""One training step's timeline, in text, from a hybridcomm trace (``trace=True``).

    python benchmarks/profile/trace_summary.py traces/100mbit-b256-hybrid-forward-rank0.json
    python benchmarks/profile/trace_summary.py TRACE --step -2      # the step before the last

Prints every span of the chosen step (a ``step()`` call to the next one), in
milliseconds from its start: the backward passes and updates on the training
thread, each bucket's operations on the channel, the waits (exposed
communication); then where the step's time went: the channel's busy share,
its idle gaps, and the waits.
"""

from __future__ import annotations

import argparse
import json
from typing import List


def spans_of_step(events: List[dict], index: int):
    """The events from ``step()`` number ``index`` (negative: from the end) to the next."""
    steps = sorted(e["ts"] for e in events if e["name"] == "step")
    if len(steps) < 2:
        raise SystemExit("the trace holds fewer than two steps")
    starts = steps[:-1]
    t0 = starts[index]
    t1 = steps[steps.index(t0) + 1]
    inside = [e for e in events if t0 <= e["ts"] < t1 or (e["ts"] < t0 < e["ts"] + e["dur"])]
    return t0, t1, sorted(inside, key=lambda e: e["ts"])


def summarize(path: str, index: int = -1) -> str:
    events = json.load(open(path))["traceEvents"]
    t0, t1, inside = spans_of_step(events, index)
    lines = [
        f"{path}: step {index} ({(t1 - t0) / 1e3:.1f} ms, step() to step())",
        f"{'start':>9} {'end':>9} {'ms':>8}  {'where':14} what",
    ]
    for e in inside:
        a, b = (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3
        lines.append(f"{a:9.1f} {b:9.1f} {e['dur'] / 1e3:8.1f}  {e['cat']:14} {e['name']}")
    comm = sorted(
        (max(e["ts"], t0), min(e["ts"] + e["dur"], t1))
        for e in inside
        if e["cat"].startswith("comm")
    )
    busy, gaps, last = 0.0, [], t0
    for a, b in comm:
        if a > last:
            gaps.append((last, a))
        busy += max(0.0, b - max(a, last))
        last = max(last, b)
    if last < t1:
        gaps.append((last, t1))
    waits = sum(e["dur"] for e in inside if e["cat"] == "wait")
    total = t1 - t0
    lines.append(
        f"channel busy {busy / total:.0%} of the step; idle gaps (ms from start): "
        + ", ".join(
            f"{(a - t0) / 1e3:.0f}-{(b - t0) / 1e3:.0f}" for a, b in gaps if b - a > 0.01 * total
        )
    )
    lines.append(
        f"training thread waited {waits / 1e3:.1f} ms for communication "
        f"({waits / total:.0%} of the step)"
    )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--step", type=int, default=-1, help="which step (default: the last)")
    args = ap.parse_args(argv)
    print(summarize(args.trace, args.step))


if __name__ == "__main__":
    main()
