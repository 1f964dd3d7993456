"""pack: many tensors -> one flat buffer, with optional scale and cast."""
import torch

from ._triton import (
    check_dtype,
    check_same_device,
    check_scale,
    check_tensor,
    flat_offsets,
    launch_table,
    simulated,
    tl,
    triton,
    triton_available,
    use_triton,
)

if triton_available:

    @triton.jit
    def _pack_kernel(
        table_ptr,
        out_ptr,
        scale: tl.float64,  # a plain float parameter would be fp32 on a GPU (check_scale)
        TENSOR: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program t: one block, whose (address, element count, offset in the
        # flat buffer) is row t of the table (_triton.block_rows).
        t = tl.program_id(0)
        src_ptr = tl.load(table_ptr + 3 * t).to(tl.pointer_type(TENSOR))
        numel = tl.load(table_ptr + 3 * t + 1)
        offset = tl.load(table_ptr + 3 * t + 2)
        offs = tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(src_ptr + offs, mask=mask)
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
        tl.store(out_ptr + offset + offs, x.to(out_ptr.dtype.element_ty), mask=mask)

else:
    _pack_kernel = None


def _prepare(tensors, out, dtype, offsets):
    """Validate; return (tensors as a list, out as a flat view, allocated if None,
    each tensor's offset in it)."""
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        check_tensor(t, f"tensors[{i}]")
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
        sizes = [t.numel() for t in tensors]
        total = sum(sizes) if offsets is None else max(
            [int(o) + n for o, n in zip(offsets, sizes)], default=0)
        # Gaps between offset tensors are zero in a buffer pack allocates.
        out = (torch.empty if offsets is None else torch.zeros)(total, dtype=dtype,
                                                               device=device)
    else:
        check_tensor(out, "out")
        if dtype is not None and dtype != out.dtype:
            raise TypeError(f"dtype={dtype} but out has dtype {out.dtype}")
    offsets = flat_offsets(tensors, offsets, out.numel(), "out")
    for i, t in enumerate(tensors):
        check_same_device(t, out, f"tensors[{i}]", "out")
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
    ``_block`` overrides elements per program (tests only).

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
    if simulated("pack", out, impl, _pack_torch, (tensors, out, scale, offsets), reads=tensors,
                 writes=[out]):
        return out
    if not use_triton(out, impl):
        return _pack_torch(tensors, out, scale, offsets)
    launch_table(_pack_kernel, out, tensors, offsets, scale, _block)  # one launch per bucket
    return out


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
