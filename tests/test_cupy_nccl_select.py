"""Transport selection: auto picks CuPy NCCL for CUDA tensors when it imports,
torch.distributed's NCCL otherwise; CPU tensors take gloo; a transport asked for by
name never falls back."""

import sys

import pytest
import torch

from hybridcomm.base.errors import HybridCommError
from hybridcomm.gpu import runtime
from hybridcomm.gpu.runtime import CudaRuntime
from hybridcomm.comm.transport import comm_thread, cupy_nccl, select

pytestmark = pytest.mark.fast  # in this process alone (tests/tiers.py)


class _FakeCudaRuntime:
    simulated = False
    device = torch.device("cuda", 0)


@pytest.fixture
def stubs(monkeypatch):
    """Replace the transports by markers and CUDA by a stand-in (no GPU needed)."""
    made = []
    monkeypatch.setattr(select, "TorchDistTransport", lambda group: made.append("gloo") or "gloo")
    monkeypatch.setattr(
        select,
        "_device_transport",
        lambda group, rt, choice, timeout: made.append(choice) or choice,
    )
    monkeypatch.setattr(
        select,
        "runtime_for",
        lambda device: _FakeCudaRuntime() if torch.device(device).type == "cuda" else None,
    )
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    monkeypatch.delenv("HYBRIDCOMM_SIMULATE_GPU", raising=False)
    return made


def with_cupy(monkeypatch, ok):
    monkeypatch.setattr(
        select, "cupy_nccl_status", lambda: (True, "") if ok else (False, "no module named 'cupy'")
    )


@pytest.mark.parametrize("ok", [True, False])
def test_auto(stubs, monkeypatch, ok):
    with_cupy(monkeypatch, ok)
    assert select.select_transport(torch.device("cuda", 0)) == ("cupy" if ok else "torch")
    assert select.select_transport(torch.ones(2)) == "gloo"  # CPU tensors: the host path


def test_named_cupy_unavailable_is_an_error(stubs, monkeypatch):
    with_cupy(monkeypatch, False)
    with pytest.raises(HybridCommError, match="asked for .*unavailable: no module named 'cupy'"):
        select.select_transport("cuda:0", transport="cupy")
    monkeypatch.setenv(select.ENV_VAR, "cupy")
    with pytest.raises(HybridCommError, match="HYBRIDCOMM_TRANSPORT"):
        select.select_transport("cuda:0")
    assert stubs == []


def test_named_cupy_on_cpu_is_an_error(stubs, monkeypatch):
    with_cupy(monkeypatch, True)
    with pytest.raises(HybridCommError, match="CUDA tensors"):
        select.select_transport("cpu", transport="cupy")


def test_named_torch_and_env(stubs, monkeypatch):
    with_cupy(monkeypatch, True)
    assert select.select_transport("cuda:0", transport="torch") == "torch"
    monkeypatch.setenv(select.ENV_VAR, "torch")
    assert select.select_transport("cuda:0") == "torch"
    monkeypatch.setenv(select.ENV_VAR, "mpi")
    with pytest.raises(HybridCommError, match="HYBRIDCOMM_TRANSPORT='mpi' is invalid"):
        select.select_transport("cuda:0")


def test_import_nccl_without_cupy_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)
    with pytest.raises(HybridCommError, match=r"hybridcomm\[cuda12\]"):
        runtime.import_nccl()


def test_cuda_runtime_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(HybridCommError, match="no CUDA device"):
        CudaRuntime(torch.device("cuda", 0))


