"""quantize / dequantize: blockwise absmax integer quantization to 8 or 4 bits.

Each group of ``group`` consecutive elements gets one fp32 scale, its largest
magnitude over ``qmax`` (127 for 8 bits, 7 for 4), and each element the
integer nearest ``x / scale`` (halves away from zero), stored with the offset
``qmax + 1`` as an unsigned code: one byte each for 8 bits, two codes a byte
for 4 (element ``2i`` in the low nibble, ``2i + 1`` in the high one). The
last group may be short; its missing elements count as zeros. Dequantizing
gives ``(code - qmax - 1) * scale`` in fp32, optionally added into the output
(``accumulate``: a sum of several ranks' messages, in the caller's order).

Error, for finite inputs: ``|dequantize(quantize(x)) - x| <= scale * (1/2 +
qmax * eps32)`` element-wise (``eps32`` fp32's epsilon: the one rounding of
the division and of the product; :func:`error_bound`). The kernel divides with
``div_rn`` (IEEE, as torch's CPU division), so it and the reference give the
same codes and scales, bit for bit.

Example::

    >>> x = torch.tensor([0.5, -1.0, 0.25, 0.0, 2.0])
    >>> codes, scales = torch.empty(3, dtype=torch.uint8), torch.empty(1)
    >>> quantize(x, codes, scales, bits=4); scales
    tensor([0.2857])
    >>> dequantize(codes, scales, torch.empty(5), bits=4)
    tensor([ 0.5714, -0.8571,  0.2857,  0.0000,  2.0000])
"""

import torch

from ._triton import check_tensor, simulated, tl, triton, triton_available, use_triton

GROUP = 128  # elements per scale: 4 bytes of scale per 64 (4 bits) or 128 bytes (8 bits)
BITS = (8, 4)
# Groups per program: the interpreter costs ~1 ms a program, so there it takes many;
# on a GPU 8 groups (1,024 elements) a program, the other kernels' block.
_ROWS_GPU, _ROWS_INTERPRETED = 8, 512


def qmax(bits: int) -> int:
    """The largest code magnitude: 127 for 8 bits, 7 for 4."""
    return (1 << (bits - 1)) - 1


def code_bytes(numel: int, bits: int) -> int:
    """Bytes the codes of ``numel`` elements take."""
    return (numel * bits + 7) // 8


