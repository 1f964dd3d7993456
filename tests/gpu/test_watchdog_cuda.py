"""The NCCL watchdog's event queries never invalidate a CUDA graph captured in
global mode (torch's default ``capture_error_mode``) on another thread.

In global mode, a potentially unsafe call (``cudaEventQuery``) from any thread
whose own capture mode is global invalidates the capture. The watchdog thread
sets its mode to thread-local (``cupy_nccl.exempt_from_global_capture``: the
driver's ``cuThreadExchangeStreamCaptureMode``; CuPy wraps no such call), as
PyTorch's NCCL watchdog does. The simulator has no graph capture: only a GPU
shows this. Written without a GPU: **not run on one yet**.

Run: TRITON_INTERPRET=0 pytest tests/gpu/test_watchdog_cuda.py
"""

import subprocess
import sys
import threading
import time

import pytest
import torch

from gpu_common import needs_cuda, require_cupy_nccl

pytestmark = needs_cuda


def capture_while_another_thread_queries(exempt: bool):
    """Capture a graph (global mode) while another thread queries a completed event
    in a loop; ``(capture error or None, the querying thread's errors, x after replay)``."""
    from hybridcomm.comm.transport.cupy_nccl import exempt_from_global_capture

    torch.cuda.set_device(0)
    event = torch.cuda.Event()
    event.record()
    torch.cuda.synchronize()
    queries, started, stop, errors = [0], threading.Event(), threading.Event(), []

    def query():
        torch.cuda.set_device(0)
        if exempt:
            assert exempt_from_global_capture()
        started.set()
        while not stop.is_set():
            try:
                event.query()
            except Exception as e:  # noqa: BLE001 - reported to the test
                errors.append(repr(e))
                return
            queries[0] += 1

    thread = threading.Thread(target=query, daemon=True)
    thread.start()
    assert started.wait(10)
    x = torch.zeros(1024, device="cuda")
    graph, failure = torch.cuda.CUDAGraph(), None
    try:
        with torch.cuda.graph(graph):  # capture_error_mode="global"
            seen, deadline = queries[0], time.monotonic() + 5
            while queries[0] < seen + 20 and time.monotonic() < deadline and not errors:
                time.sleep(0.001)  # the other thread queries while this one captures
            x.add_(1)
    except RuntimeError as e:
        failure = repr(e)
    stop.set()
    thread.join(10)
    if failure is None:
        graph.replay()
        torch.cuda.synchronize()
    return failure, errors, x.sum().item()


def test_an_exempt_thread_querying_events_leaves_a_global_capture_valid():
    failure, errors, total = capture_while_another_thread_queries(exempt=True)
    assert (failure, errors) == (None, [])
    assert total == 1024.0  # one replay of x += 1


def test_control_a_thread_in_global_mode_invalidates_the_capture():
    """The same without the exemption breaks the capture: the test above can fail.
    In a child process: an invalidated capture can leave this one's CUDA state odd."""
    code = (
        "import sys; sys.path[:0] = ['tests/gpu', '.']; "
        "from test_watchdog_cuda import capture_while_another_thread_queries as c; "
        "f, e, _ = c(False); print('BROKEN' if (f or e) else 'INTACT')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "BROKEN" in out.stdout, (out.stdout, out.stderr[-2000:])


@pytest.fixture
def transport(tmp_path, monkeypatch):
    """A CuPy NCCL transport over a 1-rank group (as tests/gpu/test_single_gpu.py)."""
    import torch.distributed as dist

    from hybridcomm.comm.transport.select import close_transports, select_transport

    torch.cuda.set_device(0)
    monkeypatch.setenv("HYBRIDCOMM_TRANSPORT", "cupy")
    dist.init_process_group(
        "cpu:gloo,cuda:nccl", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1)
    )
    try:
        require_cupy_nccl()
        yield select_transport(torch.device("cuda", 0), transport="cupy", timeout=60)
    finally:
        torch.cuda.synchronize()
        close_transports()
        dist.destroy_process_group()


def test_the_transports_watchdog_leaves_a_global_capture_valid(transport):
    """The watchdog queries a pending event (a 0.5 s kernel on the comm stream) every
    50 ms while the main thread captures in global mode: the capture holds."""
    t = transport
    with t.stream_context():
        torch.cuda._sleep(int(0.5 * 1.5e9))  # ~0.5 s of GPU cycles on the comm stream
    pending = t.record_event()
    t.watch(pending, 30, "probe")
    x = torch.zeros(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # capture_error_mode="global"
        time.sleep(0.3)  # ~6 watchdog rounds, each querying the pending event
        x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert x.sum().item() == 1024.0
    deadline = time.monotonic() + 5
    while t._watched and time.monotonic() < deadline:
        time.sleep(0.05)
    assert t.failure is None and not t._watched
