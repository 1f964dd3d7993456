"""PowerSGD (comm/powersgd.py): the arithmetic against a reference written apart, the
same bits on every rank, the planner's choice, training on the host path and on the
simulated GPU, the exact first steps, and its state through a checkpoint."""

import os

import pytest
import torch

import hybridcomm
from hybridcomm.algorithms.lowrank import compressed_shape, message_numels, parse_powersgd
from hybridcomm.comm.powersgd import PowerSGD
from hybridcomm.plan.cost_model import CostModel
from hybridcomm.plan.planner import Layer, make_plan
from multiproc import run_ranks
from optim_models import compressed_steps, train_compressed

EPS = torch.finfo(torch.float32).eps


def _alloc(n, dt):
    return torch.empty(n, dtype=dt)


def _ranks(world, shapes, rank, start=0):
    offsets, at = [], 0
    for s in shapes:
        offsets.append(at)
        at += torch.Size(s).numel()
    out = []
    for _ in range(world):
        lr = PowerSGD(shapes, offsets, list(range(len(shapes))), rank, start, world, _alloc)
        lr.active = True
        out.append(lr)
    return out, at


def _all_reduce(bufs):
    total = sum(b.clone() for b in bufs)
    for b in bufs:
        b.copy_(total)


def _step(ranks, grads, flags, scale):
    """One step of every simulated rank, the all-reduces done by summing."""
    for lr, g in zip(ranks, grads):
        lr.compress(g, flags)
    _all_reduce([lr.p for lr in ranks])
    for lr in ranks:
        lr.project()
    _all_reduce([lr.q for lr in ranks])
    out = [torch.empty_like(grads[0]) for _ in ranks]
    got_flags = [torch.empty_like(flags) for _ in ranks]
    for lr, o, f in zip(ranks, out, got_flags):
        lr.decode(o, f, scale)
    return out, got_flags


def _reference(xs, q, rank):
    """PowerSGD's step written apart: Householder QR (columns signed as Gram-Schmidt
    makes them) for the orthogonalization. ``xs``: each rank's G + E; returns the
    average estimate, each rank's new E, and the next Q."""
    world = len(xs)
    p = sum(x @ q for x in xs)
    basis, r = torch.linalg.qr(p)
    basis = basis * torch.sign(torch.diagonal(r))
    q_next = sum(x.t() @ basis for x in xs) / world
    approx = basis @ q_next.t()
    return approx, [x - approx for x in xs], q_next


def test_parse():
    assert parse_powersgd("powersgd:4") == (4, 0) and parse_powersgd("topk:0.1") is None
    for bad in ("powersgd", "powersgd:0", "powersgd:x", "powersgd:2:-1", "powersgd:2:3:4"):
        with pytest.raises(ValueError):
            parse_powersgd(bad)
    with pytest.raises(ValueError, match="powersgd:RANK"):
        hybridcomm.config.config.SyncConfig.build(compression="lowrank")
    build = hybridcomm.config.config.SyncConfig.build
    assert build(compression="powersgd:2:3+bf16").wire_dtype == torch.bfloat16
    assert build(compression="powersgd:2").wire_dtype is None
    for bad in ("topk:0.1+fp16", "powersgd:2+fp32", "fp16+powersgd:2", "fp16+bf16"):
        with pytest.raises(ValueError, match="only PowerSGD takes a wire dtype"):
            build(compression=bad)


