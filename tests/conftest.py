"""Shared pytest setup.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, so it
is set here, before the test modules (and through them the kernels) import.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
