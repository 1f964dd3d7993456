"""unpack: one flat buffer -> many tensors, with optional scale and cast."""

import torch

from ._triton import (
    _SUPPORTED,
    check_same_device,
    check_scale,
    check_tensor,
    flat_offsets,
    launch_table,
    simulated,
    copy_plan,
    tl,
    triton,
    triton_available,
    use_triton,
)

if triton_available:

    @triton.jit
    def _unpacked(x, flat_ptr, scale, TENSOR: tl.constexpr, HAS_SCALE: tl.constexpr):
        # x scaled and cast to the tensor's dtype.
        if HAS_SCALE:
            # fp64 math with the fp64 scale where either side is fp64, else fp32 math
            # with its fp32 rounding, as the reference (the interpreter gets bf16
            # arithmetic wrong, too).
            if flat_ptr.dtype.element_ty == tl.float64 or TENSOR == tl.float64:
                x = x.to(tl.float64) * scale
            else:
                x = x.to(tl.float32) * tl.cast(scale, tl.float32)
        if TENSOR == tl.bfloat16:
            x = x.to(tl.float32)  # fp64 -> bf16 through fp32 (see _triton.py)
        return x.to(TENSOR)

    @triton.jit
    def _unpack_kernel(
        table_ptr,
        flat_ptr,
        scale: tl.float64,  # a plain float parameter would be fp32 on a GPU (check_scale)
        TENSOR: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        ALIGN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program t: one block, whose (address, element count, offset in the
        # flat buffer) is row t of the table (_triton.block_rows).
        t = tl.program_id(0)
        dst_ptr = tl.load(table_ptr + 3 * t).to(tl.pointer_type(TENSOR))
        numel = tl.load(table_ptr + 3 * t + 1)
        offset = tl.load(table_ptr + 3 * t + 2)
        if ALIGN:
            # Every row starts 16 bytes aligned on both sides (_triton.flat_vec): said
            # so, a full block moves 16 bytes per access.
            dst_ptr = tl.multiple_of(dst_ptr, 16)
            offset = tl.multiple_of(offset, ALIGN)
        src_ptr = flat_ptr + offset
        offs = tl.arange(0, BLOCK)
        if numel == BLOCK:  # a full block, unmasked (a mask keeps the accesses scalar)
            x = tl.load(src_ptr + offs)
            tl.store(dst_ptr + offs, _unpacked(x, flat_ptr, scale, TENSOR, HAS_SCALE))
        else:
            mask = offs < numel
            x = tl.load(src_ptr + offs, mask=mask)
            tl.store(dst_ptr + offs, _unpacked(x, flat_ptr, scale, TENSOR, HAS_SCALE), mask=mask)

else:
    _unpack_kernel = None


def _check(flat, tensors, offsets):
    check_tensor(flat, "flat")
    tensors = list(tensors)
    device = flat.device
    sizes = [
        t.numel()
        for t in tensors
        if isinstance(t, torch.Tensor)
        and t.dtype in _SUPPORTED
        and t.is_contiguous()
        and t.device == device
    ]
    if len(sizes) != len(tensors):  # the full checks name the culprit
        for i, t in enumerate(tensors):
            check_tensor(t, f"tensors[{i}]")
            check_same_device(t, flat, f"tensors[{i}]", "flat")
    return tensors, flat_offsets(tensors, offsets, flat.numel(), "flat", sizes)


def unpack(flat, tensors, *, scale=None, offsets=None, impl=None, _block=None):
    """Scatter consecutive slices of ``flat`` into ``tensors``, in order (inverse of pack).

    Each element is multiplied by ``scale`` if given (in fp32; in fp64 where
    ``flat`` or the tensor is fp64) and cast to its tensor's dtype (e.g. a bf16
    wire buffer back into fp32 gradients).
    Without ``offsets``, ``flat.numel()`` must equal the tensors' total; with
    them, tensor i is read from ``offsets[i]`` on (as :func:`pack` wrote it).
    All are contiguous and on one device. CUDA runs the Triton kernel, other devices :func:`unpack_ref`;
    ``impl`` ("triton" or "torch") forces one. ``_block`` overrides elements
    per program (tests only). A layout unpacked again and again is cheaper
    through :func:`unpack_plan`.

    Example::

        >>> grads = [torch.empty(2, 2), torch.empty(3)]
        >>> unpack(torch.arange(7, dtype=torch.float16), grads, scale=0.5)[1]
        tensor([2.0000, 2.5000, 3.0000])

    Returns ``tensors`` (as a list).
    """
    tensors, offsets = _check(flat, tensors, offsets)
    scale = check_scale(scale)
    if not _unpacked_without_triton(flat, tensors, scale, offsets, impl):
        launch_table(_unpack_kernel, flat, tensors, offsets, scale, _block)  # one per bucket
    return tensors


def unpack_plan(flat, tensors, *, offsets=None, scale=None, impl=None, _block=None):
    """:func:`unpack` prepared for a layout that repeats (a bucket's buffer unpacked
    into its tensors step after step): checks once, works out the launch once and
    returns a function of no arguments that unpacks again, with no per-tensor
    work, and returns the tensors (a list). ``flat`` and the tensors must stay
    allocated where they are when planned, as for :func:`pack_plan`. Other
    arguments as :func:`unpack`'s.

    Example::

        >>> a, b = torch.empty(1), torch.empty(2, dtype=torch.bfloat16)
        >>> wire = torch.tensor([1.0, 2.0, 3.0])
        >>> again = unpack_plan(wire, [a, b])
        >>> wire.mul_(2)
        tensor([2., 4., 6.])
        >>> again()
        [tensor([2.]), tensor([4., 6.], dtype=torch.bfloat16)]

    Returns the function.
    """
    tensors, offsets = _check(flat, tensors, offsets)
    scale = check_scale(scale)
    return copy_plan(
        _unpack_kernel,
        flat,
        tensors,
        offsets,
        scale,
        _block,
        impl,
        lambda: _unpacked_without_triton(flat, tensors, scale, offsets, impl),
        tensors,
    )


def _unpacked_without_triton(flat, tensors, scale, offsets, impl) -> bool:
    """The simulated GPU takes the launch, or the torch reference unpacks; False if
    neither does (the Triton kernel is the one to run)."""
    if simulated(
        "unpack",
        flat,
        impl,
        _unpack_torch,
        (flat, tensors, scale, offsets),
        reads=[flat],
        writes=tensors,
    ):
        return True
    if not use_triton(flat, impl):
        _unpack_torch(flat, tensors, scale, offsets)
        return True
    return False


def unpack_ref(flat, tensors, *, scale=None, offsets=None):
    """Plain-torch :func:`unpack` (the CPU production path and the test oracle).

    Example::

        >>> a, b = torch.empty(1), torch.empty(2, dtype=torch.bfloat16)
        >>> unpack_ref(torch.tensor([1.0, 2.0, 3.0]), [a, b])
        [tensor([1.]), tensor([2., 3.], dtype=torch.bfloat16)]

    Returns ``tensors`` (as a list).
    """
    tensors, offsets = _check(flat, tensors, offsets)
    return _unpack_torch(flat, tensors, check_scale(scale), offsets)


def _unpack_torch(flat, tensors, scale, offsets):
    flat = flat.view(-1)
    for t, offset in zip(tensors, offsets):
        src = flat[offset : offset + t.numel()]
        dst = t.view(-1)
        if scale is None:
            dst.copy_(src)  # casts with one rounding
        elif dst.dtype == torch.float64 and flat.dtype != torch.float64:
            # fp64 multiply like the kernel: the upcast is exact, one rounding.
            dst.copy_(src).mul_(scale)
        elif flat.dtype in (torch.float32, torch.float64):
            # a multiply in flat's dtype, one rounding into t's dtype, no temporary.
            torch.mul(src, scale, out=dst)
        else:
            # fp16/bf16: multiply in fp32 like the kernel, then round once.
            dst.copy_(src.to(torch.float32).mul_(scale))
    return tensors
