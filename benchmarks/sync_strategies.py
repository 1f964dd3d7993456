"""Which data-parallel scheme reaches a target accuracy first? Synchronous hybrid
all-reduce against Parallel SGD, local SGD, ADMM SGD and Downpour SGD.

One model (an MLP) on scikit-learn's digits (bundled with the package: no
download), 4 workers (plus 2 parameter-server shards for Downpour), two
scenarios: ``uniform`` and ``straggler`` (worker 3 runs 3x slower). Each worker
stands for a bigger model's compute with ``--step-ms`` of sleep per step (the
MLP itself takes ~1 ms), so that a straggler is exactly 3x slower and the
wall clock measures synchronization, not this machine's 2 shared cores.

    python benchmarks/sync_strategies.py --quick        # < 10 minutes on 2 cores
    python benchmarks/sync_strategies.py --json out.json --plot out.png
    python benchmarks/sync_strategies.py --quick --strategies downpour \
        --scenarios uniform --kill-server-at 20 --kill-server-at 15,35,55

``downpour_mp`` is Downpour with model-parallel replicas (Dean et al.'s
setting) on the same 4 worker processes and 2 shards: 2 replicas, each a
2-stage pipeline (ranks 2r, 2r+1: the MLP's first layer, then its second;
activations forward and their gradients back over gloo, one mini-batch of 32
at a time), each stage pushing and fetching only its own parameters. Each
replica trains on half the data (the same epochs: every sample as often as in
``downpour``), and each stage sleeps half of ``--step-ms`` (it holds half the
model), so a replica's step costs what a data-parallel worker's does and the
job has half as many replicas. Replica 0 evaluates through its pipeline.

``--kill-server-at STEPS`` adds a Downpour run in which worker 0 SIGKILLs
server 0 after each of those steps; the benchmark restarts it at once (a fresh
process, as a process manager would), it resumes from its checkpoint, and the
workers replay what it missed. The row reports the kills, the workers'
reconnects, replayed and lost pushes, and the pushes each shard applied
against the pushes the workers sent (the loss counted independently).

Per strategy and scenario: the test accuracy over wall time (rank 0's model:
between averaging rounds, local SGD and Parallel SGD evaluate worker 0's own
model; ADMM its consensus; Downpour worker 0's latest fetch; downpour_mp
replica 0 through its pipeline), the time to the target accuracy (every
worker's clock starts at one barrier), the samples the whole job had trained
on when it got there (Downpour: shard 0's applied pushes x batch), and the
bytes worker 0 sent (downpour_mp: its pushes and its activations).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import hybridcomm  # noqa: E402
from hybridcomm.tools.launch import launch  # noqa: E402
from hybridcomm.strategies import (
    ADMM,
    DownpourSGD,
    DownpourStage,
    LocalSGD,
    ParallelSGD,
    init_downpour,
    serve,
)

STRATEGIES = ("sync", "parallel_sgd", "local_sgd", "admm", "downpour", "downpour_mp")
SCENARIOS = ("uniform", "straggler")
WORKERS, SERVERS = 4, 2
STRAGGLER, SLOWDOWN = 3, 3.0
STAGES = 2  # downpour_mp: WORKERS // STAGES replicas of STAGES stages


def digits():
    """(train x, train y, test x, test y): the 8x8 digits, 80/20, fixed shuffle."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def mlp_stages():
    """The same MLP (same initial values), cut after its ReLU: 2 stage modules."""
    m = mlp()
    return [m[:2], m[2:]]


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def _serve_shard(index, rdv, cfg):
    """A Downpour server process (started, and restarted, by :class:`_Servers`)."""
    torch.set_num_threads(1)
    serve(
        index=index,
        workers=WORKERS,
        rendezvous=rdv,
        checkpoint_every=cfg["checkpoint_every"],
        timeout=60,
    )


