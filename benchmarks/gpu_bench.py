"""`make gpu-bench`: hybridcomm's speed on one GPU in a few minutes, against torch itself.

Four sections, each timed apart and each allowed to fail alone (its traceback goes to
the JSON and the others still run); the JSON is rewritten after every section, so a
killed run leaves what it had measured:

1. kernels: reduce / pack / unpack against torch's own ops and against a
   device-to-device copy of the same bytes, measured in the same run;
2. step: a training step at world 1 (plain SGD, DDP, hybridcomm's three overlap modes)
   on ResNet-18 and a 12-layer transformer, configs interleaved in rounds;
3. ranks: P = 2 and 4 rank processes on the one GPU (the one-device transport), and
   each rank's peak memory, with ``shard="gradients"`` released in flight and at the step;
4. profile: cProfile and torch.profiler of steady steps (text files beside the JSON).

One timing harness: DEVICE time per call = CUDA events around N back-to-back launches,
queued behind a sleep kernel so that the GPU, not the host, sets the pace, divided by N;
HOST time per call = time.perf_counter over N calls with no sync inside the loop.
GB/s counts each op's own traffic: reduce reads two buffers and writes one; pack,
unpack and copy read and write each byte once.

Without CUDA (or with --dry-run) everything runs at tiny sizes on the simulated CUDA
runtime (HYBRIDCOMM_SIMULATE_GPU=1), so every code path runs on CPU; its figures are
labelled dry run, and its verdict measures nothing.

    python benchmarks/gpu_bench.py --json gpu-bench.json        # make gpu-bench, ~4 min
    python benchmarks/gpu_bench.py --sections kernels,step --quick
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")  # plans go to the JSON, not the log

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # vision_arch, also when spawned
import hybridcomm  # noqa: E402
import hybridcomm.kernels as K  # noqa: E402
from hybridcomm.gpu.runtime import runtime_for  # noqa: E402
from hybridcomm.tools.launch import launch  # noqa: E402
from vision_arch import resnet18  # noqa: E402

KB, MB = 1 << 10, 1 << 20
FULL = dict(
    reduce_bytes=[4 * KB << 2 * i for i in range(9)],  # 4K .. 256M by 4x
    packs=[("large", 8, 4 * MB), ("small", 512, 2 * KB), ("tiny", 4096, 64)],  # count x fp32
    n=(10, 200),
    traffic_per_row=4 << 30,
    host_s_per_row=0.05,
    hold_max_s=0.5,
    resnet=dict(batch=32, image=128, classes=100),
    transformer=dict(layers=12, d=768, heads=12, seq=256, batch=8),
    # hybridcomm measures and re-plans in its first ~4-6 steps: warm up past that
    warm=10,
    synced=10,
    pipelined=30,
    rounds=5,
    ranks=(2, 4),
    rank_batch=16,
    rank_configs=("local", "hc-forward", "hc-none", "hc-backward", "hc-zero2", "hc-zero2-at-step"),
    profile_steps=20,
    torch_profile_steps=5,
    budget=dict(kernels=60, step=120, ranks=100, profile=35),
    total_s=340,
)
SPECS = {
    "full": FULL,
    "quick": dict(
        FULL,
        reduce_bytes=[4 * KB << 4 * i for i in range(5)],  # 4K .. 256M by 16x
        rounds=1,
        synced=5,
        pipelined=10,
        ranks=(2,),
        profile_steps=10,
        rank_configs=("local", "hc-forward", "hc-none"),
        budget=dict(kernels=40, step=60, ranks=50, profile=25),
        total_s=200,
    ),
    # the CPU dry run: every path, tiny sizes, well under a minute on 2 cores
    "dry": dict(
        FULL,
        reduce_bytes=[4 * KB, 64 * KB],
        packs=[("large", 8, 4 * KB), ("small", 32, 64), ("tiny", 64, 4)],
        n=(3, 3),
        hold_max_s=0.01,
        resnet=dict(batch=4, image=16, classes=10),
        transformer=dict(layers=1, d=32, heads=2, seq=8, batch=2),
        warm=6,
        synced=2,
        pipelined=3,
        rounds=1,
        ranks=(2,),
        rank_batch=4,
        profile_steps=3,
        torch_profile_steps=2,
        budget=dict(kernels=30, step=40, ranks=60, profile=20),
        total_s=150,
    ),
}
STEP_CONFIGS = ("plain", "ddp", "hc-forward", "hc-backward", "hc-none")
# CUDA API calls (cudaLaunchKernel, cudaEventQuery, ...) and these, counted per step
PROFILED_OPS = ("torch::autograd::AccumulateGrad", "Optimizer.step", "Optimizer.zero_grad")


def simulate(one_device: bool = False) -> None:
    """The dry run: CPU tensors take the GPU path on the simulated CUDA runtime."""
    os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    os.environ.setdefault("HYBRIDCOMM_SIM_DELAY_US", "5")  # late streams, but a fast dry run
    torch.set_num_threads(1)  # torch's spinning worker threads would starve the simulator's
    if one_device:
        os.environ["HYBRIDCOMM_TRANSPORT"] = "one-device"


# -- the timing harness ----------------------------------------------------------------


class Device:
    """The GPU, or the simulated one in a dry run, through hybridcomm's device runtime
    (events, sync); the sleep kernel that launches queue behind is the one difference."""

    def __init__(self, dry: bool, spec: dict):
        self.dry, self.spec = dry, spec
        self.device = (
            torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
        )
        self.rt = runtime_for(self.device)  # CudaRuntime, or simgpu's SimRuntime
        self.cycles_per_s = None if dry else self._sleep_rate()

    def sync(self) -> None:
        self.rt.synchronize()

    def event(self):
        return self.rt.new_event(timing=True)

    def hold(self, seconds: float) -> None:
        """Keep the GPU busy for ``seconds`` while the host goes on queueing."""
        if self.dry:
            from hybridcomm.testing import simgpu

            simgpu.sleep(seconds)
        else:
            torch.cuda._sleep(max(1, int(seconds * self.cycles_per_s)))

    def _sleep_rate(self) -> float:
        torch.cuda._sleep(1000)
        a, b = self.event(), self.event()
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        return 1e7 / (a.elapsed_time(b) * 1e-3)

    def time_call(self, fn, traffic: int):
        """(device us, host us, N) per call of ``fn`` (see the module docstring)."""
        s = self.spec
        for _ in range(2):  # the first call compiles and builds launch tables
            fn()
        self.sync()
        t0 = time.perf_counter()
        fn()
        est = time.perf_counter() - t0
        self.sync()
        n = int(min(s["traffic_per_row"] / traffic, s["host_s_per_row"] / max(est, 1e-7)))
        n = max(s["n"][0], min(s["n"][1], n))
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n
        self.sync()
        start, end = self.event(), self.event()
        self.hold(min(1.5 * host * n + 1e-4, s["hold_max_s"]))
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / n, host * 1e6, n


def workload(name: str, spec: dict, dry: bool, batch=None) -> dict:
    """A model builder, its fixed batch, loss, optimizer and autocast dtype."""
    if name == "resnet18":
        c = dict(spec["resnet"], **({"batch": batch} if batch else {}))
        build = (
            (lambda: resnet18(num_classes=c["classes"]))
            if not dry
            else (
                lambda: nn.Sequential(
                    nn.Conv2d(3, 8, 3, padding=1, bias=False),
                    nn.BatchNorm2d(8),
                    nn.ReLU(),
                    nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),
                    nn.BatchNorm2d(16),
                    nn.ReLU(),
                    nn.AdaptiveAvgPool2d(1),
                    nn.Flatten(),
                    nn.Linear(16, c["classes"]),
                )
            )
        )
        return dict(
            build=build,
            desc=("tiny conv net" if dry else "ResNet-18")
            + f", batch {c['batch']}, {c['image']}x{c['image']} fp32",
            batch=lambda d: (
                torch.randn(c["batch"], 3, c["image"], c["image"], device=d),
                torch.randint(0, c["classes"], (c["batch"],), device=d),
            ),
            loss=nn.functional.cross_entropy,
            amp=None,
            opt=lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
        )
    c = spec["transformer"]
    return dict(
        build=lambda: nn.Sequential(
            *[
                nn.TransformerEncoderLayer(
                    c["d"], c["heads"], 4 * c["d"], dropout=0.0, batch_first=True, norm_first=True
                )
                for _ in range(c["layers"])
            ]
        ),
        desc=f"{c['layers']} x TransformerEncoderLayer(d {c['d']}, {c['heads']} heads), "
        f"seq {c['seq']}, batch {c['batch']}, bf16 autocast, AdamW",
        batch=lambda d: (torch.randn(c["batch"], c["seq"], c["d"], device=d), None),
        loss=lambda out, _: out.float().square().mean(),
        amp=torch.bfloat16,
        opt=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
    )


class Trainer:
    """One config of one workload: the user's loop, unchanged, and its step."""

    def __init__(self, config: str, wl: dict, dev: Device):
        torch.manual_seed(0)
        self.name, self.wl, self.dev = config, wl, dev
        model = wl["build"]().to(dev.device)
        self.module, self.opt, self.hc = model, wl["opt"](model.parameters()), None
        if config == "ddp":
            self.module = nn.parallel.DistributedDataParallel(
                model, device_ids=None if dev.dry else [dev.device.index]
            )
        elif config.startswith("hc-zero2"):  # sharded state and gradients (issue 40)
            self.opt = self.hc = hybridcomm.DistributedOptimizer(
                self.opt, model=model, overlap="forward", shard="gradients", timeout=120
            )
        elif config.startswith("hc-"):
            self.opt = self.hc = hybridcomm.DistributedOptimizer(
                self.opt, model=model, overlap=config[3:], timeout=120
            )
        self.x, self.y = wl["batch"](dev.device)

    def step(self) -> float:
        """One step; returns the host time until ``opt.step()`` returned."""
        t0 = time.perf_counter()
        self.opt.zero_grad()
        with torch.autocast(
            self.dev.device.type, dtype=self.wl["amp"], enabled=bool(self.wl["amp"])
        ):
            loss = self.wl["loss"](self.module(self.x), self.y)
        loss.backward()
        self.opt.step()
        return time.perf_counter() - t0

    def finish(self) -> None:
        """The end of a timed run: all queued work, communication and deferred updates."""
        if self.hc is not None:
            self.hc.synchronize()
        self.dev.sync()

    def close(self) -> None:
        if self.hc is not None:
            self.hc.close()


