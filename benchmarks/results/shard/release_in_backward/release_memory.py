"""Gradient memory a rank's buckets hold when backward ends, shard="gradients" (issue 40).

With the release in backward (HYBRIDCOMM_RELEASE_IN_BACKWARD=1, the default on the
host path) a bucket whose reduce-scatter is done keeps only this rank's part
(sync/scatter.py); with it off (0) every bucket stays whole until the step. Per
step, right after ``backward()`` returns, the bytes of every bucket's buffer or
kept part are summed (the live gradient memory the library holds then; the peak of
it in a step without the release), and the step's wall time is taken (ms, median).

4 ranks, gloo on loopback (2 cores here: the ranks share them), Adam, batch 8,
``benchmarks/models.py``'s transformer and ResNet-18; 3 warm-up steps (the re-plan
after the measured ones comes within them), 6 timed. Buckets as the planner makes
them on loopback (few and large here), and of at most 1 MiB (``fusion_bytes``: as
many as on a slow link, where the planner made 16 for the transformer). Prints one
line per model, plan and setting: the largest over the ranks of the median per step.

    python benchmarks/results/shard/release_in_backward/release_memory.py [checkout] [models]

``models``: a comma list (default ``transformer,resnet18``). With
``HYBRIDCOMM_SIMULATE_GPU=1`` the ranks run the GPU path on the simulated CUDA
runtime (a GPU releases a bucket as its launch is issued, the part copied on the
comm stream): the bytes held are the library's, as on a GPU; the step times are
the simulator's, not a GPU's.
"""

import os
import statistics
import sys
import time

ROOT = os.path.abspath(
    sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), *[".."] * 4)
)
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
os.environ["HYBRIDCOMM_LOG_LEVEL"] = "WARNING"
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import hybridcomm  # noqa: E402
from hybridcomm.tools.launch import launch  # noqa: E402
from models import NUM_CLASSES, build, input_shape  # noqa: E402

WARMUP, TIMED, BATCH = 3, 6, 8


def held_bytes(opt) -> int:
    out = 0
    for s in opt._hc_sync.group.states:
        b = s.bucket
        t = b.buffer if b.buffer is not None else b.part
        out += 0 if t is None else t.numel() * t.element_size()
    return out


def rank(r, w, name, release, fusion):
    os.environ["HYBRIDCOMM_RELEASE_IN_BACKWARD"] = release
    torch.set_num_threads(1)
    model = build(name, seed=0)
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-3),
        model=model,
        overlap="forward",
        shard="gradients",
        measure_iters=2,
        cost_model="default",
        timeout=300,
        **({"fusion_bytes": fusion} if fusion else {}),
    )
    g = torch.Generator().manual_seed(r)
    x = torch.randn(BATCH, *input_shape(name), generator=g)
    y = torch.randint(0, NUM_CLASSES, (BATCH,), generator=g)
    held, times = [], []
    for step in range(WARMUP + TIMED):
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        after_backward = held_bytes(opt)
        opt.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - t0)
            held.append(after_backward)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    buckets = len(opt._hc_sync.group.states)
    opt.close()
    return statistics.median(held), grads, statistics.median(times) * 1e3, buckets


if __name__ == "__main__":
    for name in (sys.argv[2] if len(sys.argv) > 2 else "transformer,resnet18").split(","):
        for fusion, release in [(f, r) for f in (None, 1 << 20) for r in ("0", "1")]:
            out = launch(rank, 4, name, release, fusion, backend="gloo", timeout=900)
            held = max(o[0] for o in out)
            grads, buckets = out[0][1], out[0][3]
            print(
                f"{name:12s} fusion_bytes={fusion or 'planner'} "
                f"release_in_backward={release}: held at backward's end "
                f"{held / 1e6:7.2f} MB of {grads / 1e6:6.2f} MB of gradients "
                f"({held / grads:.2f}), {buckets} buckets; step {max(o[2] for o in out):7.1f} "
                "ms (slowest rank's median)",
                flush=True,
            )
