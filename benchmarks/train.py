"""Training benchmark: the thesis experiment (hybrid all-reduce with layer overlapping).

A VGG-like CNN (few conv parameters, large fully-connected layers; see
``models.py``), or with ``--model`` torchvision's ResNet-18 or VGG-11 adapted to
32x32 inputs and 10 classes, trains on synthetic data (fixed seed, each rank its own shard)
on N local ranks over gloo, one launch for the whole run, so every
configuration is measured side by side on the same processes:

    compute          forward, backward, optimizer.step() with no communication at all
                     (same processes, same contention: the floor every config is held to)
    stock            forward, backward, torch.distributed.all_reduce of every gradient
                     (sum, then divide by the world size), optimizer.step()
    comm             one flat torch.distributed.all_reduce of all gradient bytes, no compute
                     (communication alone: bound = max(compute, comm) is what perfect
                     overlap would give if the two never competed for the machine)
    limit            compute's step with comm's flat all_reduce (all gradient bytes, one
                     buffer allocated once) running at the same time in a helper thread (a
                     persistent worker, signalled per step): both start together, the step
                     ends when both have. What perfect overlap reaches on this machine,
                     contention for cores and memory included; it is not bound everywhere
                     (where the cores move the bytes, it is closer to compute + comm)
    ddp              torch.nn.parallel.DistributedDataParallel (its defaults: 25 MB buckets)
    ddp:CAP_MB       DDP with bucket_cap_mb=CAP_MB and gradient_as_bucket_view=True
    ring             hybridcomm.DistributedOptimizer(strategy="ring", overlap="backward")
    butterfly        hybridcomm.DistributedOptimizer(strategy="butterfly", overlap="backward")
    hybrid-backward  hybridcomm.DistributedOptimizer(strategy="hybrid", overlap="backward")
    hybrid-forward   hybridcomm.DistributedOptimizer(strategy="hybrid", overlap="forward")

Sharded optimizer state (issue 40; best with ``--optimizer adam``, whose state is twice the
parameters):

    zero             DDP + torch.distributed.optim.ZeroRedundancyOptimizer(params, the optimizer's
                     class): each rank steps the state of whole parameters it owns (a greedy
                     partition by size), then broadcasts them
    fsdp2            torch.distributed.fsdp.fully_shard on each layer (a conv/linear/norm, a
                     ResNet block, a transformer layer), then the root,
                     reshard_after_forward=False (gloo, CPU); parameters are DTensor shards
    shard-optimizer  hybridcomm.DistributedOptimizer(shard="optimizer"): ZeRO-1, reduce-scatter in
                     backward, 1/P of every bucket's state, the all-gather deferred to the next
                     forward's first read (overlap="forward", the default)
    shard-gradients  shard="gradients": ZeRO-2, also frees each bucket's gradient buffer between
                     step() and the next backward
    shard-optimizer-backward  shard="optimizer", overlap="backward" (the all-gather in step())

Every config starts from a fresh model with the same seed and runs the same
number of steps on the same data. Each step is timed on every rank in a loop
with no barrier inside (a barrier would hide overlap); the step time is the
per-rank median averaged across ranks. exposed comm = step - compute. After
the timed steps every config's parameters are checksummed on every rank and
compared (column ``same``); a mismatch fails the run. ``max|d|`` is the
largest parameter difference from ``stock`` after the same steps (float
reduction order differs between algorithms, so small, not zero).

``/bound`` and ``/limit`` are each config's step time over ``bound`` and over
``limit``'s step time (1.00x on ``/limit``: as good as overlap can get here).

``cpu%`` is the machine's CPU busy share while that config's timed steps
ran (/proc/stat): where ``comm`` keeps the cores busy, the network is CPU-bound
and nothing can overlap; where it leaves them idle, the wire is the bottleneck.

``stateMB`` is the optimizer state each rank keeps (the bytes of every tensor in
``optimizer.state``: ZeroRedundancyOptimizer's local optimizer's, FSDP2's DTensors' local
shards), the largest over ranks; ``/rep`` is that over the replicated state / P (the
replicated state: compute's, the same plain optimizer over the same parameters as ddp's).
The JSON has every rank's.

``peakMB`` is the process's peak resident memory (VmHWM) during that config's
timed steps, the largest over ranks (Linux: the peak is reset through
/proc/self/clear_refs before the timed steps, after freed heap memory is handed
back with malloc_trim; ``-`` where that cannot be done). Every config's model
lives in every process, so it counts all configs' persistent state and differs
between configs by what their steps allocate on top (e.g. gradients held while
the next forward runs). ``footMB`` is the config's own persistent memory: the
resident memory its trainer added from construction through its first round of
steps (model, gradients, optimizer state, communication buffers), the largest
over ranks; the first config (compute) also carries the runtime's one-time
start-up. footMB compares what configs keep between steps, peakMB what their
steps add on top. ``ownMB`` puts the two together per config: its footprint plus the
most its timed steps raised the process's resident memory above where it stood when they
began (the largest over ranks): what that config alone would peak at, up to the runtime's
own start-up (in compute's footprint); it is what shows ZeRO-2's freed gradients, which
peakMB (everyone's persistent state underneath) cannot.

    python benchmarks/train.py                       # 4 ranks, batch 8,16,32,64, all configs
    python benchmarks/train.py --quick               # ~1 minute
    python benchmarks/train.py --configs stock,ddp:2 --batch-sizes 8 --json out.json --plot out.png
    python benchmarks/train.py --shape "rate 100mbit" --batch-sizes 256 \
        --configs comm,stock,ddp:0.5,ddp:2,ddp:25,hybrid-forward          # root: the wire-bound case
    python benchmarks/train.py --model resnet18 --quick   # a real model (vgg11 too), loopback
    python benchmarks/train.py --regime-map --json map.json --plot map.png   # root; ~30 minutes
    python benchmarks/train.py --demo                # what `make demo` runs (< 3 minutes)
    python benchmarks/train.py --optimizer adam --model transformer --batch-sizes 8 \
        --configs ddp,zero,fsdp2,shard-optimizer,shard-gradients   # sharded state (issue 40)
    python benchmarks/train.py --configs hybrid-forward --batch-sizes 32 --trace traces/
                                                     # timelines (ui.perfetto.dev), per rank
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # models.py, also when spawned
import hybridcomm  # noqa: E402
from hybridcomm.tools.bench.report import machine_info  # noqa: E402
from hybridcomm.tools.launch import launch  # noqa: E402
from models import (
    ALL_MODELS,
    DEFAULT_MODEL,
    NUM_CLASSES,
    build,  # noqa: E402
    input_shape,
    model_source,
    param_counts,
)

# config -> (strategy, overlap, shard) for hybridcomm.DistributedOptimizer; None: plain torch.
# "ddp:CAP_MB" (any cap) is accepted besides these; see config_kind.
CONFIGS = {
    "comm": None,
    "limit": None,
    "stock": None,
    "ddp": None,
    "ring": ("ring", "backward", None),
    "butterfly": ("butterfly", "backward", None),
    "hybrid-backward": ("hybrid", "backward", None),
    "hybrid-forward": ("hybrid", "forward", None),
    "zero": None,
    "fsdp2": None,
    # strategy None: the default (shard= reduce-scatters every bucket on the ring)
    "shard-optimizer": (None, "forward", "optimizer"),
    "shard-gradients": (None, "forward", "gradients"),
    "shard-optimizer-backward": (None, "backward", "optimizer"),
}
SHARD_CONFIGS = [
    "ddp",
    "zero",
    "fsdp2",
    "shard-optimizer",
    "shard-gradients",
    "shard-optimizer-backward",
]  # issue 40's comparison (with --optimizer adam)
DEFAULT_CONFIGS = [
    "comm",
    "limit",
    "stock",
    "ddp",
    "ring",
    "butterfly",
    "hybrid-backward",
    "hybrid-forward",
]
LR, MOMENTUM, SEED, DATA_BATCHES = 0.01, 0.9, 1234, 4
ADAM_LR = 1e-3
ADAFACTOR_LR, MUON_LR = 1e-2, 2e-2


def _every(model):
    return list(model.parameters())


def _hidden_matrices(model):
    """Muon's share: the 2-D weights of the hidden layers (not an embedding or the head)."""
    return [
        p
        for n, p in model.named_parameters()
        if p.ndim == 2 and not n.startswith(("embed", "head", "fc", "classifier"))
    ]


