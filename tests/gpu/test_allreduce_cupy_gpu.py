"""CupyNcclTransport on real GPUs: exact all-reduce across >= 2 GPUs for every
algorithm, through the executor's host-wait path, the stream-ordered path
(no host synchronization) and a captured CUDA graph.

Run: TRITON_INTERPRET=0 pytest tests/gpu   (one process per GPU is spawned)
"""
import pytest
import torch

from gpu_common import require_cupy_nccl, skip_if_interpreting
from hybridcomm.tools.launch import launch

pytestmark = pytest.mark.gpus(2)  # tests/gpu/conftest.py skips with fewer


@pytest.fixture(autouse=True)
def _cupy():
    require_cupy_nccl()  # with the GPUs but without CuPy: a failure naming the extra

ALGOS = ("ring", "butterfly", "halving_doubling")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _inputs(world, n, dtype):
    # Small integers: the sum is exact in any order and any of the three dtypes.
    return [torch.randint(-8, 9, (n,), generator=torch.Generator().manual_seed(r)).to(dtype)
            for r in range(world)]


def _rank(rank, world, algorithm, n, dtype_name, mode):
    import torch

    from hybridcomm.algorithms import get_schedule
    from hybridcomm.comm.executor import execute, execute_async
    from hybridcomm.comm.transport.select import close_transports, select_transport

    dtype = DTYPES[dtype_name]
    dev = torch.device("cuda", torch.cuda.current_device())
    t = select_transport(dev, transport="cupy", timeout=120)
    data = _inputs(world, n, dtype)
    want = torch.stack([x.float() for x in data]).sum(0).to(dtype)
    buf = data[rank].to(dev)
    sched = get_schedule(algorithm, rank, world, n)
    if mode == "host":
        execute(sched, buf, t, timeout=60)  # the caller's stream waits; the host does not
    elif mode == "stream":
        done = execute_async(sched, buf, t, timeout=60)
        torch.cuda.current_stream().wait_event(done)
    else:  # graph: warm up eagerly (NCCL connects lazily), capture, replay; no watchdog
        orig = buf.clone()
        done = execute_async(sched, buf, t)
        torch.cuda.current_stream().wait_event(done)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            done = execute_async(sched, buf, t)
            torch.cuda.current_stream().wait_event(done)
        for _ in range(3):
            buf.copy_(orig)
            graph.replay()
    torch.cuda.synchronize()
    ok = bool(torch.equal(buf.cpu(), want))
    close_transports()
    return ok


def _run(world, algorithm, n, dtype_name, mode):
    skip_if_interpreting()
    return launch(_rank, world, algorithm, n, dtype_name, mode, backend="nccl",
                  start_method="spawn", timeout=300)


@pytest.mark.parametrize("mode", ["host", "stream", "graph"])
@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("n", [1, 1000, (1 << 20) + 7])
def test_all_reduce_exact(algorithm, n, mode):
    world = torch.cuda.device_count()
    assert all(_run(world, algorithm, n, "float32", mode))


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_all_reduce_half_dtypes(dtype_name):
    world = torch.cuda.device_count()
    assert all(_run(world, "ring", 4099, dtype_name, "stream"))
