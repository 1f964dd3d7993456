"""Callgrind counts at world 1 on the conv net of sync_overhead.py (docs/PERFORMANCE.md,
issue 38 tenth part). Run from the repository root, under callgrind with collection off at
the start; each count is one dump. Prints nothing itself.

``operation``: one bucket launch's operation on the host path, built 20 times
(``CommEngine._operation``, dump 1), then run 20 times on this thread (dump 2; at world
1 it moves no byte: what is counted is the Python around it), backward mode:

    valgrind --tool=callgrind --collect-atstart=no --callgrind-out-file=/tmp/oc \\
      .venv/bin/python benchmarks/results/synchronizer/host_cost_ext/step_counts.py \\
      operation > /dev/null 2>&1
    for f in /tmp/oc.1 /tmp/oc.2; do grep '^summary' $f | awk '{print $2 / 20}'; done

A comma-separated order of configs: whole steps (zero_grad, forward, backward, step()
as one; 10 counted after 6), one dump per config in that order, in one process: a check
on benchmarks/host_instructions.py, which runs each config once, in one order, with a
dump per phase. Each config twice, in two orders:

    for order in plain,forward,ddp-batch,backward,plain,forward,ddp-batch,backward \\
                 forward,ddp-batch,plain,backward,forward,plain,ddp-batch,backward; do
      rm -f /tmp/ws.*
      valgrind --tool=callgrind --collect-atstart=no --callgrind-out-file=/tmp/ws \\
        .venv/bin/python benchmarks/results/synchronizer/host_cost_ext/step_counts.py \\
        $order > /dev/null 2>&1
      i=0; for c in ${order//,/ }; do i=$((i + 1))
        echo $c $(grep '^summary' /tmp/ws.$i | awk '{print $2 / 10 / 1e6}'); done
    done

One config per process, with a fixed ``PYTHONHASHSEED`` (no config counted before it
moves its heap, and the dicts are laid out the same: two processes of the same code
count the same, to the fourth decimal of millions), one process per seed:

    for seed in 0 1; do for c in plain ddp-batch forward backward none; do
      rm -f /tmp/one.*
      PYTHONHASHSEED=$seed valgrind --tool=callgrind --collect-atstart=no \\
        --callgrind-out-file=/tmp/one \\
        .venv/bin/python benchmarks/results/synchronizer/host_cost_ext/step_counts.py \\
        $c > /dev/null 2>&1
      echo $c $seed $(grep '^summary' /tmp/one.1 | awk '{print $2 / 10 / 1e6}')
    done; done
"""

import os
import sys
import tempfile

sys.path[:0] = ["benchmarks", "."]
os.environ["HYBRIDCOMM_DEFER"] = "always"  # (as host_instructions.py runs forward mode)
os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sync_overhead import _Run  # noqa: E402


class Sizes:  # sync_overhead.py's defaults
    layers, width, batch, channels, image, conv_batch = 100, 64, 32, 8, 16, 8


def operation() -> None:
    run = _Run("backward", "conv", Sizes)
    run.steps(6, keep=False)
    engine = run.opt._hc_sync.group.engine
    torch._C._valgrind_toggle()  # the builds
    ops = [engine._operation(0, 0, True) for _ in range(20)]
    torch._C._valgrind_toggle_and_dump_stats()
    torch._C._valgrind_toggle()  # the runs
    for op in ops:
        op()
    torch._C._valgrind_toggle_and_dump_stats()
    run.close()


def whole_steps(order: str) -> None:
    for config in order.split(","):
        run = _Run(config, "conv", Sizes)
        run.steps(6, keep=False)
        torch._C._valgrind_toggle()
        for _ in range(10):
            run.opt.zero_grad(**run.zero)
            run.model(run.x).square().mean().backward()
            run.opt.step()
        torch._C._valgrind_toggle_and_dump_stats()
        run.close()


torch.set_num_threads(1)
with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1
    )
    operation() if sys.argv[1] == "operation" else whole_steps(sys.argv[1])
    dist.destroy_process_group()
