"""What both scripts here share: hybridcomm imported from a checkout, one gloo rank,
one compute thread, and the linear stack of ``benchmarks/sync_overhead.py``."""

import os
import sys
import tempfile


def start(checkout: str):
    """hybridcomm from ``checkout``, the process group of one rank up; returns the module."""
    os.environ.setdefault("HYBRIDCOMM_DEFER", "always")
    os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")
    sys.path.insert(0, checkout)
    import torch
    import torch.distributed as dist

    import hybridcomm

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return hybridcomm


def linear_stack(hybridcomm, mode=None):
    """(model, input, optimizer): 100 x Linear(64, 64), SGD with momentum, wrapped in
    ``mode`` (None: plain torch)."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(100)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    if mode is not None:
        opt = hybridcomm.DistributedOptimizer(
            opt, model=model, overlap=mode, cost_model="probe", measure_iters=0
        )
    return model, torch.randn(32, 64), opt


def steps(model, x, opt, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
