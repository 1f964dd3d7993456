"""The executor's pipelined path (large buffers cut into parts), forced onto small buffers."""

import pytest
import torch

import hybridcomm
from hybridcomm.comm import executor
from multiproc import run_ranks


def _pipelined(rank, world):
    wrong = []
    for algo in hybridcomm.ALGORITHMS:
        for dtype in (torch.float32, torch.bfloat16):
            for n in (world * 8 - 1, 1000, 4099):
                parts = executor.num_parts(
                    hybridcomm.algorithms.get_schedule(algo, rank, world, n),
                    torch.empty((), dtype=dtype).element_size(),
                )
                x = ((torch.arange(n) * 7 + rank * 3) % 11 - 5).to(dtype)
                want = sum(((torch.arange(n) * 7 + r * 3) % 11 - 5) for r in range(world))
                got = hybridcomm.all_reduce(x, algorithm=algo, check=False)
                if parts < 2 or not torch.equal(got.double(), want.double()):
                    wrong.append((algo, str(dtype), n, parts))
    return wrong


@pytest.mark.parametrize("world", [3, 4])
def test_pipelined_parts_are_exact(world, monkeypatch):
    monkeypatch.setenv("HYBRIDCOMM_PIPELINE_BYTES", "16")  # inherited by the forked ranks
    for rank, wrong in enumerate(run_ranks(world, _pipelined, timeout=120)):
        assert wrong == [], f"rank {rank}: {wrong}"
