"""A script written for Hugging Face Accelerate, with hybridcomm's all-reduce.

    # CPU, 2 processes (gloo): torchrun, or accelerate's launcher (which calls torchrun)
    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py
    # GPUs (nccl, one per process)
    accelerate launch --multi_gpu --num_processes 8 examples/accelerate_train.py

The change hybridcomm asks for is one line after ``accelerator.prepare``::

    state = hybridcomm.integrations.accelerate.register(accelerator, model)

which puts hybridcomm's DDP communication hook on the prepared DDP model
(backward overlap; ``--overlap backward``, the default). ``--overlap forward``
takes the other route, forward overlap: ``accelerator.prepare`` is replaced by
``hybridcomm.integrations.accelerate.prepare`` (no DDP; the optimizer is a
``hybridcomm.DistributedOptimizer``) and
``hybridcomm.integrations.accelerate.synchronize(optimizer)`` comes before
clipping and at the end. The rest is the stock Accelerate loop:
``accelerator.accumulate(model)`` for gradient accumulation
(``--accumulation``), ``accelerator.clip_grad_norm_`` (``--max-grad-norm``),
mixed precision from ``accelerate launch --mixed_precision``.
``--no-hybridcomm`` runs the stock path (DDP's own all-reduce) for comparison.
Without CUDA the Accelerator is made with ``cpu=True``: Accelerate then runs
several CPU processes over gloo when a launcher starts them.
``accelerate launch --cpu --num_processes 2`` starts one process here
(Accelerate's CPU launcher needs mpirun for more); one process trains the
same loop with nothing to reduce.

The task is a small MLP regressing a fixed random teacher on synthetic data
(nothing to download). The data loader is sharded by Accelerate: with
``--global-batch-size G`` each of P processes takes G/P samples per
micro-batch, so one process with the same G sees the same samples per step,
and trains to the same parameters up to summation order (the tests check it).

``--overlap backward,forward --accumulation 1,2`` trains once per pair of
values, each from the same start, in one launch. Rank 0 prints each run's
final loss and how many steps were clipped, the hook's algorithms
(``hybridcomm algorithms {bucket: algorithm}``: an empty dict means the hook
never ran) or the optimizer's (``hybridcomm optimizer algorithms [...], last
step sent N bytes``), and every rank a digest of its parameters;
``--params-out P`` writes the parameters (a flat fp32 tensor,
``torch.load``-able) to ``P.<overlap>.acc<K>.pt``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from torch.utils.data import DataLoader, TensorDataset

import hybridcomm.integrations.accelerate


def say(line: str) -> None:
    """One line in one write: the ranks share the launcher's pipe, and a line
    written in pieces (unbuffered output) can be split by another rank's."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def make_data(n: int, seed: int) -> TensorDataset:
    """Inputs and the outputs of a fixed random teacher, plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    teacher = torch.randn(16, 4, generator=g)
    return TensorDataset(x, torch.sin(x @ teacher) + 0.05 * torch.randn(n, 4, generator=g))


def digest(model: nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def train(accelerator: Accelerator, args, overlap: str, accumulation: int) -> None:
    accelerator.gradient_accumulation_steps = accumulation
    world = accelerator.num_processes
    if args.global_batch_size % world:
        raise SystemExit(
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"the {world} processes"
        )
    model = make_model(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    samples = args.steps * accumulation * args.global_batch_size
    # In order (no shuffle): Accelerate gives process r every P-th micro-batch of
    # G/P samples, which together are the G samples one process would take.
    loader = DataLoader(
        make_data(samples, args.seed + 1), batch_size=args.global_batch_size // world
    )

    state = None
    if args.no_hybridcomm or overlap == "backward":
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        if not args.no_hybridcomm:  # the change: hybridcomm's DDP hook
            state = hybridcomm.integrations.accelerate.register(accelerator, model)
    else:  # the change: no DDP; hybridcomm.DistributedOptimizer, forward overlap
        model, optimizer, loader = hybridcomm.integrations.accelerate.prepare(
            accelerator, model, optimizer, loader, overlap="forward"
        )

    losses, clipped = [], 0
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.max_grad_norm > 0:
                hybridcomm.integrations.accelerate.synchronize(optimizer)  # forward: reduce first
                norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                clipped += int(norm > args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    hybridcomm.integrations.accelerate.synchronize(optimizer)  # forward: the last update

    label = f"overlap {overlap}, accumulation {accumulation}"
    params = torch.cat(
        [p.detach().reshape(-1).cpu() for p in accelerator.unwrap_model(model).parameters()]
    )
    say(f"[rank {accelerator.process_index}] {label}: parameters sha256 {digest(model)}")
    if accelerator.is_main_process:
        steps = len(losses) // accumulation
        how = (
            "stock"
            if args.no_hybridcomm
            else "hybridcomm"
            if world > 1
            else "one process: nothing to reduce"
        )
        say(
            f"{label}: final loss {losses[-1]:.6f} (first {losses[0]:.6f}) over {steps} "
            f"steps ({clipped} clipped), {world} process(es), {how}"
        )
        if state is not None:
            say(f"{label}: hybridcomm algorithms {state.algorithms}")
        inner = optimizer.optimizer  # Accelerate's wrapper holds the (hybridcomm) optimizer
        if not args.no_hybridcomm and hasattr(inner, "plan"):
            say(
                f"{label}: hybridcomm optimizer algorithms "
                f"{[b.algorithm for b in inner.plan.buckets]}, last step sent "
                f"{inner.last_step_stats.get('bytes_sent', 0)} bytes"
            )
        if args.params_out:
            torch.save(params, f"{args.params_out}.{overlap}.acc{accumulation}.pt")
    # hybridcomm's threads and channels end here, not in the interpreter's teardown
    inner = getattr(optimizer, "optimizer", optimizer)
    if hasattr(inner, "close"):
        inner.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=16,
        help="samples per micro-batch over all processes",
    )
    p.add_argument(
        "--accumulation",
        default="1",
        help="micro-batches per step; a comma list trains once per value",
    )
    p.add_argument(
        "--overlap",
        default="backward",
        help="backward: the DDP hook (register); forward: hybridcomm's optimizer "
        "(prepare); a comma list trains once per value",
    )
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--max-grad-norm", type=float, default=0.0, help="clip (0: no clipping)")
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP's bucket size (small: several buckets)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--params-out", default=None, help="write the parameters to PATH.<overlap>.acc<K>.pt"
    )
    p.add_argument(
        "--no-hybridcomm",
        action="store_true",
        help="Accelerate's stock path (DDP's own all-reduce; --overlap is ignored)",
    )
    args = p.parse_args()

    handlers = []
    if args.bucket_cap_mb is not None:
        handlers.append(DistributedDataParallelKwargs(bucket_cap_mb=args.bucket_cap_mb))
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=handlers)
    for overlap in args.overlap.split(","):
        if overlap not in ("backward", "forward"):
            raise SystemExit(f"--overlap takes backward or forward, got {overlap!r}")
        for accumulation in [int(a) for a in args.accumulation.split(",")]:
            train(accelerator, args, overlap, accumulation)


if __name__ == "__main__":
    main()
    # Done and closed: skip the interpreter's teardown of torch's C++ objects, where a
    # worker sometimes aborts after a successful run ("terminate called without an
    # active exception"; see examples/train.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
