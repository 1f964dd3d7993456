"""What the three launchers share: the Triton import, the backend choice, the
block size, and the argument checks (so each rule lives in one place)."""
import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl

    triton_available = True
except ImportError:  # CPU-only installs: the torch references still work
    triton = None
    tl = None
    triton_available = False

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_BACKENDS = (None, "triton", "torch")
_GPU_BLOCK = 1024
# The interpreter costs ~1 ms per program instance whatever its size, so there
# a few big programs beat many small ones.
_INTERPRET_MAX_BLOCK = 65536


def interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def use_triton(tensor: torch.Tensor, backend) -> bool:
    """Decide whether ``tensor`` is handled by a Triton kernel.

    ``backend=None`` is automatic: Triton for CUDA tensors when it imports, the
    torch reference otherwise. ``"triton"`` forces the kernel (on CPU tensors
    that needs the interpreter), ``"torch"`` forces the reference.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return False
    if backend is None:
        return triton_available and tensor.is_cuda
    if not triton_available:
        raise RuntimeError("backend='triton' but triton is not importable (pip install triton)")
    if not tensor.is_cuda and not interpreting():
        raise RuntimeError(
            "backend='triton' on a CPU tensor needs TRITON_INTERPRET=1, set before "
            "hybridcomm.kernels is imported"
        )
    return True


def block_size(numel: int) -> int:
    """Elements per program instance for a launch over ``numel`` elements."""
    if interpreting():
        return max(16, min(_INTERPRET_MAX_BLOCK, triton.next_power_of_2(max(numel, 1))))
    return _GPU_BLOCK


def launch_geometry(numel: int, block):
    """(grid, BLOCK) for ``numel`` elements; ``block`` overrides the size (tests)."""
    block = block_size(numel) if block is None else block
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block must be a positive power of two, got {block}")
    return (triton.cdiv(numel, block),), block


def device_guard(tensor: torch.Tensor):
    """Launch on ``tensor``'s GPU, not on whichever one happens to be current."""
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def check_tensor(t, name: str) -> None:
    """Type, dtype and contiguity of one argument (the kernels ignore strides)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} has dtype {t.dtype}; supported dtypes are {supported}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
            "pass t.contiguous()"
        )


def check_dtype(dtype, name: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} is {dtype}; supported dtypes are {supported}")


def check_same_device(t: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_scale(scale):
    """None, or the scale as a Python float (a 0-dim CUDA tensor would sync)."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        raise TypeError("scale must be a Python number, not a tensor")
    return float(scale)


def launch_each(kernel, flat: torch.Tensor, tensors, scale, block, flat_is_src: bool) -> None:
    """Launch ``kernel`` once per non-empty tensor, moving it to or from its
    slice of ``flat`` (offset passed as a plain argument). One launch per
    tensor: a single launch would need a device-side table of pointers and
    sizes, built and copied for every bucket, to save a few launches (a
    layer's bucket holds a handful of tensors)."""
    offset = 0
    with device_guard(flat):
        for t in tensors:
            numel = t.numel()
            if numel == 0:
                continue
            grid, blk = launch_geometry(numel, block)
            src, dst = (flat, t) if flat_is_src else (t, flat)
            kernel[grid](src, dst, numel, offset, 1.0 if scale is None else scale,
                         HAS_SCALE=scale is not None, BLOCK=blk)
            offset += numel
