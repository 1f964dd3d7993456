"""hierarchical and torus2d over real gloo processes, and on the simulated GPU
(NCCL's FIFO matching without tags, several peers in one step): exact, bitwise
identical on every rank, at world sizes that leave the last node short
(LOCAL_WORLD_SIZE=2)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import hybridcomm
from multiproc import run_ranks

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LENGTHS = (0, 1, 2, 5, 13, 1009, 100003)


def integer_input(rank, n, dtype):
    # Small integers: every partial sum is exact in every dtype, in any order.
    return ((torch.arange(n) * 7 + rank * 3) % 11 - 5).to(dtype)


def _sweep(rank, world, simulate=False):
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # as torchrun would set it: nodes of 2, the last short
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    lengths = LENGTHS[:-1] if simulate else LENGTHS
    wrong, identical = [], {}
    for algo, kw in (
        ("hierarchical", {}),
        ("torus2d", {}),
        ("hierarchical", {"node_size": 3}),
        ("torus2d", {"grid": (-(-world // 2), 2)}),
    ):
        tag = f"{algo}{kw}"
        for dtype in DTYPES:
            for n in lengths:
                expected = sum(integer_input(r, n, torch.float64) for r in range(world))
                got = hybridcomm.all_reduce(integer_input(rank, n, dtype), algorithm=algo, **kw)
                if got.dtype != dtype or not torch.equal(got.double(), expected):
                    wrong.append((tag, str(dtype), n))
            # Non-integer data: rounding depends on the order of the additions,
            # so this is where ranks could drift apart. They must not.
            x = torch.randn(4099, generator=torch.Generator().manual_seed(rank)).to(dtype)
            identical[(tag, str(dtype))] = hybridcomm.all_reduce(x, algorithm=algo, **kw).tolist()
        x = integer_input(rank, 100, torch.float32)
        avg = hybridcomm.all_reduce(x, op="avg", algorithm=algo, **kw)
        want = sum(integer_input(r, 100, torch.float64) for r in range(world)) / world
        if not torch.allclose(avg.double(), want, rtol=2 * torch.finfo(torch.float32).eps, atol=0):
            wrong.append((tag, "avg", 100))
    os.environ["HYBRIDCOMM_ALGO"] = "hierarchical"  # forces auto
    forced = hybridcomm.all_reduce(integer_input(rank, 37, torch.float32))
    if not torch.equal(
        forced.double(), sum(integer_input(r, 37, torch.float64) for r in range(world))
    ):
        wrong.append(("HYBRIDCOMM_ALGO", "float32", 37))
    return wrong, identical


@pytest.mark.parametrize("world,simulate", [(3, False), (6, False), (7, False), (5, True)])
def test_exact_and_identical_with_short_last_node(world, simulate):
    results = run_ranks(world, _sweep, simulate, timeout=240)
    for rank, (wrong, _) in enumerate(results):
        assert wrong == [], f"rank {rank}: wrong results for {wrong}"
    first = results[0][1]
    for rank, (_, identical) in enumerate(results[1:], start=1):
        for key, values in first.items():
            assert identical[key] == values, f"rank {rank} differs from rank 0 for {key}"


def _node_size_mismatch(rank, world):
    try:
        hybridcomm.all_reduce(
            torch.ones(8), algorithm="hierarchical", node_size=2 + (rank == 2), timeout=30
        )
    except hybridcomm.HybridCommError as e:
        return str(e)
    return "no error"


def test_node_size_mismatch_is_an_error_not_a_hang():
    for msg in run_ranks(3, _node_size_mismatch):
        assert "node_size differs" in msg and "ranks [2] have 3" in msg


def test_step_formula_against_emulated_latency(tmp_path):
    # With a large emulated latency per step, time ~ steps x latency: the
    # formula's message counts (ring 6, hierarchical 4, torus2d 2x2: 4) show
    # up in the measured times, loosely.
    out = tmp_path / "lat.json"
    delay = 0.02
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridcomm.tools.bench",
            "--nprocs",
            "4",
            "--node-size",
            "2",
            "-b",
            "4K",
            "-e",
            "4K",
            "-n",
            "3",
            "-w",
            "1",
            "--latency",
            "20ms",
            "--algo",
            "ring,hierarchical,torus2d",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["node_size"] == 2 and doc["grid"] == [2, 2]
    t = {row["algo"]: row["time_us"] * 1e-6 for row in doc["results"]}
    for algo, steps in (("ring", 6), ("hierarchical", 4), ("torus2d", 4)):
        assert steps * delay <= t[algo] < steps * delay * 1.5, (algo, t[algo])
    check = {row["algo"]: row for row in doc["two_level_check"]["rows"]}
    for algo in ("hierarchical", "torus2d"):
        assert check[algo]["predicted_speedup"] == pytest.approx(
            check[algo]["measured_speedup"], rel=0.3
        )
