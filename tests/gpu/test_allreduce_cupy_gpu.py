"""CupyNcclTransport on real GPUs: exact all-reduce for every algorithm at 3, 4, 5
and 7 ranks (folds of a non-power of two included), through the executor's
host-wait path and the stream-ordered path (no host synchronization): one rank
per GPU over NCCL where there are enough GPUs, else all on one GPU over the
one-device transport (``gpu_common.placement``). A captured CUDA graph needs
one GPU per rank (``gpus(2)``): the one-device transport's host hand-shakes are
not captured.

Run: TRITON_INTERPRET=0 pytest tests/gpu   (one process per rank is spawned)
"""

import pytest
import torch

from gpu_common import placement, require_cupy_nccl, skip_if_interpreting
from hybridcomm.tools.launch import launch

ALGOS = ("ring", "butterfly", "halving_doubling")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _inputs(world, n, dtype):
    # Small integers: the sum is exact in any order and any of the three dtypes.
    return [
        torch.randint(-8, 9, (n,), generator=torch.Generator().manual_seed(r)).to(dtype)
        for r in range(world)
    ]


def _rank(rank, world, algorithm, n, dtype_name, mode, transport):
    import torch

    from hybridcomm.algorithms import get_schedule
    from hybridcomm.comm.executor import execute, execute_async
    from hybridcomm.comm.transport.select import close_transports, select_transport

    dtype = DTYPES[dtype_name]
    dev = torch.device("cuda", torch.cuda.current_device())
    t = select_transport(dev, transport=transport, timeout=120)
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
    how, transport = placement(world)
    return launch(
        _rank,
        world,
        algorithm,
        n,
        dtype_name,
        mode,
        transport,
        start_method="spawn",
        timeout=300,
        **how,
    )


@pytest.mark.parametrize("mode", ["host", "stream"])
@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("n", [1, 1000, (1 << 20) + 7])
@pytest.mark.parametrize("world", [3, 4])
def test_all_reduce_exact(world, algorithm, n, mode):
    assert all(_run(world, algorithm, n, "float32", mode))


@pytest.mark.parametrize("world", [5, 6, 7])
@pytest.mark.parametrize("algorithm", ALGOS)
def test_all_reduce_exact_at_odd_world_sizes(world, algorithm):
    assert all(_run(world, algorithm, 4099, "float32", "stream"))


@pytest.mark.gpus(2)
@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("n", [1, 1000, (1 << 20) + 7])
def test_all_reduce_exact_in_a_cuda_graph(algorithm, n):
    skip_if_interpreting()
    require_cupy_nccl()  # with the GPUs but without CuPy: a failure naming the extra
    world = torch.cuda.device_count()
    assert all(
        launch(
            _rank,
            world,
            algorithm,
            n,
            "float32",
            "graph",
            "cupy",
            backend="nccl",
            start_method="spawn",
            timeout=300,
        )
    )


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_all_reduce_half_dtypes(dtype_name):
    assert all(_run(3, "ring", 4099, dtype_name, "stream"))
