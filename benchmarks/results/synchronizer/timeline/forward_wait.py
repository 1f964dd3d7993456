"""World 2, forward mode (``HYBRIDCOMM_DEFER=always``): how long the next forward's first read waits for the step's reduction.

Each rank steps plain, forward and none (sync_overhead.py's conv net, loop and
shared probe), 20 interleaved rounds of 10 steps. Each rank records its
phases, each host-path reduction's entry and exit
(``executor._execute_on_host``, which forward mode runs on
``hybridcomm-channel``), and each ``HostChannel.wait``, all on the one clock
both processes share. Printed:

- per rank, the median phases (forward, backward, step, ms) of each config;
- how long forward mode's wait (the first read of the next forward) took:
  its median and p90;
- four steps, event by event on both ranks, in ms from rank 0's end of
  backward: ``bwd_end``, ``step_end``, the next forward's start and end, the
  reduction (``op>`` / ``op<``), the wait (``wait>`` / ``wait<``).

    python benchmarks/results/synchronizer/timeline/forward_wait.py
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import sync_overhead as so  # noqa: E402

CONFIGS = ("plain", "forward", "none")
SHOWN = (100, 101, 102, 103)  # the steps printed event by event


def _record(events: list) -> None:
    """Append each reduction's and each channel wait's start and end to ``events``."""
    from hybridcomm.comm import channel, executor

    run, wait = executor._execute_on_host, channel.HostChannel.wait

    def timed(fn, name):
        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                events.append((name, t0, time.perf_counter()))

        return inner

    executor._execute_on_host = timed(run, "op")
    channel.HostChannel.wait = timed(wait, "wait")


def _rank(rank, world, args):  # launch()'s function: module level
    torch.set_num_threads(1)
    events = []
    _record(events)
    cost_model = so.shared_probe(args)
    runs = [so._Run(c, "conv", args, cost_model) for c in CONFIGS]
    for run in runs:
        run.steps(10, keep=False)
    steps = {c: [] for c in CONFIGS}
    for _ in range(20):
        for run in runs:
            for _ in range(10):
                steps[run.config].append(run.step())
    for run in runs:
        run.close()
    return steps, events


def _in(events, name, lo, hi, end=False):
    return [e for e in events if e[0] == name and lo <= e[2 if end else 1] <= hi]


def report(ranks) -> None:
    for r, (steps, events) in enumerate(ranks):
        for c in CONFIGS:
            phases = [statistics.median(s[i + 1] - s[i] for s in steps[c]) * 1e3 for i in range(3)]
            print(
                f"rank {r} {c:<8} forward {phases[0]:.2f} backward {phases[1]:.2f} "
                f"step {phases[2]:.2f}"
            )
        waits = sorted(
            e[2] - e[1] for s in steps["forward"] for e in _in(events, "wait", s[0], s[1])
        )
        if waits:
            print(
                f"rank {r} forward mode's first-read wait: {len(waits)} in "
                f"{len(steps['forward'])} steps, median {statistics.median(waits) * 1e3:.3f} ms, "
                f"p90 {waits[int(0.9 * (len(waits) - 1))] * 1e3:.3f} ms"
            )
    for k in SHOWN:
        base = ranks[0][0]["forward"][k][2]
        for r, (steps, events) in enumerate(ranks):
            t0, t1, t2, t3 = steps["forward"][k]
            n0, n1 = steps["forward"][k + 1][:2]
            marks = [("bwd_end", t2), ("step_end", t3), ("next_fwd", n0), ("next_fwd_end", n1)]
            for name in ("op", "wait"):
                marks += [(name + ">", e[1]) for e in _in(events, name, t1, n1)]
                marks += [(name + "<", e[2]) for e in _in(events, name, t1, n1, end=True)]
            marks.sort(key=lambda m: m[1])
            print(
                f"step {k} rank {r}: " + " ".join(f"{n}{(t - base) * 1e3:+.2f}" for n, t in marks)
            )


def main() -> None:
    import argparse

    from hybridcomm.tools.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    so.add_model_arguments(parser)
    args = parser.parse_args()
    args.timeout = 300
    os.environ["HYBRIDCOMM_DEFER"] = "always"  # (before launch(): its ranks inherit it)
    os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")
    report(launch(_rank, 2, args, backend="gloo", timeout=args.timeout))


if __name__ == "__main__":
    main()
