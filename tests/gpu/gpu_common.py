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
