"""TensorAverager's compression (what DiLoCo sends Δ with) and its averages in flight:
every rank holds the same bits; fp16/bf16 within their rounding, 8 and 4 bits
within the quantized all-reduce's stated error; the bytes each sends; averages
started together and waited for out of order. Host path and simulated GPU."""

import os

import pytest
import torch

from hybridcomm.algorithms.quantized import bytes_sent
from hybridcomm.averager import TensorAverager
from hybridcomm.gpu.runtime import runtime_for
from hybridcomm.kernels.quantize import GROUP, qmax
from multiproc import run_ranks

N = 3001  # not a multiple of the group, of the world, or of a chunk
EPS32 = torch.finfo(torch.float32).eps


def _values(rank, n=N):
    g = torch.Generator().manual_seed(10 + rank)
    scale = torch.logspace(-2, 1, n)  # groups of different magnitudes
    return torch.randn(n, generator=g) * scale


def _average(rank, world, compression, simulate):
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    avg = TensorAverager(timeout=60, cost_model="default", compression=compression)
    a, b = _values(rank), _values(rank + 7, 500)
    first = avg.start_average_([a])  # two averages in flight, waited for in reverse
    second = avg.start_average_([b])
    sent = second.wait() + first.wait()
    assert first.wait() == first.bytes_sent  # (a second wait returns at once)
    if simulate:
        runtime_for("cpu").synchronize()
    avg.close()
    return a, b, sent


def _bound(world, bits, n=N):
    """Per element: each rank's message within half its group's step, the owner's
    average within half of its own step (its largest value is at most the exact
    mean's plus the first error), and fp32's roundings (module kernels/quantize.py)."""
    ranks = torch.stack([_values(r, n) for r in range(world)]).double()
    mean = ranks.mean(0)
    pad = (-n) % GROUP

    def group_absmax(x):
        return torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, GROUP).amax(1)

    q, slack = qmax(bits), 0.5 + qmax(bits) * EPS32
    first = torch.stack([group_absmax(x) for x in ranks]).mean(0) / q * slack
    second = (group_absmax(mean) + first) / q * slack
    per_group = first + second
    return mean, per_group.repeat_interleave(GROUP)[:n] + 4 * EPS32 * mean.abs()


@pytest.mark.parametrize("simulate", [False, True], ids=["host", "simgpu"])
@pytest.mark.parametrize("compression", ["int8", "int4"])
def test_quantized_averages_are_the_same_on_every_rank_and_within_the_stated_error(
    compression, simulate
):
    world, bits = 3, int(compression[3:])
    results = run_ranks(world, _average, compression, simulate, timeout=180)
    mean, bound = _bound(world, bits)
    for a, b, sent in results:
        assert torch.equal(a, results[0][0]) and torch.equal(b, results[0][1])
        err = (a.double() - mean).abs()
        assert (err <= bound).all(), (err - bound).max()
        assert sent == bytes_sent(N, world, bits, GROUP) + bytes_sent(500, world, bits, GROUP)
    # and compression pays: under a third (8 bits) or a sixth (4 bits) of fp32's ring
    ring = 2 * (world - 1) / world * 4 * (N + 500)
    assert results[0][2] < ring / (3 if bits == 8 else 6)


@pytest.mark.parametrize("simulate", [False, True], ids=["host", "simgpu"])
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_a_wire_dtype_averages_within_its_rounding(compression, simulate):
    world = 3
    results = run_ranks(world, _average, compression, simulate, timeout=180)
    mean = torch.stack([_values(r) for r in range(world)]).double().mean(0)
    eps = torch.finfo(torch.float16 if compression == "fp16" else torch.bfloat16).eps
    # each input rounded, each of the P-1 partial sums rounded, the scale: P + 1 roundings
    # of values at most the ranks' largest magnitude
    largest = torch.stack([_values(r).abs() for r in range(world)]).amax(0).double()
    for a, b, sent in results:
        assert torch.equal(a, results[0][0])
        assert ((a.double() - mean).abs() <= (world + 1) * eps * largest).all()


def test_a_set_of_tensors_averaged_again_before_its_wait_is_refused():
    def both(rank, world):
        avg = TensorAverager(timeout=30, cost_model="default")
        t = [torch.ones(10)]
        pending = avg.start_average_(t)
        try:
            avg.start_average_(t)
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            msg = str(e)
        pending.wait()
        avg.close()
        return msg

    for msg in run_ranks(2, both, timeout=120):
        assert "last average was not waited for" in msg
