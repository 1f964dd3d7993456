"""Host time per step that gradient synchronization adds: hybridcomm's three overlap modes against DDP.

The question: does hybridcomm add no more host time per step than DDP, in
every overlap mode? Each config trains the same model with the same loop
(``opt.zero_grad(); model(x).square().mean().backward(); opt.step()``), timed
with ``time.perf_counter`` around forward (with ``zero_grad``), backward and
``step()``; each figure is the median over ``--steps`` steps after ``--warmup``,
the configs interleaved in ``--rounds`` rounds so that drift on a shared machine
hits them all. One compute thread per rank (``torch.set_num_threads(1)``).

Configs (built in one place, ``CONFIGS``):

- ``plain``: the bare model and ``torch.optim.SGD(momentum=0.9)``, no
  process group traffic at all: the floor every other config is measured from.
- ``ddp``: ``DistributedDataParallel`` (gloo) with its defaults.
- ``ddp-view``: DDP at its cheapest with hybridcomm's semantics:
  ``gradient_as_bucket_view=True`` (hybridcomm's gradients are bucket views
  too), ``forward_sync_buffers=False`` (buffers synced at construction only, as
  hybridcomm does; DDP's default broadcasts them before every forward: the
  BatchNorm statistics of the conv model) and ``zero_grad(set_to_none=False)``:
  with ``set_to_none=True`` DDP's views are dropped every step and it copies
  each gradient into its bucket again (hybridcomm keeps ``zero_grad()``'s
  default: it copies the gradients autograd kept apart into each bucket in one
  multi-tensor copy, as ``ddp-batch`` does).
- ``ddp-batch``: the same with ``batched_grad_copy=True`` and ``zero_grad()``'s
  default ``set_to_none=True``: DDP's own answer to that copy (one
  ``_foreach_copy_`` per bucket instead of one copy per parameter).

  "best DDP" is whichever of the three adds the least (a minimum of noisy
  figures: it favours DDP slightly). DDP's ``static_graph=True`` and
  ``gradient_as_bucket_view`` with ``set_to_none=True`` alone were never the
  best DDP in a trial run here and are left out to keep the run short.
- ``forward`` / ``backward`` / ``none``: ``hybridcomm.DistributedOptimizer``
  with that ``overlap``. Forward mode runs with ``HYBRIDCOMM_DEFER=always``:
  its updates are deferred to the first read of each parameter in the next
  forward, as on a network where forward overlap pays (on loopback the plan
  would otherwise find nothing to overlap and not defer), so its forward
  column holds them; compare whole steps (``total``).

hybridcomm's options are ``HYBRID``: ``cost_model="probe"`` (the link is
probed, rank 0's figures agreed by every rank, as a job without a saved
calibration does; a calibration file on this machine is not read, so launches
do not depend on what an earlier run left there), probed once per launch and
that cost model given to every mode's optimizer (``shared_probe``), as a job
whose probe was kept plans from one: probing each on its own, the three modes
of one launch planned differently from the same link, a bucket ``native`` in
one mode and ``butterfly`` in the next, fused up to 1.7 or 3.0 MB) and
``measure_iters=0`` (no measured steps and no re-plans: the steady-state step
with a fixed plan, which is what DDP's steps are after its first-iteration
bucket rebuild; measured steps are 3 in every 200 by default and would fall
outside a median anyway). With the built-in constants instead
(``cost_model="default"``, which assume a fast link) the plan cuts the linear
stack into 4 buckets where this machine's gloo costs ~1 ms a call, and a world
of 2 pays for it (13.7 against 10.7 ms a step in a trial here); the probe finds
that and fuses (one bucket here, as DDP's 25 MB cap does). A world of one rank
plans one bucket per dtype whatever the model. ``HYBRIDCOMM_LOG_LEVEL=INFO``
prints each optimizer's plan (the script sets WARNING unless told).

Models (``--models``): ``linear``, a stack of ``--layers`` Linear(``--width``)
layers (100 x 64: 200 parameters); ``conv``, ResNet-18's layout (stem, four
stages of two basic blocks, 1x1 downsample convs, Conv2d+BatchNorm2d+ReLU, a
Linear head: 62 parameters, like ResNet-18's) at ``--channels`` base channels
on ``--image`` x ``--image`` inputs, small enough that compute does not drown
the per-parameter and per-bucket host cost.

Worlds (``--worlds``): 1, in this process (gloo, FileStore, one rank; DDP and
hybridcomm still run their whole paths); 2, two processes started by
``hybridcomm.tools.launch.launch`` (FileStore rendezvous, gloo on loopback),
each timing every config; a figure is the larger of the two ranks' medians.
At world 2 communication is real: ``plain`` is still the local step with no
communication, so the added time includes the all-reduce wait for DDP and
hybridcomm alike (``step`` is the time until ``step()`` returns; forward mode
waits in the next forward instead).

Reported per config: forward, backward, step and total ms (total: the median of
the per-step sums); ``added``, the time added over ``plain``: in each round the
config's median total less plain's median total of the same round, the median
over rounds (paired, so a change of machine load between rounds cancels; it is
close to, not exactly, total less plain's total); that per parameter per step
(us), and the ratio of the config's added time to the best DDP's; then one
verdict line per model and world. ``--launches N`` repeats the whole
measurement in N fresh processes and reports the median over launches of each
figure (per-parameter figures and ratios from the median added times).

    python benchmarks/sync_overhead.py                  # 3 launches, both models and worlds, ~3 min
    python benchmarks/sync_overhead.py --quick          # one launch, fewer steps, ~30 s
    python benchmarks/sync_overhead.py --models linear --worlds 1 --launches 1 --json out.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# hybridcomm's options for every mode, in one place (see the docstring for why).
HYBRID = dict(cost_model="probe", measure_iters=0)
_DDP_ARGS = inspect.signature(nn.parallel.DistributedDataParallel).parameters
DDP_VIEW = dict(gradient_as_bucket_view=True, forward_sync_buffers=False)
if "forward_sync_buffers" not in _DDP_ARGS:  # torch < 2.13's name for it
    DDP_VIEW = dict(gradient_as_bucket_view=True, broadcast_buffers=False)
KEEP_VIEWS = dict(set_to_none=False)  # zero_grad() options that keep DDP's bucket views bound
# config -> (kind, constructor options, zero_grad options)
CONFIGS = {
    "plain": ("plain", {}, {}),
    "ddp": ("ddp", {}, {}),
    "ddp-view": ("ddp", DDP_VIEW, KEEP_VIEWS),
    "ddp-batch": ("ddp", dict(DDP_VIEW, batched_grad_copy=True), {}),
    "forward": ("hybrid", dict(HYBRID, overlap="forward"), {}),
    "backward": ("hybrid", dict(HYBRID, overlap="backward"), {}),
    "none": ("hybrid", dict(HYBRID, overlap="none"), {}),
}
if "batched_grad_copy" not in _DDP_ARGS:  # torch < 2.13
    del CONFIGS["ddp-batch"]
DDPS = [c for c, (kind, *_) in CONFIGS.items() if kind == "ddp"]
MODES = [c for c, (kind, *_) in CONFIGS.items() if kind == "hybrid"]
PHASES = ("forward", "backward", "step", "total")
FIGURES = PHASES + ("added",)  # what a launch reports per config


# ---------------------------------------------------------------- models


class _Block(nn.Module):
    """ResNet's basic block: two 3x3 conv+BN, a 1x1 conv+BN shortcut where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.short(x))


