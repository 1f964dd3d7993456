"""Training benchmark: the thesis experiment (hybrid all-reduce with layer overlapping).

A VGG-like CNN (few conv parameters, large fully-connected layers; see
``models.py``) trains on synthetic data (fixed seed, each rank its own shard)
on N local ranks over gloo, one launch for the whole run, so every
configuration is measured side by side on the same processes:

    compute          forward, backward, optimizer.step() with no communication at all
                     (same processes, same contention: the floor every config is held to)
    stock            forward, backward, torch.distributed.all_reduce of every gradient
                     (sum, then divide by the world size), optimizer.step()
    ddp              torch.nn.parallel.DistributedDataParallel
    ring             hybridcomm.DistributedOptimizer(strategy="ring", overlap="backward")
    butterfly        hybridcomm.DistributedOptimizer(strategy="butterfly", overlap="backward")
    hybrid-backward  hybridcomm.DistributedOptimizer(strategy="hybrid", overlap="backward")
    hybrid-forward   hybridcomm.DistributedOptimizer(strategy="hybrid", overlap="forward")

Every config starts from a fresh model with the same seed and runs the same
number of steps on the same data. Each step is timed on every rank in a loop
with no barrier inside (a barrier would hide overlap); the step time is the
per-rank median averaged across ranks. exposed comm = step - compute. After
the timed steps every config's parameters are checksummed on every rank and
compared (column ``same``); a mismatch fails the run. ``max|d|`` is the
largest parameter difference from ``stock`` after the same steps (float
reduction order differs between algorithms, so small, not zero).

    python benchmarks/train.py                       # 4 ranks, batch 8,16,32,64, all configs
    python benchmarks/train.py --quick               # ~1 minute
    python benchmarks/train.py --configs stock,ddp --batch-sizes 8 --json out.json --plot out.png
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # models.py, also when spawned
import hybridcomm  # noqa: E402
from hybridcomm.launch import launch  # noqa: E402
from models import IMAGE_SHAPE, NUM_CLASSES, param_counts, vgg_small  # noqa: E402

# config -> (strategy, overlap) for hybridcomm.DistributedOptimizer; None: plain torch.
CONFIGS = {
    "stock": None,
    "ddp": None,
    "ring": ("ring", "backward"),
    "butterfly": ("butterfly", "backward"),
    "hybrid-backward": ("hybrid", "backward"),
    "hybrid-forward": ("hybrid", "forward"),
}
LR, MOMENTUM, SEED, DATA_BATCHES = 0.01, 0.9, 1234, 4
# Warm-up covers DistributedOptimizer's re-plan (after measure_iters=3 steps by default).
QUICK = {"batch_sizes": [8, 32], "iters": 6, "warmup": 4, "rounds": 2}
FULL = {"batch_sizes": [8, 16, 32, 64], "iters": 20, "warmup": 5, "rounds": 4}


def shaped_network(nprocs: int, shape: str):
    """One network namespace per rank, each link shaped by ``tbf <shape>`` (hybridcomm.netns).

    Returns a context manager whose ``setup`` goes to launch(setup=...).
    """
    from hybridcomm.netns import NetnsError, ShapedNetwork

    @contextlib.contextmanager
    def opened():
        try:
            net = ShapedNetwork(nprocs, shape).open()
        except NetnsError as e:  # not root, no iproute2, a bad spec
            raise SystemExit(f"error: {e}") from None
        try:
            yield net
        finally:
            net.close()

    return opened()


# ---------------------------------------------------------------- per rank

def _shard(rank: int, batch_size: int):
    """This rank's synthetic batches: fixed seed, a different shard on every rank."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + rank * 1009 + batch_size)
    return [(torch.randn(batch_size, *IMAGE_SHAPE, generator=g),
             torch.randint(0, NUM_CLASSES, (batch_size,), generator=g))
            for _ in range(DATA_BATCHES)]


