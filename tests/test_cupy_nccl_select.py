"""Transport selection: auto picks CuPy NCCL for CUDA tensors when it imports,
torch.distributed otherwise; a backend asked for by name never falls back."""
import sys

import pytest
import torch

from hybridcomm.errors import HybridCommError
from hybridcomm.transport import cupy_nccl, select


@pytest.fixture
def stubs(monkeypatch):
    """Replace both transports by markers (no process group, no GPU needed)."""
    made = []
    monkeypatch.setattr(select, "TorchDistTransport", lambda group: made.append("torch") or "torch")
    monkeypatch.setattr(select, "_cupy_transport", lambda group, dev: made.append("cupy") or "cupy")
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    return made


def with_cupy(monkeypatch, ok):
    monkeypatch.setattr(select, "cupy_nccl_status",
                        lambda: (True, "") if ok else (False, "no module named 'cupy'"))


@pytest.mark.parametrize("ok", [True, False])
def test_auto(stubs, monkeypatch, ok):
    with_cupy(monkeypatch, ok)
    assert select.select_transport(torch.device("cuda", 0)) == ("cupy" if ok else "torch")
    assert select.select_transport(torch.ones(2)) == "torch"  # CPU tensors: gloo


def test_named_cupy_unavailable_is_an_error(stubs, monkeypatch):
    with_cupy(monkeypatch, False)
    with pytest.raises(HybridCommError, match="asked for .*unavailable: no module named 'cupy'"):
        select.select_transport("cuda:0", backend="cupy")
    monkeypatch.setenv(select.ENV_VAR, "cupy")
    with pytest.raises(HybridCommError, match="HYBRIDCOMM_TRANSPORT"):
        select.select_transport("cuda:0")
    assert stubs == []


def test_named_cupy_on_cpu_is_an_error(stubs, monkeypatch):
    with_cupy(monkeypatch, True)
    with pytest.raises(HybridCommError, match="CUDA tensors"):
        select.select_transport("cpu", backend="cupy")


def test_named_torch_and_env(stubs, monkeypatch):
    with_cupy(monkeypatch, True)
    assert select.select_transport("cuda:0", backend="torch") == "torch"
    monkeypatch.setenv(select.ENV_VAR, "torch")
    assert select.select_transport("cuda:0") == "torch"
    monkeypatch.setenv(select.ENV_VAR, "mpi")
    with pytest.raises(HybridCommError, match="not one of"):
        select.select_transport("cuda:0")


def test_import_nccl_without_cupy_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)
    with pytest.raises(HybridCommError, match=r"hybridcomm\[cuda12\]"):
        cupy_nccl.import_nccl()


def test_transport_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(HybridCommError):
        cupy_nccl.CupyNcclTransport(nccl=object(), rank=0, world_size=1, store=object())