def _all_but_hidden_matrices(model):
    hidden = {id(p) for p in _hidden_matrices(model)}
    return [p for p in model.parameters() if id(p) not in hidden]


# --optimizer: name -> the optimizers a trainer steps, each (class, keywords, its parameters)
OPTIMIZERS = {
    "sgd": [(torch.optim.SGD, {"lr": LR, "momentum": MOMENTUM}, _every)],
    "adam": [(torch.optim.Adam, {"lr": ADAM_LR}, _every)],
    "adafactor": [(torch.optim.Adafactor, {"lr": ADAFACTOR_LR}, _every)],
    # as Muon's users run it: Muon for the hidden matrices, AdamW for the rest
    "muon": [
        (torch.optim.Muon, {"lr": MUON_LR}, _hidden_matrices),
        (torch.optim.AdamW, {"lr": ADAM_LR}, _all_but_hidden_matrices),
    ],
}
DEFAULT_OPTIMIZER = "sgd"
# Warm-up covers DistributedOptimizer's re-plan (after measure_iters=3 steps by default).
QUICK = {"batch_sizes": [8, 32], "iters": 6, "warmup": 4, "rounds": 2}
FULL = {"batch_sizes": [8, 16, 32, 64], "iters": 20, "warmup": 5, "rounds": 4}
# --regime-map: every network x batch size, the configs that decide "never slower than DDP".
REGIME_NETWORKS = [None, "rate 1gbit", "rate 300mbit", "rate 100mbit"]
REGIME_BATCHES = [32, 128, 256, 512]  # 512: compute and comm about equal at 100mbit
REGIME_CONFIGS = ["comm", "limit", "stock", "ddp:0.5", "ddp:2", "ddp:25", "hybrid-forward"]
REGIME_RUN = {"iters": 6, "warmup": 4, "rounds": 2}
# --demo: the wire-bound case, quick (make demo; < 3 minutes).
DEMO = {
    "shape": "rate 100mbit",
    "batch_sizes": [256],
    "iters": 4,
    "warmup": 4,
    "rounds": 1,
    "configs": ["comm", "limit", "stock", "ddp:25", "ddp:2", "hybrid-forward"],
}
DEMO_LOOPBACK_BATCHES = [32]  # without namespaces: loopback, a quick batch
UNSYNCED = ("compute", "limit")  # configs that train on local gradients (no averaging)


# A hybridcomm config may carry DistributedOptimizer options after slashes:
# "hybrid-forward/fusion_bytes=4M/split_bytes=0" (sizes take K/M/G), to compare plans.
HYBRID_OPTIONS = {
    "fusion_bytes": "size",
    "split_bytes": "size",
    "lazy_bytes": "size",
    "measure_iters": int,
    "replan_every": int,
    "strategy": str,
    "shard_by": str,
}


def hybrid_options(name: str, takes_options=lambda base: CONFIGS.get(base) is not None):
    """(base config, DistributedOptimizer keywords) of ``name``; ValueError for an
    option that is not one of HYBRID_OPTIONS or a config that takes none
    (``takes_options(base)`` False: by default, any but this script's hybrid ones).

        >>> hybrid_options("hybrid-forward/fusion_bytes=4M/split_bytes=0")
        ('hybrid-forward', {'fusion_bytes': 4194304, 'split_bytes': 0})
        >>> hybrid_options("ddp:2")
        ('ddp:2', {})
    """
    from hybridcomm.base.units import parse_size

    base, *parts = name.split("/")
    if parts and not takes_options(base):
        raise ValueError(f"{name!r}: only hybridcomm's configs take options")
    options = {}
    for part in parts:
        key, _, value = part.partition("=")
        kind = HYBRID_OPTIONS.get(key)
        if kind is None or not value:
            raise ValueError(
                f"{name!r}: expected KEY=VALUE with KEY one of {', '.join(HYBRID_OPTIONS)}"
            )
        options[key] = parse_size(value) if kind == "size" else kind(value)
    return base, options


def config_kind(name: str):
    """("ddp", cap_mb or None) for DDP configs, (name, None) for the others (options
    after a slash belong to the name); ValueError for an unknown name.

        >>> config_kind("ddp:2"), config_kind("ddp"), config_kind("stock")
        (('ddp', 2.0), ('ddp', None), ('stock', None))
    """
    if "/" in name:
        hybrid_options(name)  # checks them
        return name, None
    if name.startswith("ddp:"):
        try:
            cap = float(name[4:])
        except ValueError:
            cap = -1.0
        if not cap > 0:
            raise ValueError(f"{name!r}: DDP's bucket cap must be a positive number of MB")
        return "ddp", cap
    if name not in CONFIGS and name != "compute":  # compute always runs, as the floor
        raise ValueError(f"unknown config {name!r}; choose from {list(CONFIGS)} or ddp:CAP_MB")
    return name, None


def is_ddp(name: str) -> bool:
    return config_kind(name)[0] == "ddp"


def shaped_network(nprocs: int, shape: str):
    """One network namespace per rank, each link shaped by ``tbf <shape>`` (hybridcomm.tools.netns).

    Returns a context manager whose ``setup`` goes to launch(setup=...).
    """
    from hybridcomm.tools.netns import NetnsError, ShapedNetwork

    @contextlib.contextmanager
    def opened():
        try:
            net = ShapedNetwork(nprocs, shape).open()
        except NetnsError as e:  # not root, no iproute2, a bad spec
            raise SystemExit(f"error: {e}") from None
        try:
            yield net
        finally:
            net.close()

    return opened()


