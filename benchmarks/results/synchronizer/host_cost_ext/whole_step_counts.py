"""Instructions per whole step (zero_grad, forward, backward, step() counted as one, no
split by phase), each config counted twice in one process, in the order given: a check
on benchmarks/host_instructions.py, whose five configs run once each, in one order, with
a dump per phase (docs/PERFORMANCE.md, issue 38 tenth part). The conv net of
sync_overhead.py at world 1, 10 counted steps after 6. Run from the repository root:

    for order in plain,forward,ddp-batch,backward,plain,forward,ddp-batch,backward \\
                 forward,ddp-batch,plain,backward,forward,plain,ddp-batch,backward; do
      rm -f /tmp/ws.*
      valgrind --tool=callgrind --collect-atstart=no --callgrind-out-file=/tmp/ws \\
        .venv/bin/python benchmarks/results/synchronizer/host_cost_ext/whole_step_counts.py \\
        $order > /dev/null 2>&1
      i=0; for c in ${order//,/ }; do i=$((i + 1))
        echo $c $(grep '^summary' /tmp/ws.$i | awk '{print $2 / 10 / 1e6}'); done
    done

Prints nothing itself: one dump per config, in the order given (millions per step).
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


torch.set_num_threads(1)
with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1),
                            rank=0, world_size=1)
    for config in sys.argv[1].split(","):
        run = _Run(config, "conv", Sizes)
        run.steps(6, keep=False)
        torch._C._valgrind_toggle()
        for _ in range(10):
            run.opt.zero_grad(**run.zero)
            run.model(run.x).square().mean().backward()
            run.opt.step()
        torch._C._valgrind_toggle_and_dump_stats()
        run.close()
    dist.destroy_process_group()
