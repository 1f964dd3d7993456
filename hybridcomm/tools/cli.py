"""``python -m hybridcomm``: the version, the settings, the plan a model would get,
and a calibration, without writing a training script.

    python -m hybridcomm --version
    python -m hybridcomm env                       # every HYBRIDCOMM_* variable, value, default
    python -m hybridcomm plan --model torchvision.models:resnet18 --world 8
    python -m hybridcomm plan --layers conv1:1728,conv2:18432,fc:4096000 --world 4
    python -m hybridcomm calibrate --nprocs 4      # = hybridcomm-bench --calibrate --nprocs 4

``plan`` plans as rank 0 does at construction (before any step is measured):
from the cost model ``--cost-model`` names, else the saved calibration
(``HYBRIDCOMM_COST_MODEL``, else the user cache dir: what ``calibrate`` writes),
else the start-up probe an earlier job of that many ranks kept there, else the
built-in defaults. ``--model MODULE:FACTORY`` builds the model by
calling ``FACTORY()`` (any importable module; ``benchmarks.models:vgg_small``
from the checkout) and groups its parameters into layers as
``DistributedOptimizer(model=...)`` does; ``--layers NAME:NUMEL,...`` lists the
layers in forward order (the order the model defines them) instead. After the
first measured steps the running optimizer re-plans with the measured overlap
windows and issue order, so its table may differ in those columns.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from typing import List, Optional

from ..config import env
from .._version import __version__


def _version_line() -> str:
    import platform

    import torch

    return (
        f"hybridcomm {__version__} (torch {torch.__version__}, python {platform.python_version()})"
    )


# --- env --------------------------------------------------------------------------------------


def env_lines(environ=None) -> List[str]:
    """Every variable of env.VARIABLES: its value here (or unset), its default and its
    help; then any HYBRIDCOMM_* variable hybridcomm does not read (a typo?)."""
    environ = os.environ if environ is None else environ
    lines = []
    for v in env.VARIABLES.values():
        raw = environ.get(v.name)
        if raw is None or not raw.strip():
            now = "unset"
        else:
            try:
                now = f"{raw!r} -> {v.parse(raw)!r}"
            except (ValueError, TypeError) as e:
                now = f"{raw!r} INVALID: {e}"
        default = "unset" if v.default is None else repr(v.default)
        lines.append(f"{v.name}  value {now}  default {default}")
        lines.append(f"    {v.help}")
    unknown = sorted(k for k in environ if k.startswith("HYBRIDCOMM_") and k not in env.VARIABLES)
    for k in unknown:
        close = difflib.get_close_matches(k, env.VARIABLES, n=1)
        lines.append(
            f"{k}  value {environ[k]!r}  UNKNOWN: hybridcomm does not read it"
            + (f" (did you mean {close[0]}?)" if close else "")
        )
    return lines


def _env(args) -> int:
    from ..sync import host_ext

    lines = env_lines()
    for line in lines:
        print(line)
    print(f"host C++ extension: {host_ext.status()}")
    return 1 if any(" INVALID: " in line for line in lines) else 0


# --- plan -------------------------------------------------------------------------------------


def parse_layers(text: str, element_size: int = 4, dtype: str = "torch.float32"):
    """``name:numel,...`` (forward order) -> planner Layers in backward order.

    >>> [(l.name, l.numel) for l in parse_layers("conv1:1728, fc:4096000")]
    [('fc', 4096000), ('conv1', 1728)]
    """
    from ..plan.planner import Layer
    from ..base.units import parse_size

    layers = []
    for i, item in enumerate(p.strip() for p in text.split(",") if p.strip()):
        name, sep, numel = item.rpartition(":")
        if not sep or not name:
            raise ValueError(f"layer {item!r}: expected NAME:NUMEL (e.g. fc:4096000)")
        n = parse_size(numel)  # parameter count; 4M style accepted
        layers.append(Layer(name.strip(), [i], n, element_size, dtype=dtype, sizes=[n]))
    if not layers:
        raise ValueError("--layers lists no layer")
    return layers[::-1]


def model_layers(spec: str):
    """The layers ``DistributedOptimizer(model=...)`` makes for ``MODULE:FACTORY()``'s
    model (its trainable parameters, one layer per module), in backward order."""
    from ..sync.registry import ParamRegistry

    module_name, sep, factory = spec.partition(":")
    if not sep or not module_name or not factory:
        raise ValueError(
            f"--model {spec!r}: expected MODULE:FACTORY, e.g. torchvision.models:resnet18"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # benchmarks.models from a checkout
    fn = importlib.import_module(module_name)
    for part in factory.split("."):
        fn = getattr(fn, part)
    model = fn()

    class _Local(ParamRegistry):  # one process: nothing to agree on
        def _check(self, *args, **kwargs) -> None:
            pass

    reg = _Local(
        [{"params": list(model.parameters())}],
        model,
        None,
        wire_dtype=None,
        group=None,
        timeout=1.0,
        device_path=False,
    )
    return reg.layers


def _saved_probe(world: int):
    """The start-up probe an earlier run of a ``world``-rank job kept (calibration.py's
    probe cache beside the calibration file's place), the newest; None if none."""
    import dataclasses
    import glob

    from ..plan import auto_model

    if not env.get("HYBRIDCOMM_PROBE_CACHE"):
        return None
    where = os.path.dirname(os.path.abspath(auto_model.default_path()))
    found = sorted(glob.glob(os.path.join(where, f"probe-w{world}-*.json")), key=os.path.getmtime)
    for path in reversed(found):
        try:
            model = auto_model.load(path)
        except ValueError:
            continue
        if model is not None and "fit" in model.meta:  # (else a job probes again: calibration)
            return dataclasses.replace(model, source=f"probe saved at {path}")
    return None


def _load_model(path: Optional[str], world: Optional[int]):
    """The model ``plan`` uses: ``path``'s ('default': the built-in constants), else the
    saved calibration, else the probe an earlier job of ``world`` ranks kept (what a
    job would use), else the built-in constants."""
    from ..plan import auto_model
    from ..plan.cost_model import DEFAULT_MODEL

    if path == "default":
        return DEFAULT_MODEL
    model = auto_model.load(path)  # ValueError: a file that does not parse
    if model is None:
        if path:
            raise ValueError(f"no cost model at {path}")
        return _saved_probe(world or 4) or DEFAULT_MODEL
    return model


def _plan(args) -> int:
    import torch

    from ..algorithms import Topology
    from ..plan.planner import make_plan

    try:
        model = _load_model(args.cost_model, args.world)
        if args.layers:
            dt = getattr(torch, args.dtype)
            layers = parse_layers(args.layers, torch.empty((), dtype=dt).element_size(), str(dt))
        else:
            layers = model_layers(args.model)
    except (ValueError, ImportError, AttributeError) as e:
        print(f"python -m hybridcomm plan: {e}", file=sys.stderr)
        return 2
    saved_world = model.meta.get("world_size")
    world = args.world or saved_world or 4
    print(
        f"# cost model: {model.source}"
        + (
            ""
            if model.source != "built-in defaults"
            else " (no saved calibration: `python -m hybridcomm calibrate` measures one)"
        )
    )
    print(
        f"# world size {world}"
        + (
            ""
            if args.world
            else (" (the calibration's)" if saved_world else " (default; --world N)")
        )
    )
    if saved_world and saved_world != world:
        print(
            f"# note: the calibration was measured on {saved_world} ranks; a job of {world} "
            "ranks probes instead of using it"
        )
    plan = make_plan(
        layers,
        world_size=world,
        model=model,
        strategy=args.strategy,
        topology=Topology(node_size=args.node_size) if args.node_size else None,
    )
    print(plan)
    return 0


# --- calibrate --------------------------------------------------------------------------------


def _calibrate(bench_args: List[str]) -> int:
    from ..tools.bench.cli import main as bench_main

    if not any(a == "--calibrate" or a.startswith("--calibrate=") for a in bench_args):
        bench_args = ["--calibrate", *bench_args]
    return bench_main(bench_args)


# --- the parser ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hybridcomm",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="python -m hybridcomm COMMAND --help says more; docs/API.md documents all of it.",
    )
    ap.add_argument("--version", action="version", version=_version_line())
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser(
        "env",
        help="every HYBRIDCOMM_* variable: its value here, its default, "
        "what it does (exit status 1 if a value is invalid)",
    )
    p = sub.add_parser(
        "plan",
        help="the bucket plan a model would get, without training",
        description=__doc__.split("\n\n")[2].replace("``", ""),
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="a model built by calling FACTORY() from MODULE, e.g. "
        "torchvision.models:resnet18 or benchmarks.models:vgg_small",
    )
    what.add_argument(
        "--layers",
        metavar="NAME:NUMEL,...",
        help="layers with their parameter counts, in forward order, e.g. "
        "conv1:1728,fc:4096000 (4M style counts accepted)",
    )
    p.add_argument(
        "--world",
        type=int,
        default=None,
        metavar="N",
        help="ranks (default: the calibration's world size, else 4)",
    )
    p.add_argument(
        "--cost-model",
        default=None,
        metavar="PATH",
        help="a saved calibration (JSON), or 'default' for the built-in constants "
        "(default: HYBRIDCOMM_COST_MODEL, else the user cache dir's, else the "
        "probe an earlier job of --world ranks saved there, else the built-in "
        "constants)",
    )
    p.add_argument(
        "--strategy",
        default="hybrid",
        help="hybrid (default), auto, or one algorithm for every bucket",
    )
    p.add_argument(
        "--node-size",
        type=int,
        default=None,
        metavar="L",
        help="ranks per node (default LOCAL_WORLD_SIZE, else one node)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float16", "bfloat16", "float64"),
        help="the dtype of --layers' gradients (default float32)",
    )
    sub.add_parser(
        "calibrate",
        help="measure this machine's network and save the cost model: "
        "hybridcomm-bench --calibrate with the flags that follow "
        "(e.g. --nprocs 4; hybridcomm-bench --help lists them)",
        add_help=False,
    )
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser()
    if argv and argv[0] == "calibrate":  # everything after it is hybridcomm-bench's
        return _calibrate(argv[1:])
    args = ap.parse_args(argv)
    if args.command == "env":
        return _env(args)
    if args.command == "plan":
        if args.world is not None and args.world < 1:
            ap.error("--world must be >= 1")
        return _plan(args)
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
