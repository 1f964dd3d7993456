"""Triton and CUDA C++ kernels on a real GPU against the plain-torch references.

Exact equality: both sides compute in fp32 (fp64 for fp64 data, with an fp64
scale) and round once to nearest even, on the device (the CPU interpreter's
truncating bf16 cast does not apply here).
The csrc cases FAIL when the extension's build fails (they skip only without a
CUDA toolkit to build with).
Run: TRITON_INTERPRET=0 pytest tests/gpu
"""
import pytest
import torch

from gpu_common import needs_cuda, require_csrc, skip_if_interpreting
from hybridcomm.kernels import pack, pack_ref, reduce, reduce_ref, unpack, unpack_ref

pytestmark = needs_cuda

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SIZES = (0, 1, 7, 1000, 65537, (1 << 20) + 3)


def rand(n, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, device="cuda", generator=g).to(dtype)


@pytest.fixture(params=["triton", "csrc"])
def impl(request):
    if request.param == "triton":
        skip_if_interpreting()
        return {"reduce": lambda d, s, scale, out: reduce(d, s, scale=scale, out=out),
                "pack": lambda ts, out, scale: pack(ts, out, scale=scale),
                "unpack": lambda flat, ts, scale: unpack(flat, ts, scale=scale)}
    ext = require_csrc()  # a failed build fails here; only a missing toolkit skips
    return {"reduce": ext.reduce, "pack": ext.pack, "unpack": ext.unpack}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("scale", [None, 0.125])
def test_reduce(impl, n, dst_dtype, src_dtype, scale):
    dst, src = rand(n, dst_dtype, 1), rand(n, src_dtype, 2)
    out, out_ref = torch.empty(n, dtype=torch.float16, device="cuda"), \
        torch.empty(n, dtype=torch.float16, device="cuda")
    want = reduce_ref(dst.clone(), src, scale=scale, out=out_ref)
    impl["reduce"](dst, src, scale, out)
    torch.cuda.synchronize()
    assert torch.equal(dst, want) and torch.equal(out, out_ref)


@pytest.mark.parametrize("wire", DTYPES)
@pytest.mark.parametrize("scale", [None, 0.5])
def test_pack_unpack_roundtrip(impl, wire, scale):
    ts = [rand(n, torch.float32, i) for i, n in enumerate((3, 0, 1000, 65537, 1))]
    total = sum(t.numel() for t in ts)
    flat = torch.empty(total, dtype=wire, device="cuda")
    want = pack_ref(ts, torch.empty_like(flat), scale=scale)
    impl["pack"](ts, flat, scale)
    torch.cuda.synchronize()
    assert torch.equal(flat, want)
    back = [torch.empty_like(t) for t in ts]
    back_ref = unpack_ref(want, [torch.empty_like(t) for t in ts], scale=scale)
    impl["unpack"](flat, back, scale)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(back, back_ref))


def test_kernels_follow_the_current_stream(impl):
    """Launched under `with torch.cuda.stream(s)` they run on s, ordered after its work."""
    s = torch.cuda.Stream()
    n = 1 << 22
    dst = torch.zeros(n, device="cuda")
    src = torch.empty(n, device="cuda")
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # keep s busy, so a launch elsewhere would run first
        src.fill_(2.0)
        impl["reduce"](dst, src, None, None)
    torch.cuda.synchronize()
    assert torch.equal(dst, torch.full_like(dst, 2.0))


@pytest.mark.parametrize("world", [3, 5, 6, 7])
def test_triton_fp64_average_is_exact_fp64_arithmetic(world):
    """Issue 29, defect 1: a Python float kernel argument is an fp32 parameter on a
    GPU, so fp64 averages were scaled by fp32(1/P), up to 3e-8 relative off at
    these P. The kernels declare the scale fp64: bitwise torch's fp64 arithmetic."""
    skip_if_interpreting()
    g = torch.Generator(device="cuda").manual_seed(world)
    dst, src = (torch.randn(65537, device="cuda", generator=g, dtype=torch.float64)
                for _ in range(2))
    exact = (dst + src) * (1.0 / world)  # torch on CUDA: fp64 add, fp64 scale
    got = dst.clone()
    reduce(got, src, scale=1.0 / world)
    ts = [torch.randn(n, device="cuda", generator=g, dtype=torch.float64) for n in (7, 65537, 1)]
    flat = pack(ts, scale=1.0 / world)
    back = unpack(flat, [torch.empty_like(t) for t in ts], scale=1.0 / world)
    torch.cuda.synchronize()
    assert torch.equal(got, exact)
    assert torch.equal(flat, torch.cat(ts) * (1.0 / world))
    for b, f in zip(back, flat.split([t.numel() for t in ts])):
        assert torch.equal(b, f * (1.0 / world))


@pytest.mark.parametrize("world", [3, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_other_dtypes_average_with_the_references_fp32_scale(dtype, world):
    """The fp64 scale parameter is rounded to fp32 for fp32/fp16/bf16 data, as torch
    does: bitwise the references at a scale that fp32 cannot hold exactly."""
    skip_if_interpreting()
    dst, src = rand(65537, dtype, 1), rand(65537, dtype, 2)
    got = dst.clone()
    want = reduce_ref(dst.clone(), src, scale=1.0 / world)
    reduce(got, src, scale=1.0 / world)
    ts = [rand(n, dtype, 3 + i) for i, n in enumerate((7, 65537, 1))]
    flat = pack(ts, scale=1.0 / world)
    flat_ref = pack_ref(ts, scale=1.0 / world)
    back = unpack(flat_ref, [torch.empty_like(t) for t in ts], scale=1.0 / world)
    back_ref = unpack_ref(flat_ref, [torch.empty_like(t) for t in ts], scale=1.0 / world)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert torch.equal(flat, flat_ref)
    assert all(torch.equal(a, b) for a, b in zip(back, back_ref))
