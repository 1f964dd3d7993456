"""The one-device transport (issue 29): P rank processes on one GPU, exchanging by
device-to-device copies through mailboxes ordered by shared events, under the
production transport, executor, kernels and optimizer. Run here on the
simulated GPU (its streams run late, so a missing event wait corrupts sums);
tests/gpu/ runs the same on a real GPU.

Mailboxes of 1-2 KiB make every message move in several pieces."""

import os
import time

import pytest
import torch

import hybridcomm
from multiproc import run_ranks
from test_gpu_path import ATOL, COMBOS, RTOL, _single, _train_odd

ALGORITHMS = hybridcomm.algorithms.ALGORITHMS + ("native",)


def _one_device(mailbox="1K"):
    os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    os.environ["HYBRIDCOMM_TRANSPORT"] = "one-device"
    os.environ["HYBRIDCOMM_ONE_DEVICE_MAILBOX"] = mailbox


def _values(n, rank, dtype):
    """Small integers: their sum is exact in every dtype and any order."""
    return ((torch.arange(n) % 13) + rank).to(dtype)


def _every_algorithm(rank, world, dtype_name, sizes):
    _one_device()
    from hybridcomm.comm.transport.select import _device_transports
    from hybridcomm.testing import simgpu

    dtype = getattr(torch, dtype_name)
    out = {}
    for algo in ALGORITHMS:
        for n in sizes:
            out[(algo, n)] = hybridcomm.all_reduce(
                _values(n, rank, dtype), op="sum", algorithm=algo, timeout=60
            )
    simgpu.check()
    kinds = [t.kind for t in _device_transports.values()]
    return out, kinds, simgpu.stats()


@pytest.mark.parametrize("world,dtype_name", [(3, "float32"), (5, "float16"), (6, "bfloat16")])
def test_every_algorithm_is_exact_over_one_device(world, dtype_name):
    sizes = [1, 7, 1000]  # 1000 x 2-4 bytes: several pieces of a 1 KiB mailbox
    dtype = getattr(torch, dtype_name)
    for out, kinds, stats in run_ranks(world, _every_algorithm, dtype_name, sizes, timeout=120):
        assert kinds == ["one-device"]
        assert stats["defects"] == 0 and stats["host_syncs"] == 0, stats
        assert stats["launches:copy"] > 0  # bytes moved by device copies, not NCCL
        for (algo, n), got in out.items():
            want = sum(_values(n, r, torch.float64) for r in range(world)).to(dtype)
            assert torch.equal(got, want), (algo, n, (got.double() - want.double()).abs().max())


def _train_over_one_device(rank, world, combos):
    _one_device("4M")  # the start-up probe's messages in one piece each
    return _train_odd(rank, world, combos, simulate=True)


def test_the_optimizer_over_one_device_equals_one_process():
    combos = [c for c in COMBOS if c[0] == "sgd"]  # forward, backward, none
    want = _single("sgd")
    for out in run_ranks(3, _train_over_one_device, combos, timeout=150):
        for combo in combos:
            assert torch.allclose(out[combo], want, rtol=RTOL, atol=ATOL), combo


def _mismatch_and_abort(rank, world):
    """Rank 1 receives 8 floats where rank 0 sends 4: an error naming both sizes.
    Then rank 0 aborts while rank 1 waits for it: rank 1's wait ends with an error."""
    _one_device()
    import torch.distributed as dist
    from hybridcomm.comm.transport.one_device import OneDeviceNccl
    from hybridcomm.gpu.runtime import runtime_for

    rt = runtime_for("cpu")
    nccl = OneDeviceNccl(rt)
    uid = nccl.get_unique_id() if rank == 0 else None
    box = [uid]
    dist.broadcast_object_list(box, src=0)
    comm = nccl.NcclCommunicator(world, box[0], rank)
    s = rt.new_stream()
    h = rt.handle(s)
    buf = rt.empty(8, torch.float32)
    found = {}
    if rank == 0:
        comm.send(buf.data_ptr(), 4, nccl.NCCL_FLOAT32, 1, h)
        dist.barrier()  # rank 1 has seen the mismatch
        comm.abort()
        dist.barrier()
        return found
    try:
        comm.recv(buf.data_ptr(), 8, nccl.NCCL_FLOAT32, 0, h)
    except nccl.NcclError as e:
        found["mismatch"] = str(e)
    comm.recv(buf.data_ptr(), 4, nccl.NCCL_FLOAT32, 0, h)  # the right size takes it
    dist.barrier()
    t0 = time.monotonic()
    try:  # rank 0 never sends again: blocked until its abort shows
        comm.recv(buf.data_ptr(), 4, nccl.NCCL_FLOAT32, 0, h)
    except nccl.NcclError as e:
        found["abort"] = (str(e), time.monotonic() - t0)
    try:
        comm.check_async_error()
    except nccl.NcclError as e:
        found["async"] = str(e)
    dist.barrier()
    return found


def test_a_wrong_size_is_reported_and_a_peers_abort_ends_a_wait():
    found = run_ranks(2, _mismatch_and_abort, timeout=30)[1]
    assert "receive of 32 bytes" in found["mismatch"] and "sent 16 bytes" in found["mismatch"]
    assert "rank 0 aborted" in found["abort"][0]
    assert "rank 0 aborted" in found["async"]


def _stalled(rank, world):
    """Rank 1 stalls past rank 0's timeout: rank 0 gets our timeout, not a hang."""
    _one_device()
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    from hybridcomm.comm.transport.select import select_transport

    select_transport("cpu", timeout=2)
    if rank == 1:
        store.wait(["stalled/done"])
        return None
    t0 = time.monotonic()
    try:
        hybridcomm.all_reduce(torch.ones(100), algorithm="ring", check="off", timeout=2)
        result = ("no error", time.monotonic() - t0, "")
    except hybridcomm.HybridCommError as e:
        result = (type(e).__name__, time.monotonic() - t0, str(e))
    store.set("stalled/done", "1")
    return result


def test_a_stalled_rank_is_a_timeout_not_a_hang():
    kind, elapsed, msg = run_ranks(2, _stalled, timeout=60)[0]
    assert kind == "HybridCommTimeout", (kind, msg)
    assert elapsed < 5, elapsed
    assert "rank 0" in msg, msg
