"""tests/gpu: the ``gpus(n)`` marker and the ``ieee`` fixture. A test marked
``@pytest.mark.gpus(n)`` needs n CUDA GPUs (NCCL takes one GPU per rank) and skips
with fewer; unmarked tests need one. ``make gpu-check`` reports
each test's number."""

from pathlib import Path

import pytest
import torch

from gpu_common import gpus_needed, ieee_fp32_here


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): the test needs n CUDA GPUs (skipped with fewer)")


HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    have = torch.cuda.device_count()
    for item in items:  # every item of the session: only those under tests/gpu are ours
        if HERE in Path(item.path).resolve().parents and gpus_needed(item) > have:
            need = gpus_needed(item)
            item.add_marker(
                pytest.mark.skip(reason=f"needs {need} CUDA GPU{'s' if need > 1 else ''}")
            )


@pytest.fixture
def ieee():
    """IEEE fp32 in the test process while the test runs (its GPU reference)."""
    with ieee_fp32_here():
        yield
