"""Doctests of the package (``pytest --doctest-modules hybridcomm kernels``).

Each docstring example runs in a namespace with a one-rank gloo process group
(made and destroyed around every example, so nothing leaks into other tests)
and the names the examples use: a small ``model``, a ``loader`` of batches, a
``loss_fn``, a gradient ``grad``. Examples that need a GPU are written as plain
usage blocks, not doctests: they cannot run here.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# Hermetic tests: a start-up probe one test saved must not decide another's plan
# (tests/test_calibration.py turns the cache on where it tests it).
os.environ.setdefault("HYBRIDCOMM_PROBE_CACHE", "0")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _doctest_process_group(request, tmp_path):
    if not isinstance(request.node, pytest.DoctestItem):
        yield
        return
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import hybridcomm

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ns = request.getfixturevalue("doctest_namespace")
    ns.update(
        torch=torch,
        nn=nn,
        dist=dist,
        hybridcomm=hybridcomm,
        os=os,
        model=model,
        loader=[(torch.randn(3, 4), torch.randn(3, 2)) for _ in range(2)],
        loss_fn=nn.functional.mse_loss,
        grad=torch.ones(10),
        rank=0,
        world=1,
    )
    try:
        yield
    finally:
        from hybridcomm.comm.calibration import set_active

        set_active(None)
        dist.destroy_process_group()
