"""Instructions per step that gradient synchronization adds: sync_overhead.py's configs, counted
by callgrind instead of timed.

``sync_overhead.py`` times each config's step on the wall clock. On a shared
VM its figures move by 30% from one launch to the next (the VM's own drift),
more than most changes to the per-step path; a change of 20 us in 1.5 ms
cannot be seen there. This script runs the same configs (``CONFIGS``), the
same models and the same loop (``zero_grad``, forward, backward, ``step()``,
one compute thread) under valgrind's callgrind and reports the instructions
each step executes, in every thread of the process (the training thread,
autograd's, gloo's, hybridcomm's issuing thread), counted only over the
measured steps (``torch._C._valgrind_toggle``, the switch
``torch.utils.benchmark``'s ``collect_callgrind`` uses). The counted process
runs with a fixed ``PYTHONHASHSEED`` (``--hash-seed``): with Python's random
one, a config's count moved by 0.1-0.4M a step from one launch to the next;
with a fixed one, the same code counts the same. A change to the code still
moves the heap's and the dicts' layout, by up to ~50K a step in functions it
does not touch (glibc's malloc, dict look-ups): read a before/after by
function (``--keep``, ``callgrind_annotate``), not by its total alone.

What it is not: time. An instruction count weighs a Python attribute write
and a cache-missing copy alike, and it ignores waiting. The wall-clock
verdict stays ``sync_overhead.py``'s; this is the instrument for the host
path's own work (Python and the C++ it calls), where the wall clock is too
noisy. World 1 only: at world 2 the ranks' waiting on each other would be
counted as the spinning of whatever polls.

Reported per model and config: instructions per phase (``zero_grad``,
forward, backward, ``step()``) and per step (millions), those added over
``plain`` (millions per step and thousands per parameter per step), and the
ratio of the added count to the best DDP's (the DDP config that adds the
fewest), then one line per model: whether every hybridcomm mode adds no more
than the best DDP. Under valgrind a step takes ~10 s and the start ~4 min.

    python benchmarks/host_instructions.py                    # both models, ~15 min
    python benchmarks/host_instructions.py --models linear --configs plain,ddp-batch,backward
    python benchmarks/host_instructions.py --models linear --keep dumps/ --json counts.json

Needs valgrind (``apt-get install valgrind``); ``--no-valgrind`` runs the
configs once without it (nothing counted: checks that the script works).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sync_overhead  # noqa: E402  (the configs, models and loop measured here)
from sync_overhead import CONFIGS, DDPS, MODES, _Run, build_model, describe  # noqa: E402


PHASES = ("zero_grad", "forward", "backward", "step")  # sync_overhead.py's loop, split


def step_phases(run: _Run) -> None:
    """One step of ``run`` (sync_overhead.py's loop), its phases counted apart: collection
    goes on as each phase begins and off, with a dump, as it ends (one dump per phase)."""
    loss = None

    def forward():
        nonlocal loss
        loss = run.model(run.x).square().mean()

    for work in (
        lambda: run.opt.zero_grad(**run.zero),
        forward,
        lambda: loss.backward(),
        run.opt.step,
    ):
        torch._C._valgrind_toggle()  # collection on
        work()
        torch._C._valgrind_toggle_and_dump_stats()  # off, and one dump


def count_steps(args, order_path: str) -> None:
    """Inside callgrind (collection off at start): each (model, config) in turn is built,
    stepped ``--warmup`` steps, then ``--steps`` steps counted phase by phase; the
    dumps' ``[model, config, phase]`` in order are written to ``order_path``."""
    torch.set_num_threads(1)
    order = []
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1
        )
        try:
            for model_name in args.models:
                for config in args.configs:
                    run = _Run(config, model_name, args)
                    run.steps(args.warmup, keep=False)
                    for _ in range(args.steps):
                        step_phases(run)
                        order += [[model_name, config, phase] for phase in PHASES]
                    run.close()
        finally:
            dist.destroy_process_group()
    with open(order_path, "w") as f:
        json.dump(order, f)


