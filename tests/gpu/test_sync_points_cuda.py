"""On one real GPU, the host-sync facts the simulated runtime is built on
(issue 29, defect 2), under ``torch.cuda.set_sync_debug_mode("error")``:

- a ``copy_`` between pageable host memory and the device synchronizes (ATen's
  ``memcpy_and_sync``); a device-to-device copy or a ``fill_`` does not; this is
  the rule ``hybridcomm.testing.simgpu`` counts by;
- ``GradBucket.set_flags`` writes every pattern of usage flags with no host sync
  (it copied a host mask before) and exactly the flags ``used()`` reads back.

Not run on a GPU yet (none was available). Run: TRITON_INTERPRET=0 pytest tests/gpu
"""

import contextlib
from itertools import combinations

import torch

from gpu_common import needs_cuda

pytestmark = needs_cuda


@contextlib.contextmanager
def syncs_raise():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _syncs(fn) -> bool:
    """Whether ``fn()`` synchronizes the host with the device."""
    try:
        with syncs_raise():
            fn()
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return True
    return False


def test_the_simulators_copy_rule_holds_on_cuda():
    dev = torch.zeros(8, device="cuda")
    other = torch.ones(8, device="cuda")
    host = torch.zeros(8)
    assert _syncs(lambda: dev.copy_(host))  # host to device, pageable
    assert _syncs(lambda: host.copy_(dev))  # device to host
    assert not _syncs(lambda: dev.copy_(other))
    assert not _syncs(lambda: dev[2:5].fill_(1))
    torch.cuda.synchronize()


def test_flags_are_written_without_a_host_sync():
    from hybridcomm.plan.planner import Bucket
    from hybridcomm.sync.buckets import GradBucket

    n = 5
    params = [torch.nn.Parameter(torch.zeros(3, device="cuda")) for _ in range(n)]
    b = GradBucket(
        Bucket(0, ["l"], list(range(n)), 3 * n, 12 * n, "ring", 0.0),
        params,
        torch.float32,
        None,
        lambda k, dt: torch.empty(k, dtype=dt, device="cuda"),
    )
    for r in range(n + 1):
        for positions in combinations(range(n), r):
            b.flags.fill_(7)
            assert not _syncs(lambda: b.set_flags(set(positions))), positions
            assert b.used() == list(positions)
            assert b.flags.tolist() == [1.0 if i in positions else 0.0 for i in range(n)]
