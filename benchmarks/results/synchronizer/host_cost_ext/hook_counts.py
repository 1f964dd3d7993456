"""Instructions the model's torch.compile pre-hook adds to an eager forward, and forward
mode's class switches (docs/PERFORMANCE.md, issue 38 ninth part). Run from the repository
root, one mode per process:

    for m in none hook old-hook switches; do
      valgrind --tool=callgrind --collect-atstart=no --instr-atstart=yes \\
        --callgrind-out-file=/tmp/hc.$m .venv/bin/python \\
        benchmarks/results/synchronizer/host_cost_ext/hook_counts.py $m > /dev/null 2>&1
      echo $m $(grep -h '^summary' /tmp/hc.$m* | awk '{s+=$2} END {print s/20}')
    done

Prints nothing itself: the figure is callgrind's, per forward (the first three modes:
20 forwards of the conv net of sync_overhead.py) or per round trip of 62 parameters to
pending and back (``switches``). ``old-hook``: the hook as it was before, the frame walk
inside ``torch._dynamo.disable`` on every call.
"""

import os
import sys
import tempfile

sys.path[:0] = ["benchmarks", "."]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hybridcomm.sync import grad_fields, pending  # noqa: E402
from sync_overhead import _Run  # noqa: E402

torch.set_num_threads(1)
mode = sys.argv[1]
if mode == "switches":
    ps = [torch.nn.Parameter(torch.zeros(4)) for _ in range(62)]
    pending.defer(ps, lambda p: pending.release_all(ps))
    pending.release_all(ps)

    def work():
        grad_fields.switch_classes(ps, pending._classes, True)
        grad_fields.switch_classes(ps, pending._bases, False)
else:

    class Args:
        layers, width, batch, channels, image, conv_batch = 100, 64, 32, 8, 16, 8

    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1), rank=0, world_size=1
    )
    run = _Run("plain", "conv", Args)
    model, x = run.model, run.x
    import torch._dynamo  # noqa: E402  (loaded by any optimizer step)

    pending._waiting[0] = (None, None)  # an update is registered, as after a step
    pending._arm_compiled_forward_hook()
    if mode == "hook":
        model.register_forward_pre_hook(pending.ApplyBeforeCompiledForward())
    elif mode == "old-hook":

        class Old:
            __call__ = torch._dynamo.disable(pending._legacy_call)

        model.register_forward_pre_hook(Old())

    def work():
        model(x)


for _ in range(3):
    work()
torch._C._valgrind_toggle()
for _ in range(20):
    work()
torch._C._valgrind_toggle_and_dump_stats()
