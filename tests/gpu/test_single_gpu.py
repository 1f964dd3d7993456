"""One GPU (what a lent machine has): world size 1, in this process.

* the real ``CudaRuntime`` and ``CupyNcclTransport`` over a 1-rank NCCL
  communicator (valid in NCCL): native all-reduce and every schedule;
* ``DistributedOptimizer`` in all three overlap modes, whose steady-state steps
  run under ``gpu_common.no_host_sync()`` (``set_sync_debug_mode("error")`` and
  the Event/Stream/device synchronize it does not see: a host sync fails),
  against plain torch training in IEEE fp32;
* native all-reduce captured in a CUDA graph and replayed;
* the Triton table kernels (pack/unpack, one launch for many tensors) checked
  against and timed next to ``torch.cat`` and ``torch._foreach_copy_`` (timings
  printed and recorded for ``make gpu-check``; no speed is asserted).

On a CUDA machine without CuPy the CuPy tests FAIL (naming the extra to
install). Run: TRITON_INTERPRET=0 pytest tests/gpu   (or make gpu-check)
"""

import contextlib

import pytest
import torch
import torch.nn as nn

from gpu_common import needs_cuda, no_host_sync, record, require_cupy_nccl, skip_if_interpreting

pytestmark = needs_cuda

STEPS, WARMUP = 8, 5  # steps 5-7: past the measured steps and the re-plan (steady state)
TOL = 64 * torch.finfo(torch.float32).eps


@pytest.fixture
def group1(tmp_path, monkeypatch):
    """A 1-rank process group (gloo for CPU, NCCL for CUDA) on a FileStore."""
    import torch.distributed as dist

    from hybridcomm.comm.calibration import set_active
    from hybridcomm.comm.transport.select import close_transports

    torch.cuda.set_device(0)
    monkeypatch.setenv("HYBRIDCOMM_TRANSPORT", "cupy")  # never a silent torch fallback
    dist.init_process_group(
        "cpu:gloo,cuda:nccl", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1)
    )
    try:
        yield torch.device("cuda", 0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        close_transports()
        set_active(None)
        dist.destroy_process_group()


@pytest.fixture
def cupy_transport(group1):
    from hybridcomm.gpu.runtime import CudaRuntime, runtime_for
    from hybridcomm.comm.transport.cupy_nccl import CupyNcclTransport
    from hybridcomm.comm.transport.select import select_transport

    require_cupy_nccl()
    rt = runtime_for(group1)
    assert isinstance(rt, CudaRuntime) and not rt.simulated
    t = select_transport(group1, transport="cupy", timeout=60)
    assert isinstance(t, CupyNcclTransport) and t.runtime is rt
    assert (t.rank, t.world_size, t.stream_ordered) == (0, 1, True)
    return t


def test_world_one_native_and_every_schedule(cupy_transport):
    import hybridcomm
    from hybridcomm.comm.executor import execute_native

    t, dev = cupy_transport, cupy_transport.device
    want = torch.randn(4099, device=dev)
    buf = want.clone()
    done = execute_native(buf, t, average=False, timeout=60)  # a 1-rank ncclAllReduce
    torch.cuda.current_stream().wait_event(done)
    results = {"native-direct": buf}
    for algo in ("native", "ring", "butterfly", "halving_doubling", "auto"):
        for op in ("sum", "avg"):
            results[f"{algo}-{op}"] = hybridcomm.all_reduce(want.clone(), op=op, algorithm=algo)
    torch.cuda.synchronize()
    t.check_async_error()
    assert t.failure is None
    bad = [k for k, v in results.items() if not torch.equal(v, want)]
    assert not bad, f"one rank's all-reduce changed the values: {bad}"


@pytest.mark.parametrize("overlap", ["forward", "backward", "none"])
def test_optimizer_steady_steps_make_no_host_sync(group1, ieee, overlap):
    import hybridcomm
    from hybridcomm.plan.cost_model import CostModel
    from hybridcomm.comm.transport.cupy_nccl import CupyNcclTransport
    from hybridcomm.comm.transport.select import select_transport
    from optim_models import batch, flat, make_model

    require_cupy_nccl()
    dev = group1
    # on the device before the checked steps: a copy from pageable memory syncs
    batches = [tuple(x.to(dev) for x in batch(s)) for s in range(STEPS)]

    ref = make_model().to(dev)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches:
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()

    model = make_model().to(dev)
    # a fixed cost model: no probe, the same plan every run
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model=model,
        overlap=overlap,
        fusion_bytes=0,
        cost_model=CostModel(2e-5, 1e-9, 1e-10),
        measure_iters=2,
        timeout=120,
    )
    with contextlib.ExitStack() as checked:
        for s, (x, y) in enumerate(batches):
            if s == WARMUP:
                torch.cuda.synchronize()
                checked.enter_context(no_host_sync())  # a host sync from here on fails
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    opt.synchronize()
    got = flat(model.parameters()).cpu()
    assert isinstance(select_transport(dev), CupyNcclTransport)
    opt.close()
    want = flat(ref.parameters()).cpu()
    assert torch.allclose(got, want, rtol=TOL, atol=TOL), (got - want).abs().max()


