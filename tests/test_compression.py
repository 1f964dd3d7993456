"""Top-k sparsification with error feedback: exact bookkeeping, identical ranks,
accuracy close to dense at a tenth of its bytes, residuals in the state_dict."""

import os

import pytest
import torch

from hybridcomm.algorithms.topk import gather_schedule, parse_topk, sparse_bytes_sent
from hybridcomm.comm.compression import TopK
from hybridcomm.plan.cost_model import CostModel, bytes_sent
from hybridcomm.plan.planner import Layer, make_plan
from multiproc import run_ranks
from optim_models import compressed_steps, train_compressed


def _alloc(n, dt):
    return torch.empty(n, dtype=dt)


def _exchange(sparsifiers):
    """What the ring all-gather does: every rank ends with every segment."""
    for dst in sparsifiers:
        for r, src in enumerate(sparsifiers):
            seg = slice(r * src.seg, (r + 1) * src.seg)
            dst.gathered[seg] = src.gathered[seg]


def test_error_feedback_sends_everything_eventually_and_exactly():
    """Integer-valued gradients: after every step, what was sent plus what is left
    equals what came in, exactly, on every rank; every rank decodes the same."""
    world, n, params = 3, 50, 2
    ranks = [TopK(n, params, 0.1, r, world, 0.0, _alloc) for r in range(world)]
    gen = torch.Generator().manual_seed(0)
    came_in = torch.zeros(world, n)
    sent = torch.zeros(n)
    for _ in range(6):
        for r, t in enumerate(ranks):
            g = torch.randint(-4, 5, (n,), generator=gen).float()
            came_in[r] += g
            t.select(g, torch.ones(params))
        _exchange(ranks)
        out = []
        for t in ranks:
            grads, flags = torch.empty(n), torch.empty(params)
            t.decode(grads, flags, None)
            out.append((grads, flags))
        assert all(torch.equal(o[0], out[0][0]) for o in out)  # identical on every rank
        assert torch.equal(out[0][1], torch.full((params,), float(world)))
        sent += out[0][0]
        left = sum(t.residual for t in ranks)
        assert torch.equal(sent + left, came_in.sum(0))


def test_momentum_correction_masks_sent_entries():
    t = TopK(10, 1, 0.2, 0, 1, 0.9, _alloc)
    g = torch.arange(10.0)
    t.select(g, torch.ones(1))
    sent = t.gathered[: t.k]
    assert sorted(sent.tolist()) == [8.0, 9.0]  # v = u = g at first
    assert t.velocity[8] == 0 and t.velocity[9] == 0 and t.velocity[7] == 7
    assert t.residual[9] == 0 and t.residual[7] == 7


def test_the_gather_schedule_is_a_ring_of_copies():
    """Run the schedules step by step (one send and one receive per rank per step,
    matched as NCCL would): every rank ends with every rank's segment."""
    seg = 3
    for world in range(1, 9):
        scheds = [gather_schedule(r, world, seg) for r in range(world)]
        bufs = [[None] * (world * seg) for _ in range(world)]
        for r in range(world):
            bufs[r][r * seg : (r + 1) * seg] = [(r, i) for i in range(seg)]
        for i in range(world - 1):
            msgs = {}
            for r, s in enumerate(scheds):
                (snd,), (rcv,) = s.steps[i].sends, s.steps[i].recvs
                assert snd.peer == (r + 1) % world and rcv.peer == (r - 1) % world
                assert not rcv.reduce
                msgs[(r, snd.peer)] = bufs[r][snd.start : snd.stop]
            for r, s in enumerate(scheds):
                rcv = s.steps[i].recvs[0]
                bufs[r][rcv.start : rcv.stop] = msgs[(rcv.peer, r)]
        want = [(r, i) for r in range(world) for i in range(seg)]
        assert all(b == want for b in bufs)


def test_buckets_stay_dense_where_the_sparse_message_is_larger():
    model = CostModel(1e-4, 1e-9, 1e-10)
    layers = [Layer("big", [0], 100_000), Layer("two", [1], 2)]
    plan = make_plan(layers, world_size=4, model=model, fusion_bytes=0, topk=0.01)
    # values and indices: 2k + 1 floats per rank against the ring's 2(P-1)/P n
    assert [b.algorithm == "topk" for b in plan.buckets] == [True, False]
    assert sparse_bytes_sent(100_000, 1, 0.01, 4) < bytes_sent("ring", 400_000, 4) / 10
    assert "topk" in str(plan)
    dense = make_plan(layers, world_size=4, model=model, fusion_bytes=0, topk=0.5)
    assert all(b.algorithm != "topk" for b in dense.buckets)  # larger than any dense choice