class _Servers:
    """The Downpour server processes, restarted when one dies of a signal (as a
    process manager would); each one's pid in ``rdv/server{i}.pid`` for the killer."""

    def __init__(self, rdv, cfg):
        self.rdv, self.cfg, self.restarts = rdv, cfg, 0
        self.ctx = mp.get_context("spawn")
        self.procs = [self._start(i) for i in range(SERVERS)]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _start(self, i):
        p = self.ctx.Process(target=_serve_shard, args=(i, self.rdv, self.cfg), daemon=True)
        p.start()
        with open(os.path.join(self.rdv, f"server{i}.pid.tmp"), "w") as f:
            f.write(str(p.pid))
        os.replace(
            os.path.join(self.rdv, f"server{i}.pid.tmp"), os.path.join(self.rdv, f"server{i}.pid")
        )
        return p

    def _watch(self):
        while not self.stop.wait(0.02):
            for i, p in enumerate(self.procs):
                if p.exitcode is not None and p.exitcode < 0:  # killed: start it again
                    self.procs[i] = self._start(i)
                    self.restarts += 1

    def finish(self):
        """Wait for the servers to stop (they do once every worker has closed)."""
        self.stop.set()
        self.thread.join()
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        return [
            torch.load(os.path.join(self.rdv, f"server{i}.pt"), weights_only=True)["pushes"]
            for i in range(SERVERS)
        ]


def _kill_server(rdv, index):
    with open(os.path.join(rdv, f"server{index}.pid")) as f:
        os.kill(int(f.read()), signal.SIGKILL)


def _worker_loop(
    rank,
    cfg,
    model,
    step_fn,
    evaluate,
    bytes_of,
    replica=None,
    replicas=WORKERS,
    evaluator=None,
    compute=1.0,
    job_steps=None,
):
    """Train ``cfg['epochs']`` epochs of this replica's shard (``replica`` of
    ``replicas``, default: one per rank); rank 0 records (seconds, accuracy) every
    ``eval_every`` steps, and with each point the mini-batches the whole job has
    trained on (``job_steps()``: Downpour asks its shard; default this replica's
    steps x replicas). ``evaluator``: this rank takes part in rank 0's
    evaluations (a pipeline's other stages; default rank 0 only); ``compute``:
    the share of ``step_ms`` this rank sleeps."""
    replica = rank if replica is None else replica
    evaluator = rank == 0 if evaluator is None else evaluator
    xtr, ytr, xte, yte = digits()
    xs, ys = xtr[replica::replicas], ytr[replica::replicas]
    delay = (
        compute
        * cfg["step_ms"]
        / 1e3
        * (SLOWDOWN if cfg["scenario"] == "straggler" and rank == STRAGGLER else 1.0)
    )
    curve, at, step = [], [], 0
    # one start for every worker (they come up at different times, Downpour's
    # after connecting to the servers): rank 0's clock is the job's
    torch.distributed.barrier()
    t0 = time.perf_counter()
    bs = cfg["batch"]
    for epoch in range(cfg["epochs"]):
        perm = torch.randperm(
            len(xs), generator=torch.Generator().manual_seed(100 * epoch + replica)
        )
        for i in range(0, len(xs) - bs + 1, bs):
            idx = perm[i : i + bs]
            time.sleep(delay)  # a bigger model's compute
            step_fn(xs[idx], ys[idx], epoch_end=False)
            step += 1
            if evaluator and step % cfg["eval_every"] == 0:
                at.append(job_steps() if job_steps else step * replicas)
                curve.append((time.perf_counter() - t0, evaluate(xte, yte)))
        step_fn(None, None, epoch_end=True)
        if evaluator:
            at.append(job_steps() if job_steps else step * replicas)
            curve.append((time.perf_counter() - t0, evaluate(xte, yte)))
    # curve_steps: the job's mini-batches at each point (x batch: the samples
    # trained on, which the machine's load does not change)
    return {
        "curve": curve if rank == 0 else [],
        "curve_steps": at if rank == 0 else [],
        "bytes_sent": bytes_of(),
        "accuracy": evaluate(xte, yte) if evaluator else None,
        "steps": step,
    }


