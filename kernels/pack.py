"""pack: many tensors -> one flat buffer, with optional scale and cast."""

import torch

from ._triton import (
    check_devices,
    check_dtype,
    check_scale,
    check_tensor,
    checked_sizes,
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
    def _packed(x, out_ptr, scale, TENSOR: tl.constexpr, HAS_SCALE: tl.constexpr):
        # x scaled and cast to the flat buffer's dtype.
        if HAS_SCALE:
            # fp64 math with the fp64 scale where either side is fp64, else fp32 math
            # with its fp32 rounding, as the reference (the interpreter gets bf16
            # arithmetic wrong, too).
            if TENSOR == tl.float64 or out_ptr.dtype.element_ty == tl.float64:
                x = x.to(tl.float64) * scale
            else:
                x = x.to(tl.float32) * tl.cast(scale, tl.float32)
        if out_ptr.dtype.element_ty == tl.bfloat16:
            x = x.to(tl.float32)  # fp64 -> bf16 through fp32 (see _triton.py)
        return x.to(out_ptr.dtype.element_ty)

    @triton.jit
    def _pack_kernel(
        table_ptr,
        out_ptr,
        scale: tl.float64,  # a plain float parameter would be fp32 on a GPU (check_scale)
        TENSOR: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        ALIGN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program t: one block, whose (address, element count, offset in the
        # flat buffer) is row t of the table (_triton.block_rows).
        t = tl.program_id(0)
        src_ptr = tl.load(table_ptr + 3 * t).to(tl.pointer_type(TENSOR))
        numel = tl.load(table_ptr + 3 * t + 1)
        offset = tl.load(table_ptr + 3 * t + 2)
        if ALIGN:
            # Every row starts 16 bytes aligned on both sides (_triton.flat_vec): said
            # so, a full block moves 16 bytes per access.
            src_ptr = tl.multiple_of(src_ptr, 16)
            offset = tl.multiple_of(offset, ALIGN)
        dst_ptr = out_ptr + offset
        offs = tl.arange(0, BLOCK)
        if numel == BLOCK:  # a full block, unmasked (a mask keeps the accesses scalar)
            x = tl.load(src_ptr + offs)
            tl.store(dst_ptr + offs, _packed(x, out_ptr, scale, TENSOR, HAS_SCALE))
        else:
            mask = offs < numel
            x = tl.load(src_ptr + offs, mask=mask)
            tl.store(dst_ptr + offs, _packed(x, out_ptr, scale, TENSOR, HAS_SCALE), mask=mask)

else:
    _pack_kernel = None


def _prepare(tensors, out, dtype, offsets):
    """Validate; return (tensors as a list, out as a flat view, allocated if None,
    each tensor's offset in it)."""
    tensors = list(tensors)
    sizes = checked_sizes(tensors)
    if out is None:
        if dtype is None:
            dtypes = {t.dtype for t in tensors}
            if len(dtypes) > 1:
                raise TypeError(
                    f"tensors have mixed dtypes {sorted(map(str, dtypes))}; pass dtype= or out="
                )
            dtype = dtypes.pop() if dtypes else torch.float32
        check_dtype(dtype, "dtype")
        device = tensors[0].device if tensors else torch.device("cpu")
        total = (
            sum(sizes)
            if offsets is None
            else max([int(o) + n for o, n in zip(offsets, sizes)], default=0)
        )
        # Gaps between offset tensors are zero in a buffer pack allocates.
        out = (torch.empty if offsets is None else torch.zeros)(total, dtype=dtype, device=device)
    else:
        check_tensor(out, "out")
        if dtype is not None and dtype != out.dtype:
            raise TypeError(f"dtype={dtype} but out has dtype {out.dtype}")
    offsets = flat_offsets(tensors, offsets, out.numel(), "out", sizes)
    check_devices(tensors, out, "out")
    return tensors, out, offsets


def pack(tensors, out=None, *, scale=None, dtype=None, offsets=None, impl=None, _block=None):
    """Concatenate the flattened ``tensors``, in order, into one flat 1-D buffer.

    Each element is multiplied by ``scale`` if given (in fp32; in fp64 where a
    tensor or the buffer is fp64) and cast to the buffer's dtype (e.g. fp32
    gradients -> a bf16 wire buffer). Without ``offsets`` the tensors go one
    after another and ``out`` must hold exactly as many elements; with
    ``offsets`` (increasing element offsets, e.g. a
    bucket's aligned layout) tensor i starts at ``offsets[i]`` and the gaps are
    left as they are. ``out`` must be contiguous; if None it is allocated with
    ``dtype``, or the tensors' common dtype (gaps zeroed). Inputs must be
    contiguous and on ``out``'s device. CUDA runs the Triton kernel, other
    devices :func:`pack_ref`; ``impl`` ("triton" or "torch") forces one.
    ``_block`` overrides elements per program (tests only). A layout packed
    again and again is cheaper through :func:`pack_plan`.

    Example::

        >>> flat = pack([torch.ones(2, 2), torch.full((3,), 2.0)], dtype=torch.bfloat16)
        >>> flat
        tensor([1., 1., 1., 1., 2., 2., 2.], dtype=torch.bfloat16)
        >>> pack([torch.ones(3), torch.full((2,), 2.0)], offsets=[0, 4])
        tensor([1., 1., 1., 0., 2., 2.])

    Returns ``out`` (the 1-D buffer).
    """
    tensors, out, offsets = _prepare(tensors, out, dtype, offsets)
    scale = check_scale(scale)
    if not _packed_without_triton(tensors, out, scale, offsets, impl):
        launch_table(_pack_kernel, out, tensors, offsets, scale, _block)  # one launch per bucket
    return out


def pack_plan(tensors, out, *, offsets=None, scale=None, impl=None, _block=None):
    """:func:`pack` prepared for a layout that repeats (a bucket's views packed into
    its buffer step after step): checks ``tensors`` and ``out`` once, works out
    the launch once (its table of blocks, one launch per dtype) and returns a
    function of no arguments that packs them again, with no per-tensor work, and
    returns ``out``. It reads the tensors' memory where it was when planned: the
    tensors and ``out`` must stay allocated where they are (their values may
    change; a tensor replaced, e.g. ``p.data = ...``, needs a new plan). Other
    arguments as :func:`pack`'s.

    Example::

        >>> grads = [torch.ones(2, 2), torch.full((3,), 2.0)]
        >>> flat = torch.empty(7)
        >>> again = pack_plan(grads, flat, scale=0.5)
        >>> grads[1].fill_(4.0)
        tensor([4., 4., 4.])
        >>> again()
        tensor([0.5000, 0.5000, 0.5000, 0.5000, 2.0000, 2.0000, 2.0000])

    Returns the function.
    """
    tensors, out, offsets = _prepare(tensors, out, None, offsets)
    scale = check_scale(scale)
    return copy_plan(
        _pack_kernel,
        out,
        tensors,
        offsets,
        scale,
        _block,
        impl,
        lambda: _packed_without_triton(tensors, out, scale, offsets, impl),
        out,
    )


def _packed_without_triton(tensors, out, scale, offsets, impl) -> bool:
    """The simulated GPU takes the launch, or the torch reference packs; False if
    neither does (the Triton kernel is the one to run)."""
    if simulated(
        "pack", out, impl, _pack_torch, (tensors, out, scale, offsets), reads=tensors, writes=[out]
    ):
        return True
    if not use_triton(out, impl):
        _pack_torch(tensors, out, scale, offsets)
        return True
    return False


def pack_ref(tensors, out=None, *, scale=None, dtype=None, offsets=None):
    """Plain-torch :func:`pack` (the CPU production path and the test oracle).

    Example::

        >>> pack_ref([torch.tensor([1.0, 3.0]), torch.tensor([5.0])], scale=0.5)
        tensor([0.5000, 1.5000, 2.5000])

    Returns ``out`` (the 1-D buffer).
    """
    tensors, out, offsets = _prepare(tensors, out, dtype, offsets)
    return _pack_torch(tensors, out, check_scale(scale), offsets)


def _pack_torch(tensors, out, scale, offsets):
    flat = out.view(-1)
    for t, offset in zip(tensors, offsets):
        dst = flat[offset : offset + t.numel()]
        if scale is None:
            dst.copy_(t.view(-1))  # casts with one rounding
        elif dst.dtype == torch.float64 and t.dtype != torch.float64:
            # fp64 multiply like the kernel: the upcast is exact, one rounding.
            dst.copy_(t.view(-1)).mul_(scale)
        elif t.dtype in (torch.float32, torch.float64):
            # a multiply in t's dtype, one rounding into dst's dtype, no temporary.
            torch.mul(t.view(-1), scale, out=dst)
        else:
            # fp16/bf16: multiply in fp32 like the kernel, then round once.
            dst.copy_(t.view(-1).to(torch.float32).mul_(scale))
    return out
