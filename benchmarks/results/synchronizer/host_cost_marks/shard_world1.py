"""Sharded state at world 1, in one checkout: the added ms over plain of DDP
(batched copy), hybridcomm backward mode, and shard="optimizer" in backward and
none modes, interleaved in 10 rounds (benchmarks/sync_overhead.py's loop and
figures) on the linear stack (200 parameters).

    python benchmarks/results/synchronizer/host_cost_marks/shard_world1.py <checkout>
"""

import os
import sys
import tempfile

ROOT = os.path.abspath(
    sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), *[".."] * 4)
)
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]
os.environ["HYBRIDCOMM_LOG_LEVEL"] = "WARNING"
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import sync_overhead as so  # noqa: E402


class A:
    layers, width, batch, channels, image, conv_batch = 100, 64, 32, 8, 16, 8


dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
torch.set_num_threads(1)
for mode in ("backward", "none"):
    kind, options, zero = so.CONFIGS[mode]
    so.CONFIGS["shard-" + mode] = (kind, dict(options, shard="optimizer"), zero)
runs = {
    c: so._Run(c, "linear", A)
    for c in ("plain", "ddp-batch", "backward", "shard-backward", "shard-none")
}
for r in runs.values():
    r.steps(20, keep=False)
for _ in range(10):
    for r in runs.values():
        r.steps(20, keep=True)
print(
    ROOT,
    " ".join(
        f"{c} {r.medians(runs['plain'])['added']:+.3f}" for c, r in runs.items() if c != "plain"
    ),
)
for r in runs.values():
    r.close()
