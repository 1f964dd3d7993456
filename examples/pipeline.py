"""Data parallelism across pipeline replicas: each pipeline stage's gradients
all-reduced by hybridcomm over that stage's data-parallel group.

4 ranks = 2 replicas x 2 stages (``--stages`` x ``--replicas`` in general)::

    replica 0:  rank 0 (stage 0) --activations--> rank 1 (stage 1)
    replica 1:  rank 2 (stage 0) --activations--> rank 3 (stage 1)
    data-parallel groups (what hybridcomm reduces over): {0, 2} and {1, 3}

Each replica runs ``torch.distributed.pipelining`` (GPipe or 1F1B) on its half
of the batch in micro-batches; each stage wraps its optimizer in
``hybridcomm.DistributedOptimizer(..., process_group=<its dp group>)``. Every
micro-batch's backward is one backward pass: the synchronizer learns the count
(the first steps launch in the first pass and relaunch after each later one;
after the measured steps the buckets launch in the last), so nothing is passed
about micro-batches. In forward mode a stage's update waits for its first
micro-batch's forward of the next step, so the all-reduce overlaps the other
stages draining the pipeline.

Run (CPU, gloo)::

    torchrun --nproc-per-node 4 examples/pipeline.py --schedule 1f1b --steps 20

One thing to set: build the schedule with ``scale_grads=False`` and divide the
loss by the micro-batch count (the same gradients): the schedule's own scaling
divides ``p.grad`` in place after the last backward, while hybridcomm is
already reducing it (and says so if it happens).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import hybridcomm

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
IN, HIDDEN, OUT = 16, 32, 4
GLOBAL_BATCH = 32


def make_model() -> nn.Sequential:
    """The whole model (one process's reference); stages are slices of it."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, OUT),
    )


def split(model: nn.Sequential, stages: int, index: int) -> nn.Sequential:
    """Stage ``index`` of ``stages``: a contiguous slice of the layers."""
    layers = list(model)
    cut = [round(i * len(layers) / stages) for i in range(stages + 1)]
    return nn.Sequential(*layers[cut[index] : cut[index + 1]])


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def groups(stages: int, replicas: int):
    """(pipeline group, data-parallel group) of this rank, from a 2-D device mesh
    (replicas x stages: rank = replica * stages + stage)."""
    mesh = init_device_mesh("cpu", (replicas, stages), mesh_dim_names=("dp", "pp"))
    return mesh["pp"].get_group(), mesh["dp"].get_group()


def train(
    schedule: str = "1f1b",
    steps: int = 6,
    stages: int = 2,
    microbatches: int = 4,
    overlap: str = "forward",
    lr: float = 0.05,
    scale_grads: bool = False,
    **options,
):
    """Train on every rank of the default group; returns this stage's flat parameters
    and its last plan (``options`` go to ``DistributedOptimizer``).

    Example (in each of 4 ranks, after ``init_process_group``)::

        >>> params, plan = train("gpipe", steps=6)   # stage 0 on ranks 0, 2; stage 1 on 1, 3
        >>> plan.launch_pass                          # learned: the last micro-batch's backward
        4
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % stages:
        raise ValueError(f"world size {world} is not a multiple of {stages} stages")
    replicas = world // stages
    stage_index, replica = rank % stages, rank // stages
    pp, dp = groups(stages, replicas)
    module = split(make_model(), stages, stage_index)
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(module.parameters(), lr=lr),
        model=module,
        process_group=dp,
        overlap=overlap,
        **options,
    )
    stage = PipelineStage(module, stage_index, stages, torch.device("cpu"), group=pp)

    def loss_fn(out, target):  # the mean over the micro-batch, / the count: scale_grads=False
        return F.mse_loss(out, target) / (1 if scale_grads else microbatches)

    pipe = SCHEDULES[schedule](
        stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads
    )
    per_replica = GLOBAL_BATCH // replicas
    for step in range(steps):
        x, y = batch(step)
        x, y = (t[replica * per_replica : (replica + 1) * per_replica] for t in (x, y))
        opt.zero_grad()
        if stage_index == 0:
            pipe.step(x)
        elif stage_index == stages - 1:
            pipe.step(target=y)
        else:
            pipe.step()
        opt.step()
    opt.synchronize()  # forward mode: the last update is still pending
    plan = opt.plan
    opt.close()
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]), plan


def reference(steps: int = 6, lr: float = 0.05, stages: int = 2) -> list:
    """One process, the whole batch, plain SGD: each stage's flat parameters."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [
        torch.cat([p.detach().reshape(-1) for p in split(model, stages, s).parameters()])
        for s in range(stages)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--overlap", choices=["forward", "backward", "none"], default="forward")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    params, plan = train(args.schedule, args.steps, args.stages, args.microbatches, args.overlap)
    want = reference(args.steps, stages=args.stages)[dist.get_rank() % args.stages]
    diff = (params - want).abs().max().item()
    print(
        f"rank {dist.get_rank()}: stage {dist.get_rank() % args.stages}, buckets launched in "
        f"backward pass {plan.launch_pass} of {args.microbatches}, max difference from one "
        f"process on the whole batch: {diff:.2e}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc-per-node 4 examples/pipeline.py")
    main()