def measure_steps(trainers, spec: dict, deadline=None) -> dict:
    """Warm-up, then rounds of synced and pipelined steps with the configs interleaved
    (a change of machine load hits every config alike); one summary per config."""
    t = {tr.name: {"synced": [], "pipelined": [], "host": []} for tr in trainers}
    for tr in trainers:
        for _ in range(spec["warm"]):
            tr.step()
        tr.finish()
    for r in range(spec["rounds"]):
        if r and deadline is not None and time.monotonic() > deadline:
            break
        for tr in trainers:
            for _ in range(spec["synced"]):
                t0 = time.perf_counter()
                tr.step()
                tr.dev.sync()
                t[tr.name]["synced"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            t[tr.name]["host"] += [tr.step() for _ in range(spec["pipelined"])]
            tr.finish()
            t[tr.name]["pipelined"].append((time.perf_counter() - t0) / spec["pipelined"])
    return {
        name: dict(
            synced_ms=1e3 * statistics.median(v["synced"]),
            pipelined_ms=1e3 * statistics.mean(v["pipelined"]),
            host_ms=1e3 * statistics.median(v["host"]),
            rounds=len(v["pipelined"]),
        )
        for name, v in t.items()
    }


def table(title: str, cols, rows) -> None:
    """``rows`` (dicts) in fixed-width columns, nccl-tests style; ``cols`` is
    [(key, header, format spec)]; a missing value prints as '-'."""
    cells = [[format(r[k], f) if r.get(k) is not None else "-" for k, _, f in cols] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(cols)]
    print(f"#\n# {title}\n#", "  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths)))
    for c in cells:
        print(" ", "  ".join(v.rjust(w) for v, w in zip(c, widths)))
    sys.stdout.flush()


# -- the sections ----------------------------------------------------------------------

KERNEL_COLS = [
    ("op", "op", ""),
    ("case", "case", ""),
    ("dtype", "type", ""),
    ("bytes", "size(B)", "d"),
    ("count", "count", "d"),
    ("variant", "variant", ""),
    ("n", "N", "d"),
    ("dev_us", "dev(us)", ".2f"),
    ("host_us", "host(us)", ".2f"),
    ("gbps", "GB/s", ".1f"),
    ("of_copy", "xcopy", ".2f"),
]


def section_kernels(b, sec) -> None:
    dev, spec, d = b.dev, b.spec, b.dev.device
    # dry run: the Triton kernels (interpreted) only if asked for, else their references
    impl = {"impl": "triton"} if b.dry and os.environ.get("TRITON_INTERPRET") == "1" else {}
    rows = sec["rows"] = []

    def measure(op, case, dtype, nbytes, count, variant, fn, traffic, copy=None):
        dev_us, host_us, n = dev.time_call(fn, traffic)
        gbps = traffic / dev_us / 1e3
        rows.append(
            dict(
                op=op,
                case=case,
                dtype=str(dtype)[6:],
                bytes=nbytes,
                count=count,
                variant=variant,
                n=n,
                dev_us=dev_us,
                host_us=host_us,
                gbps=gbps,
                of_copy=gbps / copy["gbps"] if copy else 1.0,
            )
        )
        return rows[-1]

    for dtype in (torch.float32, torch.bfloat16):
        for nbytes in spec["reduce_bytes"]:
            if time.monotonic() > b.section_deadline:
                sec.setdefault("skipped", []).append(f"reduce {dtype} from {nbytes} B: time budget")
                break
            numel = nbytes * 8 // torch.finfo(dtype).bits
            dst, src = (
                torch.zeros(numel, dtype=dtype, device=d),
                torch.ones(numel, dtype=dtype, device=d),
            )
            other = torch.empty_like(dst)
            args = ("reduce", "", dtype, nbytes, numel)
            copy = measure(
                "copy", "", dtype, nbytes, numel, "dst.copy_", lambda: other.copy_(src), 2 * nbytes
            )
            for variant, fn in (
                ("hybridcomm", lambda: K.reduce(dst, src, **impl)),
                ("torch add_", lambda: dst.add_(src)),
                ("hybridcomm scale", lambda: K.reduce(dst, src, scale=0.5, **impl)),
                ("torch add_.mul_", lambda: dst.add_(src).mul_(0.5)),
            ):
                measure(*args, variant, fn, 3 * nbytes, copy)
            dst = src = other = None  # (freed before the next size)
        b.log(f"kernels: reduce {str(dtype)[6:]} done")

    pack_plan, unpack_plan = getattr(K, "pack_plan", None), getattr(K, "unpack_plan", None)
    for case, count, numel in spec["packs"]:
        if time.monotonic() > b.section_deadline:
            sec.setdefault("skipped", []).append(f"pack/unpack {case}: time budget")
            continue
        tensors = [torch.ones(numel, device=d) for _ in range(count)]
        flat, other = torch.empty(count * numel, device=d), torch.empty(count * numel, device=d)
        views = [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
        nbytes = flat.numel() * flat.element_size()
        copy = measure(
            "copy",
            case,
            flat.dtype,
            nbytes,
            count,
            "dst.copy_",
            lambda: other.copy_(flat),
            2 * nbytes,
        )
        variants = {
            "pack": [
                ("hybridcomm", lambda: K.pack(tensors, flat, **impl)),
                ("prepared", pack_plan and pack_plan(tensors, flat)),
                ("torch.cat", lambda: torch.cat(tensors, out=flat)),
                ("_foreach_copy_", lambda: torch._foreach_copy_(views, tensors)),
            ],
            "unpack": [
                ("hybridcomm", lambda: K.unpack(flat, tensors, **impl)),
                ("prepared", unpack_plan and unpack_plan(flat, tensors)),
                ("_foreach_copy_", lambda: torch._foreach_copy_(tensors, views)),
            ],
        }
        for op, fns in variants.items():
            for variant, fn in fns:
                if fn is not None:
                    measure(op, case, flat.dtype, nbytes, count, variant, fn, 2 * nbytes, copy)
        b.log(f"kernels: pack/unpack {count} x {numel} done")
    table(
        "kernels: dev = per call, N back-to-back launches between CUDA events; host = per "
        "call, no sync in the loop; xcopy = GB/s / the copy's of the same bytes" + b.label,
        KERNEL_COLS,
        rows,
    )


STEP_COLS = [
    ("model", "model", ""),
    ("config", "config", ""),
    ("synced_ms", "synced(ms)", ".2f"),
    ("pipelined_ms", "pipelined(ms)", ".2f"),
    ("host_ms", "host(ms)", ".2f"),
    ("added_host_ms", "+host(ms)", ".2f"),
    ("x_ddp", "xDDP", ".3f"),
    ("x_plain", "xplain", ".3f"),
    ("rounds", "rounds", "d"),
]


def section_step(b, sec) -> None:
    b.world1()
    sec["rows"], sec["models"] = [], {}
    names = ("resnet18", "transformer")
    for i, name in enumerate(names):
        wl = workload(name, b.spec, b.dry)
        sec["models"][name] = wl["desc"]
        left = b.section_deadline - time.monotonic()
        deadline = time.monotonic() + left / (len(names) - i)  # an equal share of what is left
        trainers = []
        try:
            trainers = [Trainer(c, wl, b.dev) for c in STEP_CONFIGS]
            got = measure_steps(trainers, b.spec, deadline)
            for c in STEP_CONFIGS:
                g = got[c]
                g.update(
                    model=name,
                    config=c,
                    x_ddp=g["pipelined_ms"] / got["ddp"]["pipelined_ms"],
                    x_plain=g["pipelined_ms"] / got["plain"]["pipelined_ms"],
                    added_host_ms=g["host_ms"] - got["plain"]["host_ms"],
                )
                sec["rows"].append(g)
            sec.setdefault("plans", {})[name] = str(trainers[2].hc.plan)
        except Exception:
            sec.setdefault("errors", []).append(f"{name}:\n{traceback.format_exc()}")
            b.log(f"step: {name} failed (traceback in the JSON)")
        for tr in trainers:
            tr.close()
        del trainers
        b.free()
        b.log(f"step: {name} done")
    table(
        "a step at world 1: synced = sync after each step (median); pipelined = one sync "
        f"after {b.spec['pipelined']} steps (mean); host = until opt.step() returns (median); "
        "+host = over plain; xDDP, xplain = pipelined ratios" + b.label,
        STEP_COLS,
        sec["rows"],
    )


def rank_main(rank: int, world: int, spec_name: str, dry: bool) -> dict:
    """One rank of the ranks section (top level: spawned processes unpickle it)."""
    if dry:
        simulate(one_device=True)
    spec = SPECS[spec_name]
    dev = Device(dry, spec)
    wl = workload("resnet18", spec, dry, batch=spec["rank_batch"])
    out = {}
    for config in spec["rank_configs"]:  # the same on every rank: hybridcomm's steps are collective
        # hc-zero2: each bucket keeps this rank's part from its launch; -at-step: from step()
        os.environ["HYBRIDCOMM_RELEASE_IN_BACKWARD"] = "0" if config.endswith("at-step") else "1"
        if not dry:
            torch.cuda.reset_peak_memory_stats()
        tr = Trainer(config, wl, dev)
        out[config] = measure_steps([tr], dict(spec, rounds=1))[config]
        # the most this rank's tensors took at once (the caching allocator's count)
        out[config]["peak_mb"] = None if dry else torch.cuda.max_memory_allocated() / MB
        if rank == 0 and tr.hc is not None:
            out[config]["plan"] = str(tr.hc.plan)
        tr.close()
    return out


RANK_COLS = [
    ("P", "P", "d"),
    ("config", "config", ""),
    ("rank", "rank", "d"),
    ("synced_ms", "synced(ms)", ".2f"),
    ("pipelined_ms", "pipelined(ms)", ".2f"),
    ("host_ms", "host(ms)", ".2f"),
    ("x_local", "xlocal", ".3f"),
    ("peak_mb", "peak(MiB)", ".1f"),
]


def section_ranks(b, sec) -> None:
    sec["rows"], sec["model"] = (
        [],
        workload("resnet18", b.spec, b.dry, b.spec["rank_batch"])["desc"],
    )
    for i, P in enumerate(b.spec["ranks"]):
        left = b.section_deadline - time.monotonic()
        timeout = left / (len(b.spec["ranks"]) - i)  # an equal share of what is left
        if timeout < 10:
            sec.setdefault("skipped", []).append(f"P={P}: time budget")
            continue
        kw = dict(backend="gloo") if b.dry else dict(one_device=True)
        try:
            got = launch(
                rank_main, P, b.spec_name, b.dry, start_method="spawn", timeout=timeout, **kw
            )
        except Exception:
            sec.setdefault("errors", []).append(f"P={P}:\n{traceback.format_exc()}")
            b.log(f"ranks: P={P} failed (traceback in the JSON)")
            continue
        for config in b.spec["rank_configs"]:
            for rank, res in enumerate(got):
                r = res[config]
                if "plan" in r:
                    sec.setdefault("plans", {})[f"P={P} {config}"] = r.pop("plan")
                r.update(
                    P=P,
                    config=config,
                    rank=rank,
                    x_local=r["pipelined_ms"] / res["local"]["pipelined_ms"],
                )
                sec["rows"].append(r)
        b.log(f"ranks: P={P} done")
    table(
        f"P ranks on the one device: {sec['model']}; local = no communication" + b.label,
        RANK_COLS,
        sec["rows"],
    )


def section_profile(b, sec) -> None:
    b.world1()
    spec, dev = b.spec, b.dev
    wl = workload("resnet18", spec, b.dry)
    hc, plain = Trainer("hc-forward", wl, dev), Trainer("plain", wl, dev)
    for tr in (hc, plain):
        for _ in range(spec["warm"]):
            tr.step()
        tr.finish()
    steps, prof = spec["profile_steps"], cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        hc.step()
    dev.sync()
    prof.disable()
    text = io.StringIO()
    for key in ("tottime", "cumtime"):
        text.write(f"# hc-forward, {steps} steady steps at world 1, top 40 by {key}\n")
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(40)
    sec["files"] = {"cprofile": b.beside("cprofile.txt", text.getvalue())}
    st = pstats.Stats(prof).sort_stats("tottime")
    sec["top_tottime"] = [
        dict(
            function=pstats.func_std_string(f),
            calls_per_step=st.stats[f][1] / steps,
            tottime_us_per_step=1e6 * st.stats[f][2] / steps,
            cumtime_us_per_step=1e6 * st.stats[f][3] / steps,
        )
        for f in st.fcn_list[:15]
    ]
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([] if b.dry else [ProfilerActivity.CUDA])
    n, sec["ops_per_step"] = spec["torch_profile_steps"], {}
    for tr in (hc, plain):
        with warnings.catch_warnings(), profile(activities=acts) as p:
            warnings.simplefilter("ignore")  # torch's note on clearing events per cycle
            for _ in range(n):
                tr.step()
            dev.sync()
        ka = p.key_averages()
        out = ka.table(sort_by="self_cpu_time_total", row_limit=40)
        if not b.dry:
            out += "\n\n" + ka.table(sort_by="self_device_time_total", row_limit=20)
        sec["files"][f"torch-{tr.name}"] = b.beside(f"torch-{tr.name}.txt", out)
        sec["ops_per_step"][tr.name] = {
            e.key: e.count / n for e in ka if e.key.startswith(("cuda",) + PROFILED_OPS)
        }
        tr.finish()
        tr.close()
    table(
        f"cProfile, hc-forward at world 1: top 15 by tottime, per step{b.label}",
        [
            ("tottime_us_per_step", "tottime(us)", ".1f"),
            ("cumtime_us_per_step", "cumtime(us)", ".1f"),
            ("calls_per_step", "calls", ".1f"),
            ("function", "function", ""),
        ],
        sec["top_tottime"],
    )
    ops = sorted(set().union(*sec["ops_per_step"].values()))
    table(
        "torch.profiler: calls per step",
        [("op", "op", "")] + [(c, c, ".1f") for c in sec["ops_per_step"]],
        [dict(op=o, **{c: v.get(o, 0.0) for c, v in sec["ops_per_step"].items()}) for o in ops],
    )


SECTIONS = {
    "kernels": section_kernels,
    "step": section_step,
    "ranks": section_ranks,
    "profile": section_profile,
}


# -- goals and verdict -----------------------------------------------------------------


def goals(sections: dict, dry: bool) -> list:
    """Each goal: what, the value, the target, met (None: not measured, or a dry run)."""
    out = []

    def goal(what, value, target, at_most=True, moonshot=False):
        met = (
            None
            if dry or value is None or target is None
            else (value <= target if at_most else value >= target)
        )
        out.append(dict(goal=what, value=value, target=target, moonshot=moonshot, met=met))

    k = sections.get("kernels", {}).get("rows", [])
    hcv = ("hybridcomm", "hybridcomm scale", "prepared")
    big = [
        r["of_copy"]
        for r in k
        if r["op"] == "reduce" and r["variant"] in hcv[:2] and r["bytes"] >= 64 * MB
    ]
    goal("reduce >= 64 MB: GB/s / copy's (worst)", min(big, default=None), 0.8, at_most=False)
    add = {(r["dtype"], r["bytes"]): r["host_us"] for r in k if r["variant"] == "torch add_"}
    ratios = [
        r["host_us"] / add[(r["dtype"], r["bytes"])]
        for r in k
        if r["op"] == "reduce" and r["variant"] in hcv[:2] and (r["dtype"], r["bytes"]) in add
    ]
    goal(
        "reduce host time / torch add_'s (median)",
        statistics.median(ratios) if ratios else None,
        1.0,
    )
    for op in ("pack", "unpack"):
        best = {
            c: min(
                (r for r in k if r["op"] == op and r["case"] == c and r["variant"] in hcv),
                key=lambda r: r["dev_us"],
                default=None,
            )
            for c in ("large", "small")
        }
        cat = next((r for r in k if r["variant"] == "torch.cat" and r["case"] == "small"), None)
        goal(
            f"{op} large: GB/s / copy's",
            best["large"] and best["large"]["of_copy"],
            0.8,
            at_most=False,
        )
        goal(
            f"{op} small: device time / torch.cat's",
            best["small"] and cat and best["small"]["dev_us"] / cat["dev_us"],
            1.2,
        )
    s = sections.get("step", {}).get("rows", [])
    for model in ("resnet18", "transformer"):
        r = {x["config"]: x for x in s if x["model"] == model}
        hc = [v for c, v in r.items() if c.startswith("hc-")]
        goal(
            f"{model}: hc pipelined / DDP's (worst mode)",
            max((v["x_ddp"] for v in hc), default=None),
            1.0,
        )
        goal(
            f"{model}: hc added host ms over plain (worst) <= DDP's",
            max((v["added_host_ms"] for v in hc), default=None),
            r["ddp"]["added_host_ms"] if "ddp" in r else None,
        )
        goal(
            f"{model}: hc pipelined / plain's (worst)",
            max((v["x_plain"] for v in hc), default=None),
            1.05,
            moonshot=True,
        )
    return out


def verdict(gs: list, dry: bool) -> str:
    if dry:
        return "verdict: dry run: no GPU, nothing measured against the goals"
    need = [g for g in gs if not g["moonshot"]]
    failing = [g["goal"] for g in need if g["met"] is False]
    unmeasured = sum(g["met"] is None for g in need)
    moon = [g["met"] for g in gs if g["moonshot"] and g["met"] is not None]
    parts = [f"{sum(bool(g['met']) for g in need)} of {len(need)} goals met"]
    if unmeasured:
        parts.append(f"{unmeasured} not measured")
    if failing:
        parts.append("failing: " + "; ".join(failing))
    if moon:
        parts.append("moonshot (<= 1.05x plain): " + ("met" if all(moon) else "not met"))
    return "verdict: " + ", ".join(parts)


# -- the run ---------------------------------------------------------------------------


def versions() -> dict:
    """Each one's version, or 'missing' (a CPU build has no CUDA, NCCL or CuPy)."""
    import importlib
    from importlib import metadata

    def installed(*names):
        for n in names:
            try:
                return metadata.version(n)
            except metadata.PackageNotFoundError:
                pass
        return "missing"

    v = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "missing",
        "triton": installed("triton", "pytorch-triton"),
        "cupy": installed("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "hybridcomm": hybridcomm.__version__,
    }
    for name, get in (
        ("nccl (torch)", lambda: ".".join(map(str, torch.cuda.nccl.version()))),
        ("nccl (cupy)", lambda: str(importlib.import_module("cupy.cuda.nccl").get_version())),
    ):
        try:
            v[name] = get()
        except Exception as e:  # noqa: BLE001 - informational only
            v[name] = f"missing ({type(e).__name__})"
    return v


def git_commit() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root, timeout=10).returncode
        return (head + ("+local changes" if dirty else "")) if head else "unknown (no git checkout)"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"


class Bench:
    """The run: the spec, the device, the clock, the JSON and the world-1 group."""

    def __init__(self, args, dry: bool):
        self.t0, self.dry, self.json = time.monotonic(), dry, args.json
        self.spec_name = "dry" if dry else "quick" if args.quick else "full"
        self.spec = SPECS[self.spec_name]
        self.label = " [DRY RUN on CPU: simulated GPU, not GPU figures]" if dry else ""
        self.deadline = self.t0 + self.spec["total_s"]
        if not dry:
            torch.backends.cudnn.benchmark = True
        self.dev = Device(dry, self.spec)
        self.tmp = tempfile.mkdtemp(prefix="gpu-bench-")
        self.result = dict(
            dry_run=dry,
            spec=self.spec_name,
            command=sys.argv,
            started=time.strftime("%Y-%m-%d %H:%M:%S"),
            git=git_commit(),
            device=torch.cuda.get_device_name(0)
            if not dry
            else "cpu (dry run: simulated GPU, HYBRIDCOMM_SIMULATE_GPU=1)",
            versions=versions(),
            sections={},
        )

    def log(self, msg: str) -> None:
        print(
            f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - self.t0:5.1f}s] {msg}", flush=True
        )

    def save(self) -> None:
        tmp = self.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        os.replace(tmp, self.json)  # a killed run never leaves half a file

    def beside(self, suffix: str, text: str) -> str:
        path = f"{os.path.splitext(self.json)[0]}.{suffix}"
        with open(path, "w") as f:
            f.write(text)
        return path

    def world1(self) -> None:
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo" if self.dry else "nccl",
                rank=0,
                world_size=1,
                store=dist.FileStore(os.path.join(self.tmp, "store"), 1),
            )

    def free(self) -> None:
        gc.collect()
        if not self.dry:
            torch.cuda.empty_cache()

    def run(self, name: str) -> None:
        sec = self.result["sections"][name] = dict(status="running", dry_run=self.dry)
        left = self.deadline - time.monotonic()
        budget = min(self.spec["budget"][name], left)
        if budget < 5:
            sec.update(status="skipped", error=f"the run's {self.spec['total_s']} s are spent")
            self.log(f"{name}: skipped (time)")
            return self.save()
        self.section_deadline, start = time.monotonic() + budget, time.monotonic()
        self.log(f"{name}: start (budget {budget:.0f} s)")
        try:
            SECTIONS[name](self, sec)
            sec["status"] = "error" if sec.get("errors") else "ok"
        except Exception:
            sec.update(status="error", error=traceback.format_exc())
            print(sec["error"], file=sys.stderr)
        sec["seconds"] = round(time.monotonic() - start, 1)
        self.log(f"{name}: {sec['status']} in {sec['seconds']} s")
        self.free()
        self.save()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", default="gpu-bench.json", help="results (default gpu-bench.json)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="any of " + ",".join(SECTIONS))
    p.add_argument("--quick", action="store_true", help="fewer sizes and steps")
    p.add_argument(
        "--dry-run", action="store_true", help="the CPU dry run (automatic without CUDA)"
    )
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    if set(sections) - set(SECTIONS):
        p.error(f"unknown sections {sorted(set(sections) - set(SECTIONS))}")
    dry = args.dry_run or not torch.cuda.is_available()
    if dry:
        simulate()
    b = Bench(args, dry)
    r = b.result
    print(
        f"# gpu_bench: {r['device']}{b.label}\n# commit {r['git']}; "
        + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
        flush=True,
    )
    b.save()
    for name in sections:
        b.run(name)
    r["goals"] = goals(r["sections"], dry)
    r["verdict"] = verdict(r["goals"], dry)
    r["wall_s"] = round(time.monotonic() - b.t0, 1)
    table(
        "goals" + b.label,
        [
            ("goal", "goal", ""),
            ("value", "value", ".3f"),
            ("target", "target", ".3f"),
            ("met", "met", ""),
        ],
        r["goals"],
    )
    if dist.is_initialized():
        dist.destroy_process_group()
    b.save()
    print(f"# {r['verdict']}\n# results in {args.json} ({r['wall_s']} s)", flush=True)
    return 1 if any(s["status"] == "error" for s in r["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
