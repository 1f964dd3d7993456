"""The real ``cupy.cuda.nccl`` has every name CupyNcclTransport uses (API drift).

Needs only the CPU-installable packages (cupy-cuda12x + nvidia-nccl-cu12, the
``cuda12`` extra): no GPU. Skips where they are not installed.
"""

import inspect
import re

import pytest
import torch

from hybridcomm.base.errors import HybridCommError
from hybridcomm.comm.transport import cupy_nccl, select
from hybridcomm.gpu import runtime

pytestmark = pytest.mark.fast  # in this process alone (tests/tiers.py)

try:  # ImportError too, not only ModuleNotFoundError: a CuPy without its CUDA libraries
    from cupy.cuda import nccl
except ImportError as e:
    pytest.skip(f"cupy-cuda12x/13x not usable here: {e}", allow_module_level=True)


def test_module_has_everything_the_transport_uses():
    missing = [a for a in cupy_nccl.NCCL_MODULE_ATTRS if not hasattr(nccl, a)]
    assert missing == []
    comm = nccl.NcclCommunicator
    missing = [m for m in cupy_nccl.NCCL_COMM_METHODS if not callable(getattr(comm, m, None))]
    assert missing == []


def test_send_recv_take_pointer_count_dtype_peer_stream():
    # Cython keeps the signature in the docstring:
    # "NcclCommunicator.send(self, intptr_t sendbuf, size_t count, int datatype, ...)"
    for name in ("send", "recv"):
        doc = inspect.getdoc(getattr(nccl.NcclCommunicator, name)) or ""
        m = re.search(rf"\b{name}\(([^)]*)\)", doc)
        if m is None:
            pytest.skip(f"no signature in the docstring of NcclCommunicator.{name}")
        params = [p.split()[-1] for p in m.group(1).split(",")]
        assert params[1:] == [f"{name}buf", "count", "datatype", "peer", "stream"], doc


def test_dtype_map_values_are_the_real_enums():
    want = {
        torch.float32: 7,
        torch.float16: 6,
        torch.bfloat16: 9,
        torch.float64: 8,
        torch.int8: 0,
        torch.uint8: 1,
        torch.int32: 2,
        torch.int64: 4,
    }  # nccl.h
    assert cupy_nccl.nccl_dtypes(nccl) == want


def test_nccl_error_takes_a_status():
    e = nccl.NcclError(5)
    assert isinstance(e, Exception) and "NCCL" in str(e)


def test_unique_id_is_128_bytes_for_the_store():
    if not nccl.available:
        pytest.skip("libnccl not found (pip install nvidia-nccl-cu12)")
    uid = nccl.get_unique_id()
    assert isinstance(bytes(uid), bytes) and len(bytes(uid)) == 128


def test_import_nccl_and_status():
    if nccl.available:
        assert runtime.import_nccl() is nccl
        select.cupy_nccl_status.cache_clear()
        assert select.cupy_nccl_status() == (True, "")
    else:
        with pytest.raises(HybridCommError, match="nvidia-nccl"):
            runtime.import_nccl()