def test_native_all_reduce_in_a_cuda_graph(cupy_transport):
    from hybridcomm.comm.executor import execute_native

    t, dev = cupy_transport, cupy_transport.device
    orig = torch.randn(1 << 16, device=dev)
    buf = orig.clone()
    # eager first (NCCL connects lazily, the comm stream gets used); no timeout around
    # the capture: the watchdog would query captured events
    done = execute_native(buf, t, average=False)
    torch.cuda.current_stream().wait_event(done)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        buf.add_(1.0)  # before and after, on the capturing stream: the order is captured too
        done = execute_native(buf, t, average=False)
        torch.cuda.current_stream().wait_event(done)
        buf.mul_(2.0)
    want = (orig + 1.0) * 2.0
    for _ in range(3):
        buf.copy_(orig)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(buf, want)
    t.check_async_error()


def _time_ms(fn, iters=50):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _sizes(case):
    g = torch.Generator().manual_seed(0)
    if case == "many-small":  # a model's biases and small layers: 512 odd sizes
        return torch.randint(1, 4097, (512,), generator=g).tolist()
    return [(1 << 20) + int(k) for k in torch.randint(0, 999, (8,), generator=g)]  # few large


@pytest.mark.parametrize("case", ["many-small", "few-large"])
def test_table_kernels_against_cat_and_foreach_copy(case):
    from hybridcomm.kernels import pack, unpack

    skip_if_interpreting()
    dev = torch.device("cuda", 0)
    sizes = _sizes(case)
    tensors = [torch.randn(n, device=dev) for n in sizes]
    flat = torch.empty(sum(sizes), device=dev)
    flat_torch = torch.empty_like(flat)
    views = list(torch.split(flat_torch, sizes))
    outs = [torch.empty_like(t) for t in tensors]
    outs_torch = [torch.empty_like(t) for t in tensors]

    pack(tensors, flat, impl="triton")
    unpack(flat, outs, impl="triton")
    torch.cuda.synchronize()
    assert torch.equal(flat, torch.cat(tensors))
    assert all(torch.equal(a, b) for a, b in zip(outs, tensors))

    timings = {
        ("pack", "triton"): _time_ms(lambda: pack(tensors, flat, impl="triton")),
        ("pack", "torch.cat"): _time_ms(lambda: torch.cat(tensors, out=flat_torch)),
        ("pack", "torch._foreach_copy_"): _time_ms(lambda: torch._foreach_copy_(views, tensors)),
        ("unpack", "triton"): _time_ms(lambda: unpack(flat, outs, impl="triton")),
        ("unpack", "torch._foreach_copy_"): _time_ms(
            lambda: torch._foreach_copy_(outs_torch, views)
        ),
    }
    torch.cuda.synchronize()
    assert torch.equal(flat_torch, flat)
    assert all(torch.equal(a, b) for a, b in zip(outs_torch, outs))
    nbytes = 4 * sum(sizes)
    for (op, impl), ms in timings.items():
        print(
            f"{case}: {op} {impl}: {ms * 1e3:.1f} us ({len(sizes)} tensors, {nbytes} bytes, "
            f"{nbytes / (ms * 1e-3) / 1e9:.1f} GB/s one way)"
        )
        record(
            "kernel_timing",
            case=case,
            op=op,
            impl=impl,
            tensors=len(sizes),
            bytes=nbytes,
            ms=ms,
            device=torch.cuda.get_device_name(dev),
        )