def groups(numel: int, group: int = GROUP) -> int:
    """Scales (groups) ``numel`` elements take."""
    return -(-numel // group)


def error_bound(scales: torch.Tensor, bits: int, group: int = GROUP) -> torch.Tensor:
    """Per group, the largest ``|dequantize(quantize(x)) - x|`` (module docstring)."""
    eps = torch.finfo(torch.float32).eps
    return scales.double() * (0.5 + qmax(bits) * eps)


if triton_available:

    @triton.jit
    def _codes(x, scale, QMAX: tl.constexpr):
        # The nearest integer to x / scale, halves away from zero (a group of zeros:
        # scale 0, divided by 1 instead).
        y = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0))
        r = tl.minimum(tl.floor(tl.abs(y) + 0.5), QMAX * 1.0)
        return tl.where(y < 0, -r, r) + (QMAX + 1)

    @triton.jit
    def _quantize_kernel(
        x_ptr,
        codes_ptr,
        scales_ptr,
        numel,
        QMAX: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        # Program p: groups p * ROWS ... (p + 1) * ROWS - 1, a row each.
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        if BITS == 8:
            idx = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            x = tl.load(x_ptr + idx, mask=idx < numel, other=0.0).to(tl.float32)
            scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), QMAX * 1.0)
            code = _codes(x, scale[:, None], QMAX)
            tl.store(codes_ptr + idx, code.to(tl.uint8), mask=idx < numel)
        else:  # two codes a byte: even elements low, odd high
            half = tl.arange(0, GROUP // 2)
            even = rows[:, None] * GROUP + 2 * half[None, :]
            lo = tl.load(x_ptr + even, mask=even < numel, other=0.0).to(tl.float32)
            hi = tl.load(x_ptr + even + 1, mask=even + 1 < numel, other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))
            scale = tl.math.div_rn(amax, QMAX * 1.0)
            byte = _codes(lo, scale[:, None], QMAX) + 16 * _codes(hi, scale[:, None], QMAX)
            at = rows[:, None] * (GROUP // 2) + half[None, :]
            tl.store(codes_ptr + at, byte.to(tl.uint8), mask=even < numel)
        tl.store(scales_ptr + rows, scale, mask=rows * GROUP < numel)

    @triton.jit
    def _dequantize_kernel(
        codes_ptr,
        scales_ptr,
        out_ptr,
        numel,
        ACCUMULATE: tl.constexpr,
        QMAX: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        scale = tl.load(scales_ptr + rows, mask=rows * GROUP < numel, other=0.0)[:, None]
        if BITS == 8:
            idx = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            code = tl.load(codes_ptr + idx, mask=idx < numel, other=0).to(tl.float32)
            v = (code - (QMAX + 1)) * scale
            if ACCUMULATE:
                v = tl.load(out_ptr + idx, mask=idx < numel, other=0.0) + v
            tl.store(out_ptr + idx, v, mask=idx < numel)
        else:
            half = tl.arange(0, GROUP // 2)
            even = rows[:, None] * GROUP + 2 * half[None, :]
            at = rows[:, None] * (GROUP // 2) + half[None, :]
            byte = tl.load(codes_ptr + at, mask=even < numel, other=0).to(tl.int32)
            lo = ((byte & 15).to(tl.float32) - (QMAX + 1)) * scale
            hi = ((byte >> 4).to(tl.float32) - (QMAX + 1)) * scale
            if ACCUMULATE:
                lo = tl.load(out_ptr + even, mask=even < numel, other=0.0) + lo
                hi = tl.load(out_ptr + even + 1, mask=even + 1 < numel, other=0.0) + hi
            tl.store(out_ptr + even, lo, mask=even < numel)
            tl.store(out_ptr + even + 1, hi, mask=even + 1 < numel)

else:
    _quantize_kernel = _dequantize_kernel = None


def _check(x, codes, scales, bits, group, x_name):
    check_tensor(x, x_name)
    if bits not in BITS:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if group <= 1 or group & (group - 1):
        raise ValueError(f"group must be a power of two >= 2, got {group}")
    n = x.numel()
    for t, name, dtype, want in (
        (codes, "codes", torch.uint8, code_bytes(n, bits)),
        (scales, "scales", torch.float32, groups(n, group)),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or not t.is_contiguous():
            raise TypeError(f"{name} must be a contiguous {dtype} tensor")
        if t.numel() != want:
            raise ValueError(f"{name} has {t.numel()} elements; {n} elements need {want}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but {x_name} is on {x.device}")


def _launch(kernel, x, *args, bits, group, **constexprs):
    rows = _ROWS_GPU if x.is_cuda else _ROWS_INTERPRETED
    grid = max(1, -(-groups(x.numel(), group) // rows))
    meta = dict(constexprs, QMAX=qmax(bits), BITS=bits, GROUP=group, ROWS=rows)
    if x.is_cuda:
        with torch.cuda.device(x.device):
            kernel[(grid,)](*args, **meta)
    else:
        kernel[(grid,)](*args, **meta)


def quantize(x, codes, scales, *, bits: int, group: int = GROUP, impl=None):
    """Quantize the contiguous ``x`` (fp32, fp16, bf16 or fp64; read in fp32) into
    ``codes`` (uint8, :func:`code_bytes`) and ``scales`` (fp32, :func:`groups`).
    CUDA runs the Triton kernel, other devices :func:`quantize_ref`; ``impl``
    ("triton" or "torch") forces one."""
    _check(x, codes, scales, bits, group, "x")
    if x.numel() == 0:
        return
    if simulated(
        "quantize",
        x,
        impl,
        _quantize_torch,
        (x, codes, scales, bits, group),
        reads=[x],
        writes=[codes, scales],
    ):
        return
    if not use_triton(x, impl):
        _quantize_torch(x, codes, scales, bits, group)
        return
    _launch(_quantize_kernel, x, x, codes, scales, x.numel(), bits=bits, group=group)


def dequantize(codes, scales, out, *, bits: int, group: int = GROUP, accumulate=False, impl=None):
    """``out`` (fp32) = (or, ``accumulate``, ``+=``) the values ``codes`` and
    ``scales`` stand for (:func:`quantize`'s layout); returns ``out``."""
    if out.dtype != torch.float32:
        raise TypeError(f"out must be float32 (an accumulator), got {out.dtype}")
    _check(out, codes, scales, bits, group, "out")
    if out.numel() == 0:
        return out
    if simulated(
        "dequantize",
        out,
        impl,
        _dequantize_torch,
        (codes, scales, out, bits, group, accumulate),
        reads=[codes, scales] + ([out] if accumulate else []),
        writes=[out],
    ):
        return out
    if not use_triton(out, impl):
        return _dequantize_torch(codes, scales, out, bits, group, accumulate)
    _launch(
        _dequantize_kernel,
        out,
        codes,
        scales,
        out,
        out.numel(),
        bits=bits,
        group=group,
        ACCUMULATE=bool(accumulate),
    )
    return out


def quantize_ref(x, codes, scales, *, bits: int, group: int = GROUP):
    """Plain-torch :func:`quantize` (the CPU production path and the test oracle)."""
    _check(x, codes, scales, bits, group, "x")
    if x.numel():
        _quantize_torch(x, codes, scales, bits, group)


def dequantize_ref(codes, scales, out, *, bits: int, group: int = GROUP, accumulate=False):
    """Plain-torch :func:`dequantize`."""
    _check(out, codes, scales, bits, group, "out")
    return _dequantize_torch(codes, scales, out, bits, group, accumulate) if out.numel() else out


def _rows(x, group):
    """``x`` as fp32 rows of ``group`` values: ``x`` itself where it is fp32 and whole
    groups (no copy: a sync's buckets are), else a copy padded with zeros."""
    n = x.numel()
    flat = x.reshape(-1)
    if n % group == 0 and flat.dtype == torch.float32:
        return flat.view(-1, group)
    padded = torch.zeros(groups(n, group) * group, dtype=torch.float32, device=x.device)
    padded[:n] = flat
    return padded.view(-1, group)


def _quantize_torch(x, codes, scales, bits, group):
    # The kernel's numbers in few passes over the values: this is the CPU production
    # path, and each pass of eager torch reads or writes 4 bytes a value.
    q = qmax(bits)
    rows = _rows(x, group)
    # |x|'s largest without a copy of |x|; abs_ makes a group of zeros' scale +0.0.
    # Both divisions are IEEE, as the kernel's div_rn.
    scale = torch.maximum(rows.amax(1), rows.amin(1).neg_()).abs_().div_(q)
    scales.copy_(scale)
    y = (rows / torch.where(scale > 0, scale, 1.0)[:, None]).view(-1)  # (x is not written)
    negative = torch.signbit(y).view(torch.uint8)
    # min(floor(|y| + 1/2), q), the kernel's r: the truncation of min(|y| + 1/2, q)
    r = y.abs_().add_(0.5).clamp_(max=q).to(torch.uint8)
    # r's sign as bytes, mod 256: r * 255 is -r, and q + 1 - r is never below 1
    code = r.mul_(negative.mul(254).add_(1)).add_(q + 1)
    if bits == 4:  # two codes a byte, even elements low: written into codes directly
        pairs = code.view(-1, 2)[: codes.numel()]
        torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=codes)
    else:
        codes.copy_(code[: codes.numel()])


def _dequantize_torch(codes, scales, out, bits, group, accumulate):
    n, q = out.numel(), qmax(bits)
    size = groups(n, group) * group
    direct = not accumulate and size == n and out.is_contiguous()
    value = out.view(-1) if direct else torch.empty(size, dtype=torch.float32, device=out.device)
    if bits == 4:  # low nibbles to the even elements, high to the odd
        pairs = value.view(-1, 2)
        pairs[: codes.numel(), 0] = codes & 15
        pairs[: codes.numel(), 1] = codes >> 4
        filled = 2 * codes.numel()
    else:
        value[: codes.numel()] = codes
        filled = codes.numel()
    value[filled:].zero_()  # (the last group's padding: no codes)
    value.sub_(q + 1).view(-1, group).mul_(scales[:, None])
    if direct:
        return out
    if accumulate:
        out.view(-1).add_(value[:n])
    else:
        out.view(-1).copy_(value[:n])
    return out
