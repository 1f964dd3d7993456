"""World 2: where a hybridcomm step's reduction time goes, mode by mode, both ranks on one clock.

Each rank steps each config (sync_overhead.py's models, loop and shared probe)
and records, per step, on ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for
both processes of this machine): the step's phases, and for each host-path
reduction (``executor._execute_on_host``, or ``execute_native`` for a
``native`` bucket) when it was entered and left, how long posting its sends
and receives took (``TorchDistTransport.exchange``), how long it waited for
them (``TorchDistPending.wait``) and how long its add took. Then, per config,
the median over steps of:

- ``fwd`` / ``bwd`` / ``step``: the phases (the larger rank's);
- ``skew``: how much later the later rank entered the reduction;
- ``after``: from the later rank's entry until the last rank left: the
  reduction's own time once both are in;
- ``post`` / ``wait`` / ``add`` / ``rest``: posting, waiting, the add and
  scale (``kernels.reduce``), and the rest, on the rank that entered last (a
  ``native`` bucket's call is all ``rest``: gloo's own all-reduce);
- ``early wait`` / ``early post`` / ``early add``: the earlier rank's (its
  wait is the skew plus most of ``after``, spent idle);
- ``lead in`` / ``lead out``: from the start of the phase the reduction runs in
  (backward or step) to its entry, and from its exit to the phase's end (both
  ranks' steps).

    python benchmarks/results/synchronizer/timeline/timeline.py --model conv
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import sync_overhead as so  # noqa: E402

CONFIGS = ["plain", "ddp-batch", "backward", "none"]


class _Recorder:
    """The times of the host-path reductions of one step (patched in by ``install``)."""

    def __init__(self):
        self.ops = []  # per reduction: {enter, leave, post, wait, add}

    def install(self) -> None:
        from hybridcomm.comm import executor
        from hybridcomm.comm.transport import torch_dist

        run, exchange = executor._execute_on_host, torch_dist.TorchDistTransport.exchange
        wait, add = torch_dist.TorchDistPending.wait, executor.reduce
        rec = self

        def entered(fn):
            def inner(*a, **k):
                op = {"enter": time.perf_counter(), "post": 0.0, "wait": 0.0, "add": 0.0}
                rec.ops.append(op)
                try:
                    return fn(*a, **k)
                finally:
                    op["leave"] = time.perf_counter()

            return inner

        def timed(fn, key):
            def inner(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    if rec.ops:
                        rec.ops[-1][key] += time.perf_counter() - t0

            return inner

        executor._execute_on_host = entered(run)
        executor.execute_native = entered(executor.execute_native)
        torch_dist.TorchDistTransport.exchange = timed(exchange, "post")
        torch_dist.TorchDistPending.wait = timed(wait, "wait")
        executor.reduce = timed(add, "add")


def _rank(rank, world, args):  # launch()'s function: module level
    torch.set_num_threads(1)
    rec = _Recorder()
    rec.install()
    cost_model = so.shared_probe(args)
    runs = [so._Run(c, args.model, args, cost_model) for c in CONFIGS]
    for run in runs:
        run.steps(10, keep=False)
    steps = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for run in runs:
            for _ in range(args.steps):
                rec.ops = []
                steps[run.config].append({"t": run.step(), "ops": rec.ops})
    for run in runs:
        run.close()
    return {"steps": steps}


def _med(xs) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


def summarize(ranks) -> dict:
    """Per config: the medians described in the docstring, ms."""
    out = {}
    for config in CONFIGS:
        per = [r["steps"][config] for r in ranks]
        rows = {
            k: []
            for k in (
                "fwd",
                "bwd",
                "step",
                "skew",
                "after",
                "post",
                "wait",
                "add",
                "rest",
                "early wait",
                "early post",
                "early add",
                "lead in",
                "lead out",
            )
        }
        for s0, s1 in zip(*per):
            for i, k in enumerate(("fwd", "bwd", "step")):
                rows[k].append(max(s["t"][i + 1] - s["t"][i] for s in (s0, s1)))
            for a, b in zip(s0["ops"], s1["ops"]):
                late, early = (a, b) if a["enter"] >= b["enter"] else (b, a)
                rows["skew"].append(late["enter"] - early["enter"])
                rows["after"].append(max(a["leave"], b["leave"]) - late["enter"])
                rows["post"].append(late["post"])
                rows["wait"].append(late["wait"])
                rows["add"].append(late["add"])
                rows["rest"].append(
                    late["leave"] - late["enter"] - late["post"] - late["wait"] - late["add"]
                )
                rows["early wait"].append(early["wait"])
                rows["early post"].append(early["post"])
                rows["early add"].append(early["add"])
                for s, op in ((s0, a), (s1, b)):  # the phase the reduction runs in
                    t = s["t"]
                    i = 1 if op["enter"] < t[2] else 2
                    rows["lead in"].append(op["enter"] - t[i])
                    rows["lead out"].append(t[i + 1] - op["leave"])
        out[config] = {k: _med(v) for k, v in rows.items()}
        out[config]["reductions/step"] = len(per[0][0]["ops"]) if per[0] else 0
    return out


def main() -> None:
    from hybridcomm.tools.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    so.add_model_arguments(parser)
    parser.add_argument("--model", default="conv")
    parser.add_argument("--steps", type=int, default=10, help="steps per config per round")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    args.timeout = 600
    os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")
    ranks = launch(_rank, 2, args, backend="gloo", timeout=args.timeout)
    table = summarize(ranks)
    keys = list(next(iter(table.values())))
    print(
        f"# {so.describe(args.model, args)}; world 2, medians of {args.steps * args.rounds} "
        f"steps, ms"
    )
    print(f"{'config':<10}" + "".join(f"{k:>{max(12, len(k) + 2)}}" for k in keys))
    for config, row in table.items():
        print(f"{config:<10}" + "".join(f"{row[k]:>{max(12, len(k) + 2)}.3f}" for k in keys))


if __name__ == "__main__":
    main()
