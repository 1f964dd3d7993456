"""Step-time simulation: stock, DDP, hybrid-backward and hybrid-forward, past this machine.

A discrete-event simulation of training steps. The inputs are, per layer, its
forward and backward time and its gradient bytes; per network, the cost
model's alpha (s per message), beta (s per byte), gamma (s per byte reduced),
with a second link class between nodes (``inter_alpha``, ``inter_beta``) and
``cpu_share``: the fraction of the compute a running all-reduce takes from it
(0 on GPUs, where the NIC and NCCL move the bytes; measured on this CPU box).

One compute resource runs forward (layer 0 first), then backward (last
layer first); one communication channel runs all-reduces one at a time, in a
fixed order. How each config uses them:

    stock            after backward, one all-reduce per parameter tensor, in order;
                     the next forward starts when the last one is done
    ddp:CAP          DDP's buckets (1 MB first, then CAP MB, backward order), each
                     all-reduced as soon as its gradients are ready; the next forward
                     waits for all of them
    hybrid-backward  hybridcomm's plan (planner.make_plan under this network's cost
                     model: fusion, butterfly or ring per bucket, split, issue order),
                     each bucket as soon as it is ready; the next forward waits for all
    hybrid-forward   the same plan; layer i's next forward waits only for i's bucket

The step time is the steady-state period (forward start to forward start,
averaged over iterations 2..N), the scaling efficiency compute / step.

    python benchmarks/scale.py                                 # projections, table
    python benchmarks/scale.py --json proj.json --plot proj.png
    python benchmarks/scale.py --validate-against TRAIN_JSON --json OUT   # predict this machine

``--validate-against`` reads a ``benchmarks/train.py`` JSON, profiles VggSmall
per layer here (scaled to that run's measured ``compute`` step), calibrates
alpha/beta/gamma with a short all-reduce sweep on the same network shape (a
namespace per rank under tbf, as train.py did; root) and predicts every
config it measured. Which conclusions rest on which assumptions:
docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # models.py
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hybridcomm.algorithms import Topology  # noqa: E402
from hybridcomm.plan.cost_model import CostModel  # noqa: E402
from hybridcomm.plan.planner import Layer as PlanLayer  # noqa: E402
from hybridcomm.plan.planner import make_plan  # noqa: E402

MB = 1 << 20
DDP_FIRST_BUCKET = 1 * MB  # torch's _DEFAULT_FIRST_BUCKET_BYTES
SIM_CONFIGS = ("stock", "ddp:25", "hybrid-backward", "hybrid-forward")


# ------------------------------------------------------------------ inputs


@dataclass
class LayerProfile:
    """One layer (a module with parameters): its times and its gradient tensors' bytes."""

    name: str
    fwd_s: float
    bwd_s: float
    tensors: List[int]  # bytes of each parameter's gradient

    @property
    def grad_bytes(self) -> int:
        return sum(self.tensors)


@dataclass
class Network:
    """A network for the simulation: the cost model's coefficients and node size."""

    name: str
    model: CostModel
    node_size: Optional[int] = None  # None: one node (a flat network)
    cpu_share: float = 0.0  # compute slowed to (1 - share) while an all-reduce runs
    stock_algorithm: str = "ring"  # what torch's all_reduce does (NCCL / gloo: a ring)
    notes: str = ""

    def topology(self, world: int) -> Topology:
        return Topology(node_size=min(self.node_size or world, world)).resolve(world)

    def allreduce_s(self, nbytes: int, world: int, algorithm: Optional[str] = None) -> float:
        if world <= 1 or nbytes == 0:
            return 0.0
        algo = algorithm or self.stock_algorithm
        if algo == "ring" and self.node_size and 1 < self.node_size < world:
            algo = "hierarchical"  # NCCL's rings cross nodes once per node, as this does
        return self.model.predict(algo, nbytes, world, self.topology(world))


# ------------------------------------------------------------------ the simulation


