"""pack / unpack: the Triton kernels (under TRITON_INTERPRET) against the torch references.

Tolerances: integer-valued data is exact in every dtype, so it must match
bitwise. Random data: fp32 and fp16 outputs come from the same math as the
reference (fp32 scale, one rounding), so they must match bitwise too. bf16
outputs may be 1 bf16 ulp off, and only under the interpreter: its casts to
bf16 truncate where torch (and the GPU) round to nearest even. The scale's
type on a GPU is read from the PTX Triton compiles from the launcher's own
arguments. A launch of a bucket layout seen before must do no per-block Python
work (the table's rows are built once per layout), and a prepared one
(pack_plan, unpack_plan) no per-tensor work either.
"""

import gc
import importlib
import sys

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

pytestmark = [
    pytest.mark.skipif(not K.triton_available, reason="triton is not installed"),
    pytest.mark.fast,
]


def _shapes(n):
    # A 1-D, a 2-D, an empty and an n-dependent 2-D tensor: offsets that are
    # not multiples of anything, and zero-numel tensors when n == 0.
    return [(n,), (3, 5), (0,), (n, 2)]


def _tensors(n, dtype, gen, integer):
    if integer:
        return [torch.randint(-8, 8, s, generator=gen).to(dtype) for s in _shapes(n)]
    return [torch.randn(s, generator=gen).to(dtype) for s in _shapes(n)]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_integer_valued_are_bitwise_exact(n, dtype, out_dtype, block):
    gen = torch.Generator().manual_seed(n)
    tensors = _tensors(n, dtype, gen, integer=True)
    exact = torch.cat([t.reshape(-1).double() * 0.5 for t in tensors]).to(out_dtype)
    flat = K.pack(tensors, scale=0.5, dtype=out_dtype, impl="triton", _block=block)
    assert flat.shape == (sum(t.numel() for t in tensors),)
    assert torch.equal(flat, exact)
    assert torch.equal(K.pack_ref(tensors, scale=0.5, dtype=out_dtype), exact)

    got = [torch.empty_like(t) for t in tensors]
    ref = [torch.empty_like(t) for t in tensors]
    assert K.unpack(flat, got, scale=2.0, impl="triton", _block=block) == got
    K.unpack_ref(flat, ref, scale=2.0)
    for g, r, t in zip(got, ref, tensors):
        assert torch.equal(g, t) and torch.equal(r, t)


@pytest.mark.parametrize("scale", [None, 1 / 3])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_pack_fp32_grads_to_wire_dtype_matches_ref(n, dtype, block, scale):
    gen = torch.Generator().manual_seed(1000 + n)
    tensors = _tensors(n, torch.float32, gen, integer=False)
    got = K.pack(tensors, scale=scale, dtype=dtype, impl="triton", _block=block)
    ref = K.pack_ref(tensors, scale=scale, dtype=dtype)
    assert_within_ulps(got, ref, allowed_ulps(dtype))


