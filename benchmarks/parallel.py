"""DP x PP step time: hybridcomm per pipeline stage against DDP per stage, one run.

4 ranks = 2 replicas x 2 stages (torch.distributed.pipelining, 1F1B or GPipe,
4 micro-batches); each stage's gradients are averaged over its data-parallel
group by

    hybrid-forward    hybridcomm.DistributedOptimizer, overlap="forward" (the
                      update waits for the stage's first micro-batch of the next step)
    hybrid-backward   hybridcomm, overlap="backward" (done by the end of step())
    ddp               torch DistributedDataParallel around each stage (pipelining
                      runs it with no_sync until the last micro-batch's backward)
    local             no gradient averaging at all: the pipeline's own time, the
                      floor a data-parallel step could reach with all communication hidden

The configs run one after another in the same launch, on the same network:
a tbf-shaped link per rank (``--shape "rate 100mbit"``, needs root) or
loopback. Prints the median step time per config per rank (the slowest rank
is the step), and each config's ratio to ddp.

    python benchmarks/parallel.py --shape "rate 100mbit" --steps 12
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS = ("hybrid-forward", "hybrid-backward", "ddp", "local")
STAGES, MICRO = 2, 4


def _stage_module(index: int, width: int, layers: int) -> nn.Sequential:
    """Half of an MLP of ``2 * layers`` square layers of ``width``."""
    torch.manual_seed(index)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods)


def _run_config(config, rank, world, args, pp, dp):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import hybridcomm

    stage_index, replica = rank % STAGES, rank // STAGES
    module = _stage_module(stage_index, args.width, args.layers)
    base = torch.optim.SGD(module.parameters(), lr=1e-3)
    opt, wrapped = base, module
    if config == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(module, process_group=dp)
    elif config != "local":
        opt = hybridcomm.DistributedOptimizer(
            base, model=module, process_group=dp, overlap=config.split("-")[1], timeout=300
        )
    stage = PipelineStage(wrapped, stage_index, STAGES, torch.device("cpu"), group=pp)
    schedule = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[args.schedule]
    pipe = schedule(
        stage,
        n_microbatches=MICRO,
        scale_grads=False,
        loss_fn=lambda out, y: F.mse_loss(out, y) / MICRO,
    )
    g = torch.Generator().manual_seed(replica)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier(group=pp)  # both stages of a replica start the step together
        t0 = time.perf_counter()
        opt.zero_grad()
        if stage_index == 0:
            pipe.step(x)
        else:
            pipe.step(target=y)
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    if config.startswith("hybrid"):
        opt.synchronize()
        plan = opt.plan
        opt.close()
        note = f"launched in pass {plan.launch_pass}, {len(plan.buckets)} buckets"
    else:
        note = {"ddp": "25 MB buckets (DDP's default)", "local": "no averaging (the floor)"}[config]
    return {"config": config, "step_ms": statistics.median(times) * 1e3, "note": note}


def _rank(rank, world, args):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // STAGES, STAGES), mesh_dim_names=("dp", "pp"))
    pp, dp = mesh["pp"].get_group(), mesh["dp"].get_group()
    return [_run_config(c, rank, world, args, pp, dp) for c in args.configs]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=None, help='tbf spec per rank link, e.g. "rate 100mbit"')
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2, help="square layers per stage")
    parser.add_argument("--batch", type=int, default=64, help="per replica (4 micro-batches)")
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps (measure + re-plan)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS))
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)

    from hybridcomm.tools.launch import launch
    from train import shaped_network

    network = shaped_network(4, args.shape) if args.shape else contextlib.nullcontext()
    with network as net:
        per_rank = launch(
            _rank,
            4,
            args,
            backend="gloo",
            setup=net and net.setup,
            timeout=args.timeout,
            start_method="forkserver",
        )  # torch imported once
    where = f"tbf {args.shape} per rank link" if args.shape else "loopback"
    params = args.layers * (args.width * args.width + args.width)
    print(
        f"DP x PP: 2 replicas x 2 stages, {args.schedule}, {MICRO} micro-batches of "
        f"{args.batch // MICRO}, {params / 1e6:.2f}M params per stage "
        f"({params * 4 / 2**20:.1f} MiB of gradients), 4 ranks on CPU (gloo), {where}; "
        f"median of {args.steps} steps after {args.warmup}, slowest rank"
    )
    ddp = (
        max(r[args.configs.index("ddp")]["step_ms"] for r in per_rank)
        if "ddp" in args.configs
        else None
    )
    print(f"{'config':<16} {'step ms':>9} {'vs ddp':>7}  plan")
    for i, config in enumerate(args.configs):
        step = max(r[i]["step_ms"] for r in per_rank)
        ratio = f"{step / ddp:.2f}" if ddp else "-"
        print(f"{config:<16} {step:>9.1f} {ratio:>7}  {per_rank[0][i]['note']}")


if __name__ == "__main__":
    main()