def test_what_is_compressed_and_the_message_sizes():
    assert compressed_shape((64, 32), 2) == (64, 32)  # 2*2*96 <= 2048
    assert compressed_shape((64, 32), 16) is None  # 2*16*96 > 2048: sent whole
    assert compressed_shape((7,), 1) is None  # a vector is sent whole
    assert compressed_shape((16, 3, 3, 3), 1) == (16, 27)  # a conv weight: out x the rest
    # (8, 4) at rank 2: 2*2*12 > 32, sent whole like the vector
    assert message_numels([(64, 32), (32,), (8, 4)], 2) == (64 * 2 + 32 + 32 + 3, 32 * 2)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_one_step_matches_the_reference_and_every_rank_agrees(world):
    shapes = [(40, 24), (24,), (10, 3, 2, 2)]  # a matrix, a bias (whole), a conv weight
    rank = 3
    ranks, numel = _ranks(world, shapes, rank)
    gen = torch.Generator().manual_seed(world)
    grads = [torch.randn(numel, generator=gen) for _ in range(world)]
    flags = torch.ones(len(shapes))
    q0 = ranks[0].state(0)[1].clone()
    out, got_flags = _step(ranks, grads, flags, 1 / world)
    for o, f in zip(out, got_flags):  # the same bits everywhere
        assert torch.equal(o, out[0]) and torch.equal(f, torch.full_like(flags, world))
    xs = [g[: 40 * 24].view(40, 24) for g in grads]  # E was 0
    approx, errors, q_next = _reference(xs, q0, rank)
    # Gram-Schmidt against Householder on a well-conditioned 40 x 3 P: a few hundred
    # fp32 roundings apart at most, relative to the entries' size
    tol = 256 * EPS * max(x.abs().max().item() for x in xs)
    torch.testing.assert_close(out[0][: 40 * 24].view(40, 24), approx, atol=tol, rtol=0)
    torch.testing.assert_close(ranks[0].state(0)[1], q_next, atol=tol, rtol=0)
    for lr, e in zip(ranks, errors):
        torch.testing.assert_close(lr.state(0)[0], e, atol=tol, rtol=0)
    # the bias went whole: the exact average (a sum of `world` fp32 values, then 1/world)
    bias = sum(g[40 * 24 : 40 * 24 + 24] for g in grads) * (1 / world)
    assert torch.equal(out[0][40 * 24 : 40 * 24 + 24], bias)
    assert ranks[0].state(1) is None


def test_a_gradient_of_the_compressed_rank_comes_through_exactly():
    """Every rank's gradient u v_r^T (one column space): rank 1 holds their average,
    so the estimate is the average, and the errors are each rank's difference from
    it (they sum to zero)."""
    world, n, m = 4, 30, 20
    gen = torch.Generator().manual_seed(7)
    u = torch.randn(n, 1, generator=gen)
    grads = [(u @ torch.randn(1, m, generator=gen)).reshape(-1) for _ in range(world)]
    ranks, _ = _ranks(world, [(n, m)], 1)
    out, _ = _step(ranks, grads, torch.ones(1), 1 / world)
    mean = sum(grads) / world
    scale = max(g.abs().max().item() for g in grads)
    torch.testing.assert_close(out[0], mean, atol=64 * EPS * scale, rtol=0)
    total_error = sum(lr.residual for lr in ranks)
    assert total_error.abs().max().item() <= 64 * EPS * scale * world


def test_error_feedback_keeps_what_was_not_sent():
    """X = G + E goes out as X' and E = X - X' stays: over steps, what was applied
    plus what every rank still holds is what came in (fp32 rounding apart)."""
    world, shapes = 2, [(16, 12)]
    ranks, numel = _ranks(world, shapes, 1)
    gen = torch.Generator().manual_seed(3)
    came_in, applied = torch.zeros(numel), torch.zeros(numel)
    for _ in range(5):
        grads = [torch.randn(numel, generator=gen) for _ in range(world)]
        came_in += sum(grads)
        out, _ = _step(ranks, grads, torch.ones(1), None)  # a sum
        applied += out[0]
    held = sum(lr.residual for lr in ranks)
    # each step rounds the sums, products and differences a few times at most, each
    # within eps of the largest term: 64 eps of it per step and rank
    scale = max(t.abs().max().item() for t in (came_in, applied, held))
    tol = 64 * EPS * scale * 5 * world
    torch.testing.assert_close(applied + held, came_in, atol=tol, rtol=0)


def test_the_planner_compresses_a_bucket_where_its_messages_are_smaller():
    model = CostModel(1e-4, 1e-9, 1e-10)
    layers = [
        Layer(
            "fc", [0, 1], 4096 * 256 + 256, sizes=[4096 * 256, 256], shapes=[(256, 4096), (256,)]
        ),
        Layer("bn", [2, 3], 128, sizes=[64, 64], shapes=[(64,), (64,)]),
    ]
    plan = make_plan(layers, world_size=4, model=model, fusion_bytes=0, low_rank=(4, 0))
    assert [b.compressor for b in plan.buckets] == ["powersgd", None]  # vectors: nothing to gain
    fc = plan.buckets[0]
    assert fc.segments == [(0, fc.grad_numel + 2)] and "powersgd+" in str(plan)
    dense = make_plan(layers, world_size=4, model=model, fusion_bytes=0)
    assert dense.buckets[0].compressor is None and fc.predicted_s < dense.buckets[0].predicted_s
    assert plan.decisions() != dense.decisions()


