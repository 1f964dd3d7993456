"""TensorAverager (what the strategies average parameters and state with): every
rank ends with the exact mean, for tensors of awkward sizes and every supported
dtype, on the host path and the simulated GPU (where the tensors are packed
into each bucket and unpacked back, one kernel each)."""

import os

import pytest
import torch

from hybridcomm.averager import TensorAverager
from hybridcomm.gpu.runtime import runtime_for
from multiproc import run_ranks
from plan_counts import schedule_counts

SHAPES = [(0,), (1,), (7,), (3, 5), (127,), (2, 1000)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tensors(rank):
    """Integer-valued, so every sum is exact in every dtype and the mean over 4
    ranks (a multiple of 4 apart) is too; each rank's values differ. Grouped by
    dtype, so a bucket (one dtype) holds several tensors."""
    out = []
    for j, dtype in enumerate(DTYPES):
        for i, shape in enumerate(SHAPES):
            n = torch.Size(shape).numel()
            base = torch.arange(n, dtype=torch.float64).view(shape) % 50 - 25 + 7 * i + j
            out.append((base + 4 * rank).to(dtype))  # mean over ranks 0..3: base + 6
    return out


def _average(rank, world, simulate):
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    from hybridcomm.testing import simgpu

    avg = TensorAverager(timeout=60, cost_model="default")
    tensors = _tensors(rank)
    sent = [avg.average_(tensors)]
    again = _tensors(rank)  # the same signature: the buckets are reused
    simgpu.reset_stats()
    sent.append(avg.average_(again))
    stats = simgpu.stats()
    if simulate:  # the host reads the results: as .cpu() would on a GPU, wait for them
        runtime_for("cpu").synchronize()
    buckets, engine = next(iter(avg._made.values()))
    avg.close()
    return (
        tensors,
        again,
        sent,
        stats,
        [len(b.params) for b in buckets],
        schedule_counts(engine.plan, rank, world),
    )


@pytest.mark.parametrize("simulate", [False, True], ids=["host", "simgpu"])
def test_every_rank_gets_the_exact_mean(simulate):
    want = [(t.double() + 6).to(t.dtype) for t in _tensors(0)]
    for tensors, again, sent, stats, sizes, (reduces, calls) in run_ranks(
        4, _average, simulate, timeout=180
    ):
        for got in (tensors, again):
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and torch.equal(g, w)
        assert sent[0] > 0 and sent[0] == sent[1]
        # the fixed "default" model fuses each dtype's tensors (the empty one skipped) into
        # one bucket: a per-tensor launch would show in the counts below
        assert sizes == [len(SHAPES) - 1] * len(DTYPES), sizes
        if simulate:  # one pack and one unpack kernel per bucket, whatever its tensor count
            buckets = len(sizes)
            assert stats["launches:pack"] == stats["launches:unpack"] == buckets, stats
            assert stats["kernel_launches"] == 2 * buckets + reduces, (stats, reduces)
            assert stats["nccl_ops"] == calls, (stats, calls)
            assert stats["host_syncs"] == 0 and stats["defects"] == 0, stats


def _mismatched(rank, world):
    avg = TensorAverager(timeout=30, cost_model="default")
    try:
        avg.average_([torch.zeros(3 + rank)])
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return str(e)
    finally:
        avg.close()
    return "no error"


def test_ranks_with_different_tensors_are_told_so():
    for msg in run_ranks(2, _mismatched, timeout=120):
        assert "tensors differ from this rank's" in msg


def _live_events(rank, world, rounds):
    os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    import gc

    from hybridcomm.testing.simgpu import SimEvent

    avg = TensorAverager(timeout=60, cost_model="default")
    tensors = [torch.full((1000,), float(rank))]
    for _ in range(rounds):
        avg.average_(tensors)
        runtime_for("cpu").synchronize()
    gc.collect()
    live = sum(isinstance(o, SimEvent) for o in gc.get_objects())
    avg.close()
    return live


def test_averaging_often_keeps_no_more_events_than_averaging_once():
    """The channel times every operation with two events; the averager never asks
    for those times, so the channel must drop them once complete (a strategy
    averages every few steps for a whole run: they would pile up on a GPU)."""
    few, many = run_ranks(2, _live_events, 3), run_ranks(2, _live_events, 40)
    # kept ones would be two more per round (74 here); those in flight and not yet
    # collected vary by a few, independent of the rounds
    for f, m in zip(few, many):
        assert m < f + (40 - 3), (few, many)


def _plans(rank, world, simulate):
    """The buckets the averager plans for 12 tensors of 100 KB, 1.2 MB in all (the
    default cost model fuses 444 KB on the wire), by compression and with a user's
    fusion_bytes; and the averages those plans give."""
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    tensors = [torch.full((25_000,), float(rank + i)) for i in range(12)]
    out = {}
    for name, options in {
        "fp32": {},
        "fp16": {"compression": "fp16"},
        "int4": {"compression": "int4"},
        "fused 200 KB": {"fusion_bytes": 200_000},
    }.items():
        avg = TensorAverager(timeout=60, cost_model="default", **options)
        plan = avg.prepare(tensors)
        averaged = [t.clone() for t in tensors]
        avg.average_(averaged)
        rt = runtime_for(averaged[0].device)
        if rt is not None:  # the host reads the results: as .cpu() would on a GPU
            rt.synchronize()
        avg.close()
        out[name] = ([len(b.params) for b in plan.buckets], averaged)
    return out


@pytest.mark.parametrize("simulate", [False, True], ids=["host", "simgpu"])
def test_an_average_is_fused_by_its_bytes_on_the_wire_unless_told_otherwise(simulate):
    """A quantized average is one bucket (its messages are per bucket, whatever its
    size); fp16 fuses on the wire, so twice fp32's values a bucket; ``fusion_bytes``
    cuts them as told; and the averages agree."""
    for out in run_ranks(2, _plans, simulate, timeout=120):
        assert out["int4"][0] == [12]
        fp32, fp16 = out["fp32"][0], out["fp16"][0]
        assert len(fp32) > 1 and len(fp16) < len(fp32) and sum(fp16) == 12, (fp32, fp16)
        fused = out["fused 200 KB"][0]
        assert len(fused) == 6 and sum(fused) == 12, fused  # two 100 KB tensors a bucket
        for i, t in enumerate(out["fused 200 KB"][1]):
            assert torch.equal(t, torch.full_like(t, i + 0.5))  # the mean of rank + i
            assert torch.equal(out["fp32"][1][i], t)