# ---------------------------------------------------------------- per rank


def _shard(rank: int, batch_size: int, model: str = DEFAULT_MODEL):
    """This rank's synthetic batches: fixed seed, a different shard on every rank (images,
    or token embeddings for the transformer)."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + rank * 1009 + batch_size)
    return [
        (
            torch.randn(batch_size, *input_shape(model), generator=g),
            torch.randint(0, NUM_CLASSES, (batch_size,), generator=g),
        )
        for _ in range(DATA_BATCHES)
    ]


class _Concurrent:
    """A persistent helper thread that runs ``fn()`` once per ``start()``; ``wait()`` returns
    when that run is done (and raises what it raised). Started once, outside the timed steps,
    so a step pays a wake-up, never a thread's start-up."""

    def __init__(self, fn, name="concurrent"):
        self._fn, self._error, self._stop = fn, None, False
        self._go, self._done = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self):
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop:
                return
            try:
                self._fn()
            except BaseException as e:  # handed to the step that waits on it
                self._error = e
            finally:
                self._done.set()

    def start(self):
        self._done.clear()
        self._go.set()

    def wait(self):
        self._done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self, timeout=10.0):
        self._stop = True
        self._go.set()
        self._thread.join(timeout)  # a daemon: a run stuck on a dead peer cannot hold the exit


FSDP_BLOCKS = ("BasicBlock", "Bottleneck", "TransformerEncoderLayer")


def fsdp_units(model):
    """The modules fsdp2 shards one by one before the root: each ResNet block or
    transformer layer, and each other module that holds parameters itself (a conv, a
    linear, a norm) outside those; outermost first, none inside another."""
    units = []

    def walk(m):
        for child in m.children():
            if type(child).__name__ in FSDP_BLOCKS or (
                any(True for _ in child.parameters(recurse=False))
            ):
                units.append(child)
            else:
                walk(child)

    walk(model)
    return units


def _fully_shard(model):
    """FSDP2 (torch.distributed.fsdp.fully_shard) on every unit, then the root, on a
    one-dimensional CPU mesh of the default (gloo) group; reshard_after_forward=False
    (parameters stay gathered from forward through backward, as ZeRO-2 does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(state) -> int:
    """Bytes of every tensor in an optimizer's ``state`` (DTensors: their local shard)."""
    return sum(
        _local(v).numel() * _local(v).element_size()
        for st in state.values()
        for v in st.values()
        if torch.is_tensor(v)
    )


class _Trainer:
    """One config's model, optimizer and step; ``step`` is what gets timed."""

    def __init__(
        self,
        config: str,
        world: int,
        trace: bool = False,
        model: str = DEFAULT_MODEL,
        optimizer: str = DEFAULT_OPTIMIZER,
    ):
        self.config, self.world = config, world
        self.model = build(model, SEED)
        if config == "fsdp2":  # its parameters become DTensor shards: the optimizer takes those
            _fully_shard(self.model)
        self.params = list(self.model.parameters())
        parts = [(cls, kwargs, select(self.model)) for cls, kwargs, select in OPTIMIZERS[optimizer]]
        bases = [cls(params, **kwargs) for cls, kwargs, params in parts if params]
        self.net, self.opts, self.concurrent = self.model, bases, None
        kind, cap = config_kind(config)
        if config == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.net = torch.nn.parallel.DistributedDataParallel(self.model)
            self.opts = [
                ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
                for cls, kwargs, params in parts
                if params
            ]
        if config in ("comm", "limit"):  # every gradient's bytes in one buffer
            self.flat = torch.zeros(sum(p.numel() for p in self.params))
        if config == "limit":  # that all_reduce beside compute's step, in a persistent thread
            self.concurrent = _Concurrent(lambda: dist.all_reduce(self.flat), "limit-all_reduce")
        elif kind == "ddp":
            extra = {} if cap is None else {"bucket_cap_mb": cap, "gradient_as_bucket_view": True}
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, **extra)
        elif CONFIGS.get(hybrid_options(config)[0]) is not None:
            name, options = hybrid_options(config)
            strategy, overlap, shard = CONFIGS[name]
            extra = {} if shard is None else {"shard": shard}
            if strategy is not None:
                extra["strategy"] = strategy
            self.opts = [
                hybridcomm.DistributedOptimizer(
                    base,
                    model=self.model,
                    overlap=overlap,
                    op="avg",
                    trace=trace,
                    **{**extra, **options},
                )
                for base in bases
            ]

    def step(self, x, y):
        if self.config == "comm":
            dist.all_reduce(self.flat)
            return
        if self.concurrent is not None:  # limit: the all_reduce starts with the compute
            self.concurrent.start()
        for opt in self.opts:
            opt.zero_grad()
        F.cross_entropy(self.net(x), y).backward()
        if self.config == "stock":  # the plain PyTorch pattern, one all_reduce per gradient
            for p in self.params:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(self.world)
        for opt in self.opts:
            opt.step()
        if self.concurrent is not None:  # ... and the step ends when both have
            self.concurrent.wait()

    def state_bytes(self) -> int:
        """The optimizer state this rank keeps, in bytes: ZeroRedundancyOptimizer's local
        optimizer's; FSDP2's DTensors' local shards; shard=: this rank's slices'."""
        return sum(
            state_bytes(opt.optim.state if self.config == "zero" else opt.state)
            for opt in self.opts
        )

    def flat_params(self) -> torch.Tensor:
        """Every parameter, flattened and concatenated, as this rank holds it whole (FSDP2:
        the shards all-gathered, a collective every rank calls alike)."""
        if self.config == "fsdp2":
            return torch.cat(
                [p.detach().full_tensor().reshape(-1) for p in self.model.parameters()]
            )
        return _flat_params(self.model)

    def plan(self):
        """hybridcomm's plan table as it stands now, or None."""
        if not CONFIGS.get(hybrid_options(self.config)[0]):
            return None
        plans = [str(opt.plan) for opt in self.opts if getattr(opt, "plan", None) is not None]
        return "\n".join(plans) or None

    def library_stats(self):
        """(exposed_comm_s, comm_busy_s) from hybridcomm's last step, None where absent."""
        stats = [getattr(opt, "last_step_stats", None) or {} for opt in self.opts]
        if not any(stats):
            return None, None
        # (several optimizers: their communication shares one wire, one after another)
        return tuple(
            sum(st.get(k) or 0.0 for st in stats) for k in ("exposed_comm_s", "comm_busy_s")
        )

    def finish(self):
        """Complete all communication and pending updates (outside the timed steps)."""
        for opt in self.opts:
            if hasattr(opt, "synchronize"):
                opt.synchronize()

    def close(self):
        if self.concurrent is not None:
            self.concurrent.close()
        for opt in self.opts:
            if hasattr(opt, "close"):
                opt.close()


