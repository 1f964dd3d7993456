"""What the GPU tests share: the skip rules (no CUDA, or Triton interpreting)."""
import os

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def needs_gpus(n):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA GPUs")


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
        pytest.fail("CuPy with NCCL is not usable on this CUDA machine; install the extra "
                    "matching torch's CUDA: pip install -e '.[cuda12]' or '.[cuda13]' "
                    f"({why})", pytrace=False)


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