@pytest.mark.parametrize("scale", [None, 1 / 3])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_unpack_wire_dtype_to_fp32_and_own_dtype_matches_ref(n, dtype, block, scale):
    gen = torch.Generator().manual_seed(2000 + n)
    shapes = _shapes(n)
    flat = torch.randn(sum(torch.Size(s).numel() for s in shapes), generator=gen).to(dtype)
    # Alternate fp32 and the wire dtype among the destinations.
    dtypes = [torch.float32 if i % 2 else dtype for i in range(len(shapes))]
    got = [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes)]
    ref = [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes)]
    K.unpack(flat, got, scale=scale, impl="triton", _block=block)
    K.unpack_ref(flat, ref, scale=scale)
    for g, r in zip(got, ref):
        assert_within_ulps(g, r, allowed_ulps(g.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_round_trip_same_dtype_is_identity(impl, dtype):
    gen = torch.Generator().manual_seed(5)
    tensors = _tensors(1000, dtype, gen, integer=False)
    # Power-of-two scales change only exponents: still bitwise.
    flat = K.pack(tensors, scale=4.0, impl=impl)
    back = K.unpack(flat, [torch.empty_like(t) for t in tensors], scale=0.25, impl=impl)
    for b, t in zip(back, tensors):
        assert torch.equal(b, t)


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_round_trip_through_wire_dtype_rounds_once(impl, wire):
    gen = torch.Generator().manual_seed(6)
    tensors = _tensors(1000, torch.float32, gen, integer=False)
    out = torch.empty(sum(t.numel() for t in tensors), dtype=wire)
    assert K.pack(tensors, out, impl=impl) is out
    back = K.unpack(out, [torch.empty_like(t) for t in tensors], impl=impl)
    ulps = allowed_ulps(wire) if impl == "triton" else 0
    for b, t in zip(back, tensors):
        assert_within_ulps(b.to(wire), t.to(wire), ulps)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_fp16_source_is_scaled_in_fp32(impl):
    # 60000 * 2 overflows fp16 (max 65504) but not the fp32 destination: the
    # scale must be applied after the upcast, not in the source dtype.
    x = torch.full((9,), 60000.0, dtype=torch.float16)
    assert torch.isinf(x * 2.0).all()  # what fp16 arithmetic gives
    expected = torch.full((9,), 120000.0)
    assert torch.equal(K.pack([x], scale=2.0, dtype=torch.float32, impl=impl), expected)
    y = torch.empty(9)
    K.unpack(x, [y], scale=2.0, impl=impl)
    assert torch.equal(y, expected)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_empty_inputs(impl):
    flat = K.pack([], impl=impl)
    assert flat.shape == (0,) and flat.dtype == torch.float32
    assert K.pack([], dtype=torch.bfloat16, impl=impl).dtype == torch.bfloat16
    zeros = [torch.empty(0, 3), torch.empty(0)]
    assert K.pack(zeros, impl=impl).shape == (0,)
    assert K.unpack(torch.empty(0), [], impl=impl) == []
    assert K.unpack(torch.empty(0), zeros, impl=impl) == zeros


@pytest.mark.parametrize("fn", ["triton", "torch", "ref"])
def test_pack_rejects_bad_arguments(fn):
    if fn == "ref":
        call = K.pack_ref
    else:

        def call(*args, **kwargs):
            return K.pack(*args, impl=fn, **kwargs)

    a, b = torch.zeros(3), torch.zeros(4)
    with pytest.raises(ValueError, match=r"tensors\[1\] is not contiguous"):
        call([a, torch.zeros(4, 2).t(), b])
    with pytest.raises(TypeError, match=r"tensors\[0\] has dtype torch\.int32; supported dtypes"):
        call([torch.zeros(3, dtype=torch.int32)])
    with pytest.raises(TypeError, match=r"dtype is torch\.complex64; supported dtypes are"):
        call([a], dtype=torch.complex64)
    with pytest.raises(TypeError, match="mixed dtypes"):
        call([a, b.half()])
    with pytest.raises(ValueError, match="out has 6 elements but the tensors hold 7"):
        call([a, b], torch.empty(6))
    with pytest.raises(ValueError, match="out has 8 elements but the tensors hold 7"):
        call([a, b], torch.empty(8))
    with pytest.raises(ValueError, match="out is not contiguous"):
        call([a, b], torch.empty(14)[::2])
    with pytest.raises(ValueError, match=r"tensors\[1\] is on meta but out is on cpu"):
        call([a, torch.zeros(4, device="meta")], torch.empty(7))


@pytest.mark.parametrize("fn", ["triton", "torch", "ref"])
def test_unpack_rejects_bad_arguments(fn):
    if fn == "ref":
        call = K.unpack_ref
    else:

        def call(*args, **kwargs):
            return K.unpack(*args, impl=fn, **kwargs)

    a, b = torch.zeros(3), torch.zeros(4)
    with pytest.raises(ValueError, match="flat has 8 elements but the tensors hold 7"):
        call(torch.zeros(8), [a, b])
    with pytest.raises(ValueError, match=r"tensors\[1\] is not contiguous"):
        call(torch.zeros(11), [a, torch.zeros(4, 2).t()])
    with pytest.raises(ValueError, match="flat is not contiguous"):
        call(torch.zeros(14)[::2], [a, b])
    with pytest.raises(TypeError, match=r"flat has dtype torch\.int64"):
        call(torch.zeros(7, dtype=torch.int64), [a, b])
    with pytest.raises(TypeError, match=r"tensors\[0\] has dtype torch\.int32"):
        call(torch.zeros(7), [torch.zeros(3, dtype=torch.int32), b])
    with pytest.raises(ValueError, match=r"tensors\[0\] is on meta but flat is on cpu"):
        call(torch.zeros(7), [torch.zeros(3, device="meta"), b])


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_pack_and_unpack_through_a_chunk_of_a_larger_buffer(impl):
    # A bucket's slot in a bigger flat buffer: a view with a storage offset.
    buf = torch.zeros(100, dtype=torch.bfloat16)
    tensors = [torch.arange(1.0, 11.0), torch.arange(11.0, 31.0).view(4, 5)]
    K.pack(tensors, buf[40:70], impl=impl, _block=16)
    assert torch.equal(buf[40:70], torch.arange(1.0, 31.0, dtype=torch.bfloat16))
    assert not buf[:40].any() and not buf[70:].any()
    back = K.unpack(buf[40:70], [torch.empty(10), torch.empty(4, 5)], impl=impl, _block=16)
    assert all(torch.equal(b, t) for b, t in zip(back, tensors))


class _CountingKernel:
    """Wraps a Triton kernel and counts its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.programs = kernel, 0, 0

    def __getitem__(self, grid):
        self.launches += 1
        self.programs += grid[0] * (grid[1] if len(grid) > 1 else 1)
        return self.kernel[grid]


@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_one_launch_per_bucket_whatever_its_tensor_count(monkeypatch, op):
    module = importlib.import_module(f"hybridcomm.kernels.{op}")
    counter = _CountingKernel(getattr(module, f"_{op}_kernel"))
    monkeypatch.setattr(module, f"_{op}_kernel", counter)
    tensors = [torch.randn(s) for s in [(3, 5), (7,), (1,), (0,), (2, 2, 2), (11,)]]
    flat = torch.empty(sum(t.numel() for t in tensors))
    if op == "pack":
        K.pack(tensors, flat, impl="triton", _block=4)
        assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))
    else:
        flat.copy_(torch.arange(flat.numel(), dtype=torch.float32))
        out = [torch.empty_like(t) for t in tensors]
        K.unpack(flat, out, impl="triton", _block=4)
        assert torch.equal(torch.cat([t.reshape(-1) for t in out]), flat)
    assert counter.launches == 1
    # one program per block of each tensor, none empty: 4+2+1+0+2+3 (not 4 x 5 tensors)
    assert counter.programs == sum(-(-t.numel() // 4) for t in tensors) == 12


def test_launch_tables_are_kept_for_every_bucket_of_a_large_model():
    """A model with more buckets than a small cache holds: after the first step
    every bucket's table is reused, none rebuilt."""
    from hybridcomm.kernels import _triton

    buckets = [[torch.randn(3), torch.randn(2)] for _ in range(300)]
    flats = [torch.empty(5) for _ in buckets]
    for step in range(2):
        before = _triton.table_stats()
        for tensors, flat in zip(buckets, flats):
            K.pack(tensors, flat, impl="triton", _block=16)
        after = _triton.table_stats()
        built = after["built"] - before["built"]
        reused = after["reused"] - before["reused"]
        assert built + reused == 300
    assert built == 0  # the second step (the first may find tables of freed tensors)
    assert torch.equal(flats[-1], torch.cat(buckets[-1]))


def _aligned_offsets(tensors, align=4):
    """A bucket-like layout: each tensor starts at a multiple of ``align`` elements."""
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += -(-t.numel() // align) * align
    return offsets, at


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_at_offsets_match_ref_and_leave_the_gaps(n, dtype, block):
    """Integer-valued data, so every dtype is exact: the kernels and the references
    agree bitwise, each tensor lands at its offset, and the padding between the
    tensors keeps its sentinel."""
    gen = torch.Generator().manual_seed(3000 + n)
    tensors = _tensors(n, dtype, gen, integer=True)
    offsets, total = _aligned_offsets(tensors)
    got = torch.full((total + 3,), -99.0, dtype=dtype)
    ref = got.clone()
    K.pack(tensors, got, offsets=offsets, impl="triton", _block=block)
    K.pack_ref(tensors, ref, offsets=offsets)
    assert torch.equal(got, ref)
    gap = torch.ones(total + 3, dtype=torch.bool)
    for t, o in zip(tensors, offsets):
        assert torch.equal(got[o : o + t.numel()], t.reshape(-1))
        gap[o : o + t.numel()] = False
    assert (got[gap] == -99).all()

    back = [torch.empty_like(t) for t in tensors]
    back_ref = [torch.empty_like(t) for t in tensors]
    K.unpack(got, back, offsets=offsets, impl="triton", _block=block)
    K.unpack_ref(got, back_ref, offsets=offsets)
    for b, r, t in zip(back, back_ref, tensors):
        assert torch.equal(b, t) and torch.equal(r, t)


def test_pack_with_offsets_allocates_zeroed_gaps():
    flat = K.pack([torch.ones(3), torch.full((2,), 2.0)], offsets=[1, 5])
    assert torch.equal(flat, torch.tensor([0.0, 1, 1, 1, 0, 2, 2]))


@pytest.mark.parametrize("fn", ["pack", "unpack"])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_offsets_rejected_when_they_overlap_or_overrun(fn, impl):
    a, b = torch.zeros(3), torch.zeros(4)

    def call(flat, offsets):
        if fn == "pack":
            return K.pack([a, b], flat, offsets=offsets, impl=impl)
        return K.unpack(flat, [a, b], offsets=offsets, impl=impl)

    name = "out" if fn == "pack" else "flat"
    with pytest.raises(ValueError, match=r"offsets\[1\]=2 overlaps the tensor before it"):
        call(torch.zeros(10), [0, 2])
    with pytest.raises(ValueError, match=f"the tensors end at element 11 but {name} has 10"):
        call(torch.zeros(10), [0, 7])
    with pytest.raises(ValueError, match="1 offsets for 2 tensors"):
        call(torch.zeros(10), [0])
    call(torch.zeros(8), [0, 4])  # a gap of one element, and room: fine


@pytest.mark.slow  # (Triton runs ptxas for its version: a process, not in the fast tier)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_on_a_gpu_the_scale_is_fp64_and_fp32_data_rounds_it_to_fp32(monkeypatch, op, dtype):
    """Issue 29, defect 1 (see the reduce test of the same name): compiled for sm_90
    from the launcher's own arguments, the scale is an fp64 parameter, fp64 data
    is multiplied by it in fp64, fp32 data by its fp32 rounding in fp32."""
    tensors, flat = [torch.ones(10, dtype=dtype)], torch.ones(10, dtype=dtype)
    if op == "pack":

        def launch():
            K.pack(tensors, flat, scale=1 / 3, impl="triton")
    else:

        def launch():
            K.unpack(flat, tensors, scale=1 / 3, impl="triton")

    assert_scale_is_fp64(*launched_ptx(monkeypatch, op, launch), op, dtype)


@pytest.mark.parametrize("world", [3, 5, 6, 7])
def test_fp64_pack_and_unpack_scale_in_exact_fp64(world):
    gen = torch.Generator().manual_seed(world)
    tensors = [torch.randn(n, generator=gen, dtype=torch.float64) for n in (7, 1000, 1)]
    flat = K.pack(tensors, scale=1.0 / world, impl="triton", _block=128)
    assert torch.equal(flat, torch.cat(tensors) * (1.0 / world))
    back = K.unpack(
        flat, [torch.empty_like(t) for t in tensors], scale=1.0 / world, impl="triton", _block=128
    )
    for b, f in zip(back, flat.split([t.numel() for t in tensors])):
        assert torch.equal(b, f * (1.0 / world))


class _NoLaunch:
    """Stands in for a kernel: ``kernel[grid](...)`` runs nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_a_seen_layout_builds_no_rows_and_costs_the_same_whatever_its_blocks(monkeypatch, op):
    """Issue 29, defect 5: one Python row per block was rebuilt and hashed at every
    launch (25,600 rows, ~9 ms of host time for a 100 MiB bucket at block 1024).
    Rows are built once per layout; a launch of a seen layout makes the same
    Python calls for 4 blocks as for 4096."""
    from hybridcomm.kernels import _triton

    module = importlib.import_module(f"hybridcomm.kernels.{op}")
    monkeypatch.setattr(module, f"_{op}_kernel", _NoLaunch())
    real_rows, built = _triton.block_rows, []

    def counted_rows(members, block):
        built.append(block)
        return real_rows(members, block)

    monkeypatch.setattr(_triton, "block_rows", counted_rows)

    def launch(tensors, flat):
        if op == "pack":
            K.pack(tensors, flat, impl="triton", _block=16)
        else:
            K.unpack(flat, tensors, impl="triton", _block=16)

    def python_calls(tensors, flat):
        calls = [0]

        def profile(frame, event, arg):
            calls[0] += event in ("call", "c_call")

        sys.setprofile(profile)
        try:
            launch(tensors, flat)
        finally:
            sys.setprofile(None)
        return calls[0]

    small = [torch.zeros(16) for _ in range(4)]  # 4 blocks
    large = [torch.zeros(16 * 1024) for _ in range(4)]  # 4096 blocks
    buckets = [(small, torch.zeros(64)), (large, torch.zeros(16 * 4096))]
    for bucket in buckets:
        launch(*bucket)  # the first launch of this layout may build its rows
    seen = len(built)
    costs = [python_calls(*bucket) for bucket in buckets for _ in range(2)]
    assert len(built) == seen  # no rows built for a layout seen before
    assert costs[0] == costs[1] == costs[2] == costs[3], costs


@pytest.mark.parametrize("dst_dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("src_dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_every_dtype_pair_scales_like_the_reference_in_fp64_where_either_is(src_dtype, dst_dtype):
    """Scaled in fp64 (the fp64 scale) where the source or the destination is fp64,
    else in fp32: the kernels and the references alike, at a scale fp32 cannot hold."""
    gen = torch.Generator().manual_seed(11)
    sizes = (7, 1000, 1)
    tensors = [torch.randn(n, generator=gen).to(src_dtype) for n in sizes]
    packed = K.pack(tensors, scale=1 / 3, dtype=dst_dtype, impl="triton", _block=128)
    assert_within_ulps(
        packed,
        K.pack_ref(tensors, scale=1 / 3, dtype=dst_dtype),
        allowed_ulps(dst_dtype, src_dtype),
    )
    flat = torch.randn(sum(sizes), generator=gen).to(src_dtype)
    got = [torch.empty(n, dtype=dst_dtype) for n in sizes]
    ref = [torch.empty(n, dtype=dst_dtype) for n in sizes]
    K.unpack(flat, got, scale=1 / 3, impl="triton", _block=128)
    K.unpack_ref(flat, ref, scale=1 / 3)
    for g, r in zip(got, ref):
        assert_within_ulps(g, r, allowed_ulps(dst_dtype, src_dtype))
    if dst_dtype == torch.float64:  # one fp64 rounding of the exact product
        assert torch.equal(packed, torch.cat(tensors).double() * (1 / 3))
        assert torch.equal(torch.cat(got), flat.double() * (1 / 3))


# -- prepared pack and unpack (pack_plan, unpack_plan) -------------------------------------
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("wire", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_plans_equal_the_one_shot_calls_and_the_references(n, dtype, wire, block):
    """Integer-valued data and a power-of-two scale: every dtype pair is exact, so
    the plans, the one-shot calls and the references agree bitwise, run after run
    (the second run reads the tensors' new values from the same memory)."""
    gen = torch.Generator().manual_seed(4000 + n)
    tensors = _tensors(n, dtype, gen, integer=True)
    offsets, total = _aligned_offsets(tensors)
    flat = torch.full((total + 3,), -99.0, dtype=wire)
    pack_again = K.pack_plan(tensors, flat, offsets=offsets, scale=0.5, impl="triton", _block=block)
    back = [torch.empty_like(t) for t in tensors]
    unpack_again = K.unpack_plan(
        flat, back, offsets=offsets, scale=2.0, impl="triton", _block=block
    )
    for run in range(2):
        for t in tensors:
            t.copy_(torch.randint(-8, 8, t.shape, generator=gen))
        assert pack_again() is flat
        one_shot = torch.full_like(flat, -99.0)
        K.pack(tensors, one_shot, offsets=offsets, scale=0.5, impl="triton", _block=block)
        ref = K.pack_ref(tensors, torch.full_like(flat, -99.0), offsets=offsets, scale=0.5)
        assert torch.equal(flat, one_shot) and torch.equal(flat, ref)
        assert unpack_again() == back
        for b, t in zip(back, tensors):
            assert torch.equal(b, t)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_plans_of_random_data_match_the_references(impl):
    gen = torch.Generator().manual_seed(12)
    tensors = [torch.randn(s, generator=gen) for s in [(1000,), (3, 5), (0,), (1,), (4099,)]]
    wire = torch.empty(sum(t.numel() for t in tensors), dtype=torch.bfloat16)
    K.pack_plan(tensors, wire, scale=1 / 3, impl=impl)()
    assert_within_ulps(
        wire,
        K.pack_ref(tensors, torch.empty_like(wire), scale=1 / 3),
        allowed_ulps(torch.bfloat16) if impl == "triton" else 0,
    )
    got = [torch.empty_like(t) for t in tensors]
    ref = K.unpack_ref(wire, [torch.empty_like(t) for t in tensors], scale=3.0)
    K.unpack_plan(wire, got, scale=3.0, impl=impl)()
    for g, r in zip(got, ref):
        assert torch.equal(g, r)  # bf16 -> fp32 and the fp32 multiply: exact on both


@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_a_plan_launches_once_per_call_with_no_per_tensor_work(monkeypatch, op):
    """The plan does its per-tensor and per-block work once: each call is one launch
    (one dtype), builds no rows, and makes the same Python calls for 4 tensors of
    one block as for 64 tensors of many blocks."""
    from hybridcomm.kernels import _triton

    module = importlib.import_module(f"hybridcomm.kernels.{op}")
    counter = _CountingKernel(_NoLaunch())
    monkeypatch.setattr(module, f"_{op}_kernel", counter)
    real_rows, built = _triton.block_rows, []
    monkeypatch.setattr(
        _triton,
        "block_rows",
        lambda members, block: built.append(block) or real_rows(members, block),
    )

    def plan(count, size):
        tensors = [torch.zeros(size) for _ in range(count)]
        flat = torch.zeros(count * size)
        if op == "pack":
            return K.pack_plan(tensors, flat, impl="triton", _block=16)
        return K.unpack_plan(flat, tensors, impl="triton", _block=16)

    plans = [plan(4, 16), plan(64, 16 * 100)]
    plans[0](), plans[1]()  # the first run on this stream moves its table to the device
    rows_built, launches = len(built), counter.launches

    def python_calls(run):
        calls = [0]

        def profile(frame, event, arg):
            calls[0] += event in ("call", "c_call")

        sys.setprofile(profile)
        try:
            run()
        finally:
            sys.setprofile(None)
        return calls[0]

    costs = [python_calls(p) for p in plans for _ in range(2)]
    assert len(built) == rows_built and counter.launches == launches + 4
    assert costs[0] == costs[1] == costs[2] == costs[3], costs


def test_plans_reject_what_the_one_shot_calls_reject():
    a, b = torch.zeros(3), torch.zeros(4)
    with pytest.raises(ValueError, match=r"tensors\[1\] is not contiguous"):
        K.pack_plan([a, torch.zeros(4, 2).t()], torch.empty(11))
    with pytest.raises(TypeError, match=r"tensors\[0\] has dtype torch\.int32; supported dtypes"):
        K.pack_plan([torch.zeros(3, dtype=torch.int32)], torch.empty(3))
    with pytest.raises(ValueError, match="out has 8 elements but the tensors hold 7"):
        K.pack_plan([a, b], torch.empty(8))
    with pytest.raises(ValueError, match=r"tensors\[1\] is on meta but out is on cpu"):
        K.pack_plan([a, torch.zeros(4, device="meta")], torch.empty(7))
    with pytest.raises(ValueError, match=r"offsets\[1\]=2 overlaps the tensor before it"):
        K.pack_plan([a, b], torch.zeros(10), offsets=[0, 2])
    with pytest.raises(TypeError, match="scale must be a Python number"):
        K.pack_plan([a, b], torch.zeros(7), scale=torch.tensor(0.5))
    with pytest.raises(ValueError, match="flat has 8 elements but the tensors hold 7"):
        K.unpack_plan(torch.zeros(8), [a, b])
    with pytest.raises(TypeError, match=r"flat has dtype torch\.int64"):
        K.unpack_plan(torch.zeros(7, dtype=torch.int64), [a, b])
    with pytest.raises(ValueError, match=r"tensors\[0\] is on meta but flat is on cpu"):
        K.unpack_plan(torch.zeros(7), [torch.zeros(3, device="meta"), b])
    with pytest.raises(ValueError, match="impl must be"):
        K.unpack_plan(torch.zeros(7), [a, b], impl="cuda")


def test_a_plan_keeps_the_memory_it_writes_alive():
    """A tensor given new memory after planning: the plan writes into the old memory,
    which it keeps alive as long as it lives, never into memory freed and handed
    to someone else."""
    from torch.multiprocessing.reductions import StorageWeakRef

    p = torch.nn.Parameter(torch.zeros(1000))
    old = StorageWeakRef(p.untyped_storage())
    again = K.unpack_plan(torch.ones(1000), [p], impl="triton")
    p.data = torch.zeros(1000)
    assert not old.expired()
    again()
    assert not p.detach().any()  # the new memory is not the plan's
    del again
    gc.collect()
    assert old.expired()


@pytest.mark.parametrize(
    "members, aligned",
    [
        ([(0, 0), (0, 24)], True),  # 16-byte addresses, offsets multiples of 4 fp32 elements
        ([(0, 0), (0, 22)], False),  # an offset that is no multiple of 4
        ([(1, 0)], False),  # a misaligned view
    ],
)
def test_the_table_kernels_assume_alignment_only_where_every_row_has_it(members, aligned):
    from hybridcomm.kernels import _triton

    buf, flat = torch.zeros(1 << 12), torch.zeros(64)
    members = [(buf[start : start + 100], offset) for start, offset in members]
    alignment = _triton.row_alignment(members, 16)
    vec = _triton.flat_vec(alignment, flat)
    assert vec == (4 if aligned else 0)
    for t, offset in members:
        for addr, _, row_offset in _triton.block_rows([(t, offset)], 16):
            assert not vec or (addr % 16 == 0 and row_offset % vec == 0)
    # bf16 rows of a block of 4 elements are 8 bytes: no 16-byte promise at any offset
    assert _triton.row_alignment([(torch.zeros(64, dtype=torch.bfloat16), 0)], 4) == 0


def test_the_gpu_launch_geometry():
    from hybridcomm.kernels import _triton

    assert _triton.geometry(1000, True) == (1024, 4)
    assert _triton.geometry(1 << 22, True) == (4096, 8)
    assert _triton.geometry(10, True, 128) == (128, 4)
    with pytest.raises(ValueError, match="positive power of two"):
        _triton.geometry(10, False, 100)