def _flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _checksum(flat: torch.Tensor) -> torch.Tensor:
    """A bitwise checksum: position-weighted sum of the fp32 bit patterns (wraps in int64)."""
    bits = flat.contiguous().view(torch.int32).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64) % 1_000_003 + 1
    return (bits * weights).sum().reshape(1)


def _median_or_none(xs):
    """Median, or None unless every step reported a value (stats may be absent early on)."""
    return statistics.median(xs) if xs and None not in xs else None


def cpu_times():
    """(busy, total) jiffies of the whole machine, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _status_kb(field: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM), None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _libc_malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL(None).malloc_trim  # glibc only
    except (OSError, AttributeError, TypeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def resident_kb(trim: bool = False) -> Optional[int]:
    """This process's resident memory (VmRSS) in kB; ``trim`` first hands freed heap memory
    back to the OS (glibc malloc_trim), so what is left is what is live. None elsewhere."""
    if trim and _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
    return _status_kb("VmRSS")


def reset_peak_rss() -> bool:
    """Set this process's peak resident memory (VmHWM) to its current one (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_kb() -> Optional[int]:
    """This process's peak resident memory (VmHWM) in kB since start or the last reset."""
    return _status_kb("VmHWM")


def _run_steps(trainer, data, first, untimed, timed, record, cpu, peak=None):
    """``untimed + timed`` steps; each timed one goes to ``record(seconds, stats)``;
    the machine's CPU jiffies over the timed steps are added to ``cpu`` [busy, total];
    ``peak`` [kB] is raised to the process's peak resident memory over the timed steps
    (set to None where the peak cannot be reset and read)."""
    for i in range(untimed + timed):
        if i == untimed:
            if peak is not None and peak[0] is not None and not reset_peak_rss():
                peak[0] = None
            before = cpu_times()
        x, y = data[(first + i) % len(data)]
        t0 = time.perf_counter()
        trainer.step(x, y)
        dt = time.perf_counter() - t0
        if i >= untimed:
            record(dt, trainer.library_stats())
    after = cpu_times()
    if timed and peak is not None and peak[0] is not None:
        hwm = peak_rss_kb()
        peak[0] = None if hwm is None else max(peak[0], hwm)
    if timed and before and after:
        cpu[0] += after[0] - before[0]
        cpu[1] += after[1] - before[1]
    return first + untimed + timed


def _same_across_ranks(flat, world) -> bool:
    mine = _checksum(flat)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def reference_config(names):
    """What ``max|d|`` is measured against: stock, else the first DDP config, else None."""
    return "stock" if "stock" in names else next((c for c in names if is_ddp(c)), None)


