"""reduce: the Triton kernel (under TRITON_INTERPRET) against the torch reference.

Tolerances: integer-valued data is exact in every dtype, so it must match
bitwise. Random data: fp32 and fp16 do the same math as the reference (fp32
add and scale, one rounding), so they must match bitwise too. bf16 outputs may
be 1 bf16 ulp off, and only under the interpreter: its fp32->bf16 cast
truncates where torch (and the GPU) round to nearest even. fp64 averages are
exact fp64 arithmetic (an fp64 scale), checked in the interpreter and in the
PTX Triton compiles for a GPU from the launcher's own arguments.
"""

import importlib
import types

import pytest
import torch

from kernel_checks import (
    BLOCKS,
    DTYPES,
    SIZES,
    allowed_ulps,
    assert_scale_is_fp64,
    assert_within_ulps,
    launched_ptx,
)

from hybridcomm import kernels as K
from hybridcomm.kernels._triton import use_triton

pytestmark = [
    pytest.mark.skipif(not K.triton_available, reason="triton is not installed"),
    pytest.mark.fast,
]
if K.triton_available:
    import triton.language as tl


def _ints(n, dtype, gen):
    return torch.randint(-8, 8, (n,), generator=gen).to(dtype)


@pytest.mark.parametrize("scale", [None, 0.5])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_reduce_integer_valued_is_bitwise_exact(n, dtype, block, scale):
    gen = torch.Generator().manual_seed(n)
    dst, src = _ints(n, dtype, gen), _ints(n, dtype, gen)
    exact = dst.double() + src.double()
    if scale is not None:
        exact = exact * scale
    got, ref = dst.clone(), dst.clone()
    assert K.reduce(got, src, scale=scale, impl="triton", _block=block) is got
    assert K.reduce_ref(ref, src, scale=scale) is ref
    assert torch.equal(got, exact.to(dtype))
    assert torch.equal(ref, exact.to(dtype))


@pytest.mark.parametrize("scale", [None, 1 / 3])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_reduce_random_matches_ref(n, dtype, block, scale):
    gen = torch.Generator().manual_seed(1000 + n)
    dst = torch.randn(n, generator=gen).to(dtype)
    src = torch.randn(n, generator=gen).to(dtype)
    got, ref = dst.clone(), dst.clone()
    K.reduce(got, src, scale=scale, impl="triton", _block=block)
    K.reduce_ref(ref, src, scale=scale)
    assert_within_ulps(got, ref, allowed_ulps(dtype))


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_reduce_mixed_dtypes_and_copy_out_match_ref(dst_dtype, src_dtype, out_dtype):
    gen = torch.Generator().manual_seed(7)
    n = 4099
    dst = torch.randn(n, generator=gen).to(dst_dtype)
    src = torch.randn(n, generator=gen).to(src_dtype)
    got, ref = dst.clone(), dst.clone()
    got_out = torch.empty(n, dtype=out_dtype)
    ref_out = torch.empty(n, dtype=out_dtype)
    K.reduce(got, src, scale=0.1, out=got_out, impl="triton", _block=1024)
    K.reduce_ref(ref, src, scale=0.1, out=ref_out)
    assert_within_ulps(got, ref, allowed_ulps(dst_dtype))
    assert_within_ulps(got_out, ref_out, allowed_ulps(out_dtype))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_reduce_fp16_wire_into_fp32_buffer_with_fp16_copy_out(impl):
    gen = torch.Generator().manual_seed(3)
    dst = torch.randn(1000, generator=gen)
    src = torch.randn(1000, generator=gen).half()
    out = torch.empty(1000, dtype=torch.float16)
    expected = dst + src.float()  # fp16 -> fp32 is exact, so this is the fp32 sum
    got = dst.clone()
    K.reduce(got, src, out=out, impl=impl)
    assert torch.equal(got, expected)
    assert torch.equal(out, expected.half())  # fp16 casts round to nearest even


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_reduce_fp16_accumulates_in_fp32(impl):
    # 60000 + 60000 overflows fp16 (max 65504); in fp32 it is fine, and the
    # scaled result 60000 is representable again.
    dst = torch.full((37,), 60000.0, dtype=torch.float16)
    src = dst.clone()
    assert torch.isinf((dst + src) * 0.5).all()  # what step-by-step fp16 gives
    out = torch.empty(37, dtype=torch.float16)
    K.reduce(dst, src, scale=0.5, out=out, impl=impl)
    assert torch.equal(dst, src)
    assert torch.equal(out, src)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_reduce_src_aliasing_dst_doubles(impl):
    x = torch.arange(100, dtype=torch.bfloat16)
    K.reduce(x, x, impl=impl)
    assert torch.equal(x, 2 * torch.arange(100, dtype=torch.bfloat16))


