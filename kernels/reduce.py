"""reduce: ``dst = (dst + src) * scale`` with fp32 accumulation, optional copy-out."""

import torch

from ._triton import (
    check_same_device,
    check_scale,
    check_tensor,
    fine,
    geometry,
    launch,
    tl,
    triton,
    triton_available,
    simulated,
    use_triton,
)

if triton_available:

    @triton.jit
    def _reduce_block(
        dst_ptr,
        src_ptr,
        out_ptr,
        offs,
        mask,
        scale,
        ACC: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        HAS_OUT: tl.constexpr,
    ):
        # Upcast before any math (ACC: fp32, or fp64 for fp64): fp16/bf16 sums
        # must not round (or overflow) per step, and the interpreter gets bf16
        # arithmetic wrong.
        r = tl.load(dst_ptr + offs, mask=mask).to(ACC)
        r += tl.load(src_ptr + offs, mask=mask).to(ACC)
        if HAS_SCALE:
            # fp64 data: the fp64 scale; else rounded to fp32 as torch's reference does.
            r *= scale if ACC == tl.float64 else tl.cast(scale, tl.float32)
        tl.store(dst_ptr + offs, r.to(dst_ptr.dtype.element_ty), mask=mask)
        if HAS_OUT:
            if out_ptr.dtype.element_ty == tl.bfloat16:
                r = r.to(tl.float32)  # fp64 -> bf16 through fp32 (see _triton.py)
            tl.store(out_ptr + offs, r.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _reduce_kernel(
        dst_ptr,
        src_ptr,
        out_ptr,
        numel,
        scale: tl.float64,  # a plain float parameter would be fp32 on a GPU (check_scale)
        ACC: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        HAS_OUT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # int64 so buffers past 2**31 elements index correctly.
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= numel:
            # A full block takes no mask, so 16-byte aligned buffers move 16 bytes
            # per access (a mask against a numel that is no multiple of 16 would
            # keep every access scalar); only the last block is masked.
            _reduce_block(dst_ptr, src_ptr, out_ptr, offs, None, scale, ACC, HAS_SCALE, HAS_OUT)
        else:
            _reduce_block(
                dst_ptr, src_ptr, out_ptr, offs, offs < numel, scale, ACC, HAS_SCALE, HAS_OUT
            )

else:
    _reduce_kernel = None


def _check(dst, src, out):
    # A valid call (the common one) costs a few attribute reads; anything else
    # goes through the full checks, which name the culprit.
    if (
        fine(dst)
        and fine(src)
        and src.numel() == dst.numel()
        and src.device == dst.device
        and (out is None or (fine(out) and out.numel() == dst.numel() and out.device == dst.device))
    ):
        return
    check_tensor(dst, "dst")
    check_tensor(src, "src")
    check_same_device(src, dst, "src", "dst")
    if src.numel() != dst.numel():
        raise ValueError(f"src has {src.numel()} elements but dst has {dst.numel()}")
    if out is not None:
        check_tensor(out, "out")
        check_same_device(out, dst, "out", "dst")
        if out.numel() != dst.numel():
            raise ValueError(f"out has {out.numel()} elements but dst has {dst.numel()}")


def reduce(dst, src, *, scale=None, out=None, impl=None, _block=None):
    """Reduce ``src`` into ``dst`` in place: ``dst[:] = (dst + src) * scale``.

    The sum and the scale are computed in fp32 (fp64, with the fp64 scale, for
    an fp64 ``dst``) whatever the dtypes (fp16/bf16 round once, at the end), then cast to ``dst.dtype``; ``src`` may have
    another float dtype (fp16 wire data into an fp32 buffer). If ``out`` is
    given (the last reduce-scatter step's copy-out), the same fp32 result is
    also written there, cast to ``out.dtype``. All tensors are contiguous, on
    one device, with equal numel. CUDA tensors run the Triton kernel, others
    :func:`reduce_ref`; ``impl`` ("triton" or "torch") forces one.
    ``_block`` overrides elements per program (tests only).

    Example::

        >>> acc = torch.zeros(4)
        >>> reduce(acc, torch.ones(4, dtype=torch.float16), scale=0.5)
        tensor([0.5000, 0.5000, 0.5000, 0.5000])

    Returns ``dst``.
    """
    _check(dst, src, out)
    if scale is not None:
        scale = check_scale(scale)
    if not (impl is None and triton_available and dst.is_cuda):  # else: the GPU kernel, at once
        if simulated(
            "reduce",
            dst,
            impl,
            _reduce_torch,
            (dst, src, scale, out),
            reads=[src],
            writes=[dst] if out is None else [dst, out],
        ):
            return dst
        if not use_triton(dst, impl):
            return _reduce_torch(dst, src, scale, out)
    numel = dst.numel()
    if numel == 0:
        return dst
    block, warps = geometry(numel, dst.is_cuda, _block)
    launch(
        _reduce_kernel,
        -(-numel // block),
        warps,
        dst.get_device(),
        (
            dst,
            src,
            dst if out is None else out,  # never written when HAS_OUT is False
            numel,
            1.0 if scale is None else scale,
            tl.float64 if dst.dtype is torch.float64 else tl.float32,  # ACC
            scale is not None,  # HAS_SCALE
            out is not None,  # HAS_OUT
            block,  # BLOCK
        ),
    )
    return dst


def reduce_ref(dst, src, *, scale=None, out=None):
    """Plain-torch :func:`reduce` (the CPU production path and the test oracle).

    Example::

        >>> acc = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
        >>> wire = torch.empty(2, dtype=torch.float16)
        >>> reduce_ref(acc, torch.tensor([3.0, 4.0], dtype=torch.bfloat16), out=wire)
        tensor([4., 6.], dtype=torch.bfloat16)
        >>> wire
        tensor([4., 6.], dtype=torch.float16)

    Returns ``dst``.
    """
    _check(dst, src, out)
    return _reduce_torch(dst, src, check_scale(scale), out)


def _reduce_torch(dst, src, scale, out):
    d = dst.view(-1)
    s = src.view(-1)
    if dst.dtype in (torch.float32, torch.float64):
        # Accumulate in dst itself: no temporary (src upcasts exactly).
        r = d.add_(s)
    else:
        # One fp32 temporary, so fp16/bf16 round once, after add and scale.
        r = d.to(torch.float32)
        r.add_(s)
    if scale is not None:
        r.mul_(scale)
    if r is not d:
        d.copy_(r)
    if out is not None:
        out.view(-1).copy_(r)
    return dst
