"""Parameter-server-assisted all-reduce against ring and native, one run.

W workers (default 4) and K summation servers (hybridcomm/comm/servers.py) for each K
in ``--servers`` (default 0,2,4; K = 0 runs only ring and native), every
process in its own network namespace with a tbf-shaped link (``--shape``,
needs root; loopback otherwise): the servers have links of their own, as
BytePS's servers use spare NICs. Within each launch the workers time ring
(hybridcomm), native (gloo's all-reduce) and ps over the same W workers, so
each row's baseline ran on the same network in the same launch.

``--train`` adds, in each K's launch after its all-reduce timing, the time of a
training step on the W workers: an MLP of ``--layers`` square Linear layers of
``--width`` (default 4 x 1024: 4.2M parameters, 16.0 MiB of fp32 gradients;
its compute is tens of ms, small next to 16 MiB at 100 Mbit/s), SGD, the same
steps for every config, each config's median step (after ``--warmup``) on the
slowest worker:

    ring / native / ps   hybridcomm.DistributedOptimizer, strategy forced (ps: K > 0)
    hybrid               the planner's own choice per bucket (ps a candidate when K > 0;
                         cost model probed at start-up on this network)
    ddp                  torch DistributedDataParallel over the workers (the baseline)
    local                no averaging: the compute alone (the floor)

hybridcomm's configs use overlap="backward" (buckets reduced while backward
runs, step() waits for them). After the steps every worker hashes its
parameters; each averaging config must leave them bitwise equal on all
workers (printed, and a mismatch is an error). ``--json`` writes everything.

    python benchmarks/ps.py --shape "rate 100mbit"
    python benchmarks/ps.py --shape "rate 100mbit" --sizes 16777216 --train --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _time(fn, buf, iters, group):
    fn(buf)  # warm-up (connections, first-use)
    times = []
    for _ in range(iters):
        dist.barrier(group=group)  # the workers start together (the servers serve)
        t0 = time.perf_counter()
        fn(buf)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _raw_exchange(role, nbytes, pull):
    """ps's traffic without ps: every worker isends its 1/K of ``nbytes`` to each
    server (and, with ``pull``, receives as much back at the same time) as plain
    gloo point-to-point: what the network gives this pattern of flows."""
    n = nbytes // 4 // len(role.servers)
    works = []
    if role.is_server:
        for worker in role.workers:
            works.append(dist.irecv(torch.empty(n), worker, tag=91))
            if pull:
                works.append(dist.isend(torch.ones(n), worker, tag=92))
    else:
        for server in role.servers:
            works.append(dist.isend(torch.ones(n), server, tag=91))
            if pull:
                works.append(dist.irecv(torch.empty(n), server, tag=92))
    for work in works:
        work.wait()


TRAIN_CONFIGS = ("ring", "native", "ps", "hybrid", "ddp", "local")


def _mlp(width, layers):
    """``layers`` x (Linear(width, width), ReLU): the same weights on every rank."""
    import torch.nn as nn

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def _train_config(config, rank, group, srv, train):
    """One config's median step time on this worker, its plan, its parameters' hash."""
    import torch.nn as nn
    import torch.nn.functional as F

    import hybridcomm

    model = _mlp(train["width"], train["layers"])
    base = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt, wrapped = base, model
    if config == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model, process_group=group)
    elif config != "local":
        kw = dict(servers=srv) if srv is not None else dict(process_group=group)
        if config == "hybrid":
            kw["cost_model"] = "probe"  # this network's line (and ps's, with servers)
        else:
            kw["strategy"] = config
        opt = hybridcomm.DistributedOptimizer(
            base, model=model, overlap="backward", timeout=1800, **kw
        )
    g = torch.Generator().manual_seed(1000 + rank)  # each worker its own shard
    x = torch.randn(train["batch"], train["width"], generator=g)
    y = torch.randn(train["batch"], train["width"], generator=g)
    times = []
    for step in range(train["warmup"] + train["steps"]):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        opt.zero_grad()
        F.mse_loss(wrapped(x), y).backward()
        opt.step()
        if step >= train["warmup"]:
            times.append(time.perf_counter() - t0)
    if config in ("ddp", "local"):
        note = {"ddp": "DDP, 25 MB buckets (its default)", "local": "no averaging (the floor)"}[
            config
        ]
    else:
        opt.synchronize()
        plan = opt.plan
        algos = {}
        for b in plan.buckets:
            algos[b.algorithm] = algos.get(b.algorithm, 0) + 1
        note = f"{len(plan.buckets)} buckets: " + ", ".join(f"{a} x{n}" for a, n in algos.items())
        opt.close()  # the servers (shared, closed after the last config) stay up
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "config": config,
        "step_ms": statistics.median(times) * 1e3,
        "times_ms": [t * 1e3 for t in times],
        "note": note,
        "params_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
    }


def _rank(rank, world, servers, sizes, iters, chunk_bytes, train=None):
    import hybridcomm
    import hybridcomm.comm.servers as ps

    role = ps.split_world(servers)
    group = role.worker_group
    out = [{"bytes": nbytes} for nbytes in sizes]
    if servers:  # the raw pattern first, every rank (the servers serve after it)
        for row in out:
            for name, pull in (("push", False), ("pushpull", True)):
                row[name] = _time(
                    lambda b, p=pull: _raw_exchange(role, row["bytes"], p), None, iters, None
                )
    if role.is_server:
        ps.serve(role, timeout=1800)
        return (out, None) if train else out
    srv = ps.SummationServers(role, timeout=1800, chunk_bytes=chunk_bytes) if servers else None
    algos = {
        "ring": lambda b: hybridcomm.all_reduce(b, algorithm="ring", group=group, timeout=1800),
        "native": lambda b: dist.all_reduce(b, group=group),
    }
    for row in out:
        buf = torch.ones(row["bytes"] // 4)
        for name, fn in algos.items():
            row[name] = _time(fn, buf, iters, group)
    if srv is not None:
        for row in out:
            row["ps"] = _time(
                lambda b: srv.all_reduce(b), torch.ones(row["bytes"] // 4), iters, group
            )
    steps = None
    if train:
        steps = [
            _train_config(c, rank, group, srv, train)
            for c in train["configs"]
            if c != "ps" or srv is not None
        ]
    if srv is not None:
        srv.close()
    return (out, steps) if train else out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=None, help='tbf spec per link, e.g. "rate 100mbit"')
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--servers", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2, 4]
    )
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1 << 20, 4 << 20, 16 << 20],
        help="bytes (fp32)",
    )
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=64 << 10, help="ps chunk bytes")
    parser.add_argument(
        "--train",
        action="store_true",
        help="also time a training step per config in each K's launch",
    )
    parser.add_argument("--width", type=int, default=1024, help="MLP width (--train)")
    parser.add_argument("--layers", type=int, default=4, help="MLP layers (--train)")
    parser.add_argument("--batch", type=int, default=32, help="per worker (--train)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="untimed steps (--train; hybridcomm measures 3, then re-plans)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps (--train)")
    parser.add_argument(
        "--configs",
        type=lambda s: s.split(","),
        default=list(TRAIN_CONFIGS),
        help="--train configs",
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    train = (
        dict(
            width=args.width,
            layers=args.layers,
            batch=args.batch,
            warmup=args.warmup,
            steps=args.steps,
            configs=args.configs,
        )
        if args.train
        else None
    )
    os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")  # the plans: the table's column

    from hybridcomm.tools.launch import launch
    from train import shaped_network

    where = f"tbf {args.shape} on every process's link" if args.shape else "loopback"
    print(
        f"all-reduce over {args.workers} workers (fp32), CPU/gloo, {where}; median of "
        f"{args.iters} after a warm-up; ring/native/ps timed in the same launch; "
        f"ps = BytePS-style summation servers (hybridcomm.comm.servers, {args.chunk} B chunks)"
    )
    print(
        "raw push / raw push+pull: ps's flows as plain gloo isend/irecv (no summing, "
        "no pipelining): what this network gives that pattern"
    )
    print(
        f"{'servers':>7} {'bytes':>10} {'ring ms':>9} {'native ms':>9} {'ps ms':>9} "
        f"{'ring/ps':>7} {'native/ps':>9} {'raw push':>9} {'raw p+p':>8}"
    )
    doc = {
        "command": sys.argv,
        "shape": args.shape,
        "workers": args.workers,
        "chunk": args.chunk,
        "iters": args.iters,
        "train": train,
        "allreduce": [],
        "steps": [],
    }
    for k in args.servers:
        nprocs = args.workers + k
        network = shaped_network(nprocs, args.shape) if args.shape else contextlib.nullcontext()
        with network as net:
            per_rank = launch(
                _rank,
                nprocs,
                k,
                args.sizes,
                args.iters,
                args.chunk,
                train,
                backend="gloo",
                setup=net and net.setup,
                timeout=3600,
            )
        if train:
            steps = [r[1] for r in per_rank[: args.workers]]
            per_rank = [r[0] for r in per_rank]
            for i, row in enumerate(steps[0]):
                hashes = {s[i]["params_sha256"] for s in steps}
                doc["steps"].append(
                    {
                        "servers": k,
                        "config": row["config"],
                        "step_ms": max(s[i]["step_ms"] for s in steps),
                        "per_worker_ms": [s[i]["step_ms"] for s in steps],
                        "note": row["note"],
                        "identical": len(hashes) == 1,
                    }
                )
        doc["allreduce"] += [
            dict(
                servers=k,
                bytes=nbytes,
                **{
                    a: max(r[i][a] for r in per_rank[: args.workers])
                    for a in ("ring", "native", "ps")
                    if a in per_rank[0][i]
                },
            )
            for i, nbytes in enumerate(args.sizes)
        ]
        for i, nbytes in enumerate(args.sizes):
            rows = [r[i] for r in per_rank[: args.workers]]
            ring = max(r["ring"] for r in rows) * 1e3
            native = max(r["native"] for r in rows) * 1e3
            if k:
                p = max(r["ps"] for r in rows) * 1e3
                push = max(x[i]["push"] for x in per_rank)
                both = max(x[i]["pushpull"] for x in per_rank)
                print(
                    f"{k:>7} {nbytes:>10} {ring:>9.1f} {native:>9.1f} {p:>9.1f} "
                    f"{ring / p:>7.2f} {native / p:>9.2f} {push * 1e3:>9.1f} "
                    f"{both * 1e3:>8.1f}"
                )
            else:
                print(f"{k:>7} {nbytes:>10} {ring:>9.1f} {native:>9.1f} {'-':>9} {'-':>7} {'-':>9}")

    if train:
        _print_steps(args, doc["steps"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    bad = [
        f"K={r['servers']} {r['config']}"
        for r in doc["steps"]
        if not r["identical"] and r["config"] != "local"
    ]
    if bad:
        raise SystemExit(f"error: parameters differ across workers: {', '.join(bad)}")


def _print_steps(args, rows):
    params = args.layers * (args.width * args.width + args.width)
    where = f"tbf {args.shape} on every process's link" if args.shape else "loopback"
    print()
    print(
        f"training step over {args.workers} workers: MLP {args.layers} x Linear({args.width}, "
        f"{args.width}), {params / 1e6:.2f}M params ({params * 4 / 2**20:.1f} MiB fp32 "
        f"gradients), batch {args.batch} per worker, SGD; CPU/gloo, {where}; hybridcomm "
        f"overlap=backward; median of {args.steps} steps after {args.warmup}, slowest worker; "
        f"each K one launch (after its all-reduce timing)"
    )
    print(
        f"{'servers':>7} {'config':<7} {'step ms':>9} {'vs ring':>7} {'vs ddp':>7} "
        f"{'params':>9}  plan"
    )
    for k in args.servers:
        mine = {r["config"]: r for r in rows if r["servers"] == k}
        ring, ddp = mine.get("ring"), mine.get("ddp")
        for config, r in mine.items():
            vs_ring = f"{ring['step_ms'] / r['step_ms']:.2f}" if ring else "-"
            vs_ddp = f"{ddp['step_ms'] / r['step_ms']:.2f}" if ddp else "-"
            same = "identical" if r["identical"] else "differ"
            print(
                f"{k:>7} {config:<7} {r['step_ms']:>9.1f} {vs_ring:>7} {vs_ddp:>7} "
                f"{same:>9}  {r['note']}"
            )
    print(
        "vs ring / vs ddp: that config's step time / this one's (> 1: this one is faster); "
        "params: the trained parameters bitwise identical on every worker (local: no averaging, "
        "so they differ: the check can fail)"
    )


if __name__ == "__main__":
    main()