def _run(rank, world, cfg, rdv):
    """One strategy in one scenario, on this process."""
    name = cfg["strategy"]
    if name == "downpour_mp":
        return _run_pipeline(rank, cfg, rdv)
    if name == "downpour":  # the workers; the servers are _Servers' processes
        init_downpour(rank, WORKERS, SERVERS, f"file://{rdv}", timeout=60)
        model = mlp()
        opt = DownpourSGD(
            model,
            [f"server{i}" for i in range(SERVERS)],
            lr=cfg["lr_async"],
            rule=cfg["rule"],
            timeout=60,
            replay_log=cfg["replay_log"],
        )
        kills = set(cfg["kill_at"]) if rank == 0 else set()

        def step(x, y, epoch_end):
            if x is None:
                return
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if opt.steps in kills:
                _kill_server(rdv, 0)

        # each push is one worker's mini-batch: shard 0's count is the job's
        out = _worker_loop(
            rank,
            cfg,
            model,
            step,
            lambda x, y: accuracy(model, x, y),
            lambda: opt.bytes_sent,
            job_steps=lambda: opt.links[0].shard_pushes,
        )
        opt.close()
        return dict(
            out,
            reconnects=opt.reconnects,
            replayed=opt.replayed,
            lost=opt.lost,
            reconnect_seconds=opt.reconnect_seconds,
        )
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    evaluate = lambda x, y: accuracy(model, x, y)  # noqa: E731
    if name == "sync":
        opt = hybridcomm.DistributedOptimizer(sgd, model=model, timeout=60)
        sent = [0]

        def bytes_of():
            return sent[0]
    elif name == "parallel_sgd":
        opt = ParallelSGD(sgd, model, average="epoch", timeout=60)
    elif name == "local_sgd":
        opt = LocalSGD(sgd, model, period=cfg["period"], timeout=60)
    else:
        # the local solver is the same momentum SGD as everyone's
        opt = ADMM(sgd, model, rho=cfg["rho"], local_steps=cfg["period"] // 2, timeout=60)

        def evaluate(x, y):
            with opt.consensus() as m:
                return accuracy(m, x, y)

    def step(x, y, epoch_end):
        if epoch_end:
            if name == "parallel_sgd":
                opt.end_epoch()
            elif name == "sync":
                opt.synchronize()
            return
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if name == "sync":
            sent[0] += opt.last_step_stats["bytes_sent"]

    out = _worker_loop(
        rank, cfg, model, step, evaluate, bytes_of if name == "sync" else lambda: opt.bytes_sent
    )
    if name == "sync":
        opt.close()
    return out


def _run_pipeline(rank, cfg, rdv):
    """Downpour with model-parallel replicas: this rank is stage ``rank % STAGES`` of
    replica ``rank // STAGES``; the servers are _Servers' processes."""
    init_downpour(rank, WORKERS, SERVERS, f"file://{rdv}", timeout=60)
    replica, stage = divmod(rank, STAGES)
    peers = [replica * STAGES + s for s in range(STAGES)]
    pipe = DownpourStage(
        mlp_stages()[stage],
        [f"server{i}" for i in range(SERVERS)],
        lr=cfg["lr_async"],
        rule=cfg["rule"],
        stage=stage,
        peers=peers,
        loss_fn=F.cross_entropy,
        timeout=60,
        replay_log=cfg["replay_log"],
    )

    def step(x, y, epoch_end):
        if x is not None:
            pipe.step(x) if stage == 0 else pipe.step(y=y)  # both stages read the batch

    def evaluate(x, y):
        if stage != 0:
            return pipe.forward()
        return (pipe.forward(x).argmax(1) == y).float().mean().item()

    out = _worker_loop(
        rank,
        cfg,
        None,
        step,
        evaluate,
        lambda: pipe.bytes_sent + pipe.bytes_p2p,
        replica=replica,
        replicas=WORKERS // STAGES,
        evaluator=replica == 0,
        compute=1.0 / STAGES,
        # a replica's mini-batch is one push per stage to every shard
        job_steps=lambda: pipe.opt.links[0].shard_pushes // STAGES,
    )
    pipe.close()
    return dict(
        out,
        reconnects=pipe.reconnects,
        replayed=pipe.replayed,
        lost=pipe.lost,
        reconnect_seconds=pipe.opt.reconnect_seconds,
        pushes=pipe.pushes,
        bytes_pushed=pipe.bytes_sent,
        bytes_p2p=pipe.bytes_p2p,
    )


def run(strategy: str, scenario: str, cfg: dict) -> dict:
    """Worker 0's result; for Downpour with the workers' fault counters summed and
    the pushes each shard applied."""
    cfg = dict(cfg, strategy=strategy, scenario=scenario)
    with tempfile.TemporaryDirectory(prefix="hybridcomm-rdv-") as tmp:
        rdv = os.path.join(tmp, "rdv")
        if not strategy.startswith("downpour"):
            return launch(
                _run, WORKERS, cfg, rdv, backend="gloo", start_method="spawn", timeout=1200
            )[0]
        os.makedirs(rdv)
        servers = _Servers(rdv, cfg)
        try:
            results = launch(
                _run, WORKERS, cfg, rdv, backend="gloo", start_method="spawn", timeout=1200
            )
        finally:
            applied = servers.finish()
    sent = (
        [sum(r["pushes"][i] for r in results) for i in range(SERVERS)]
        if strategy == "downpour_mp"
        else sum(r["steps"] for r in results)
    )
    out = dict(
        results[0],
        kills=len(cfg["kill_at"]),
        restarts=servers.restarts,
        shard_pushes=applied,
        pushes_sent=sent,
    )
    for k in ("reconnects", "replayed", "lost", "reconnect_seconds"):
        out[k] = sum(r[k] for r in results)
    return out


def time_to(curve, target):
    return next((t for t, acc in curve if acc >= target), None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer epochs (< 10 minutes)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--target", type=float, default=0.90, help="test accuracy to reach")
    ap.add_argument(
        "--step-ms", type=float, default=10.0, help="simulated compute per step (the straggler: 3x)"
    )
    ap.add_argument("--lr", type=float, default=0.1, help="momentum-SGD learning rate")
    ap.add_argument("--lr-async", type=float, default=0.2, help="Downpour servers' rate")
    ap.add_argument(
        "--rule", default="sgd", choices=("sgd", "adagrad"), help="Downpour servers' update rule"
    )
    ap.add_argument("--rho", type=float, default=0.1, help="ADMM's penalty")
    ap.add_argument("--period", type=int, default=8, help="local SGD's H (ADMM: local steps = H/2)")
    ap.add_argument(
        "--kill-server-at",
        action="append",
        default=[],
        metavar="STEPS",
        help="also run Downpour with server 0 SIGKILLed (and restarted) after "
        "each of these steps of worker 0, e.g. 20 or 15,35,55; repeatable",
    )
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        help="Downpour servers' pushes between checkpoints",
    )
    ap.add_argument(
        "--replay-log",
        type=int,
        default=None,
        help="Downpour workers' replay log per server (default: checkpoint_every+1)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    cfg = {
        "epochs": args.epochs or (6 if args.quick else 15),
        "batch": 32,
        "lr": args.lr,
        "lr_async": args.lr_async,
        "rule": args.rule,
        "period": args.period,
        "rho": args.rho,
        "eval_every": 4,
        "step_ms": args.step_ms,
        "checkpoint_every": args.checkpoint_every,
        "replay_log": args.replay_log,
        "kill_at": [],
    }
    faults = [[int(k) for k in spec.split(",") if k] for spec in args.kill_server_at]
    strategies = [s for s in args.strategies.split(",") if s]
    scenarios = [s for s in args.scenarios.split(",") if s]
    bad = [s for s in strategies if s not in STRATEGIES] + [
        s for s in scenarios if s not in SCENARIOS
    ]
    if bad:
        raise SystemExit(f"unknown: {bad}")
    rows, curves, t_start = [], {}, time.perf_counter()
    print(
        f"# sync strategies on digits: {WORKERS} workers (+{SERVERS} servers for downpour), "
        f"{cfg['epochs']} epochs, batch {cfg['batch']}/worker, {args.step_ms:g} ms simulated "
        f"compute per step (straggler x{SLOWDOWN:g}), target accuracy {args.target}",
        flush=True,
    )
    print(
        f"# {'scenario':>10} {'strategy':>13} {'accuracy':>9} {'to target(s)':>13} "
        f"{'bytes sent':>12} {'wall(s)':>8}",
        flush=True,
    )
    runs = [(s, []) for s in strategies]
    if "downpour" in strategies:
        at = strategies.index("downpour") + 1
        runs[at:at] = [("downpour", kills) for kills in faults]
    for scenario in scenarios:
        for strategy, kills in runs:
            out = run(strategy, scenario, dict(cfg, kill_at=kills))
            curve = out["curve"]
            t = time_to(curve, args.target)
            s_at = time_to(list(zip(out["curve_steps"], (a for _, a in curve))), args.target)
            samples = None if s_at is None else s_at * cfg["batch"]
            label = strategy + (f"+kill@{','.join(map(str, kills))}" if kills else "")
            row = {
                "strategy": label,
                "scenario": scenario,
                "test_accuracy": out["accuracy"],
                "time_to_target_s": t,
                "bytes_sent": out["bytes_sent"],
                "samples_to_target": samples,
            }
            if strategy.startswith("downpour"):
                row.update(
                    {
                        k: out[k]
                        for k in (
                            "kills",
                            "restarts",
                            "reconnects",
                            "replayed",
                            "lost",
                            "reconnect_seconds",
                            "shard_pushes",
                            "pushes_sent",
                            "steps",
                        )
                    }
                )
            if strategy == "downpour_mp":
                row.update(bytes_pushed=out["bytes_pushed"], bytes_p2p=out["bytes_p2p"])
            rows.append(row)
            curves[f"{scenario}/{label}"] = curve
            print(
                f"  {scenario:>10} {label:>13} {out['accuracy']:>9.3f} "
                f"{'-' if t is None else f'{t:.2f}':>13} {out['bytes_sent']:>12} "
                f"{curve[-1][0]:>8.1f}   ({time.perf_counter() - t_start:.0f} s elapsed)",
                flush=True,
            )
            if strategy == "downpour_mp":
                print(
                    f"  {'':>10} {'':>13} {WORKERS // STAGES} replicas x {STAGES} stages; "
                    f"rank 0: {out['steps']} steps, {out['bytes_pushed']} B pushed + "
                    f"{out['bytes_p2p']} B to its next stage",
                    flush=True,
                )
            if strategy.startswith("downpour"):
                print(
                    f"  {'':>10} {'':>13} the target after {samples} samples trained on "
                    "(all replicas: shard 0's pushes x batch, at rank 0's evaluation)",
                    flush=True,
                )
                print(
                    f"  {'':>10} {'':>13} servers: {out['kills']} killed, {out['restarts']} "
                    f"restarted; workers: {out['reconnects']} reconnects "
                    f"({out['reconnect_seconds']:.2f} s), {out['replayed']} pushes replayed, "
                    f"{out['lost']} lost; shards applied {out['shard_pushes']} of "
                    f"{out['pushes_sent']} pushes sent",
                    flush=True,
                )
    doc = {
        "target_accuracy": args.target,
        "results": rows,
        "curves": curves,
        "config": cfg,
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"# wrote {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"# wrote {args.plot}")
    return 0


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r["scenario"] for r in doc["results"]))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6 * len(scenarios), 4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for key, curve in doc["curves"].items():
            if key.startswith(scenario + "/") and curve:
                ts, accs = zip(*curve)
                ax.plot(ts, accs, label=key.split("/")[1])
        ax.axhline(doc["target_accuracy"], color="grey", linestyle=":")
        ax.set_title(scenario)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