def _conv_net(c: int) -> nn.Module:
    """ResNet-18's layout at base width ``c`` (62 parameters), CIFAR-style stem."""
    layers = [nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
    cin = c
    for i, cout in enumerate((c, 2 * c, 4 * c, 8 * c)):
        layers += [_Block(cin, cout, 1 if i == 0 else 2), _Block(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))


def build_model(name: str, args):
    """``(model, input)`` for ``--models`` entry ``name``, the same on every rank and config."""
    torch.manual_seed(0)
    if name == "linear":
        model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
        return model, torch.randn(args.batch, args.width)
    if name == "conv":
        return _conv_net(args.channels), torch.randn(args.conv_batch, 3, args.image, args.image)
    raise ValueError(f"unknown model {name!r}: linear or conv")


def describe(name: str, args) -> str:
    model, x = build_model(name, args)
    n, numel = len(list(model.parameters())), sum(p.numel() for p in model.parameters())
    what = (
        f"{args.layers} x Linear({args.width}, {args.width}), batch {args.batch}"
        if name == "linear"
        else f"ResNet-18 layout, {args.channels} base channels, batch {args.conv_batch} x 3 x "
        f"{args.image} x {args.image}"
    )
    return f"{what}: {n} parameters, {numel * 4 / 1e6:.2f} MB of gradients"


# ---------------------------------------------------------------- the timing loop


class _Run:
    """One config's model and optimizer, stepped ``n`` steps at a time."""

    def __init__(self, config: str, model_name: str, args, cost_model=None):
        import hybridcomm

        kind, options, self.zero = CONFIGS[config]
        if kind == "hybrid" and cost_model is not None:  # (shared_probe's)
            options = dict(options, cost_model=cost_model)
        self.config, self.kind = config, kind
        model, self.x = build_model(model_name, args)
        self.model = (
            nn.parallel.DistributedDataParallel(model, **options) if kind == "ddp" else model
        )
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        if kind == "hybrid":
            self.opt = hybridcomm.DistributedOptimizer(self.opt, model=model, **options)
        self.rounds = []  # per timed round: {phase: [seconds per step]}

    def step(self) -> tuple:
        """One step; ``time.perf_counter()`` at its start, after forward (with
        ``zero_grad``), after backward and after ``step()``."""
        t0 = time.perf_counter()
        self.opt.zero_grad(**self.zero)
        loss = self.model(self.x).square().mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        return t0, t1, t2, time.perf_counter()

    def steps(self, n: int, keep: bool) -> None:
        times = {phase: [] for phase in PHASES}
        for _ in range(n):
            t0, t1, t2, t3 = self.step()
            for phase, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                times[phase].append(dt)
        if keep:
            self.rounds.append(times)

    def close(self) -> None:
        if self.kind == "hybrid":
            self.opt.close()

    def medians(self, plain: "_Run") -> dict:
        """ms: each phase's median over every timed step; ``added``: in each round,
        this config's median total less plain's (the rounds alternate configs, so
        a change in machine load hits both sides of a difference alike), the
        median over rounds."""
        out = {p: statistics.median(t for r in self.rounds for t in r[p]) * 1e3 for p in PHASES}
        out["added"] = (
            statistics.median(
                statistics.median(mine["total"]) - statistics.median(base["total"])
                for mine, base in zip(self.rounds, plain.rounds)
            )
            * 1e3
        )
        return out


def shared_probe(args):
    """The link probed once (a collective: every rank calls it), for every mode's
    optimizer in this launch."""
    from hybridcomm.comm import calibration

    return calibration.resolve(HYBRID["cost_model"], timeout=args.timeout)


def measure(args) -> dict:
    """``{model: {config: {phase or "added": ms}}}`` on this rank (the process group is up)."""
    torch.set_num_threads(1)
    out = {}
    cost_model = shared_probe(args)
    for model_name in args.models:
        runs = [_Run(c, model_name, args, cost_model) for c in CONFIGS]
        for run in runs:
            run.steps(args.warmup, keep=False)
        for _ in range(args.rounds):  # interleaved: drift on a shared machine hits all
            for run in runs:
                run.steps(max(1, args.steps // args.rounds), keep=True)
        for run in runs:
            run.close()
        plain = runs[list(CONFIGS).index("plain")]
        out[model_name] = {run.config: run.medians(plain) for run in runs}
    return out


def _rank(rank: int, world: int, args) -> dict:  # launch()'s function: module level
    return measure(args)


def one_launch(args) -> dict:
    """``{world: {model: {config: {figure: ms}}}}``; at world 2 the larger rank's figure."""
    from hybridcomm.tools.launch import launch

    out = {}
    for world in args.worlds:
        if world == 1:
            with tempfile.TemporaryDirectory() as tmp:
                dist.init_process_group(
                    "gloo",
                    store=dist.FileStore(os.path.join(tmp, "store"), 1),
                    rank=0,
                    world_size=1,
                )
                try:
                    out[world] = measure(args)
                finally:
                    dist.destroy_process_group()
        else:
            ranks = launch(_rank, world, args, backend="gloo", timeout=args.timeout)
            out[world] = {
                m: {c: {k: max(r[m][c][k] for r in ranks) for k in FIGURES} for c in CONFIGS}
                for m in args.models
            }
    return out


# ---------------------------------------------------------------- launches and figures


def run_launches(args) -> list:
    """Each launch's figures; with ``--launches 1`` in this process, else each in a fresh one."""
    if args.launches == 1:
        return [one_launch(args)]
    out = []
    for i in range(args.launches):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "launch.json")
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                *_settings_argv(args),
                "--_one-launch",
                path,
            ]
            subprocess.run(cmd, check=True)
            with open(path) as f:
                out.append({int(w): v for w, v in json.load(f).items()})
        print(f"# launch {i + 1}/{args.launches} done", file=sys.stderr, flush=True)
    return out


def _settings_argv(args) -> list:
    keys = (
        "layers",
        "width",
        "batch",
        "channels",
        "image",
        "conv_batch",
        "steps",
        "warmup",
        "rounds",
        "timeout",
    )
    argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    return argv + [
        f"--models={','.join(args.models)}",
        f"--worlds={','.join(map(str, args.worlds))}",
    ]


def figures(launches: list, nparams: dict) -> list:
    """One result per (model, world): each config's figures, the median over launches
    (``added`` as ``added_ms``), the added time per parameter, its ratio to the
    best DDP's, and the verdict."""
    results = []
    for world in launches[0]:
        for model in launches[0][world]:
            rows = {
                c: {k: statistics.median(l[world][model][c][k] for l in launches) for k in FIGURES}
                for c in CONFIGS
            }
            n = nparams[model]
            for r in rows.values():
                r["added_ms"] = r.pop("added")
                r["added_us_per_param"] = r["added_ms"] * 1e3 / n
            best = min(DDPS, key=lambda c: rows[c]["added_ms"])
            ddp_added = rows[best]["added_ms"]
            for c, r in rows.items():
                r["x_ddp"] = r["added_ms"] / ddp_added if c != "plain" and ddp_added > 0 else None
            ok = all(rows[m]["added_ms"] <= ddp_added for m in MODES)
            results.append(
                {
                    "model": model,
                    "world": world,
                    "parameters": n,
                    "configs": rows,
                    "best_ddp": best,
                    "hybridcomm_le_ddp": ok,
                }
            )
    return results


def verdict(res: dict) -> str:
    ratios = ", ".join(f"{m} {_ratio(res['configs'][m]['x_ddp'])}" for m in MODES)
    return (
        f"hybridcomm added <= DDP in every mode: {'yes' if res['hybridcomm_le_ddp'] else 'no'} "
        f"({ratios} x DDP)"
    )


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def print_table(res: dict, header: str) -> None:
    print(f"\n## {res['model']}, world {res['world']}: {header}")
    print(
        f"{'config':<10} {'forward':>8} {'backward':>9} {'step':>8} {'total':>8} {'added':>8} "
        f"{'us/param':>9} {'x DDP':>6}"
    )
    for c, r in res["configs"].items():
        mark = " (best DDP)" if c == res["best_ddp"] else ""
        print(
            f"{c:<10} {r['forward']:>8.2f} {r['backward']:>9.2f} {r['step']:>8.2f} "
            f"{r['total']:>8.2f} {r['added_ms']:>+8.2f} {r['added_us_per_param']:>+9.2f} "
            f"{'' if c == 'plain' else _ratio(r['x_ddp']):>6}{mark}"
        )
    print(verdict(res))


def _git_state() -> dict:
    try:
        run = lambda *a: subprocess.run(
            ["git", "-C", ROOT, *a], capture_output=True, text=True, check=True
        ).stdout.strip()
        return {
            "commit": run("rev-parse", "HEAD"),
            "dirty": run("status", "--porcelain", "--", "hybridcomm"),
        }
    except Exception as exc:  # not a checkout
        return {"error": str(exc)}


def add_model_arguments(parser) -> None:
    """The two models' sizes (``build_model`` reads them; host_instructions.py shares them)."""
    parser.add_argument("--layers", type=int, default=100, help="linear: Linear layers")
    parser.add_argument("--width", type=int, default=64, help="linear: features")
    parser.add_argument("--batch", type=int, default=32, help="linear: batch")
    parser.add_argument("--channels", type=int, default=8, help="conv: base channels")
    parser.add_argument("--image", type=int, default=16, help="conv: image side")
    parser.add_argument("--conv-batch", type=int, default=8, help="conv: batch")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="linear,conv", help="linear, conv or both")
    parser.add_argument("--worlds", default="1,2", help="world sizes: 1 (in process), 2 (launch())")
    add_model_arguments(parser)
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per config (default 100)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 10)")
    parser.add_argument(
        "--launches",
        type=int,
        default=None,
        help="fresh processes; the median of each figure over them (default 3)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="30 steps, 3 rounds, one launch: ~30 s"
    )
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds a world-2 launch may take"
    )
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--_one-launch", dest="one_launch", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = (
        dict(steps=30, warmup=5, rounds=3, launches=1)
        if args.quick
        else dict(steps=100, warmup=10, rounds=10, launches=3)
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.models = [m for m in args.models.split(",") if m]
    args.worlds = [int(w) for w in args.worlds.split(",") if w]
    for m in args.models:
        build_model(m, args)  # fail early on a bad name
    os.environ["HYBRIDCOMM_DEFER"] = "always"  # before launch(): its ranks inherit it
    os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")  # no plan printed per optimizer

    if args.one_launch:  # a child of run_launches
        with open(args.one_launch, "w") as f:
            json.dump(one_launch(args), f)
        return 0

    t0 = time.perf_counter()
    launches = run_launches(args)
    nparams = {m: len(list(build_model(m, args)[0].parameters())) for m in args.models}
    results = figures(launches, nparams)
    header = (
        f"median of {args.steps} steps in {args.rounds} rounds, median of {args.launches} "
        f"launch(es); ms per step; added: over plain, paired by round; forward mode with "
        f"HYBRIDCOMM_DEFER=always (its updates wait in the next forward); hybridcomm {HYBRID}"
    )
    print(f"# {header}")
    for m in args.models:
        print(f"# {m}: {describe(m, args)}")
    print(
        f"# load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(
        "# world 2: gloo on loopback, the larger rank's medians; plain has no communication, "
        "so added includes the all-reduce wait"
    )
    for res in results:
        print_table(res, describe(res["model"], args).split(":")[0])
    print("\n# verdicts")
    for res in results:
        print(f"{res['model']}, world {res['world']}: {verdict(res)}")
    wall = time.perf_counter() - t0
    print(f"# {wall:.0f} s")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "one_launch")}
        doc = {
            "settings": settings,
            "hybridcomm_options": HYBRID,
            "ddp_view_options": DDP_VIEW,
            "torch": torch.__version__,
            "git": _git_state(),
            "seconds": wall,
            "loadavg": os.getloadavg(),
            "cpus": os.cpu_count(),
            "results": results,
            "launches": launches,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
