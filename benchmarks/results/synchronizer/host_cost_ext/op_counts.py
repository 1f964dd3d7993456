"""Instructions the engine spends on one bucket launch's operation on the host path: building
it (``CommEngine._operation``) and running it on the channel's thread (docs/PERFORMANCE.md,
issue 38 tenth part). The conv net of sync_overhead.py at world 1, backward mode, its one
bucket. Run from the repository root:

    valgrind --tool=callgrind --collect-atstart=no --callgrind-out-file=/tmp/oc \\
      .venv/bin/python benchmarks/results/synchronizer/host_cost_ext/op_counts.py > /dev/null 2>&1
    for f in /tmp/oc.1 /tmp/oc.2; do grep '^summary' $f | awk '{print $2 / 20}'; done

The first figure is per build, the second per run (20 of each). Prints nothing itself.
At world 1 the operation moves no byte: what is counted is the Python around it.
"""
import os
import sys
import tempfile

sys.path[:0] = ["benchmarks", "."]
os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sync_overhead import _Run  # noqa: E402


class Sizes:  # sync_overhead.py's defaults
    layers, width, batch, channels, image, conv_batch = 100, 64, 32, 8, 16, 8


torch.set_num_threads(1)
with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1),
                            rank=0, world_size=1)
    run = _Run("backward", "conv", Sizes)
    run.steps(6, keep=False)
    engine = run.opt._hc_sync.group.engine
    torch._C._valgrind_toggle()  # the builds
    ops = [engine._operation(0, 0, True) for _ in range(20)]
    torch._C._valgrind_toggle_and_dump_stats()
    torch._C._valgrind_toggle()  # the runs (at world 1 they change no element)
    for op in ops:
        op()
    torch._C._valgrind_toggle_and_dump_stats()
    run.close()
    dist.destroy_process_group()