@dataclass
class Comm:
    """One all-reduce on the channel: ready after the backward of ``after`` (layer
    indices); ``gates``: layers whose next forward waits for it (forward mode)."""

    seconds: float
    after: List[int]
    gates: List[int] = field(default_factory=list)


def simulate(
    layers: Sequence[LayerProfile],
    comms: Sequence[Comm],
    mode: str,
    cpu_share: float = 0.0,
    iterations: int = 6,
) -> Tuple[float, List[tuple]]:
    """Steady-state step time of ``layers`` with ``comms`` (in channel order).

    ``mode``: ``"after"`` (comms start after the whole backward: stock),
    ``"backward"`` (each when ready; the next forward waits for all) or
    ``"forward"`` (each when ready; a layer's forward waits for its gates).
    Returns (seconds per step, timeline of (kind, name, start, end)).

        >>> ls = [LayerProfile("a", 1.0, 2.0, [4]), LayerProfile("b", 1.0, 2.0, [4])]
        >>> simulate(ls, [Comm(3.0, [0, 1], [0, 1])], "after")[0]
        9.0
        >>> simulate(ls, [Comm(1.0, [1], [1]), Comm(1.0, [0], [0])], "forward")[0]
        7.0
        >>> simulate(ls, [Comm(1.0, [1], [1]), Comm(1.0, [0], [0])], "backward")[0]
        7.0
        >>> simulate(ls, [Comm(3.0, [1], [1]), Comm(1.0, [0], [0])], "forward")[0]
        8.0
    """
    n = len(layers)
    tasks = []  # (kind, layer, iteration) in compute order
    for it in range(iterations):
        tasks += [("fwd", i, it) for i in range(n)] + [("bwd", i, it) for i in reversed(range(n))]
    bwd_done: Dict[Tuple[int, int], float] = {}
    comm_done: Dict[Tuple[int, int], float] = {}  # (comm index, iteration) -> end
    gate_of = {g: ci for ci, c in enumerate(comms) for g in c.gates}
    timeline: List[tuple] = []
    t = 0.0
    chan_free, chan_next = 0.0, (0, 0)  # next (comm, iteration) the channel issues
    comm_busy: List[Tuple[float, float]] = []  # intervals the channel is busy
    fwd_start: Dict[int, float] = {}

    def issue_ready(until: float) -> None:
        """Run the channel's comms that are ready by ``until``, in order."""
        nonlocal chan_free, chan_next
        while chan_next[1] < iterations:
            ci, it = chan_next
            if not comms:
                return
            c = comms[ci]
            deps = c.after if mode != "after" else list(range(n))
            if any((i, it) not in bwd_done for i in deps):
                return
            start = max(chan_free, max(bwd_done[(i, it)] for i in deps))
            if start > until:
                return
            chan_free = start + c.seconds
            comm_busy.append((start, chan_free))
            comm_done[(ci, it)] = chan_free
            timeline.append(("comm", f"comm{ci}", start, chan_free))
            chan_next = (ci + 1, it) if ci + 1 < len(comms) else (0, it + 1)

    def waits_for(i: int, prev: int) -> List[Tuple[int, int]]:
        """The (comm, iteration) layer i's forward waits for."""
        if mode == "forward":
            return [(gate_of[i], prev)] if i in gate_of else []
        return [(ci, prev) for ci in range(len(comms))]

    def run_compute(start: float, work: float) -> float:
        """End of ``work`` seconds of compute begun at ``start``: slowed to
        (1 - cpu_share) while the channel is busy."""
        if cpu_share <= 0 or work <= 0:
            return start + work
        now, left = start, work
        for b0, b1 in sorted(comm_busy):
            if b1 <= now:
                continue
            if b0 > now:  # free running until this comm starts
                if now + left <= b0:
                    return now + left
                left -= b0 - now
                now = b0
            slow = (b1 - now) * (1 - cpu_share)
            if slow >= left:
                return now + left / (1 - cpu_share)
            left -= slow
            now = b1
        return now + left

    for kind, i, it in tasks:
        start = t
        if kind == "fwd" and it > 0:
            keys = waits_for(i, it - 1)
            if any(k not in comm_done for k in keys):
                issue_ready(float("inf"))  # all of them are ready: their backward is done
            start = max([t] + [comm_done[k] for k in keys])
        issue_ready(start)
        work = layers[i].fwd_s if kind == "fwd" else layers[i].bwd_s
        end = run_compute(start, work)
        # comms that start during this task slow it too: re-run until stable
        for _ in range(len(comms) + 1):
            before = len(comm_busy)
            issue_ready(end)
            if len(comm_busy) == before:
                break
            end = run_compute(start, work)
        if kind == "fwd" and i == 0:
            fwd_start[it] = start
        if kind == "bwd":
            bwd_done[(i, it)] = end
        timeline.append((kind, layers[i].name, start, end))
        t = end
    issue_ready(float("inf"))
    last = iterations - 1
    end_last = max([t] + [comm_done[(ci, last)] for ci in range(len(comms))])
    period = (
        (end_last - fwd_start[1]) / (iterations - 1) if iterations > 1 else end_last - fwd_start[0]
    )
    return period, timeline