class _Trainer:
    """One config's model, optimizer and step; ``step`` is what gets timed."""

    def __init__(self, config: str, world: int):
        self.config, self.world = config, world
        self.model = vgg_small(SEED)
        self.params = list(self.model.parameters())
        base = torch.optim.SGD(self.params, lr=LR, momentum=MOMENTUM)
        self.net, self.opt = self.model, base
        if config == "ddp":
            self.net = torch.nn.parallel.DistributedDataParallel(self.model)
        elif CONFIGS.get(config) is not None:
            strategy, overlap = CONFIGS[config]
            self.opt = hybridcomm.DistributedOptimizer(base, model=self.model, strategy=strategy,
                                                       overlap=overlap, op="avg")

    def step(self, x, y):
        self.opt.zero_grad()
        F.cross_entropy(self.net(x), y).backward()
        if self.config == "stock":  # the plain PyTorch pattern, one all_reduce per gradient
            for p in self.params:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(self.world)
        self.opt.step()

    def plan(self):
        """hybridcomm's plan table as it stands now, or None."""
        plan = getattr(self.opt, "plan", None) if CONFIGS.get(self.config) else None
        return None if plan is None else str(plan)

    def library_stats(self):
        """(exposed_comm_s, comm_busy_s) from hybridcomm's last step, None where absent."""
        stats = getattr(self.opt, "last_step_stats", None) or {}
        return stats.get("exposed_comm_s"), stats.get("comm_busy_s")

    def finish(self):
        """Complete all communication and pending updates (outside the timed steps)."""
        if hasattr(self.opt, "synchronize"):
            self.opt.synchronize()

    def close(self):
        if hasattr(self.opt, "close"):
            self.opt.close()


def _flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _checksum(flat: torch.Tensor) -> torch.Tensor:
    """A bitwise checksum: position-weighted sum of the fp32 bit patterns (wraps in int64)."""
    bits = flat.contiguous().view(torch.int32).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64) % 1_000_003 + 1
    return (bits * weights).sum().reshape(1)


def _median_or_none(xs):
    """Median, or None unless every step reported a value (stats may be absent early on)."""
    return statistics.median(xs) if xs and None not in xs else None


def _run_steps(trainer, data, first, untimed, timed, record):
    """``untimed + timed`` steps; each timed one goes to ``record(seconds, stats)``."""
    for i in range(untimed + timed):
        x, y = data[(first + i) % len(data)]
        t0 = time.perf_counter()
        trainer.step(x, y)
        dt = time.perf_counter() - t0
        if i >= untimed:
            record(dt, trainer.library_stats())
    return first + untimed + timed


