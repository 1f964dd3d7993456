"""Memory of a checkpoint of sharded optimizer state, per rank, against the steady state.

The benchmark transformer trains a few steps with ``DistributedOptimizer(shard=...)``
(1 MiB buckets) on N local ranks (gloo, loopback); then each rank saves a checkpoint
two ways, and a fresh job (after as many steps: its steady state) loads it back; each
rank reports its resident memory (VmRSS, after freed heap memory is handed back)
before and its peak (VmHWM, reset just before) during each:

    dcp save       torch.distributed.checkpoint: get_optimizer_state_dict + dcp.save
                   (each rank hands DCP its own part of the optimizer state)
    dcp load       the fresh job: get_optimizer_state_dict, dcp.load,
                   set_optimizer_state_dict (each rank reads its own part, into its state)
    full save      opt.state_dict() (every rank gathers the whole state: the small-job
                   path) + torch.save on rank 0

Only the optimizer state is saved (the model, replicated under data parallelism, is
every DCP user's alike). glibc hands every allocation over 64 KiB back when it is
freed (``MALLOC_MMAP_THRESHOLD_``, set for the ranks), so the peak is what was live,
not what the heap kept. ``+peakMB`` is the peak over the resident memory before it; the goal for DCP: at
most one bucket's state (``bucketMB``: the optimizer state of the plan's largest
bucket, whole, 10^6 bytes) above the steady state. ``stateMB`` is the state this
rank keeps, ``fullMB`` the whole optimizer state.

    python benchmarks/dcp_memory.py --nprocs 4 --optimizer adam
    python benchmarks/dcp_memory.py --nprocs 4 --optimizer adafactor --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hybridcomm  # noqa: E402
from hybridcomm.tools.launch import launch  # noqa: E402
from models import NUM_CLASSES, build, input_shape  # noqa: E402
from train import peak_rss_kb, reset_peak_rss, resident_kb, state_bytes  # noqa: E402

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
}
STEPS, BATCH = 3, 8
# About what the planner fuses to on a slow link (64 KiB to a few MB): the
# checkpoint's bound, one bucket's state, is then a small part of the whole
FUSION_BYTES = 1 << 20


def _job(model_name, optimizer, shard):
    model = build(model_name, seed=0)
    opt = hybridcomm.DistributedOptimizer(
        OPTIMIZERS[optimizer](model.parameters()),
        model=model,
        shard=shard,
        cost_model="default",
        fusion_bytes=FUSION_BYTES,
        timeout=600,
    )
    return model, opt


def _train(model, opt, rank, model_name):
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn((BATCH,) + tuple(input_shape(model_name)), generator=g)
        y = torch.randint(0, NUM_CLASSES, (BATCH,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.synchronize()


def _measure(fn):
    """(resident MB before, peak MB above it) around ``fn()``."""
    before = resident_kb(trim=True)
    reset_peak_rss()
    fn()
    return before / 1e3, (peak_rss_kb() - before) / 1e3


def _rank(rank, world, model_name, optimizer, shard, path):
    model, opt = _job(model_name, optimizer, shard)
    _train(model, opt, rank, model_name)
    # each parameter's whole state (the consolidated one; its index is the plan's: one
    # group of model.parameters()), and so each bucket's
    whole = {
        i: sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        for i, st in opt.state_dict()["state"].items()
    }
    bucket_mb = max(sum(whole.get(i, 0) for i in b.params) for b in opt.plan.buckets) / 1e6
    out = {
        "stateMB": state_bytes(opt.state) / 1e6,
        "bucketMB": bucket_mb,
        "fullMB": sum(whole.values()) / 1e6,
    }

    def dcp_save():
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)

    out["dcp save"] = _measure(dcp_save)
    dist.barrier()

    def full_save():
        state = opt.state_dict()
        if rank == 0:
            torch.save(state, os.path.join(os.path.dirname(path), "full.pt"))
        del state

    out["full save"] = _measure(full_save)
    opt.close()
    model = opt = None  # (freed before the fresh job)
    fresh_model, fresh_opt = _job(model_name, optimizer, shard)
    # its steady state: its own steps (so torch's get_state_dict need not make the state
    # with a step of zero gradients, as it does for an optimizer without any), then
    # zero_grad(), as a job is between steps
    _train(fresh_model, fresh_opt, rank, model_name)
    fresh_opt.zero_grad()

    def dcp_load():
        state = {"optim": get_optimizer_state_dict(fresh_model, fresh_opt)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(fresh_model, fresh_opt, state["optim"])

    out["dcp load"] = _measure(dcp_load)
    fresh_opt.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--optimizer", default="adam", choices=list(OPTIMIZERS))
    ap.add_argument("--shard", default="optimizer", choices=["optimizer", "gradients"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 << 10))  # (the ranks inherit it)
    with tempfile.TemporaryDirectory() as tmp:
        results = launch(
            _rank,
            args.nprocs,
            args.model,
            args.optimizer,
            args.shard,
            os.path.join(tmp, "ckpt"),
            backend="gloo",
            timeout=1200,
            start_method="spawn",
        )
    print(
        f"checkpoint memory per rank, {args.model}, {args.optimizer}, shard={args.shard!r}, "
        f"{args.nprocs} ranks (gloo, loopback); MB = 10^6 bytes; +peakMB = peak resident "
        "memory above the resident memory before (VmHWM - VmRSS)"
    )
    print(f"{'rank':>4} {'stateMB':>8} {'bucketMB':>8} {'fullMB':>7}  " + "  ".join(
        f"{what + ' +peakMB':>18}" for what in ("dcp save", "dcp load", "full save")
    ))  # fmt: skip
    for rank, r in enumerate(results):
        cells = "  ".join(f"{r[what][1]:>18.2f}" for what in ("dcp save", "dcp load", "full save"))
        print(f"{rank:>4} {r['stateMB']:>8.2f} {r['bucketMB']:>8.2f} {r['fullMB']:>7.2f}  {cells}")
    worst = max(max(r["dcp save"][1], r["dcp load"][1]) - r["bucketMB"] for r in results)
    print(
        "goal (DCP's peak <= steady + one bucket's state on every rank): "
        + ("met" if worst <= 0 else f"missed by {worst:.1f} MB")
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": results}, f, indent=1)


if __name__ == "__main__":
    main()
