"""Test doubles for the GPU-only layers (CuPy's NCCL and CUDA streams)."""
