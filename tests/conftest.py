"""Shared pytest setup.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, so it
is set here, before the test modules (and through them the kernels) import.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

# The first torch.optim.Optimizer a process makes imports torch._dynamo (about 1.7 s of
# CPU here). Imported once in this process, it is inherited by every rank a test forks
# (tests/multiproc.py), which would each import it again.
import torch._dynamo  # noqa: E402,F401
