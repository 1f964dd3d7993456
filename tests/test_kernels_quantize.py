"""quantize / dequantize: the Triton kernels (under TRITON_INTERPRET) against the torch
references, and the round trip within its stated error.

Tolerances: the kernels divide with div_rn (IEEE, as torch's CPU division) and do
the same fp32 operations as the references, so codes, scales and dequantized
values must match bitwise, in every input dtype (read in fp32). The round trip
must stay within ``error_bound``: half a step of its group's scale, plus qmax fp32
roundings of the scale (one division, one product), element-wise."""

import importlib

import pytest
import torch

from hybridcomm import kernels as K
from kernel_checks import SIZES

Q = importlib.import_module("hybridcomm.kernels.quantize")

pytestmark = [
    pytest.mark.fast,  # in this process alone (tests/tiers.py)
    pytest.mark.skipif(not K.triton_available, reason="triton is not installed"),
]
# kernel_checks' sizes with the group's edges; its large sizes keep their slow mark
QSIZES = sorted({n for n in SIZES if isinstance(n, int)} | {128, 129, 255, 256 + 7}) + [
    n for n in SIZES if not isinstance(n, int)
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _buffers(n, bits, group=Q.GROUP):
    return (
        torch.empty(Q.code_bytes(n, bits), dtype=torch.uint8),
        torch.empty(Q.groups(n, group), dtype=torch.float32),
    )


def _data(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, max(n, 1))[:n]  # groups' scales differ
    if n > 5:
        x[: n // 5] = 0  # a group of zeros (scale 0), or part of one
    return x.to(dtype)


@pytest.mark.parametrize("group", [Q.GROUP, 16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", Q.BITS)
@pytest.mark.parametrize("n", QSIZES)
def test_kernels_match_the_reference_bitwise(n, bits, dtype, group):
    x = _data(n, dtype, n + bits)
    got, ref = _buffers(n, bits, group), _buffers(n, bits, group)
    K.quantize(x, *got, bits=bits, group=group, impl="triton")
    K.quantize_ref(x, *ref, bits=bits, group=group)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for accumulate in (False, True):
        start = torch.linspace(-1, 1, n)
        out_k, out_r = start.clone(), start.clone()
        K.dequantize(*got, out_k, bits=bits, group=group, accumulate=accumulate, impl="triton")
        K.dequantize_ref(*ref, out_r, bits=bits, group=group, accumulate=accumulate)
        assert torch.equal(out_k, out_r), accumulate


@pytest.mark.parametrize("bits", Q.BITS)
@pytest.mark.parametrize("n", QSIZES)
def test_the_round_trip_is_within_its_stated_error(n, bits):
    x = _data(n, torch.float32, 7 * n + bits)
    codes, scales = _buffers(n, bits)
    K.quantize(x, codes, scales, bits=bits)
    back = K.dequantize(codes, scales, torch.empty(n), bits=bits)
    if not n:
        return
    bound = Q.error_bound(scales, bits).repeat_interleave(Q.GROUP)[:n]
    err = (back.double() - x.double()).abs()
    assert (err <= bound).all(), (err - bound).max()
    # the bound is tight: errors reach most of half a step somewhere (given enough values)
    if n >= 100:
        assert (err / bound.clamp(min=1e-30)).max() > 0.5
    # each group's scale is its largest magnitude over qmax, and that value survives
    rows = torch.nn.functional.pad(x, (0, len(scales) * Q.GROUP - n)).view(-1, Q.GROUP)
    assert torch.equal(scales, rows.abs().amax(1) / Q.qmax(bits))


@pytest.mark.parametrize("bits", Q.BITS)
def test_multiples_of_the_scale_and_zeros_are_exact(bits):
    q = Q.qmax(bits)
    x = torch.randint(-q, q + 1, (3 * Q.GROUP,), generator=torch.Generator().manual_seed(0))
    x = x.float().mul_(0.25)
    x[:: Q.GROUP] = q * 0.25  # every group's largest: its scale is 0.25 exactly
    codes, scales = _buffers(x.numel(), bits)
    K.quantize(x, codes, scales, bits=bits, impl="triton")
    assert torch.equal(K.dequantize(codes, scales, torch.empty_like(x), bits=bits), x)
    zeros = torch.zeros(300)
    codes, scales = _buffers(300, bits)
    K.quantize(zeros, codes, scales, bits=bits, impl="triton")
    assert torch.equal(scales, torch.zeros_like(scales))
    assert torch.equal(K.dequantize(codes, scales, torch.ones(300), bits=bits), zeros)


@pytest.mark.parametrize("bits", Q.BITS)
def test_halves_round_away_from_zero_in_both_signs(bits):
    q = Q.qmax(bits)
    halves = torch.arange(min(q, 62), dtype=torch.float32) + 0.5  # 0.5, 1.5, ...: one group
    y = torch.cat([torch.tensor([float(q), -0.0, 0.0]), halves, -halves])  # its scale 1
    want = torch.cat([torch.tensor([q, 0, 0]), halves.ceil(), -halves.ceil()]) + q + 1
    x = y * 0.25  # every value exact; the group's scale 0.25
    for impl in ("torch", "triton"):
        codes, scales = _buffers(x.numel(), bits)
        K.quantize(x, codes, scales, bits=bits, impl=impl)
        assert scales.tolist() == [0.25], impl
        if bits == 4:
            got = torch.stack([codes & 15, codes >> 4], 1).view(-1)[: x.numel()]
        else:
            got = codes
        assert got.tolist() == want.to(torch.uint8).tolist(), impl


def test_four_bits_pack_two_codes_a_byte_low_nibble_first():
    x = torch.tensor([7.0, -7.0, 0.0])  # scale 1: codes 7+8, -7+8, 0+8 (and the pad's 0+8)
    for impl in ("torch", "triton"):
        codes, scales = _buffers(3, 4)
        K.quantize(x, codes, scales, bits=4, impl=impl)
        assert codes.tolist() == [15 + 16 * 1, 8 + 16 * 8] and scales.tolist() == [1.0]


def test_bad_arguments_name_the_fix():
    x = torch.zeros(10)
    codes, scales = _buffers(10, 4)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        K.quantize(x, codes, scales, bits=3)
    with pytest.raises(ValueError, match="codes has 5 elements; 10 elements need 10"):
        K.quantize(x, codes, scales, bits=8)
    with pytest.raises(TypeError, match="out must be float32"):
        K.dequantize(codes, scales, torch.zeros(10, dtype=torch.float16), bits=4)
