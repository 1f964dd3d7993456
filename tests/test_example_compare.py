"""``examples/train.py --compare``: stock PyTorch, DDP and hybridcomm timed side by
side in one launch, one line on rank 0 (the figures are the user's machine's;
the test checks the line, never a time)."""

import re

import pytest

from launch_script import run_script


@pytest.mark.timeout(180)  # an example's every config
def test_compare_prints_one_line_with_every_config():
    out = run_script(
        "examples/train.py", ["--compare", "--compare-steps", "2"], nprocs=2, timeout=180
    )
    lines = [line for line in out[0].splitlines() if line.startswith("compare (")]
    assert len(lines) == 1, out[0][-2000:]
    assert re.search(
        r"stock [\d.]+ ms/step, DDP [\d.]+ ms/step, hybridcomm [\d.]+ ms/step: "
        r"-?\d+% less time than stock, -?\d+% less than DDP",
        lines[0],
    ), lines[0]
    assert not any(line.startswith("compare (") for line in out[1].splitlines())