def _run_batch_size(
    rank,
    world,
    batch_size,
    configs,
    warmup,
    iters,
    rounds,
    label,
    trace_dir=None,
    model=DEFAULT_MODEL,
    optimizer=DEFAULT_OPTIMIZER,
):
    """Every config on this batch size, interleaved in ``rounds`` so slow drift in the
    machine's load (shared cores) hits all configs alike. Each config runs the same
    number of steps on the same data from the same initial ``model`` (a models.ALL_MODELS
    name) with the same ``optimizer`` (an OPTIMIZERS name). With ``trace_dir`` each
    hybridcomm config's timeline is written there per rank."""
    data = _shard(rank, batch_size, model)
    names = ["compute"] + configs
    trainers, rows = {}, []
    per_round = [iters // rounds + (r < iters % rounds) for r in range(rounds)]
    t_start = time.perf_counter()
    try:
        # footprint [kB]: resident memory a config's trainer adds, from its construction
        # through its first round of steps (both measured with freed heap memory trimmed)
        footprint, built = {}, {}
        for c in names:
            before = resident_kb(trim=True)
            trainers[c] = _Trainer(
                c, world, trace=trace_dir is not None, model=model, optimizer=optimizer
            )
            after = resident_kb(trim=True)
            footprint[c] = None if before is None or after is None else after - before
            built[c] = footprint[c]  # its construction's part alone
        samples = {c: [] for c in names}
        cpu = {c: [0, 0] for c in names}
        peak = {c: [0] for c in names}  # kB, over the timed steps of every round
        own = dict.fromkeys(names, 0)  # kB: footprint + the most its timed steps rose above
        steps_done = dict.fromkeys(names, 0)
        for r, timed in enumerate(per_round):
            for c in names:
                # Freed memory of the configs before is handed back first, so it cannot
                # count in this config's peak; cheap, and outside the timed steps.
                start_kb = resident_kb(trim=True)
                dist.barrier()  # start together; no barrier inside the timed steps
                # Round 0 warms up; later rounds drop one step to refill the pipeline.
                this_round = [None if peak[c][0] is None else 0]
                steps_done[c] = _run_steps(
                    trainers[c],
                    data,
                    steps_done[c],
                    warmup if r == 0 else 1,
                    timed,
                    lambda dt, st, c=c: samples[c].append((dt, *st)),
                    cpu[c],
                    this_round,
                )
                trainers[c].finish()  # its communication done before the next config runs
                # the round's peak over its start, on top of what the config held before it
                # (round 0: its construction alone; later: its whole footprint)
                held = built[c] if r == 0 else footprint[c]
                if this_round[0] is None:  # the peak cannot be reset and read here
                    peak[c][0] = own[c] = None
                else:
                    peak[c][0] = max(peak[c][0], this_round[0])
                    own[c] = (
                        None
                        if own[c] is None or start_kb is None or held is None
                        else max(own[c], held + this_round[0] - start_kb)
                    )
                if r == 0 and footprint[c] is not None:
                    end_kb = resident_kb(trim=True)
                    footprint[c] = (
                        None
                        if start_kb is None or end_kb is None
                        else footprint[c] + end_kb - start_kb
                    )
                if rank == 0:  # progress: a long sweep is never silent
                    so_far = statistics.median(s[0] for s in samples[c]) * 1e3
                    print(
                        f"[train] {label} batch {batch_size} round {r + 1}/{rounds} "
                        f"{c}: {so_far:.0f} ms/step so far ({time.perf_counter() - t_start:.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
        # max|d|: against stock (or DDP where stock is not run). The sharded configs (zero,
        # fsdp2, shard-*) are compared like every other: each rank steps its part of the
        # state, but the parameters they end with are whole on every rank (FSDP2's: its
        # shards all-gathered, full_tensor), and an element-wise optimizer gives DDP's
        # numbers up to the order of the gradient's summation. Their "same" is weaker
        # than a replicated config's, since each part was stepped on one rank and copied to
        # the others: it checks that copy (the all-gather, ZeRO's broadcasts), max|d| the
        # step.
        ref_name, ref_flat = reference_config(configs), None
        for c in names:
            flat = trainers[c].flat_params()
            if c == ref_name:
                ref_flat = flat
            times, lib_exposed, lib_busy = zip(*samples[c])
            rows.append(
                {
                    "config": c,
                    "batch_size": batch_size,
                    "step_s": statistics.median(times),
                    "lib_exposed_s": _median_or_none(lib_exposed),
                    "lib_busy_s": _median_or_none(lib_busy),
                    # compute and limit average no gradients: their replicas differ by design
                    "same": None if c in UNSYNCED else _same_across_ranks(flat, world),
                    "max_abs_diff_vs_stock": (
                        None
                        if ref_flat is None or c in UNSYNCED + ("comm",)
                        else float((flat - ref_flat).abs().max())
                    ),
                    "diff_vs": ref_name,
                    "cpu_busy_pct": 100.0 * cpu[c][0] / cpu[c][1] if cpu[c][1] else None,
                    "peak_rss_mb": None if not peak[c][0] else peak[c][0] / 1024,
                    "footprint_mb": None if footprint[c] is None else footprint[c] / 1024,
                    "own_peak_mb": None if not own[c] else own[c] / 1024,
                    "opt_state_bytes": trainers[c].state_bytes(),
                    "plan": trainers[c].plan() if rank == 0 else None,
                }
            )
        if trace_dir is not None:
            for c, t in trainers.items():
                if hasattr(t.opts[0], "export_trace"):
                    t.opts[0].export_trace(
                        os.path.join(
                            trace_dir,
                            f"{label}-b{batch_size}-{c.replace('/', '+')}-rank{rank}.json",
                        )
                    )
    finally:
        for t in trainers.values():
            t.close()
    return rows


def _rank(
    rank,
    world,
    batch_sizes,
    configs,
    warmup,
    iters,
    rounds,
    label="loopback",
    trace_dir=None,
    model=DEFAULT_MODEL,
    optimizer=DEFAULT_OPTIMIZER,
):
    rows = []
    for bs in batch_sizes:
        rows += _run_batch_size(
            rank, world, bs, configs, warmup, iters, rounds, label, trace_dir, model, optimizer
        )
    return rows


# ---------------------------------------------------------------- driver


def _mean(xs):
    return statistics.mean(xs) if xs else None


def _max_or_none(xs):
    """The largest, or None unless every rank measured one."""
    return max(xs) if xs and None not in xs else None


def aggregate(per_rank, configs, batch_sizes):
    """Per (config, batch size): step time averaged over ranks of per-rank medians, etc."""
    out = {}
    for i, row in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        assert all(
            r["config"] == row["config"] and r["batch_size"] == row["batch_size"] for r in ranks
        )
        lib = [r["lib_exposed_s"] for r in ranks]
        busy = [r["lib_busy_s"] for r in ranks]
        diffs = [
            r["max_abs_diff_vs_stock"] for r in ranks if r["max_abs_diff_vs_stock"] is not None
        ]
        out[(row["config"], row["batch_size"])] = {
            "step_ms": _mean([r["step_s"] * 1e3 for r in ranks]),
            "step_ms_per_rank": [round(r["step_s"] * 1e3, 3) for r in ranks],
            "lib_exposed_comm_ms": _mean([v * 1e3 for v in lib]) if None not in lib else None,
            "lib_comm_busy_ms": _mean([v * 1e3 for v in busy]) if None not in busy else None,
            "same": None if row["same"] is None else all(r["same"] for r in ranks),
            "max_abs_diff_vs_stock": max(diffs) if diffs else None,
            "cpu_busy_pct": row.get("cpu_busy_pct"),  # rank 0's reading: the whole machine
            "diff_vs": row.get("diff_vs"),
            "peak_rss_mb": _max_or_none([r.get("peak_rss_mb") for r in ranks]),
            "peak_rss_mb_per_rank": [r.get("peak_rss_mb") for r in ranks],
            "footprint_mb": _max_or_none([r.get("footprint_mb") for r in ranks]),
            "own_peak_mb": _max_or_none([r.get("own_peak_mb") for r in ranks]),
            "own_peak_mb_per_rank": [r.get("own_peak_mb") for r in ranks],
            "opt_state_bytes_per_rank": [r.get("opt_state_bytes") for r in ranks],
        }
    results = []
    for bs in batch_sizes:
        compute = out[("compute", bs)]["step_ms"]
        stock = out.get(("stock", bs), {}).get("step_ms")
        ddps = {c: out[(c, bs)]["step_ms"] for c in configs if is_ddp(c)}
        best_ddp = min(ddps, key=ddps.get) if ddps else None
        ddp = ddps.get(best_ddp)
        comm = out.get(("comm", bs), {}).get("step_ms")
        bound = max(compute, comm) if comm else None
        limit = out.get(("limit", bs), {}).get("step_ms")
        # the replicated state (compute's: the plain optimizer on every parameter, as
        # ddp's), and the ideal share of it per rank
        replicated = max(out[("compute", bs)]["opt_state_bytes_per_rank"])
        world = len(out[("compute", bs)]["opt_state_bytes_per_rank"])
        for config in ["compute"] + configs:
            r = out[(config, bs)]
            step = r["step_ms"]
            state = r["opt_state_bytes_per_rank"]
            results.append(
                {
                    "config": config,
                    "batch_size": bs,
                    "step_ms": step,
                    "compute_ms": compute,
                    "exposed_comm_ms": step - compute,
                    "bound_ms": bound,
                    "vs_bound": step / bound if bound else None,
                    "limit_ms": limit,
                    "vs_limit": step / limit if limit else None,
                    "best_ddp": best_ddp,
                    "speedup_vs_stock": stock / step if stock else None,
                    "speedup_vs_ddp": ddp / step if ddp else None,
                    "cpu_busy_pct": r["cpu_busy_pct"],
                    "peak_rss_mb": r["peak_rss_mb"],
                    "footprint_mb": r["footprint_mb"],
                    "peak_rss_mb_per_rank": r["peak_rss_mb_per_rank"],
                    "own_peak_mb": r["own_peak_mb"],
                    "own_peak_mb_per_rank": r["own_peak_mb_per_rank"],
                    "opt_state_bytes": max(state),
                    "opt_state_bytes_per_rank": state,
                    "opt_state_replicated_bytes": replicated,
                    "opt_state_ref_bytes": replicated / world,  # DDP's / P
                    "opt_state_vs_ref": max(state) * world / replicated if replicated else None,
                    "diff_vs": r["diff_vs"],
                    "lib_exposed_comm_ms": r["lib_exposed_comm_ms"],
                    "lib_comm_busy_ms": r["lib_comm_busy_ms"],
                    "same": r["same"],
                    "max_abs_diff_vs_stock": r["max_abs_diff_vs_stock"],
                    "step_ms_per_rank": r["step_ms_per_rank"],
                }
            )
    return results


def _fmt(v, spec, width):
    return f"{'-':>{width}}" if v is None else f"{v:>{width}{spec}}"


def _mb(n):
    return None if n is None else n / 1e6


def print_table(results, header):
    print(header)
    w = max([16] + [len(r["config"]) for r in results])
    print(
        f"{'batch':>5} {'config':>{w}} {'step(ms)':>9} {'compute':>8} {'bound':>8} {'limit':>8} "
        f"{'exposed':>8} {'lib_exp':>8} {'/bound':>7} {'/limit':>7} {'vs stock':>8} "
        f"{'vs ddp':>7} {'cpu%':>5} {'peakMB':>7} {'footMB':>7} {'ownMB':>7} {'stateMB':>8} "
        f"{'/rep':>6} {'same':>5} {'max|d|':>8}"
    )
    for r in results:
        same = "-" if r["same"] is None else ("yes" if r["same"] else "NO")
        print(
            f"{r['batch_size']:>5} {r['config']:>{w}} {r['step_ms']:>9.1f} {r['compute_ms']:>8.1f} "
            f"{_fmt(r['bound_ms'], '.1f', 8)} {_fmt(r['limit_ms'], '.1f', 8)} "
            f"{r['exposed_comm_ms']:>8.1f} {_fmt(r['lib_exposed_comm_ms'], '.1f', 8)} "
            f"{_fmt(r['vs_bound'], '.2f', 6)}{'x' if r['vs_bound'] else ' '} "
            f"{_fmt(r['vs_limit'], '.2f', 6)}{'x' if r['vs_limit'] else ' '} "
            f"{_fmt(r['speedup_vs_stock'], '.2f', 7)}{'x' if r['speedup_vs_stock'] else ' '} "
            f"{_fmt(r['speedup_vs_ddp'], '.2f', 6)}{'x' if r['speedup_vs_ddp'] else ' '} "
            f"{_fmt(r['cpu_busy_pct'], '.0f', 5)} {_fmt(r['peak_rss_mb'], '.0f', 7)} "
            f"{_fmt(r['footprint_mb'], '.1f', 7)} {_fmt(r.get('own_peak_mb'), '.0f', 7)} "
            f"{_fmt(_mb(r.get('opt_state_bytes')), '.2f', 8)} "
            f"{_fmt(r.get('opt_state_vs_ref'), '.2f', 5)}{'x' if r.get('opt_state_vs_ref') else ' '} "
            f"{same:>5} {_fmt(r['max_abs_diff_vs_stock'], '.1e', 8)}"
        )
    best = {r["batch_size"]: r["best_ddp"] for r in results if r["best_ddp"]}
    if best:
        print(
            "vs ddp: against the fastest DDP config at that batch size ("
            + ", ".join(f"batch {bs}: {c}" for bs, c in best.items())
            + ")"
        )


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch_sizes = sorted({r["batch_size"] for r in results})
    configs = [c for c in dict.fromkeys(r["config"] for r in results) if c != "compute"]
    by = {(r["config"], r["batch_size"]): r for r in results}
    width = 0.8 / max(len(configs), 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 + 0.45 * len(batch_sizes) * len(configs)), 4.5))
    for j, config in enumerate(configs):
        xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(batch_sizes))]
        steps = [by[(config, bs)]["step_ms"] for bs in batch_sizes]
        computes = [by[(config, bs)]["compute_ms"] for bs in batch_sizes]
        bars = ax.bar(xs, steps, width, label=config)
        ax.bar(
            xs,
            computes,
            width,
            color="none",
            edgecolor="black",
            hatch="///",
            linewidth=0,
            label="compute (no comm)" if j == 0 else None,
        )
        for b, bs in zip(bars, batch_sizes):
            s = by[(config, bs)]["speedup_vs_stock"]
            if s and config != "stock":
                ax.annotate(
                    f"{s:.2f}x",
                    (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks(range(len(batch_sizes)), [str(bs) for bs in batch_sizes])
    ax.set_xlabel("batch size per rank")
    ax.set_ylabel("step time (ms), median")
    ax.set_title(
        "training step time per config (hatched: compute with no communication;\n"
        "labels: speed-up vs stock)",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.margins(y=0.08)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_regime_map(cells, path):
    """Heat map: hybrid-forward / best DDP per (network, batch size); < 1 is a win."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    networks = list(dict.fromkeys(c["network"] for c in cells))
    batches = sorted({c["batch_size"] for c in cells})
    by = {(c["network"], c["batch_size"]): c for c in cells}
    grid = [
        [by[(n, b)]["hybrid_vs_best_ddp"] if (n, b) in by else float("nan") for b in batches]
        for n in networks
    ]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(batches), 1.2 + 0.7 * len(networks)))
    im = ax.imshow(grid, cmap="RdYlGn_r", vmin=0.6, vmax=1.4, aspect="auto")
    for i, n in enumerate(networks):
        for j, b in enumerate(batches):
            c = by.get((n, b))
            if c:
                ax.text(
                    j,
                    i,
                    f"{c['hybrid_vs_best_ddp']:.2f}x\n({c['best_ddp']})",
                    ha="center",
                    va="center",
                    fontsize=8,
                )
    busy = {c["network"]: c["comm_cpu_busy_pct"] for c in cells}
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_yticks(
        range(len(networks)),
        [f"{n}\n(comm: {busy[n]:.0f}% CPU)" if busy.get(n) is not None else n for n in networks],
    )
    ax.set_xlabel("batch size per rank")
    ax.set_title("hybrid-forward step time / best DDP (< 1: hybridcomm faster)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def regime_cells(network, results):
    """One regime-map cell per batch size: hybrid-forward against the best DDP, the bound and
    the limit (perfect overlap as measured, contention included)."""
    by = {(r["config"], r["batch_size"]): r for r in results}
    cells = []
    for bs in sorted({r["batch_size"] for r in results}):
        hf = by.get(("hybrid-forward", bs))
        comm = by.get(("comm", bs))
        if hf is None or hf["best_ddp"] is None:
            continue
        best = by[(hf["best_ddp"], bs)]
        ddp = best["step_ms"]
        cells.append(
            {
                "network": network,
                "batch_size": bs,
                "hybrid_forward_ms": hf["step_ms"],
                "best_ddp": hf["best_ddp"],
                "best_ddp_ms": ddp,
                "hybrid_vs_best_ddp": hf["step_ms"] / ddp,
                "stock_ms": by.get(("stock", bs), {}).get("step_ms"),
                "compute_ms": hf["compute_ms"],
                "bound_ms": hf["bound_ms"],
                "hybrid_vs_bound": hf["vs_bound"],
                "limit_ms": hf.get("limit_ms"),
                "hybrid_vs_limit": hf.get("vs_limit"),
                "hybrid_peak_rss_mb": hf.get("peak_rss_mb"),
                "best_ddp_peak_rss_mb": best.get("peak_rss_mb"),
                "comm_cpu_busy_pct": comm and comm["cpu_busy_pct"],
            }
        )
    return cells


def print_regime_map(cells):
    print(
        f"{'network':>14} {'batch':>5} {'hybrid-fwd':>10} {'best DDP':>14} {'ratio':>6} "
        f"{'bound':>8} {'/bound':>6} {'limit':>8} {'/limit':>6} {'comm cpu%':>9}"
    )
    for c in cells:
        print(
            f"{c['network']:>14} {c['batch_size']:>5} {c['hybrid_forward_ms']:>10.1f} "
            f"{c['best_ddp_ms']:>7.1f} {c['best_ddp']:>6} {c['hybrid_vs_best_ddp']:>5.2f}x "
            f"{_fmt(c['bound_ms'], '.1f', 8)} {_fmt(c['hybrid_vs_bound'], '.2f', 5)}x "
            f"{_fmt(c.get('limit_ms'), '.1f', 8)} {_fmt(c.get('hybrid_vs_limit'), '.2f', 5)}"
            f"{'x' if c.get('hybrid_vs_limit') else ' '} "
            f"{_fmt(c['comm_cpu_busy_pct'], '.0f', 9)}"
        )


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        choices=list(ALL_MODELS),
        help=f"what trains (default {DEFAULT_MODEL}; --demo and --regime-map "
        "run only that): "
        + "; ".join(f"{name} = {what}" for name, what in ALL_MODELS.items())
        + ". resnet18, vgg11: torchvision.models where it imports, else "
        "benchmarks/vision_arch.py (written here from the papers, with "
        "torchvision's names; the same weights either way)",
    )
    ap.add_argument(
        "--optimizer",
        default=DEFAULT_OPTIMIZER,
        choices=list(OPTIMIZERS),
        help=f"every config's optimizer (default {DEFAULT_OPTIMIZER}): sgd = "
        f"SGD(lr={LR}, momentum={MOMENTUM}); adam = Adam(lr={ADAM_LR}), whose "
        "state (two moments) the sharded configs split: "
        + ",".join(SHARD_CONFIGS)
        + f"; adafactor = Adafactor(lr={ADAFACTOR_LR}); muon = Muon(lr={MUON_LR}) on the "
        "hidden matrices and AdamW on the rest (two optimizers; hybridcomm shards both, "
        "each with its own granularity)",
    )
    ap.add_argument(
        "--batch-sizes", default=None, help="per rank, comma-separated (default 8,16,32,64)"
    )
    ap.add_argument(
        "--configs",
        default="all",
        help=f"comma-separated from {','.join(CONFIGS)}, ddp:CAP_MB, or all; "
        f"shard stands for {','.join(SHARD_CONFIGS)}; "
        "hybridcomm's take DistributedOptimizer options after slashes, "
        "e.g. hybrid-forward/fusion_bytes=4M/split_bytes=0 (keys: "
        f"{', '.join(HYBRID_OPTIONS)})",
    )
    ap.add_argument("--iters", type=int, default=None, help="timed steps per config (default 20)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps first (default 5; "
        "keep it above DistributedOptimizer's measure_iters=3, when it re-plans)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleave the configs in this many rounds of iters/rounds timed "
        "steps each, so drift in machine load hits all alike (default 4)",
    )
    ap.add_argument(
        "--shape",
        default=None,
        help='e.g. "rate 100mbit": each rank in its own network '
        "namespace, egress shaped with tbf (root)",
    )
    ap.add_argument(
        "--regime-map",
        action="store_true",
        help=f"sweep networks (loopback, {', '.join(n for n in REGIME_NETWORKS if n)}) x "
        f"batch sizes {REGIME_BATCHES} with {','.join(REGIME_CONFIGS)}; "
        "--plot draws the heat map (root for the shaped networks)",
    )
    ap.add_argument(
        "--demo",
        action="store_true",
        help="the wire-bound case (100mbit, batch 256) quick, one summary line; "
        "loopback where namespaces cannot be made (make demo)",
    )
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--plot", default=None, metavar="PATH.png")
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"batch sizes {QUICK['batch_sizes']}, {QUICK['iters']} iters, "
        f"{QUICK['warmup']} warm-up",
    )
    ap.add_argument("--show-plan", action="store_true", help="print hybridcomm's plan per config")
    ap.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="write each hybridcomm config's timeline (Chrome trace) per rank to DIR",
    )
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for each launch")
    args = ap.parse_args(argv)
    if args.regime_map and args.demo:
        ap.error("--regime-map and --demo are separate runs")
    if (args.regime_map or args.demo) and args.model != DEFAULT_MODEL:
        # their batch sizes and networks are sized for the thesis model's step and bytes
        ap.error(
            f"--regime-map and --demo run {DEFAULT_MODEL}; --model {args.model} "
            "is for a single run (--shape, --batch-sizes, --configs)"
        )
    defaults = QUICK if args.quick else REGIME_RUN if args.regime_map else FULL
    if args.demo:
        defaults = DEMO
    args.batch_sizes = (
        [int(b) for b in args.batch_sizes.split(",")]
        if args.batch_sizes
        else REGIME_BATCHES
        if args.regime_map
        else defaults["batch_sizes"]
    )
    args.iters = defaults["iters"] if args.iters is None else args.iters
    args.warmup = defaults["warmup"] if args.warmup is None else args.warmup
    args.rounds = min(defaults["rounds"] if args.rounds is None else args.rounds, args.iters)
    if min(args.iters, args.rounds, args.nprocs, *args.batch_sizes) < 1 or args.warmup < 0:
        ap.error("--iters, --rounds, --nprocs and batch sizes must be >= 1, --warmup >= 0")
    if args.configs == "all":
        names = (
            REGIME_CONFIGS if args.regime_map else DEMO["configs"] if args.demo else DEFAULT_CONFIGS
        )
    else:  # "shard" in the list stands for SHARD_CONFIGS
        names = [
            n
            for c in args.configs.split(",")
            if c.strip()
            for n in (SHARD_CONFIGS if c.strip() == "shard" else [c.strip()])
        ]
    try:
        for c in names:
            config_kind(c)
    except ValueError as e:
        ap.error(str(e))
    args.configs = list(dict.fromkeys(c for c in names if c != "compute"))
    return args


@contextlib.contextmanager
def cost_models_of(label: str):
    """The ranks' saved cost model and start-up probe kept per network (one folder
    per ``label``): a probe of the 100 Mbit/s link must not plan the 1 Gbit/s run
    (the probe cache is keyed by the job, which is the same on every network here).
    A ``HYBRIDCOMM_COST_MODEL`` set by the caller is theirs: kept as it is."""
    from hybridcomm.plan.auto_model import default_path

    if os.environ.get("HYBRIDCOMM_COST_MODEL"):
        yield
        return
    base = os.path.dirname(default_path())
    os.environ["HYBRIDCOMM_COST_MODEL"] = os.path.join(base, f"bench-{label}", "cost_model.json")
    try:
        yield
    finally:
        del os.environ["HYBRIDCOMM_COST_MODEL"]


def measure(args, shape, batch_sizes):
    """One launch of every config on every batch size, on ``shape`` (None: loopback)."""
    network = contextlib.nullcontext() if not shape else shaped_network(args.nprocs, shape)
    label = shape.replace("rate ", "") if shape else "loopback"
    with network as net, cost_models_of(label):
        per_rank = launch(
            _rank,
            args.nprocs,
            batch_sizes,
            args.configs,
            args.warmup,
            args.iters,
            args.rounds,
            label,
            args.trace,
            args.model,
            args.optimizer,
            backend="gloo",
            start_method="forkserver",
            setup=net and net.setup,
            timeout=args.timeout,
        )
        where = f"tbf {net.spec} on each rank's link (a namespace per rank)" if net else "loopback"
    results = aggregate(per_rank, args.configs, batch_sizes)
    plans = {f"{r['config']} batch {r['batch_size']}": r["plan"] for r in per_rank[0] if r["plan"]}
    return where, results, plans


def model_line(model) -> str:
    """The model, where it comes from and its size: ``resnet18 (torchvision 0.28.0; 11.17M
    params, 44.7 MB of gradients, 0.0% in FC layers)``."""
    return (
        f"{model['arch']} ({model['source']}; {model['params'] / 1e6:.2f}M params, "
        f"{model['bytes'] / 1e6:.1f} MB of gradients, "
        f"{model['fc_params'] / model['params']:.1%} in FC layers)"
    )


def header_line(args, model, where):
    return (
        f"training step, {model_line(model)}, {OPTIMIZER_LINES[args.optimizer]}, "
        f"{args.nprocs} ranks on CPU (gloo), network: {where}; median of {args.iters} steps (configs interleaved "
        f"in {args.rounds} rounds, {args.warmup} warm-up) per rank, averaged across ranks; "
        f"exposed = step - compute; lib_exp = the library's own exposed_comm_s; "
        f"bound = max(compute, comm); limit = compute with comm in a thread at the same "
        f"time; peakMB = peak resident memory over the timed steps, footMB = the config's "
        f"own persistent memory, ownMB = footMB + what its timed steps added on top, "
        f"stateMB = optimizer state per rank (10^6 bytes; all: largest over ranks), "
        f"/rep = stateMB over the replicated state / {args.nprocs}; max|d| against "
        f"{reference_config(args.configs) or 'nothing (neither stock nor ddp runs)'}"
    )


OPTIMIZER_LINES = {
    "sgd": f"SGD(lr={LR}, momentum={MOMENTUM})",
    "adam": f"Adam(lr={ADAM_LR})",
    "adafactor": f"Adafactor(lr={ADAFACTOR_LR})",
    "muon": f"Muon(lr={MUON_LR}) on the hidden matrices + AdamW(lr={ADAM_LR}) on the rest",
}


def can_shape() -> Optional[str]:
    """None if this process can make shaped namespaces, else why not."""
    from hybridcomm.tools.netns import NetnsError, ShapedNetwork

    try:
        ShapedNetwork(1, "rate 100mbit")._check()
    except NetnsError as e:
        return str(e)
    return None


def demo_line(results, where) -> str:
    """What the demo shows, in one line."""
    by = {r["config"]: r for r in results}
    hf, stock = by["hybrid-forward"], by.get("stock")
    ddp = by.get(hf["best_ddp"]) if hf["best_ddp"] else None
    parts = [f"hybrid-forward {hf['step_ms']:.0f} ms/step"]
    if stock:
        parts.append(
            f"{1 - hf['step_ms'] / stock['step_ms']:.0%} less time than stock "
            f"({stock['step_ms']:.0f} ms)"
        )
    if ddp:
        parts.append(
            f"{1 - hf['step_ms'] / ddp['step_ms']:.0%} less than the best DDP "
            f"({hf['best_ddp']}, {ddp['step_ms']:.0f} ms)"
        )
    if hf["bound_ms"]:
        parts.append(
            f"{hf['vs_bound']:.2f}x the bound max(compute, comm) = {hf['bound_ms']:.0f} ms"
        )
    if hf.get("limit_ms"):
        parts.append(
            f"{hf['vs_limit']:.2f}x the limit (compute and comm at once) = {hf['limit_ms']:.0f} ms"
        )
    if ddp and hf.get("peak_rss_mb") and ddp.get("peak_rss_mb"):
        parts.append(
            f"peak memory {hf['peak_rss_mb']:.0f} MB vs {ddp['peak_rss_mb']:.0f} MB "
            f"({hf['best_ddp']})"
        )
    return f"demo ({where}, batch {hf['batch_size']}): " + ", ".join(parts)


def main(argv=None):
    args = parse_args(argv)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    command = " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv)
    model = dict(
        param_counts(build(args.model, SEED)), arch=args.model, source=model_source(args.model)
    )
    print(f"[train] model: {model_line(model)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if args.demo and args.shape is None:
        why = can_shape()
        if why is None:
            args.shape = DEMO["shape"]
        else:
            args.batch_sizes = DEMO_LOOPBACK_BATCHES
            print(
                f"[demo] loopback only ({why}). On loopback the cores, not a wire, move the "
                "bytes, so there is nothing for overlap to hide: expect hybridcomm close to "
                "DDP here. Run as root to see the wire-bound case (100mbit).",
                flush=True,
            )
    networks = [args.shape]
    if args.regime_map:
        why = can_shape()
        networks = [s for s in REGIME_NETWORKS if s is None or why is None]
        if why:
            print(f"[regime-map] shaped networks skipped: {why}", flush=True)
    runs, cells, all_plans = {}, [], {}
    for shape in networks:
        where, results, plans = measure(args, shape, args.batch_sizes)
        label = shape.replace("rate ", "") if shape else "loopback"
        runs[label] = {"network": where, "results": results}
        all_plans.update({f"{label} {k}": v for k, v in plans.items()})
        cells += regime_cells(label, results)
        if args.show_plan:
            for config, plan in plans.items():
                print(f"plan for {config}:\n{plan}\n")
        print_table(results, header_line(args, model, where))
        print(flush=True)
    wall = time.perf_counter() - t0
    load = os.getloadavg()[0]
    if args.regime_map:
        print_regime_map(cells)
    if args.demo:
        print(demo_line(runs[next(iter(runs))]["results"], next(iter(runs))))
    print(
        f"({wall:.0f} s wall; load average {load:.1f} on {os.cpu_count()} cores"
        + (": the machine was busy, expect noise)" if load > args.nprocs + 1 else ")")
    )
    all_results = [r for run in runs.values() for r in run["results"]]
    if args.json:
        doc = {
            "nprocs": args.nprocs,
            "model": model,
            "machine": dict(machine_info(), backend="gloo"),
            "command": command,
            "iters": args.iters,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "optimizer": OPTIMIZER_LINES[args.optimizer],
            "loadavg_after": os.getloadavg(),
            "plans": all_plans,
        }
        if args.regime_map:
            doc.update(runs=runs, regime_map=cells)
        else:
            doc.update(results=all_results, shape=args.shape)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    if args.plot:
        (plot_regime_map(cells, args.plot) if args.regime_map else plot(all_results, args.plot))
    broken = [f"{r['config']}@{r['batch_size']}" for r in all_results if r["same"] is False]
    if broken:
        raise SystemExit(f"FAILED: parameters differ across ranks for {', '.join(broken)}")


if __name__ == "__main__":
    main()