# ------------------------------------------------------------------ configs -> comms


def stock_comms(layers, network, world) -> List[Comm]:
    """One all-reduce per gradient tensor, last layer first (the order the loop
    over model.parameters() takes is first layer first; both are sequential
    after backward, so the order changes only which forward waits)."""
    out = []
    for i, layer in enumerate(layers):
        for b in layer.tensors:
            out.append(Comm(network.allreduce_s(b, world), list(range(len(layers))), [i]))
    return out


def ddp_comms(layers, network, world, cap_mb: float) -> List[Comm]:
    """DDP's buckets: backward order, the first capped at 1 MB, the rest at cap_mb."""
    out, current, size, cap = [], [], 0, DDP_FIRST_BUCKET
    for i in reversed(range(len(layers))):
        current.append(i)
        size += layers[i].grad_bytes
        if size >= cap:
            out.append(Comm(network.allreduce_s(size, world), current, current))
            current, size, cap = [], 0, int(cap_mb * MB)
    if current:
        out.append(Comm(network.allreduce_s(size, world), current, current))
    return out


def hybrid_plan(layers, network, world):
    """hybridcomm's own plan for these layers, as the optimizer makes it after its
    measurement steps (ready times, windows and the forward's order of need)."""
    plan_layers, ready, windows, need = [], {}, {}, {}
    t, total_bwd = 0.0, sum(x.bwd_s for x in layers)
    fwd_before = [sum(x.fwd_s for x in layers[:i]) for i in range(len(layers))]
    p = 0
    for i in reversed(range(len(layers))):
        x = layers[i]
        t += x.bwd_s
        ready[x.name] = t
        windows[x.name] = (total_bwd - t) + fwd_before[i]
        need[x.name] = i
        plan_layers.append(PlanLayer(x.name, list(range(p, p + len(x.tensors))), x.grad_bytes // 4))
        p += len(x.tensors)
    return make_plan(
        plan_layers,
        world_size=world,
        model=network.model,
        strategy="hybrid",
        windows=windows,
        ready=ready,
        need=need,
        topology=network.topology(world),
    )


def hybrid_comms(layers, network, world) -> List[Comm]:
    plan = hybrid_plan(layers, network, world)
    index = {x.name: i for i, x in enumerate(layers)}
    out = []
    topo = network.topology(world)
    for b, s in plan.order:
        bucket = plan.buckets[b]
        a, z = bucket.segments[s]
        members = [index[name] for name in bucket.layers]
        seconds = (
            network.model.predict(bucket.algorithm, (z - a) * 4, world, topo) if world > 1 else 0.0
        )
        last = s == len(bucket.segments) - 1
        out.append(Comm(seconds, members, members if last else []))
    return out


def comms_for(config: str, layers, network, world) -> Tuple[List[Comm], str]:
    if config == "stock":
        return stock_comms(layers, network, world), "after"
    if config.startswith("ddp"):
        cap = float(config.split(":", 1)[1]) if ":" in config else 25.0
        return ddp_comms(layers, network, world, cap), "backward"
    if config in ("hybrid-backward", "hybrid-forward"):
        return hybrid_comms(layers, network, world), config.split("-")[1]
    raise ValueError(f"no model of config {config!r}")


def predict(config: str, layers, network, world) -> float:
    """Seconds per step of ``config`` on ``world`` ranks."""
    comms, mode = comms_for(config, layers, network, world)
    return simulate(layers, comms, mode, network.cpu_share)[0]


# ------------------------------------------------------------------ models

# Projection assumptions (docs/PERFORMANCE.md): an A100-class GPU sustaining
# 125 TFLOP/s (40% of its 312 TFLOP/s fp16 peak), backward = 2x forward,
# fp32 gradients (4 bytes per parameter, as with AMP's fp32 master weights).
GPU_FLOPS = 125e12


def _conv(name, cin, cout, k, hw, bias=True):
    params = [cin * cout * k * k * 4] + ([cout * 4] if bias else [cout * 4, cout * 4])
    return name, 2 * cin * cout * k * k * hw * hw, params


def _linear(name, fin, fout, tokens=1):
    return name, 2 * fin * fout * tokens, [fin * fout * 4, fout * 4]


def vgg16_layers():
    cfg = [
        (64, 224),
        (64, 224),
        (128, 112),
        (128, 112),
        (256, 56),
        (256, 56),
        (256, 56),
        (512, 28),
        (512, 28),
        (512, 28),
        (512, 14),
        (512, 14),
        (512, 14),
    ]
    out, cin = [], 3
    for j, (c, hw) in enumerate(cfg):
        out.append(_conv(f"conv{j + 1}", cin, c, 3, hw))
        cin = c
    return out + [
        _linear("fc6", 25088, 4096),
        _linear("fc7", 4096, 4096),
        _linear("fc8", 4096, 1000),
    ]


def resnet50_layers():
    """Convolutions with their batch norms (weight + bias) as one layer each."""
    out = [_conv("conv1", 3, 64, 7, 112, bias=False)]
    cin = 64
    for s, (blocks, mid, hw) in enumerate([(3, 64, 56), (4, 128, 28), (6, 256, 14), (3, 512, 7)]):
        for b in range(blocks):
            pre = f"layer{s + 1}.{b}"
            out.append(
                _conv(f"{pre}.conv1", cin, mid, 1, hw if b else hw * (2 if s else 1), bias=False)
            )
            out.append(_conv(f"{pre}.conv2", mid, mid, 3, hw, bias=False))
            out.append(_conv(f"{pre}.conv3", mid, mid * 4, 1, hw, bias=False))
            if b == 0:
                out.append(_conv(f"{pre}.downsample", cin, mid * 4, 1, hw, bias=False))
            cin = mid * 4
    return out + [_linear("fc", 2048, 1000)]


def bert_base_layers(seq: int = 128):
    """Per token of a ``seq``-token sequence: embeddings, 12 encoder layers (each
    linear its own layer; attention's score and context products in the output
    projection's FLOPs), the pooler."""
    h, ff = 768, 3072
    out = [("embeddings", 0, [30522 * h * 4, 512 * h * 4, 2 * h * 4, h * 4, h * 4])]
    for k in range(12):
        out.append(_linear(f"layer{k}.qkv", h, 3 * h, seq))
        name, flops, params = _linear(f"layer{k}.attn_out", h, h, seq)
        out.append((name, flops + 2 * 2 * seq * seq * h, params + [h * 4, h * 4]))
        out.append(_linear(f"layer{k}.ffn_in", h, ff, seq))
        name, flops, params = _linear(f"layer{k}.ffn_out", ff, h, seq)
        out.append((name, flops, params + [h * 4, h * 4]))
    return out + [_linear("pooler", h, h)]


PROJECTED_MODELS = {  # name -> (layers, per-GPU batch, what a sample is)
    "VGG-16": (vgg16_layers, 64, "224x224 image"),
    "ResNet-50": (resnet50_layers, 64, "224x224 image"),
    "BERT-base": (bert_base_layers, 32, "128-token sequence"),
}


def profile_from_flops(spec, batch: int, flops: float = GPU_FLOPS) -> List[LayerProfile]:
    return [
        LayerProfile(name, f * batch / flops, 2 * f * batch / flops, tensors)
        for name, f, tensors in spec
    ]


# Per network: intra-node NVLink, 8 GPUs a node; between nodes as named. gamma:
# a reduction kernel at ~400 GB/s of HBM traffic.
NETWORKS = {
    "nvlink+ib": Network(
        "nvlink+ib",
        CostModel(5e-6, 1 / 150e9, 1 / 400e9, inter_alpha=15e-6, inter_beta=1 / 100e9),
        node_size=8,
        notes="NVLink 150 GB/s inside 8-GPU nodes; 4 x 200 Gb/s InfiniBand (100 GB/s) per node",
    ),
    "nvlink+eth": Network(
        "nvlink+eth",
        CostModel(5e-6, 1 / 150e9, 1 / 400e9, inter_alpha=50e-6, inter_beta=1 / 12.5e9),
        node_size=8,
        notes="NVLink 150 GB/s inside 8-GPU nodes; one 100 Gb/s Ethernet (12.5 GB/s) per node",
    ),
}
GPU_COUNTS = [4, 8, 16, 32, 64, 128, 256, 512, 1024]


def project(
    models=PROJECTED_MODELS, networks=NETWORKS, gpus=GPU_COUNTS, configs=SIM_CONFIGS
) -> List[dict]:
    rows = []
    for mname, (spec_fn, batch, _) in models.items():
        layers = profile_from_flops(spec_fn(), batch)
        compute = sum(x.fwd_s + x.bwd_s for x in layers)
        for net in networks.values():
            for p in gpus:
                for config in configs:
                    step = predict(config, layers, net, p)
                    rows.append(
                        {
                            "model": mname,
                            "gpus": p,
                            "network": net.name,
                            "config": config,
                            "step_ms": step * 1e3,
                            "compute_ms": compute * 1e3,
                            "scaling_efficiency": compute / step,
                        }
                    )
    return rows


# ------------------------------------------------------------------ validation


def profile_vgg_small(batch: int, reps: int = 5) -> List[LayerProfile]:
    """VggSmall's per-layer forward and backward seconds here (one thread; medians)."""
    import torch
    import torch.nn.functional as F
    from models import IMAGE_SHAPE, NUM_CLASSES, vgg_small

    torch.set_num_threads(1)
    model = vgg_small(0)
    for m in model.modules():  # full backward hooks cannot see through in-place ops
        if isinstance(m, torch.nn.ReLU):
            m.inplace = False
    layers = [(n, m) for n, m in model.named_modules() if list(m.parameters(recurse=False))]
    fwd = {n: [] for n, _ in layers}
    bwd = {n: [] for n, _ in layers}
    marks: Dict[str, float] = {}

    def pre(name):
        return lambda m, i: marks.__setitem__(name, time.perf_counter())

    def post(name):
        return lambda m, i, o: fwd[name].append(time.perf_counter() - marks[name])

    def bpre(name):
        return lambda m, g: marks.__setitem__("b" + name, time.perf_counter())

    def bpost(name):
        return lambda m, gi, go: bwd[name].append(time.perf_counter() - marks["b" + name])

    for n, m in layers:
        m.register_forward_pre_hook(pre(n))
        m.register_forward_hook(post(n))
        m.register_full_backward_pre_hook(bpre(n))
        m.register_full_backward_hook(bpost(n))
    x = torch.randn(batch, *IMAGE_SHAPE, requires_grad=True)  # the first layer's hook fires
    y = torch.randint(0, NUM_CLASSES, (batch,))
    totals = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        totals.append(time.perf_counter() - t0)
    out = []
    for n, m in layers:
        tensors = [p.numel() * p.element_size() for p in m.parameters(recurse=False)]
        out.append(
            LayerProfile(n, statistics.median(fwd[n][1:]), statistics.median(bwd[n][1:]), tensors)
        )
    # Time outside the hooked layers (activations, pooling, the loss) goes to the
    # layers in proportion, so the profile sums to the whole step.
    whole = statistics.median(totals[1:])
    inside = sum(x.fwd_s + x.bwd_s for x in out)
    return [
        LayerProfile(x.name, x.fwd_s * whole / inside, x.bwd_s * whole / inside, x.tensors)
        for x in out
    ]


def scaled(layers: Sequence[LayerProfile], total_s: float) -> List[LayerProfile]:
    """``layers`` with their times scaled to sum to ``total_s``."""
    now = sum(x.fwd_s + x.bwd_s for x in layers)
    k = total_s / now
    return [LayerProfile(x.name, x.fwd_s * k, x.bwd_s * k, x.tensors) for x in layers]


CAL_SIZES = [16 << 10, 256 << 10, 1 << 20, 4 << 20]


def _calibration_rank(rank, world, sizes, reps):
    import torch
    import torch.distributed as dist

    out = []
    for n in sizes:
        buf = torch.ones(n // 4)
        dist.all_reduce(buf)  # warm
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        out.append((n, statistics.median(times)))
    return out


def measure_gamma() -> float:
    """Seconds per byte of an fp32 sum here (the reduction's term)."""
    import torch

    a, b = torch.ones(1 << 20), torch.ones(1 << 20)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / a.nbytes


def calibrate(nprocs: int, shape: Optional[str], sizes=CAL_SIZES, reps: int = 3) -> CostModel:
    """alpha/beta (gamma measured apart) of torch's all_reduce on ``nprocs`` ranks on
    the network ``shape`` (tbf; None: loopback): a ring fit of a short sweep, and the
    same points as ``native`` (what the planner's ``native`` is)."""
    from hybridcomm.plan.cost_model import fit
    from hybridcomm.tools.launch import launch

    run = lambda setup=None: launch(
        _calibration_rank,
        nprocs,
        sizes,
        reps,  # noqa: E731
        backend="gloo",
        setup=setup,
        timeout=900,
    )
    if shape:
        from hybridcomm.tools.netns import ShapedNetwork

        with ShapedNetwork(nprocs, shape) as net:
            per_rank = run(net.setup)
    else:
        per_rank = run()
    points = [(n, max(r[i][1] for r in per_rank)) for i, (n, _) in enumerate(per_rank[0])]
    gamma = measure_gamma()
    samples = [("ring", n, nprocs, t) for n, t in points] + [
        ("native", n, nprocs, t) for n, t in points
    ]
    model, _ = fit(samples, gamma=gamma)
    return dataclasses.replace(model, meta={"points": points})


def validate(train_json: str, calibration: Optional[CostModel] = None) -> dict:
    """Predict every config of a train.py run; returns the ``validation`` rows and
    what the prediction rested on."""
    with open(train_json) as f:
        doc = json.load(f)
    results, world, shape = doc["results"], doc["nprocs"], doc.get("shape")
    model = calibration or calibrate(world, shape)
    rows = []
    for bs in sorted({r["batch_size"] for r in results}):
        by = {r["config"]: r for r in results if r["batch_size"] == bs}
        comm = by.get("comm")
        share = (comm["cpu_busy_pct"] or 0.0) / 100 if comm else 0.0
        network = Network(shape or "loopback", model, cpu_share=share, stock_algorithm="native")
        layers = scaled(profile_vgg_small(bs), by["compute"]["step_ms"] / 1e3)
        for config, r in by.items():
            if config not in ("stock", "ddp") and not config.startswith(("ddp:", "hybrid-")):
                continue  # compute, comm, and the configs the simulation has no model of
            pred = predict(config, layers, network, world) * 1e3
            rows.append(
                {
                    "config": config,
                    "batch_size": bs,
                    "shape": shape or "loopback",
                    "predicted_ms": pred,
                    "measured_ms": r["step_ms"],
                    "error": pred / r["step_ms"] - 1,
                }
            )
    return {
        "validation": rows,
        "calibration": {
            "alpha": model.alpha,
            "beta": model.beta,
            "gamma": model.gamma,
            "native_alpha": model.native_alpha,
            "native_beta": model.native_beta,
            "points": model.meta.get("points"),
        },
        "train_json": train_json,
    }


# ------------------------------------------------------------------ output


def print_projection(rows):
    keys = list(dict.fromkeys((r["model"], r["network"]) for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    by = {(r["model"], r["network"], r["gpus"], r["config"]): r for r in rows}
    for mname, net in keys:
        compute = next(r["compute_ms"] for r in rows if r["model"] == mname)
        print(f"\n{mname} on {net} (compute {compute:.1f} ms/step): step ms (scaling efficiency)")
        print(f"{'GPUs':>6} " + " ".join(f"{c:>20}" for c in configs))
        for p in sorted({r["gpus"] for r in rows}):
            cells = [by[(mname, net, p, c)] for c in configs]
            print(
                f"{p:>6} "
                + " ".join(
                    f"{c['step_ms']:>11.1f} ({c['scaling_efficiency']:>5.0%})" for c in cells
                )
            )


def plot_projection(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r["model"], r["network"]) for r in rows))
    fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.4), squeeze=False)
    for ax, (mname, net) in zip(axes[0], keys):
        for config in dict.fromkeys(r["config"] for r in rows):
            pts = sorted(
                (r["gpus"], r["scaling_efficiency"])
                for r in rows
                if r["model"] == mname and r["network"] == net and r["config"] == config
            )
            ax.plot(*zip(*pts), marker=".", label=config)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{mname}, {net}", fontsize=9)
        ax.set_xlabel("GPUs")
    axes[0][0].set_ylabel("scaling efficiency (compute / step)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    ap.add_argument(
        "--validate-against",
        metavar="TRAIN_JSON",
        help="a benchmarks/train.py --json file: predict its configs here",
    )
    ap.add_argument("--no-projection", action="store_true", help="only the validation")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--plot", metavar="PNG", help="scaling efficiency per model and network")
    args = ap.parse_args(argv)
    doc: dict = {
        "assumptions": {
            "gpu_flops": GPU_FLOPS,
            "backward_over_forward": 2.0,
            "gradient_bytes_per_param": 4,
            "networks": {
                k: {
                    "notes": n.notes,
                    "alpha": n.model.alpha,
                    "beta": n.model.beta,
                    "gamma": n.model.gamma,
                    "inter_alpha": n.model.inter_alpha,
                    "inter_beta": n.model.inter_beta,
                    "node_size": n.node_size,
                }
                for k, n in NETWORKS.items()
            },
            "models": {
                k: {"batch_per_gpu": b, "sample": s} for k, (_, b, s) in PROJECTED_MODELS.items()
            },
        }
    }
    if args.validate_against:
        out = validate(args.validate_against)
        doc.update(out)
        cal = out["calibration"]
        print(
            f"calibrated here: alpha {cal['alpha'] * 1e6:.0f} us, beta "
            f"{1 / cal['beta'] / 1e6 if cal['beta'] else float('inf'):.1f} MB/s, gamma "
            f"{1 / cal['gamma'] / 1e9 if cal['gamma'] else float('inf'):.2f} GB/s"
        )
        print(
            f"{'config':>16} {'batch':>5} {'shape':>14} {'predicted':>10} {'measured':>9} "
            f"{'error':>6}"
        )
        for r in out["validation"]:
            print(
                f"{r['config']:>16} {r['batch_size']:>5} {r['shape']:>14} "
                f"{r['predicted_ms']:>10.1f} {r['measured_ms']:>9.1f} {r['error']:>+6.0%}"
            )
    if not args.no_projection:
        doc["projection"] = project()
        print_projection(doc["projection"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot and doc.get("projection"):
        plot_projection(doc["projection"], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
