"""Callgrind counts of one function's calls in a steady step (docs/PERFORMANCE.md, issue
38 twelfth part): the conv net of sync_overhead.py at world 1, forward mode deferring
every update. Each region is counted over 10 steps (one dump each) after 6, in one
process; a region is every call of one function (its callees included), or a phase.
Run from the repository root, under callgrind with collection off at the start:

    rm -f /tmp/rc.*
    PYTHONHASHSEED=0 valgrind --tool=callgrind --collect-atstart=no \\
      --callgrind-out-file=/tmp/rc .venv/bin/python \\
      benchmarks/results/synchronizer/host_cost_guard/region_counts.py forward \\
      to,settle,apply,update,walk,forward,forward_no_compile_hook > /dev/null 2>&1
    i=0; for r in to settle apply update walk forward forward_no_compile_hook; do
      i=$((i + 1)); echo $r $(grep '^summary' /tmp/rc.$i | awk '{print $2 / 10 / 1e3}')K
    done

Regions: ``to`` (``BucketGroup.to``: a phase change, with its pre-hooks on or off),
``settle``, ``apply`` (a deferred update, with the optimizer's step), ``update`` (the
optimizer's step alone), ``walk`` (the first read's search for pending arguments),
``step`` (``opt.step()``), ``forward`` (``model(x)``), and ``forward_no_compile_hook``
(``model(x)`` once the torch.compile pre-hook is off: counted last). Each counted call
also counts ~1.2K of the toggling around it.
"""

import functools
import os
import sys
import tempfile

sys.path[:0] = ["benchmarks", "."]
os.environ["HYBRIDCOMM_DEFER"] = "always"  # (as host_instructions.py runs forward mode)
os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hybridcomm import optimizer  # noqa: E402
from hybridcomm.sync import bucket_group, deferred, pending  # noqa: E402
from sync_overhead import _Run  # noqa: E402

_toggle = torch._C._valgrind_toggle
_counted = [None]  # the region being counted


def _count(owner, name: str, region: str) -> None:
    """Every call of ``owner.name`` counted while ``region`` is."""
    attr = owner.__dict__[name]
    fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        on = _counted[0] == region  # (off in a recursive call: counting already)
        if on:
            _counted[0] = None
            _toggle()
        try:
            return fn(*args, **kwargs)
        finally:
            if on:
                _toggle()
                _counted[0] = region

    kind = type(attr) if isinstance(attr, (staticmethod, classmethod)) else None
    setattr(owner, name, kind(counted) if kind else counted)


_count(bucket_group.BucketGroup, "to", "to")
_count(bucket_group.BucketGroup, "settle", "settle")
_count(deferred.DeferredUpdates, "apply", "apply")
_count(optimizer._DistributedOptimizer, "_hc_update", "update")
_count(pending, "_resolve_in", "walk")


def _phase(counted: bool) -> None:
    if counted:
        _toggle()


class Sizes:  # sync_overhead.py's defaults
    layers, width, batch, channels, image, conv_batch = 100, 64, 32, 8, 16, 8


def main(config: str, regions: list) -> None:
    run = _Run(config, "conv", Sizes)
    run.steps(6, keep=False)
    for region in regions:
        if region == "forward_no_compile_hook":
            run.opt._hc_sync._compiled_hook.remove()
            region = "forward"
        _counted[0] = region
        for _ in range(10):
            run.opt.zero_grad(**run.zero)
            _phase(region == "forward")
            out = run.model(run.x)
            _phase(region == "forward")
            out.square().mean().backward()
            _phase(region == "step")
            run.opt.step()
            _phase(region == "step")
        _toggle()
        torch._C._valgrind_toggle_and_dump_stats()
    run.close()


torch.set_num_threads(1)
with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1
    )
    main(sys.argv[1], sys.argv[2].split(","))
    dist.destroy_process_group()