def test_fusion_weighs_the_compressed_messages():
    """Two 4 MB layers put ~70 KB each on the wire compressed: under a 256 KB
    fusion they share one bucket (two all-reduces a step instead of four)."""
    fc = [
        Layer(f"fc{i}", [i], 4096 * 256, sizes=[4096 * 256], shapes=[(256, 4096)]) for i in range(2)
    ]
    model = CostModel(1e-4, 1e-9, 1e-10)
    low = make_plan(fc, world_size=4, model=model, fusion_bytes=256 << 10, low_rank=(4, 0))
    dense = make_plan(fc, world_size=4, model=model, fusion_bytes=256 << 10)
    assert [b.layers for b in low.buckets] == [["fc0", "fc1"]]
    assert len(dense.buckets) == 2


# --- training ---------------------------------------------------------------------------


def _train(rank, world, compression, simulate_gpu, overlap, steps=None, strategy="hybrid"):
    os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1" if simulate_gpu else "0"
    out = train_compressed(
        rank,
        world,
        compression,
        overlap,
        samples=2400,
        batch=40,
        epochs=5,
        steps=steps,
        strategy=strategy,
    )
    return out["acc"], out["sent"], out["params"], "powersgd+" in out["plan"]


def test_powersgd_trains_close_to_dense_at_a_fifth_of_the_bytes():
    # one algorithm for both (bytes sent depend on it: a re-plan that finds the
    # window short picks the butterfly, 2.25x a ring's bytes at 3 ranks)
    dense = run_ranks(3, _train, None, False, "forward", None, "ring", timeout=300)
    low = run_ranks(3, _train, "powersgd:4", False, "forward", None, "ring", timeout=300)
    assert dense[0][0] > 0.8  # the task is learnable at all
    assert low[0][3]  # the plan compressed
    assert low[0][0] >= dense[0][0] - 0.03, (low[0][0], dense[0][0])
    assert low[0][1] <= 0.2 * dense[0][1], (low[0][1], dense[0][1])
    assert all(torch.equal(r[2], low[0][2]) for r in low)  # identical ranks


@pytest.mark.timeout(180)  # training at 4 ranks
def test_the_first_steps_are_the_exact_all_reduce():
    """With START = 4, four steps are the plain all-reduce: the same parameters as
    without compression, bit for bit; the fifth is compressed."""
    exact = run_ranks(2, _train, None, False, "backward", 4)
    start = run_ranks(2, _train, "powersgd:4:4", False, "backward", 4)
    assert torch.equal(exact[0][2], start[0][2])
    five = run_ranks(2, _train, "powersgd:4:4", False, "backward", 5)
    five_exact = run_ranks(2, _train, None, False, "backward", 5)
    assert not torch.equal(five[0][2], five_exact[0][2])
    assert five[0][1] < five_exact[0][1]  # fewer bytes by the fifth step


@pytest.mark.timeout(180)  # training at 4 ranks
def test_with_a_wire_dtype_the_exact_steps_travel_in_it():
    """ "powersgd:4:4+fp16": its four exact steps are compression="fp16"'s, bit for
    bit and byte for byte; the fifth is compressed (and its messages fp32)."""
    half = run_ranks(2, _train, "fp16", False, "backward", 4)
    start = run_ranks(2, _train, "powersgd:4:4+fp16", False, "backward", 4)
    assert torch.equal(half[0][2], start[0][2]) and half[0][1] == start[0][1]
    five = run_ranks(2, _train, "powersgd:4:4+fp16", False, "backward", 5)
    five_half = run_ranks(2, _train, "fp16", False, "backward", 5)
    assert not torch.equal(five[0][2], five_half[0][2])
    assert five[0][1] < five_half[0][1] and five[0][3]


@pytest.mark.parametrize(
    "overlap,compression",
    [("backward", "powersgd:2:2"), ("forward", "powersgd:2:2"), ("forward", "powersgd:2:2+bf16")],
)
def test_powersgd_on_the_simulated_gpu_keeps_ranks_identical(overlap, compression):
    results = run_ranks(2, _train, compression, True, overlap, 30, timeout=300)
    assert results[0][3] and torch.equal(results[0][2], results[1][2])
    assert results[0][0] > 0.5


def _resume(rank, world):
    os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "0"
    _, opt = compressed_steps(rank, world, "powersgd:2")
    saved = opt.state_dict()["hybridcomm"]["powersgd"]["residuals"].clone()
    opt.load_state_dict(opt.state_dict())  # a round trip through a checkpoint
    back = opt.state_dict()["hybridcomm"]["powersgd"]["residuals"]
    opt.close()
    return torch.equal(saved, back), saved.abs().sum().item()


def test_its_state_round_trips_through_the_state_dict():
    for same, total in run_ranks(2, _resume):
        assert same and total > 0
