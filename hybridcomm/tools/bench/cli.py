"""``hybridcomm-bench``: all-reduce latency and bandwidth, every algorithm beside
``torch.distributed.all_reduce``, in the spirit of nccl-tests.

    hybridcomm-bench --nprocs 4 -b 4K -e 64M -f 4 --algo ring,butterfly,auto,native
    torchrun --nproc-per-node 8 -m hybridcomm.tools.bench -b 8 -e 1G -f 2
    hybridcomm-bench --nprocs 4 --shape "rate 1gbit" -b 4K -e 16M     # root: namespaces + tbf
    hybridcomm-bench --nprocs 4 --latency 500us -b 4K -e 1M           # emulated latency
    hybridcomm-bench --nprocs 4 --calibrate                           # fit alpha, beta, gamma
    hybridcomm-bench --nprocs 4 --node-size 2 --inter-shape "rate 100mbit" \
        --algo ring,hierarchical,native                   # root: 2 nodes, slow link between
    hybridcomm-bench --nprocs 4 --servers 4 --shape "rate 100mbit" -b 16M -e 16M \
        --algo ring,native,ps                             # + 4 summation servers (ps)

Under ``torchrun`` (RANK / WORLD_SIZE / MASTER_ADDR set) every process runs
its rank; otherwise the command starts ``--nprocs`` local ranks itself (gloo
on CPU, NCCL with one GPU per rank where there are GPUs). ``--servers K``
adds K summation servers (hybridcomm/comm/servers.py; the last K processes, on links of
their own under ``--shape``) and times ``ps`` through them; under torchrun
the last K of WORLD_SIZE serve.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import List, Optional

from ...algorithms import ALGORITHMS
from ...base.units import format_bytes, format_seconds, parse_size, parse_time
from .harness import DTYPES, Config, run_rank
from . import report
from .report import BASELINE

PS = "ps"  # through the summation servers (--servers K)
ALGO_CHOICES = ALGORITHMS + ("auto", BASELINE, PS)


def sweep_sizes(minbytes: int, maxbytes: int, factor: float) -> List[int]:
    """minbytes, minbytes*f, ... up to maxbytes (inclusive)."""
    if minbytes < 1 or maxbytes < minbytes:
        raise ValueError(f"need 1 <= minbytes <= maxbytes, got {minbytes} and {maxbytes}")
    if factor <= 1 and minbytes != maxbytes:
        raise ValueError(f"stepfactor must be > 1, got {factor}")
    sizes, n = [], float(minbytes)
    while n <= maxbytes * (1 + 1e-12):
        sizes.append(int(round(n)))
        if factor <= 1:
            break
        n *= factor
    return sorted(set(sizes))


def parse_grid(text: str):
    """``(rows, cols)`` from ``2x3``.

    Example::

        >>> parse_grid("2x3")
        (2, 3)
    """
    m = re.fullmatch(r"\s*(\d+)\s*[xX,]\s*(\d+)\s*", str(text))
    if not m:
        raise ValueError(f"not a grid: {text!r} (try 2x3: rows x cols)")
    return int(m.group(1)), int(m.group(2))


def _version() -> str:
    from ..._version import __version__

    return f"hybridcomm-bench (hybridcomm {__version__})"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hybridcomm-bench",
        description=__doc__.split("\n\n")[0].replace("\n", " ").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Columns: size count type redop algo time(us) algbw(GB/s) busbw(GB/s) #wrong; "
        "docs/PERFORMANCE.md explains them. The summary warns where a point's spread "
        f"(p20..p80 of its iterations, or across ranks) exceeds "
        f"{report.NOISE_THRESHOLD * 100:.0f}% of its time, and checks auto's choice "
        "against the algorithms timed in the same run.",
    )
    ap.add_argument("--version", action="version", version=_version())
    ap.add_argument(
        "-b",
        "--minbytes",
        type=parse_size,
        default=parse_size("4K"),
        metavar="SIZE",
        help="smallest message size in bytes (4K, 1M style; default 4K)",
    )
    ap.add_argument(
        "-e",
        "--maxbytes",
        type=parse_size,
        default=parse_size("64M"),
        metavar="SIZE",
        help="largest message size in bytes (default 64M)",
    )
    ap.add_argument(
        "-f",
        "--stepfactor",
        type=float,
        default=4.0,
        metavar="F",
        help="multiply the size by F from one point to the next (default 4)",
    )
    ap.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per point")
    ap.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations per point")
    ap.add_argument(
        "-d",
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="element type of the buffers (default float32)",
    )
    ap.add_argument(
        "-o",
        "--op",
        choices=("sum", "avg"),
        default="sum",
        help="reduction: sum, or avg (the sum over the world size); default sum",
    )
    ap.add_argument(
        "-c",
        "--check",
        type=int,
        choices=(0, 1),
        default=1,
        help="check the results after timing (#wrong)",
    )
    ap.add_argument(
        "--algo",
        default="ring,butterfly,halving_doubling,auto,native",
        help=f"comma list of {','.join(ALGO_CHOICES)} (native: torch.distributed."
        "all_reduce, the baseline)",
    )
    ap.add_argument(
        "--nprocs",
        type=int,
        default=None,
        help="start this many local ranks (default: one per GPU, else 4); ignored under torchrun",
    )
    ap.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: nccl where there are GPUs, else gloo",
    )
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--plot", metavar="PATH.png", help="plot busbw and time against size")
    ap.add_argument(
        "--shape",
        metavar="SPEC",
        default=None,
        help="tbf spec, e.g. 'rate 1gbit': one network namespace per rank on a "
        "bridge, each link shaped (root only)",
    )
    ap.add_argument(
        "--node-size",
        type=int,
        default=None,
        metavar="L",
        help="ranks per node for hierarchical (and the two-level network); default "
        "LOCAL_WORLD_SIZE, else one node",
    )
    ap.add_argument(
        "--grid",
        type=parse_grid,
        default=None,
        metavar="RxC",
        help="torus2d's grid (default: the most square factorization)",
    )
    ap.add_argument(
        "--inter-shape",
        metavar="SPEC",
        default=None,
        help="with --node-size: one bridge per node, the nodes' uplinks shaped by "
        "this tbf spec (e.g. 'rate 100mbit'; root only); --shape then shapes "
        "the rank links inside the nodes (default: unshaped)",
    )
    ap.add_argument(
        "--latency",
        type=parse_time,
        default=0.0,
        metavar="T",
        help="emulate T of latency per message in hybridcomm's transport "
        "(e.g. 200us; not applied to torch)",
    )
    ap.add_argument(
        "--calibrate",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="fit the cost model's alpha, beta, gamma to this sweep and save them "
        "(default: the user's cache dir, where auto and the planner load them)",
    )
    ap.add_argument(
        "--servers",
        type=int,
        default=0,
        metavar="K",
        help="K summation servers (hybridcomm.comm.servers) beside the ranks, each its own "
        "process (and link under --shape): adds algorithm ps, and --calibrate "
        "fits its line; the ranks (--nprocs, or WORLD_SIZE - K) are the workers",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for a peer")
    return ap


def config_from(args) -> Config:
    algos = [a.strip() for a in args.algo.split(",") if a.strip()]
    bad = [a for a in algos if a not in ALGO_CHOICES]
    if bad or not algos:
        raise SystemExit(f"--algo: unknown {bad}; choose from {','.join(ALGO_CHOICES)}")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("--iters must be >= 1 and --warmup >= 0")
    try:
        sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor)
    except ValueError as e:
        raise SystemExit(f"sizes: {e}")
    if args.node_size is not None and args.node_size < 1:
        raise SystemExit("--node-size must be >= 1")
    if args.inter_shape and args.node_size is None:
        raise SystemExit("--inter-shape needs --node-size (ranks per node)")
    check_servers(args.servers, algos, args)
    if args.servers and PS not in algos:
        algos.append(PS)  # the servers are there to be timed
    return Config(
        sizes=sizes,
        algos=list(dict.fromkeys(algos)),
        iters=args.iters,
        warmup=args.warmup,
        dtype=args.dtype,
        op=args.op,
        check=bool(args.check),
        latency_s=args.latency,
        timeout_s=args.timeout,
        node_size=args.node_size,
        grid=args.grid,
        shape=" ".join(_parse_shape(args.shape)) if args.shape else None,
        servers=args.servers,
    )


def check_servers(k: int, algos: List[str], args) -> None:
    """``--servers K``'s rules, as clear errors: K >= 0, ``ps`` needs K > 0, and the
    servers go on a flat network (not with --node-size / --inter-shape).

        >>> check_servers(0, ["ps"], build_parser().parse_args([]))
        Traceback (most recent call last):
        SystemExit: --algo ps needs summation servers: --servers K with K >= 1
    """
    if k < 0:
        raise SystemExit(f"--servers must be >= 0 (summation servers), got {k}")
    if PS in algos and k == 0:
        raise SystemExit("--algo ps needs summation servers: --servers K with K >= 1")
    if k and (args.node_size is not None or args.inter_shape):
        raise SystemExit("--servers goes with a flat network: not with --node-size / --inter-shape")
    if k and args.latency:
        raise SystemExit(
            "--servers with --latency: the emulated latency wraps hybridcomm's "
            "transport only, not the servers' traffic; time them apart"
        )


def _parse_shape(spec):
    from ..netns import NetnsError, parse_shape

    try:
        return parse_shape(spec)
    except NetnsError as e:
        raise SystemExit(f"hybridcomm-bench: {e}")


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _torchrun_rank(cfg: Config, backend: str) -> Optional[dict]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=max(cfg.timeout_s, 60)))
    try:
        return run_rank(dist.get_rank(), dist.get_world_size(), cfg)
    finally:
        dist.destroy_process_group()


def _local(
    cfg: Config, nprocs: int, backend: str, shape: Optional[str], inter_shape: Optional[str] = None
) -> dict:
    from ..launch import launch

    start = "fork" if backend == "gloo" else "spawn"
    kwargs = dict(
        backend=backend,
        timeout=7 * 24 * 3600,
        pg_timeout=max(cfg.timeout_s, 60),
        start_method=start,
    )
    nprocs += cfg.servers  # the workers, then the servers
    if shape is None and inter_shape is None:
        return launch(run_rank, nprocs, cfg, **kwargs)[0]
    from ..netns import NetnsError, ShapedNetwork

    try:
        net = ShapedNetwork(
            nprocs, shape, node_size=cfg.node_size if inter_shape else None, inter_spec=inter_shape
        ).open()
    except NetnsError as e:
        raise SystemExit(f"hybridcomm-bench: --shape: {e}")
    try:
        cfg.network = net.describe()
        doc = launch(run_rank, nprocs, cfg, setup=net.setup, **kwargs)[0]
        doc["network"] = cfg.network
        return doc
    finally:
        net.close()


def calibrate(doc: dict, path: Optional[str]) -> dict:
    """Fit alpha, beta, gamma to the sweep's ring/butterfly/halving_doubling rows
    (native's and ps's lines to theirs), save them, and return the JSON
    ``calibration`` entry."""
    from ...comm import calibration
    from ...plan import cost_model
    from ...algorithms import Topology

    samples = [
        (r["algo"], r["bytes"], doc["world_size"], r["time_us"] * 1e-6)
        for r in doc["results"]
        if r["algo"] in cost_model.MODELED + cost_model.TWO_LEVEL + (BASELINE, PS)
    ]
    topology = Topology(doc["node_size"], tuple(doc["grid"]))
    model, rep = cost_model.fit(samples, topology, ps_servers=doc.get("servers") or None)
    saved = calibration.save(
        model,
        path or None,
        report=rep,
        world_size=doc["world_size"],
        backend=doc["backend"],
        device=doc["device"],
        dtype=doc["dtype"],
        shape=doc["shape"],
        inter_shape=doc["inter_shape"],
        node_size=doc["node_size"],
        latency_emulated_s=doc["latency"],
        sizes=[min(s[1] for s in samples), max(s[1] for s in samples)],
    )
    return {
        "alpha_s": model.alpha,
        "beta_s_per_byte": model.beta,
        "gamma_s_per_byte": model.gamma,
        "inter_alpha_s": model.inter_alpha,
        "inter_beta_s_per_byte": model.inter_beta,
        "ps_alpha_s": model.ps_alpha,
        "ps_beta_s_per_byte": model.ps_beta,
        "ps_servers": model.ps_servers,
        "n_points": rep.n_points,
        "rms_rel_err": rep.rms_rel_err,
        "max_rel_err": rep.max_rel_err,
        "path": saved,
        "points": [
            {"algo": a, "bytes": n, "measured_us": t * 1e6, "predicted_us": p * 1e6}
            for a, n, _, t, p in rep.residuals
        ],
    }


def calibration_lines(cal: dict, world: int) -> List[str]:
    from ...plan import cost_model

    m = cost_model.CostModel(
        cal["alpha_s"],
        cal["beta_s_per_byte"],
        cal["gamma_s_per_byte"],
        inter_alpha=cal.get("inter_alpha_s"),
        inter_beta=cal.get("inter_beta_s_per_byte"),
        ps_alpha=cal.get("ps_alpha_s"),
        ps_beta=cal.get("ps_beta_s_per_byte"),
        ps_servers=cal.get("ps_servers"),
    )
    bw = lambda x: f"{1 / x / 1e9:.3g} GB/s" if x > 0 else "inf"
    lines = [
        "#",
        f"# Calibration (least squares, relative error, over {cal['n_points']} points):",
        f"#   alpha {format_seconds(m.alpha)} per message, "
        f"beta {format_seconds(m.beta)} per byte ({bw(m.beta)}), "
        f"gamma {format_seconds(m.gamma)} per byte reduced ({bw(m.gamma)})",
        *(
            [
                f"#   between nodes: alpha {format_seconds(m.inter_alpha)} per step, beta "
                f"{format_seconds(m.inter_beta)} per byte on a node's link "
                f"({bw(m.inter_beta)})"
            ]
            if m.two_level
            else []
        ),
        *(
            [
                f"#   ps ({m.ps_servers} summation servers): {format_seconds(m.ps_alpha)} per "
                f"all-reduce + {format_seconds(m.ps_beta)} per byte ({bw(m.ps_beta)})"
            ]
            if m.ps_alpha is not None
            else []
        ),
        f"#   fit error: rms {cal['rms_rel_err'] * 100:.1f}%, max {cal['max_rel_err'] * 100:.1f}%",
        f"#   saved to {cal['path']}",
    ]
    c = m.crossover(world)
    lines.append(
        f"#   predicted butterfly/ring crossover at P={world}: "
        + (format_bytes(c) if c else "none")
    )
    return lines


def latency_check(doc: dict) -> Optional[dict]:
    """Under --latency: the butterfly's lead over ring at small sizes, measured vs
    the cost model auto used (which includes the emulated latency)."""
    from ...plan import cost_model

    if not doc["latency"]:
        return None
    am = doc["auto_model"]
    model = cost_model.CostModel(am["alpha_s"], am["beta_s_per_byte"], am["gamma_s_per_byte"])
    t = {(r["algo"], r["bytes"]): r["time_us"] * 1e-6 for r in doc["results"]}
    rows = []
    for (algo, n), tb in sorted(t.items(), key=lambda kv: kv[0][1]):
        if algo != "butterfly" or ("ring", n) not in t or n > 64 << 10:
            continue
        measured = t[("ring", n)] - tb
        predicted = model.predict("ring", n, doc["world_size"]) - model.predict(
            "butterfly", n, doc["world_size"]
        )
        rows.append(
            {
                "bytes": n,
                "measured_lead_us": measured * 1e6,
                "predicted_lead_us": predicted * 1e6,
                "rel_err": (measured - predicted) / predicted if predicted else None,
            }
        )
    return {"model": am["source"], "rows": rows} if rows else None


def two_level_check(doc: dict) -> Optional[dict]:
    """hierarchical and torus2d against ring, size by size: the measured
    speed-up (ring time / theirs) beside the one the auto model predicts for
    this run's topology (a model fitted on another run, e.g. --calibrate)."""
    from ...plan import cost_model
    from ...algorithms import Topology

    t = {(r["algo"], r["bytes"]): r["time_us"] * 1e-6 for r in doc["results"]}
    am = doc["auto_model"]
    model = cost_model.CostModel(
        am["alpha_s"],
        am["beta_s_per_byte"],
        am["gamma_s_per_byte"],
        inter_alpha=am.get("inter_alpha_s"),
        inter_beta=am.get("inter_beta_s_per_byte"),
    )
    topo = Topology(doc["node_size"], tuple(doc["grid"]))
    world, rows = doc["world_size"], []
    for (algo, n), time_s in sorted(t.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if algo not in cost_model.TWO_LEVEL or ("ring", n) not in t:
            continue
        rows.append(
            {
                "algo": algo,
                "bytes": n,
                "measured_speedup": t[("ring", n)] / time_s,
                "predicted_speedup": model.predict("ring", n, world, topo)
                / model.predict(algo, n, world, topo),
            }
        )
    return (
        {"model": am["source"], "two_level_model": model.two_level, "rows": rows} if rows else None
    )


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from(args)
    import torch

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if cfg.servers and backend != "gloo":
        raise SystemExit(
            "--servers: the summation servers move host tensors over gloo; use --backend gloo"
        )
    if _under_torchrun():
        if args.shape or args.inter_shape:
            raise SystemExit(
                "hybridcomm-bench: --shape needs --nprocs (it starts the ranks "
                "inside their namespaces); it cannot run under torchrun"
            )
        if cfg.servers >= int(os.environ["WORLD_SIZE"]):
            raise SystemExit(
                f"--servers {cfg.servers} leaves no workers among WORLD_SIZE "
                f"{os.environ['WORLD_SIZE']} processes"
            )
        doc = _torchrun_rank(cfg, backend)
        if doc is None:
            return 0
    else:
        nprocs = args.nprocs or (torch.cuda.device_count() if backend == "nccl" else 4)
        if nprocs < 1:
            raise SystemExit("--nprocs must be >= 1")
        from ..netns import NetnsError, parse_shape

        for spec in (args.shape, args.inter_shape):
            try:
                if spec:
                    parse_shape(spec)
            except NetnsError as e:
                raise SystemExit(f"hybridcomm-bench: {e}")
        doc = _local(cfg, nprocs, backend, args.shape, inter_shape=args.inter_shape)
    world = doc["world_size"]
    from ..netns import parse_shape as parse

    doc = {
        "world_size": world,
        "servers": cfg.servers,
        "backend": doc["backend"],
        "device": doc["device"],
        "dtype": cfg.dtype,
        "op": cfg.op,
        "shape": " ".join(parse(args.shape)) if args.shape else None,
        "inter_shape": " ".join(parse(args.inter_shape)) if args.inter_shape else None,
        "network": doc.get("network"),
        "node_size": doc["node_size"],
        "grid": doc["grid"],
        "latency": cfg.latency_s,
        "iters": cfg.iters,
        "warmup": cfg.warmup,
        "check": cfg.check,
        "auto_model": doc["auto_model"],
        "results": report.result_rows(doc["results"], world, cfg.latency_s),
        "calibration": None,
        "latency_check": None,
        "two_level_check": None,
        "env": report.machine_info(),
    }
    doc["noise_threshold"] = report.NOISE_THRESHOLD
    doc["noisy_sizes"] = sorted({r["bytes"] for r in report.noisy(doc["results"])})
    doc["auto_check"] = report.auto_check(doc["results"])
    out = sys.stdout
    if not cfg.live:  # else rank 0 printed them as the sweep went
        for line in report.header(doc):
            print(line, file=out)
        for r in doc["results"]:
            print(report.row_line(r, doc), file=out)
    for line in report.summary(doc):
        print(line, file=out)
    if args.calibrate is not None:
        doc["calibration"] = calibrate(doc, args.calibrate)
        for line in calibration_lines(doc["calibration"], world):
            print(line, file=out)
    doc["latency_check"] = latency_check(doc)
    if doc["latency_check"]:
        print(
            f"#\n# Butterfly lead over ring under the emulated latency "
            f"(model: {doc['latency_check']['model']}):",
            file=out,
        )
        for r in doc["latency_check"]["rows"]:
            err = "" if r["rel_err"] is None else f"{r['rel_err'] * 100:+.0f}%"
            print(
                f"#   {format_bytes(r['bytes']):>6}: measured {r['measured_lead_us']:.0f} us, "
                f"predicted {r['predicted_lead_us']:.0f} us ({err})",
                file=out,
            )
    doc["two_level_check"] = two_level_check(doc)
    if doc["two_level_check"]:
        chk = doc["two_level_check"]
        print(
            f"#\n# Speed-up over ring (ring time / its time), measured vs predicted by the auto "
            f"model ({chk['model']}; {'two-level' if chk['two_level_model'] else 'flat'}), "
            f"node size {doc['node_size']}, grid {doc['grid'][0]}x{doc['grid'][1]}:",
            file=out,
        )
        for r in chk["rows"]:
            print(
                f"#   {r['algo']:>12} {format_bytes(r['bytes']):>6}: measured "
                f"{r['measured_speedup']:.2f}x, predicted {r['predicted_speedup']:.2f}x",
                file=out,
            )
    if args.json:
        report.write_json(args.json, doc)
        print(f"# wrote {args.json}", file=out)
    if args.plot:
        report.plot(args.plot, doc)
        print(f"# wrote {args.plot}", file=out)
    wrong = sum(max(r["wrong"], 0) for r in doc["results"])
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