def _same_across_ranks(flat, world) -> bool:
    mine = _checksum(flat)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _run_batch_size(rank, world, batch_size, configs, warmup, iters, rounds):
    """Every config on this batch size, interleaved in ``rounds`` so slow drift in the
    machine's load (shared cores) hits all configs alike. Each config runs the same
    number of steps on the same data from the same initial model."""
    data = _shard(rank, batch_size)
    names = ["compute"] + configs
    trainers, rows = {}, []
    per_round = [iters // rounds + (r < iters % rounds) for r in range(rounds)]
    try:
        for c in names:
            trainers[c] = _Trainer(c, world)
        samples = {c: [] for c in names}
        steps_done = dict.fromkeys(names, 0)
        for r, timed in enumerate(per_round):
            for c in names:
                dist.barrier()  # start together; no barrier inside the timed steps
                # Round 0 warms up; later rounds drop one step to refill the pipeline.
                steps_done[c] = _run_steps(trainers[c], data, steps_done[c],
                                           warmup if r == 0 else 1, timed,
                                           lambda dt, st, c=c: samples[c].append((dt, *st)))
                trainers[c].finish()  # its communication done before the next config runs
        stock_flat = None
        for c in names:
            flat = _flat_params(trainers[c].model)
            if c == "stock":
                stock_flat = flat
            times, lib_exposed, lib_busy = zip(*samples[c])
            rows.append({
                "config": c, "batch_size": batch_size, "step_s": statistics.median(times),
                "lib_exposed_s": _median_or_none(lib_exposed), "lib_busy_s": _median_or_none(lib_busy),
                # compute has no communication: its replicas differ by design
                "same": None if c == "compute" else _same_across_ranks(flat, world),
                "max_abs_diff_vs_stock": (None if stock_flat is None or c == "compute"
                                          else float((flat - stock_flat).abs().max())),
                "plan": trainers[c].plan() if rank == 0 else None,
            })
    finally:
        for t in trainers.values():
            t.close()
    return rows


def _rank(rank, world, batch_sizes, configs, warmup, iters, rounds):
    rows = []
    for bs in batch_sizes:
        rows += _run_batch_size(rank, world, bs, configs, warmup, iters, rounds)
    return rows


# ---------------------------------------------------------------- driver

def _mean(xs):
    return statistics.mean(xs) if xs else None


def aggregate(per_rank, configs, batch_sizes):
    """Per (config, batch size): step time averaged over ranks of per-rank medians, etc."""
    out = {}
    for i, row in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        assert all(r["config"] == row["config"] and r["batch_size"] == row["batch_size"] for r in ranks)
        lib = [r["lib_exposed_s"] for r in ranks]
        busy = [r["lib_busy_s"] for r in ranks]
        diffs = [r["max_abs_diff_vs_stock"] for r in ranks if r["max_abs_diff_vs_stock"] is not None]
        out[(row["config"], row["batch_size"])] = {
            "step_ms": _mean([r["step_s"] * 1e3 for r in ranks]),
            "step_ms_per_rank": [round(r["step_s"] * 1e3, 3) for r in ranks],
            "lib_exposed_comm_ms": _mean([v * 1e3 for v in lib]) if None not in lib else None,
            "lib_comm_busy_ms": _mean([v * 1e3 for v in busy]) if None not in busy else None,
            "same": None if row["same"] is None else all(r["same"] for r in ranks),
            "max_abs_diff_vs_stock": max(diffs) if diffs else None,
        }
    results = []
    for bs in batch_sizes:
        compute = out[("compute", bs)]["step_ms"]
        stock = out.get(("stock", bs), {}).get("step_ms")
        ddp = out.get(("ddp", bs), {}).get("step_ms")
        for config in ["compute"] + configs:
            r = out[(config, bs)]
            step = r["step_ms"]
            results.append({
                "config": config, "batch_size": bs, "step_ms": step, "compute_ms": compute,
                "exposed_comm_ms": step - compute,
                "speedup_vs_stock": stock / step if stock else None,
                "speedup_vs_ddp": ddp / step if ddp else None,
                "lib_exposed_comm_ms": r["lib_exposed_comm_ms"],
                "lib_comm_busy_ms": r["lib_comm_busy_ms"], "same": r["same"],
                "max_abs_diff_vs_stock": r["max_abs_diff_vs_stock"],
                "step_ms_per_rank": r["step_ms_per_rank"],
            })
    return results


def _fmt(v, spec, width):
    return f"{'-':>{width}}" if v is None else f"{v:>{width}{spec}}"


def print_table(results, header):
    print(header)
    print(f"{'batch':>5} {'config':>16} {'step(ms)':>9} {'compute':>8} {'exposed':>8} "
          f"{'lib_exp':>8} {'vs stock':>8} {'vs ddp':>7} {'same':>5} {'max|d|':>8}")
    for r in results:
        same = "-" if r["same"] is None else ("yes" if r["same"] else "NO")
        print(f"{r['batch_size']:>5} {r['config']:>16} {r['step_ms']:>9.1f} {r['compute_ms']:>8.1f} "
              f"{r['exposed_comm_ms']:>8.1f} {_fmt(r['lib_exposed_comm_ms'], '.1f', 8)} "
              f"{_fmt(r['speedup_vs_stock'], '.2f', 7)}{'x' if r['speedup_vs_stock'] else ' '} "
              f"{_fmt(r['speedup_vs_ddp'], '.2f', 6)}{'x' if r['speedup_vs_ddp'] else ' '} "
              f"{same:>5} {_fmt(r['max_abs_diff_vs_stock'], '.1e', 8)}")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch_sizes = sorted({r["batch_size"] for r in results})
    configs = [c for c in dict.fromkeys(r["config"] for r in results) if c != "compute"]
    by = {(r["config"], r["batch_size"]): r for r in results}
    width = 0.8 / max(len(configs), 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 + 0.45 * len(batch_sizes) * len(configs)), 4.5))
    for j, config in enumerate(configs):
        xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(batch_sizes))]
        steps = [by[(config, bs)]["step_ms"] for bs in batch_sizes]
        computes = [by[(config, bs)]["compute_ms"] for bs in batch_sizes]
        bars = ax.bar(xs, steps, width, label=config)
        ax.bar(xs, computes, width, color="none", edgecolor="black", hatch="///", linewidth=0,
               label="compute (no comm)" if j == 0 else None)
        for b, bs in zip(bars, batch_sizes):
            s = by[(config, bs)]["speedup_vs_stock"]
            if s and config != "stock":
                ax.annotate(f"{s:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(batch_sizes)), [str(bs) for bs in batch_sizes])
    ax.set_xlabel("batch size per rank")
    ax.set_ylabel("step time (ms), median")
    ax.set_title("training step time per config (hatched: compute with no communication;\n"
                 "labels: speed-up vs stock)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.margins(y=0.08)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def machine_info():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"hostname": platform.node(), "platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "hybridcomm": hybridcomm.__version__,
            "cuda": torch.cuda.is_available(), "backend": "gloo"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--batch-sizes", default=None, help="per rank, comma-separated (default 8,16,32,64)")
    ap.add_argument("--configs", default="all", help=f"comma-separated from {','.join(CONFIGS)} or all")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per config (default 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; "
                    "keep it above DistributedOptimizer's measure_iters=3, when it re-plans)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleave the configs in this many rounds of iters/rounds timed "
                         "steps each, so drift in machine load hits all alike (default 4)")
    ap.add_argument("--shape", default=None, help='e.g. "rate 1gbit": each rank in its own network '
                                                  "namespace, egress shaped with tbf")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--plot", default=None, metavar="PATH.png")
    ap.add_argument("--quick", action="store_true",
                    help=f"batch sizes {QUICK['batch_sizes']}, {QUICK['iters']} iters, "
                         f"{QUICK['warmup']} warm-up (for make demo)")
    ap.add_argument("--show-plan", action="store_true", help="print hybridcomm's plan per config")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the whole launch")
    args = ap.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    args.batch_sizes = ([int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes
                        else defaults["batch_sizes"])
    args.iters = defaults["iters"] if args.iters is None else args.iters
    args.warmup = defaults["warmup"] if args.warmup is None else args.warmup
    args.rounds = min(defaults["rounds"] if args.rounds is None else args.rounds, args.iters)
    if min(args.iters, args.rounds, args.nprocs, *args.batch_sizes) < 1 or args.warmup < 0:
        ap.error("--iters, --rounds, --nprocs and batch sizes must be >= 1, --warmup >= 0")
    names = (list(CONFIGS) if args.configs == "all"
             else [c.strip() for c in args.configs.split(",") if c.strip()])
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        ap.error(f"unknown config(s) {bad}; choose from {list(CONFIGS)}")
    args.configs = names
    return args


def main(argv=None):
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv)
    model = param_counts(vgg_small(SEED))
    network = contextlib.nullcontext() if not args.shape else shaped_network(args.nprocs, args.shape)
    t0 = time.perf_counter()
    with network as net:
        per_rank = launch(_rank, args.nprocs, args.batch_sizes, args.configs, args.warmup,
                          args.iters, args.rounds, backend="gloo", setup=net and net.setup, timeout=args.timeout)
        network = f"tbf {net.spec} on each rank's link (a namespace per rank)" if net else "loopback"
    wall = time.perf_counter() - t0
    results = aggregate(per_rank, args.configs, args.batch_sizes)
    # hybridcomm's plan after its re-plan from measured windows, per config and batch size
    plans = {f"{r['config']} batch {r['batch_size']}": r["plan"] for r in per_rank[0] if r["plan"]}
    header = (f"training step, {model['name']} ({model['params'] / 1e6:.2f}M params, "
              f"{model['fc_params'] / model['params']:.1%} in FC layers), {args.nprocs} ranks on CPU "
              f"(gloo), network: {network}; median of {args.iters} steps (configs interleaved "
              f"in {args.rounds} rounds, {args.warmup} warm-up) per rank, averaged across ranks; "
              f"exposed = step - compute; lib_exp = the library's own exposed_comm_s")
    if args.show_plan:
        for config, plan in plans.items():
            print(f"plan for {config}:\n{plan}\n")
    print_table(results, header)
    load = os.getloadavg()[0]
    print(f"({wall:.0f} s wall; load average {load:.1f} on {os.cpu_count()} cores"
          + (": the machine was busy, expect noise)" if load > args.nprocs + 1 else ")"))
    if args.json:
        doc = {"results": results, "nprocs": args.nprocs, "shape": args.shape, "model": model,
               "machine": machine_info(), "command": command,
               "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
               "loadavg_after": os.getloadavg(),
               "plans": plans}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    if args.plot:
        plot(results, args.plot)
    broken = [f"{r['config']}@{r['batch_size']}" for r in results if r["same"] is False]
    if broken:
        raise SystemExit(f"FAILED: parameters differ across ranks for {', '.join(broken)}")


if __name__ == "__main__":
    main()