def test_unique_ids_of_both_cupy_styles_round_trip():
    """CuPy 14 returns and takes bytes; CuPy 13 a tuple of signed chars (measured on
    cupy-cuda12x 13.6.0 and 14.2.0): one stored form, converted for each."""
    raw = bytes(range(0, 256, 2))  # 128 bytes, half of them > 127: negative as signed chars
    signed = tuple(b - 256 if b > 127 else b for b in raw)
    assert min(signed) < 0 and max(raw) > 127
    assert cupy_nccl.unique_id_bytes(raw) == raw
    assert cupy_nccl.unique_id_bytes(signed) == raw

    class Comm:
        def __init__(self, ndev, uid, rank, want):
            if not isinstance(uid, want):
                raise TypeError(f"Argument 'commId' has incorrect type (expected {want.__name__})")
            if want is tuple and not all(-128 <= x <= 127 for x in uid):
                raise OverflowError("value too large to convert to char")  # CuPy 13: char[128]
            self.uid = uid

    for want, expect in ((bytes, raw), (tuple, signed)):
        module = type(
            "M",
            (),
            {"NcclCommunicator": staticmethod(lambda n, uid, r, want=want: Comm(n, uid, r, want))},
        )
        assert cupy_nccl.make_communicator(module, 2, raw, 0).uid == expect


def test_the_watchdog_exempts_its_thread_from_global_graph_capture(monkeypatch, caplog):
    """Issue 29, defect 3: the watchdog's event queries must not invalidate a graph
    another thread captures in global mode (torch's default). On its own thread it
    sets the thread-local capture mode (cudaStreamCaptureModeThreadLocal = 1) through
    the driver, CuPy having no wrapper; without a driver it says so. Only the call is
    checked here: tests/gpu/test_watchdog_cuda.py checks the capture on a GPU."""
    import ctypes
    import threading

    from hybridcomm.comm.transport import cupy_nccl

    calls = []

    class Driver:
        @staticmethod
        def cuThreadExchangeStreamCaptureMode(mode):
            calls.append((mode._obj.value, threading.current_thread().name))
            return 0  # CUDA_SUCCESS

    class Runtime(_FakeCudaRuntime):
        def bind_thread(self):
            pass

    def watchdog_round(cdll):
        monkeypatch.setattr(ctypes, "CDLL", cdll)
        t = cupy_nccl.CupyNcclTransport.__new__(cupy_nccl.CupyNcclTransport)
        t.runtime, t.rank, t._aborted = Runtime(), 3, True  # one round, then out
        t._failure = None
        thread = threading.Thread(target=t._watch_loop, name="watchdog")
        thread.start()
        thread.join(10)
        return t

    t = watchdog_round(lambda name: Driver())
    assert calls == [(1, "watchdog")] and t._failure is None

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    with caplog.at_level("WARNING", logger="hybridcomm"):
        t = watchdog_round(missing)
    assert calls == [(1, "watchdog")] and t._failure is None
    assert [r.getMessage() for r in caplog.records] == [
        "rank 3: the NCCL watchdog could not set its CUDA stream-capture mode to "
        "thread-local: its queries invalidate a graph captured in global mode on another "
        "thread"
    ]


def test_the_communicators_thread_exempts_itself_and_makes_the_last_call(monkeypatch):
    """The thread that owns the communicator is exempt from global capture too (NCCL's
    async-error query runs there), and makes the communicator's last call itself."""
    import ctypes
    import threading
    import types

    from hybridcomm.comm.transport import cupy_nccl

    calls = []

    class Driver:
        @staticmethod
        def cuThreadExchangeStreamCaptureMode(mode):
            calls.append((mode._obj.value, threading.current_thread().name))
            return 0

    class Runtime(_FakeCudaRuntime):
        def bind_thread(self):
            pass

    class Comm:
        def abort(self):
            calls.append(("abort", threading.current_thread().name))

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Driver())
    t = cupy_nccl.CupyNcclTransport.__new__(cupy_nccl.CupyNcclTransport)
    t.runtime, t.rank, t.comm, t.nccl = (
        Runtime(),
        3,
        Comm(),
        types.SimpleNamespace(NcclError=RuntimeError),
    )
    t._cv, t._aborted, t._failure, t._destroy_on_close = threading.Condition(), True, None, False
    t.stream = None
    owner = comm_thread.CommThread(t)  # failed already: exempt, then straight to the abort
    owner.thread.join(10)
    assert owner.released
    assert calls == [(1, "hybridcomm-nccl-r3"), ("abort", "hybridcomm-nccl-r3")]
