"""What the GPU tests share: the skip rules (no CUDA, Triton interpreting; the
``gpus(n)`` marker, see conftest.py), IEEE fp32 for comparisons with one
process, the host-sync check, the csrc build that must fail loudly, and the
records ``make gpu-check`` puts in its report."""

import contextlib
import functools
import os
import threading
import traceback

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def needs_gpus(n):
    """``@pytest.mark.gpus(n)``: tests/gpu/conftest.py skips with fewer GPUs."""
    return pytest.mark.gpus(n)


def gpus_needed(item) -> int:
    """How many GPUs a collected test needs: its closest ``@pytest.mark.gpus(n)``, else 1."""
    mark = item.get_closest_marker("gpus")
    return int(mark.args[0]) if mark is not None else 1


def placement(world):
    """How ``world`` rank processes run on this machine, as (``launch`` keyword
    arguments, transport name): one per GPU over CuPy's NCCL where there are that
    many GPUs, else all on GPU 0 over the one-device transport (NCCL refuses two
    ranks on a GPU; docs/GPU.md). ``HYBRIDCOMM_GPU_TESTS_ONE_DEVICE=1`` takes the
    one-device transport on a machine with more GPUs too. With CuPy's NCCL, a
    machine without CuPy fails the test naming the extra."""
    forced = os.environ.get("HYBRIDCOMM_GPU_TESTS_ONE_DEVICE", "0") == "1"
    if not forced and torch.cuda.device_count() >= world:
        require_cupy_nccl()
        return {"backend": "nccl"}, "cupy"
    return {"one_device": True}, "one-device"


def skip_if_interpreting():
    # tests/conftest.py sets TRITON_INTERPRET=1 for the CPU suite; on a GPU run
    # the kernels must compile for the device: TRITON_INTERPRET=0 pytest tests/gpu
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        pytest.skip("Triton is interpreting: run `TRITON_INTERPRET=0 pytest tests/gpu`")


def require_cupy_nccl():
    """CuPy's NCCL, or the test FAILS naming the extra: on a CUDA machine a missing
    CuPy is a broken setup for these tests, not a reason to skip them quietly."""
    from hybridcomm.comm.transport.select import cupy_nccl_status

    ok, why = cupy_nccl_status()
    if not ok:
        pytest.fail(
            "CuPy with NCCL is not usable on this CUDA machine; install the extra "
            "matching torch's CUDA: pip install -e '.[cuda12]' or '.[cuda13]' "
            f"({why})",
            pytrace=False,
        )


def require_csrc():
    """The built CUDA C++ extension. Skips only where there is nothing to build
    with (no CUDA, no toolkit); a build that was tried and failed FAILS the test:
    a compile error in csrc/ must never read as a skip."""
    from hybridcomm.gpu import cuda_ext

    ext = cuda_ext.load()
    if ext is not None:
        return ext
    if cuda_ext.build_failed():
        pytest.fail(f"the csrc build failed: {cuda_ext.why_not()}", pytrace=False)
    pytest.skip(f"CUDA extension not buildable here: {cuda_ext.why_not()}")


# -- IEEE fp32 ------------------------------------------------------------------------


def ieee_fp32():
    """fp32 as IEEE in this process (call it in every rank and around a GPU
    reference): no TF32 in matmuls or convolutions (torch's default for
    convolutions is TF32, ~10 mantissa bits, far beyond a 64-eps tolerance), and
    no cuDNN, whose algorithm choice depends on the batch size (a shard and the
    whole batch would round differently, beyond the summation-order tolerance).
    torch 2.13's fp32_precision API (the legacy allow_tf32 flags must not be mixed
    with it)."""
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    torch.backends.cudnn.enabled = False


@contextlib.contextmanager
def ieee_fp32_here():
    """ieee_fp32() in the test process for a GPU reference, then the flags as they were."""
    saved = (
        torch.backends.cuda.matmul.fp32_precision,
        torch.backends.cudnn.conv.fp32_precision,
        torch.backends.cudnn.enabled,
    )
    ieee_fp32()
    try:
        yield
    finally:
        (
            torch.backends.cuda.matmul.fp32_precision,
            torch.backends.cudnn.conv.fp32_precision,
            torch.backends.cudnn.enabled,
        ) = saved


# -- host syncs -----------------------------------------------------------------------


def _sync_points():
    """(owner, attribute, name) of the explicit host waits for the device.
    ``set_sync_debug_mode`` does not see Event.synchronize, so these are wrapped."""
    points = [
        (torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize"),
        (torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize"),
        (torch.cuda, "synchronize", "torch.cuda.synchronize"),
    ]
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize"):
        points.append((torch.accelerator, "synchronize", "torch.accelerator.synchronize"))
    return points


class HostSyncs:
    """What :func:`watch_host_syncs` saw: one entry per call (name, thread, stack)."""

    def __init__(self):
        self.found = []
        self._lock = threading.Lock()

    def saw(self, name):
        stack = "".join(traceback.format_stack(limit=10)[:-2])
        with self._lock:
            self.found.append(f"{name} on thread {threading.current_thread().name!r}:\n{stack}")


@contextlib.contextmanager
def watch_host_syncs():
    """While on, Event.synchronize, Stream.synchronize and torch.cuda.synchronize
    raise, on any thread (the issuing thread's too), and each call is kept; at the
    end any call seen is an AssertionError, even one the library caught. Needs no
    GPU itself (the wrappers raise before the original runs)."""
    seen = HostSyncs()
    saved = []

    def wrap(owner, attr, name):
        own = attr in vars(owner)
        original = getattr(owner, attr)

        @functools.wraps(original)
        def sync(*args, **kwargs):
            seen.saw(name)
            raise RuntimeError(f"host sync in a region that must have none: {name}")

        saved.append((owner, attr, own, vars(owner).get(attr)))
        setattr(owner, attr, sync)

    try:
        for point in _sync_points():
            wrap(*point)
        yield seen
    finally:
        for owner, attr, own, original in reversed(saved):
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
    assert not seen.found, f"{len(seen.found)} host sync(s):\n" + "\n".join(seen.found)


@contextlib.contextmanager
def no_host_sync():
    """A steady-state region with no host sync: ``set_sync_debug_mode("error")``
    (copies, ``item()``, ``nonzero``...) and :func:`watch_host_syncs` (the explicit
    waits that mode does not see)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        with watch_host_syncs() as seen:
            yield seen
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -- make gpu-check's records ---------------------------------------------------------

RECORDS_ENV = "HYBRIDCOMM_GPU_CHECK_RECORDS"


def record(kind, **data):
    """Append one JSON record (e.g. a kernel timing) to the file named by
    $HYBRIDCOMM_GPU_CHECK_RECORDS, which tests/gpu/gpu_check.py puts in its report."""
    path = os.environ.get(RECORDS_ENV)
    if not path:
        return
    import json

    with open(path, "a") as f:
        f.write(json.dumps({"kind": kind, **data}) + "\n")