@pytest.mark.parametrize("fn", ["triton", "torch", "ref"])
def test_reduce_rejects_bad_arguments(fn):
    if fn == "ref":
        call = K.reduce_ref
    else:

        def call(*args, **kwargs):
            return K.reduce(*args, impl=fn, **kwargs)

    x = torch.zeros(8)
    with pytest.raises(ValueError, match="dst is not contiguous"):
        call(torch.zeros(4, 4).t(), torch.zeros(16))
    with pytest.raises(ValueError, match="src is not contiguous"):
        call(torch.zeros(8), torch.zeros(16)[::2])
    with pytest.raises(TypeError, match=r"dst has dtype torch\.int32; supported dtypes are torch"):
        call(torch.zeros(8, dtype=torch.int32), x)
    with pytest.raises(TypeError, match=r"src has dtype torch\.int32"):
        call(x, torch.zeros(8, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"out has dtype torch\.int64"):
        call(x, x, out=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="src has 7 elements but dst has 8"):
        call(x, torch.zeros(7))
    with pytest.raises(ValueError, match="out has 9 elements but dst has 8"):
        call(x, x, out=torch.zeros(9))
    with pytest.raises(ValueError, match="src is on meta but dst is on cpu"):
        call(x, torch.zeros(8, device="meta"))
    assert torch.equal(x, torch.zeros(8))  # nothing was written


def test_impl_choice():
    cpu = torch.zeros(1)
    assert use_triton(cpu, None) is False  # auto: Triton only for CUDA tensors
    assert use_triton(cpu, "torch") is False
    assert use_triton(cpu, "triton") is True  # forced (runs in the interpreter)
    with pytest.raises(ValueError, match="impl must be"):
        use_triton(cpu, "cuda")


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_reduce_into_a_chunk_of_a_larger_buffer(impl):
    # The executor reduces into slices of one flat buffer: a contiguous view
    # with a storage offset must be handled, and its neighbours left alone.
    buf = torch.arange(1000, dtype=torch.float16)
    src = torch.ones(300, dtype=torch.float16)
    out = torch.zeros(500, dtype=torch.float32)
    K.reduce(buf[101:401], src, out=out[7:307], impl=impl, _block=128)
    expected = torch.arange(1000, dtype=torch.float16)
    expected[101:401] += 1
    assert torch.equal(buf, expected)
    assert torch.equal(out[7:307], expected[101:401].float())
    assert not out[:7].any() and not out[307:].any()


@pytest.mark.parametrize("world", [3, 5, 6, 7])
def test_fp64_average_is_exact_fp64_arithmetic(world):
    gen = torch.Generator().manual_seed(world)
    dst = torch.randn(4099, generator=gen, dtype=torch.float64)
    src = torch.randn(4099, generator=gen, dtype=torch.float64)
    exact = (dst + src) * (1.0 / world)  # torch: fp64 add, fp64 scale
    got = dst.clone()
    K.reduce(got, src, scale=1.0 / world, impl="triton", _block=1024)
    assert torch.equal(got, exact)


@pytest.mark.slow  # (Triton runs ptxas for its version: a process, not in the fast tier)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_on_a_gpu_the_scale_is_fp64_and_fp32_data_rounds_it_to_fp32(monkeypatch, dtype):
    """Issue 29, defect 1: a Python float kernel argument is an fp32 parameter on a
    GPU, so fp64 averages were scaled by fp32(1/P) (3e-8 relative off at P=3); the
    interpreter passes fp64 and could not tell. Compiled for sm_90 from the
    launcher's own arguments: the scale is an fp64 parameter, fp64 data is
    multiplied by it in fp64, and other data by its fp32 rounding in fp32 (as
    torch's reference does)."""
    dst, src = torch.ones(10, dtype=dtype), torch.ones(10, dtype=dtype)
    assert_scale_is_fp64(
        *launched_ptx(
            monkeypatch, "reduce", lambda: K.reduce(dst, src, scale=1 / 3, impl="triton")
        ),
        "reduce",
        dtype,
    )


# -- the direct launch (kernels/_triton.py: launch) ---------------------------------------
def _reduce_args(dst, src, out=None, scale=None, block=1024):
    return (
        dst,
        src,
        dst if out is None else out,
        dst.numel(),
        1.0 if scale is None else scale,
        tl.float32,
        scale is not None,
        out is not None,
        block,
    )


def _reduce_arg_sets():
    """Arguments the launcher could pass: aligned and misaligned views (16 bytes =
    4 fp32 elements), numel 1 (folded into the kernel), multiples of 16 and not,
    dtypes, flags and blocks."""
    buf, other = torch.zeros(4200), torch.zeros(4200)
    half = torch.zeros(4200, dtype=torch.bfloat16)
    sets = []
    for start in (0, 1, 4):
        for n in (1, 16, 17, 32, 4099):
            sets.append(_reduce_args(buf[start : start + n], other[:n]))
    sets += [
        _reduce_args(buf[:16], half[:16]),
        _reduce_args(buf[:16], half[1:17]),
        _reduce_args(buf[:16], other[:16], scale=0.5),
        _reduce_args(buf[:16], other[:16], scale=0.25),
        _reduce_args(buf[:16], other[:16], out=half[:16]),
        _reduce_args(buf[:16], other[:16], block=4096),
    ]
    return sets


def test_the_launch_key_separates_exactly_what_tritons_binder_specializes():
    """Two launches share a compiled kernel on the direct path iff their keys are
    equal: the key must split every pair of argument sets that Triton's own binder
    (this Triton's, for CUDA) specializes differently (a misaligned view run by a
    kernel compiled for 16-byte aligned pointers faults; a numel of 17 run by one
    compiled for multiples of 16 reads past the end), and should split no other."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.jit import JITFunction, create_function_from_signature
    except ImportError as e:
        pytest.skip(f"no CUDA backend to compare with: {e}")
    from hybridcomm.kernels import _triton

    module = importlib.import_module("hybridcomm.kernels.reduce")
    fn = JITFunction(getattr(module._reduce_kernel, "fn", module._reduce_kernel))
    binder = create_function_from_signature(
        fn.signature, fn.params, CUDABackend(GPUTarget("cuda", 90, 32))
    )
    constexpr = [p.is_constexpr for p in fn.params]
    sets = _reduce_arg_sets()
    ours = [_triton.specialization_key(args, constexpr) for args in sets]
    theirs = [list(binder(*args)[1]) for args in sets]
    for i in range(len(sets)):
        for j in range(i):
            assert (ours[i] == ours[j]) == (theirs[i] == theirs[j]), (i, j, ours[i], theirs[i])


def _direct_kernel(a_ptr, n, scale: tl.float64, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    pass  # never compiled: the test replaces Triton's path (JITFunction.run)


class _FakeCompiled:
    """Triton's CompiledKernel, as far as the direct launch reads it."""

    def __init__(self, takes, log):
        self.src = types.SimpleNamespace(signature={name: "?" for name in takes})
        self.function, self.packed_metadata = "function", ("packed",)
        self.log, self.fail = log, False

    def run(self, *args):
        if self.fail:
            raise RuntimeError("launcher refused")
        self.log.append(("direct",) + args)


@pytest.fixture
def direct(monkeypatch):
    """A JIT kernel whose Triton path is recorded, on a pretend GPU (device 0)."""
    from triton.runtime.jit import JITFunction
    from hybridcomm.kernels import _triton

    kernel = JITFunction(_direct_kernel)
    log, compiled = [], {}

    def run(*args, grid, warmup, **kwargs):  # Triton's path: returns the compiled kernel
        log.append(("triton", grid, args, kwargs))
        key = _triton.specialization_key(args, [False, False, False, True, True])
        return compiled.setdefault((key, kwargs["num_warps"]), _FakeCompiled(direct.takes, log))

    kernel.run = run
    monkeypatch.setattr(_triton, "FAST_LAUNCH", True)
    monkeypatch.setattr(_triton, "CompiledKernel", _FakeCompiled)
    monkeypatch.setattr(_triton, "interpreting", lambda: False)
    monkeypatch.setattr(_triton, "_raw_stream", lambda device: 7000 + device)
    monkeypatch.setattr(_triton, "_current_device", lambda: 0)
    monkeypatch.setattr(_triton, "_HOOK_OWNERS", [])
    monkeypatch.setattr(_triton, "_compiled", {})
    direct = types.SimpleNamespace(
        kernel=kernel,
        log=log,
        compiled=compiled,
        takes=["a_ptr", "n", "scale", "FLAG", "BLOCK"],
        launch=lambda args, warps=4: _triton.launch(kernel, 3, warps, 0, args),
    )
    return direct


def test_a_seen_specialization_is_launched_through_its_compiled_launcher(direct):
    x = torch.zeros(64)
    direct.launch((x, 32, 0.5, True, 128))
    direct.launch((x, 48, 0.25, True, 128))  # same specialization: 32 and 48 are multiples of 16
    assert [e[0] for e in direct.log] == ["triton", "direct"]
    assert direct.log[0][1] == (3,) and direct.log[0][3] == {"num_warps": 4}
    # As JITFunction.run calls it with no hook set: grid, stream, function, metadata,
    # no launch metadata and no hooks, then every argument (Triton 3.3 on).
    assert direct.log[1] == (
        "direct",
        3,
        1,
        1,
        7000,
        "function",
        ("packed",),
        None,
        None,
        None,
        x.data_ptr(),
        48,
        0.25,
        True,
        128,
    )  # a tensor as its address
    for args, warps in [
        ((x, 33, 0.5, True, 128), 4),  # another specialization each
        ((x[1:], 32, 0.5, True, 128), 4),
        ((x, 32, 0.5, False, 128), 4),
        ((x, 1, 0.5, True, 128), 4),
        ((x, 32, 0.5, True, 256), 4),
        ((x.double(), 32, 0.5, True, 128), 4),
        ((x, 32, 0.5, True, 128), 8),
    ]:
        del direct.log[:]
        direct.launch(args, warps)
        direct.launch(args, warps)
        assert [e[0] for e in direct.log] == ["triton", "direct"], args


def test_triton_3_0_to_3_2_launchers_take_no_constexprs(direct):
    direct.takes = ["a_ptr", "n", "scale"]  # what their compiled kernels' signatures name
    x = torch.zeros(64)
    direct.launch((x, 32, 0.5, True, 128))
    direct.launch((x, 32, 0.5, True, 128))
    assert direct.log[1][-3:] == (x.data_ptr(), 32, 0.5)


def test_the_direct_launch_falls_back_to_tritons_path(direct, monkeypatch):
    from hybridcomm.kernels import _triton

    x = torch.zeros(64)
    direct.launch((x, 32, 0.5, True, 128))
    for compiled in direct.compiled.values():
        compiled.fail = True  # the launcher refuses: Triton's path, then and from then on
    direct.launch((x, 32, 0.5, True, 128))
    direct.launch((x, 32, 0.5, True, 128))
    assert [e[0] for e in direct.log] == ["triton", "triton", "triton"]

    del direct.log[:]  # a launch hook (a profiler): Triton's path, which calls it
    monkeypatch.setattr(
        _triton,
        "_HOOK_OWNERS",
        [
            types.SimpleNamespace(
                launch_enter_hook=types.SimpleNamespace(calls=[print]), launch_exit_hook=None
            )
        ],
    )
    direct.launch((x, 17, 0.5, True, 128))
    direct.launch((x, 17, 0.5, True, 128))
    assert [e[0] for e in direct.log] == ["triton", "triton"]
    monkeypatch.setattr(
        _triton,
        "_HOOK_OWNERS",
        [
            types.SimpleNamespace(  # empty chains: unwatched
                launch_enter_hook=types.SimpleNamespace(calls=[]), launch_exit_hook=None
            )
        ],
    )
    direct.launch((x, 17, 0.5, True, 128))
    direct.launch((x, 17, 0.5, True, 128))
    assert [e[0] for e in direct.log] == ["triton", "triton", "triton", "direct"]

    del direct.log[:]  # HYBRIDCOMM_TRITON_FAST_LAUNCH=0
    monkeypatch.setattr(_triton, "FAST_LAUNCH", False)
    monkeypatch.setattr(_triton, "_compiled", {})
    for _ in range(3):
        direct.launch((x, 32, 0.5, True, 128))
    assert [e[0] for e in direct.log] == ["triton"] * 3
    assert not _triton.fast_launch_wanted({"HYBRIDCOMM_TRITON_FAST_LAUNCH": "off"})


def test_the_interpreter_and_stand_ins_take_tritons_path():
    from hybridcomm.kernels import _triton

    module = importlib.import_module("hybridcomm.kernels.reduce")
    assert _triton._compiled_for(module._reduce_kernel) is None  # interpreted (or no GPU)
    assert _triton._compiled_for(object()) is None
