"""A process group of one rank in the test's own process (gloo over a FileStore):
``DistributedOptimizer``'s hooks, passes, buckets and deferral run for real, with
nothing to send. Multi-rank behaviour is tests/fakes/network.py's (thread ranks)
or the spawned suites'.

Example::

    with one_rank_group(tmp_path):
        opt = hybridcomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              model=model, cost_model="default")
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def one_rank_group(tmp_path):
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        yield
    finally:
        from hybridcomm.comm.calibration import set_active

        set_active(None)
        dist.destroy_process_group()