def test_parse():
    assert parse_topk("topk:0.01") == 0.01 and parse_topk("fp16") is None
    for bad in ("topk", "topk:0", "topk:2", "topk:x"):
        with pytest.raises(ValueError):
            parse_topk(bad)


# --- training ---------------------------------------------------------------------------


def _train(rank, world, compression, simulate_gpu, overlap):
    if simulate_gpu:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    out = train_compressed(rank, world, compression, overlap, samples=3000, batch=50, epochs=8)
    state = out["state"]
    has_residuals = (
        all("hc_topk_residual" in s for s in state["state"].values()) if compression else None
    )
    return out["acc"], out["sent"], out["params"], has_residuals


@pytest.mark.timeout(180)  # two trainings
def test_topk_trains_close_to_dense_at_a_tenth_of_the_bytes():
    dense = run_ranks(3, _train, None, False, "forward", timeout=300)
    sparse = run_ranks(3, _train, "topk:0.01", False, "forward", timeout=300)
    acc_dense, bytes_dense = dense[0][0], dense[0][1]
    acc_sparse, bytes_sparse = sparse[0][0], sparse[0][1]
    assert acc_dense > 0.8  # the task is learnable at all
    assert acc_sparse >= acc_dense - 0.03, (acc_sparse, acc_dense)
    assert bytes_sparse <= 0.10 * bytes_dense, (bytes_sparse, bytes_dense)
    assert all(torch.equal(r[2], sparse[0][2]) for r in sparse)  # identical ranks
    assert sparse[0][3]  # residuals are in the state_dict


@pytest.mark.parametrize("overlap", ["backward", "forward"])
def test_topk_on_the_simulated_gpu_keeps_ranks_identical(overlap):
    results = run_ranks(2, _train, "topk:0.05", True, overlap, timeout=300)
    assert torch.equal(results[0][2], results[1][2])
    assert results[0][0] > 0.5


def _resume(rank, world):
    model, opt = compressed_steps(rank, world, "topk:0.01", momentum=0.9)
    saved = opt.state_dict()
    residual = torch.cat(
        [saved["state"][i]["hc_topk_residual"].reshape(-1).clone() for i in sorted(saved["state"])]
    )  # keys: parameter positions
    opt.load_state_dict(saved)  # round trip: the buckets hold the loaded residuals
    back = torch.cat([opt.state[p]["hc_topk_residual"].reshape(-1) for p in model.parameters()])
    opt.close()
    return torch.equal(residual, back), residual.abs().sum().item()


def test_residuals_round_trip_through_the_state_dict():
    for same, total in run_ranks(2, _resume):
        assert same and total > 0


def _quantized_average(rank, world, compression):
    from hybridcomm.averager import TensorAverager
    from hybridcomm.gpu.runtime import runtime_for

    avg = TensorAverager(timeout=60, cost_model="default", compression=compression)
    g = torch.Generator().manual_seed(rank)
    t = torch.randn(1000, generator=g) * (rank + 1)
    half = torch.randn(300, generator=g).to(torch.float16)  # its own bucket: cast back after
    sent = avg.average_([t, half])
    rt = runtime_for(t.device)
    if rt is not None:
        rt.synchronize()
    avg.close()
    return t, half, sent


@pytest.mark.parametrize("compression", ["int8", "int4"])
def test_quantized_averages_are_identical_on_every_rank(compression):
    """The averager's 8- and 4-bit all-reduce (exchange, the owner's sum, gather) on the
    stream path when simulated (this file runs under HYBRIDCOMM_SIMULATE_GPU=1 in
    `make test`), the host path otherwise; its error: tests/test_averager_compression.py."""
    results = run_ranks(3, _quantized_average, compression, timeout=180)
    for t, half, sent in results:
        assert torch.equal(t, results[0][0]) and torch.equal(half, results[0][1])
        assert sent == results[0][2] > 0