def instructions(dump_path: str) -> int:
    """The ``summary:`` (Ir) of one callgrind dump."""
    with open(dump_path) as f:
        for line in f:
            if line.startswith("summary:"):
                return int(line.split()[1])
    raise ValueError(f"{dump_path}: no 'summary:' line (not a callgrind dump?)")


def dumps(out_base: str) -> list:
    """The numbered dumps ``<out_base>.1``, ``.2``, ... in order (the final one at exit,
    ``<out_base>`` itself, holds nothing collected)."""
    paths = glob.glob(glob.escape(out_base) + ".*")
    numbered = [p for p in paths if p.rsplit(".", 1)[1].isdigit()]
    return sorted(numbered, key=lambda p: int(p.rsplit(".", 1)[1]))


def run_under_callgrind(args) -> dict:
    """``{model: {config: {phase: instructions per step}}}``, from a child process under
    callgrind."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit(
            "valgrind is not installed (apt-get install valgrind), or run with "
            "--no-valgrind to check the script without counting"
        )
    with tempfile.TemporaryDirectory() as tmp:
        base, order_path = os.path.join(tmp, "callgrind.out"), os.path.join(tmp, "order.json")
        cmd = [
            valgrind,
            "--tool=callgrind",
            "--collect-atstart=no",
            f"--callgrind-out-file={base}",
            sys.executable,
            os.path.abspath(__file__),
            *settings_argv(args),
            "--_inside",
            order_path,
        ]
        # (a fixed seed: the same dict and set layouts, so the same code counts the same)
        env = dict(os.environ, PYTHONHASHSEED=str(args.hash_seed))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(
                f"the run under callgrind failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        with open(order_path) as f:
            order = json.load(f)
        found = dumps(base)
        if len(found) != len(order):
            raise SystemExit(f"{len(found)} callgrind dumps for {len(order)} configs")
        out: dict = {}
        for (model, config, phase), path in zip(order, found):
            counts = out.setdefault(model, {}).setdefault(config, dict.fromkeys(PHASES, 0.0))
            counts[phase] += instructions(path) / args.steps
            if args.keep:  # (the last step's)
                os.makedirs(args.keep, exist_ok=True)
                shutil.copy(path, os.path.join(args.keep, f"{model}-{config}-{phase}.callgrind"))
    return out


def settings_argv(args) -> list:
    keys = ("layers", "width", "batch", "channels", "image", "conv_batch", "steps", "warmup")
    argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    return argv + [f"--models={','.join(args.models)}", f"--configs={','.join(args.configs)}"]


def figures(counts: dict, nparams: dict) -> list:
    """Per model: each config's instructions per step (``phases``: each phase's), those
    added over plain (also per parameter), the ratio to the best DDP's added count, and
    the verdict."""
    results = []
    for model, per_config in counts.items():
        n = nparams[model]
        plain = sum(per_config["plain"].values())
        rows = {}
        for c, phases in per_config.items():
            total = sum(phases.values())
            rows[c] = {
                "phases": dict(phases),
                "per_step": total,
                "added": total - plain,
                "added_per_param": (total - plain) / n,
            }
        best = min((c for c in DDPS if c in rows), key=lambda c: rows[c]["added"])
        for c, r in rows.items():
            r["x_ddp"] = (
                r["added"] / rows[best]["added"]
                if c != "plain" and rows[best]["added"] > 0
                else None
            )
        ok = all(rows[m]["added"] <= rows[best]["added"] for m in MODES if m in rows)
        results.append(
            {
                "model": model,
                "parameters": n,
                "configs": rows,
                "best_ddp": best,
                "hybridcomm_le_ddp": ok,
            }
        )
    return results


def verdict(res: dict) -> str:
    ratios = ", ".join(
        f"{m} {sync_overhead._ratio(res['configs'][m]['x_ddp'])}"
        for m in MODES
        if m in res["configs"]
    )
    return (
        f"hybridcomm adds <= DDP's instructions in every mode: "
        f"{'yes' if res['hybridcomm_le_ddp'] else 'no'} ({ratios} x DDP)"
    )


def print_table(res: dict, header: str) -> None:
    print(f"\n## {res['model']}, world 1: {header}")
    print(
        f"{'config':<10} "
        + " ".join(f"{p:>9}" for p in PHASES)
        + f" {'total':>8} {'added':>8} {'K/param':>8} {'x DDP':>6}"
    )
    for c, r in res["configs"].items():
        mark = " (best DDP)" if c == res["best_ddp"] else ""
        x = "" if c == "plain" else sync_overhead._ratio(r["x_ddp"])
        print(
            f"{c:<10} "
            + " ".join(f"{r['phases'][p] / 1e6:>9.3f}" for p in PHASES)
            + f" {r['per_step'] / 1e6:>8.3f} {r['added'] / 1e6:>+8.3f} "
            f"{r['added_per_param'] / 1e3:>+8.2f} {x:>6}{mark}"
        )
    print(verdict(res))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="linear,conv", help="linear, conv or both")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="of sync_overhead.py's CONFIGS: plain and a DDP at least",
    )
    sync_overhead.add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=5, help="counted steps per config")
    parser.add_argument("--warmup", type=int, default=5, help="uncounted steps first")
    parser.add_argument(
        "--no-valgrind",
        action="store_true",
        help="run the configs once without valgrind: nothing is counted",
    )
    parser.add_argument(
        "--hash-seed",
        type=int,
        default=0,
        help="PYTHONHASHSEED of the counted process (fixed: a launch counts "
        "what the last launch of the same code counted; another seed "
        "lays dicts out another way, ~0.1M a step either way)",
    )
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument(
        "--keep",
        default=None,
        metavar="DIR",
        help="keep each config's callgrind dump here (<model>-<config>.callgrind: "
        "callgrind_annotate shows where its instructions go)",
    )
    parser.add_argument("--_inside", dest="inside", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.configs = [c for c in CONFIGS if c in args.configs.split(",")]  # (in CONFIGS' order)
    if "plain" not in args.configs or not set(DDPS) & set(args.configs):
        parser.error(f"--configs needs plain and one of {', '.join(DDPS)}")
    for m in args.models:
        build_model(m, args)  # fail early on a bad name
    os.environ["HYBRIDCOMM_DEFER"] = "always"  # as sync_overhead.py: forward mode defers
    os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")

    if args.inside:  # the child under callgrind
        count_steps(args, args.inside)
        return 0
    if args.no_valgrind:
        with tempfile.TemporaryDirectory() as tmp:
            count_steps(args, os.path.join(tmp, "order.json"))
        print("# --no-valgrind: every config ran; nothing was counted")
        return 0

    t0 = time.perf_counter()
    counts = run_under_callgrind(args)
    nparams = {m: len(list(build_model(m, args)[0].parameters())) for m in args.models}
    results = figures(counts, nparams)
    print(
        f"# millions of instructions per step (callgrind, every thread; added: over plain, "
        f"K/param: thousands per parameter), {args.steps} steps counted per "
        f"config after {args.warmup}; world 1; forward mode with HYBRIDCOMM_DEFER=always; "
        f"hybridcomm {sync_overhead.HYBRID}"
    )
    for res in results:
        print_table(res, describe(res["model"], args).split(":")[0])
    print("\n# verdicts")
    for res in results:
        print(f"{res['model']}, world 1: {verdict(res)}")
    wall = time.perf_counter() - t0
    print(f"# {wall:.0f} s")
    if args.json:
        doc = {
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "inside")},
            "hybridcomm_options": sync_overhead.HYBRID,
            "torch": torch.__version__,
            "git": sync_overhead._git_state(),
            "seconds": wall,
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
