"""tests/gpu: the ``gpus(n)`` marker and the ``ieee`` fixture. A test marked
``@pytest.mark.gpus(n)`` needs n CUDA GPUs (NCCL takes one GPU per rank) and skips
with fewer; unmarked tests need one (``needs_cuda``). ``make gpu-check`` reports
each test's number."""
import pytest
import torch

from gpu_common import gpus_needed, ieee_fp32_here


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): the test needs n CUDA GPUs (skipped with fewer)")


def pytest_collection_modifyitems(config, items):
    have = torch.cuda.device_count()
    for item in items:  # every item of the session: only the marked ones are ours
        if item.get_closest_marker("gpus") is not None and gpus_needed(item) > have:
            item.add_marker(pytest.mark.skip(reason=f"needs {gpus_needed(item)} CUDA GPUs"))


@pytest.fixture
def ieee():
    """IEEE fp32 in the test process while the test runs (its GPU reference)."""
    with ieee_fp32_here():
        yield
