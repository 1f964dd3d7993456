"""Triton kernels and their plain-torch references (installed as hybridcomm.kernels).

Each op has a launcher (validates, then runs the Triton kernel for CUDA tensors
or the reference otherwise) and a ``*_ref`` in plain torch. None communicates.
"""
from ._triton import SUPPORTED_DTYPES, triton_available
from .pack import pack, pack_ref
from .reduce import reduce, reduce_ref
from .unpack import unpack, unpack_ref

__all__ = [
    "SUPPORTED_DTYPES",
    "pack",
    "pack_ref",
    "reduce",
    "reduce_ref",
    "triton_available",
    "unpack",
    "unpack_ref",
]
