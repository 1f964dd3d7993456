"""Triton kernels and their plain-torch references (installed as hybridcomm.kernels):
pack, unpack, reduce, and quantize / dequantize (8 or 4 bits a value).

Each op has a launcher (validates, then runs the Triton kernel for CUDA tensors
or the reference otherwise) and a ``*_ref`` in plain torch. None communicates.
``pack_plan`` / ``unpack_plan`` prepare a pack or unpack whose layout repeats
(checked once, launched again with no per-tensor work).

On a GPU a kernel's first launch of each specialization goes through Triton's
``JITFunction.run``; later ones call the compiled kernel's launcher directly
(``_triton.launch``), which saves most of Triton's ~20 us of host time per call.
``HYBRIDCOMM_TRITON_FAST_LAUNCH=0`` in the environment (read at import) keeps
every launch on Triton's own path.
"""

from ._triton import SUPPORTED_DTYPES, triton_available
from .pack import pack, pack_plan, pack_ref
from .quantize import dequantize, dequantize_ref, quantize, quantize_ref
from .reduce import reduce, reduce_ref
from .unpack import unpack, unpack_plan, unpack_ref

__all__ = [
    "SUPPORTED_DTYPES",
    "dequantize",
    "dequantize_ref",
    "pack",
    "pack_plan",
    "pack_ref",
    "quantize",
    "quantize_ref",
    "reduce",
    "reduce_ref",
    "triton_available",
    "unpack",
    "unpack_plan",
    "unpack_ref",
]
