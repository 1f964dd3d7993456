"""DiLoCo and Streaming DiLoCo with real processes over gloo: the exact cases against
one process, streaming against a one-process re-enactment of the algorithm (every
fragment, delay and mixing), the ranks' global copies bitwise equal after every
step, resume from a checkpoint bitwise, a dead or stalled peer, refused input.

Tolerances: the exact cases differ from one process only in summation order (a
shard's mean, then the ranks' mean, against the whole batch's mean) and in Δ being
a difference of parameters (its rounding is that of the parameters, not of Δ), so
they are a few fp32 ulps of the parameters' magnitude; the re-enactment does the
same operations in the same order at 2 ranks, so it must match bitwise."""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hybridcomm
from hybridcomm.strategies import DiLoCo
from multiproc import run_ranks
from optim_models import batch, flat, make_model, shard

EPS = torch.finfo(torch.float32).eps
TOL = dict(rtol=64 * EPS, atol=64 * EPS)  # as test_strategies.py's exact cases


def _sgd(params, lr=0.05, momentum=0.0):
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def _nesterov(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _train(model, opt, rank, world, steps, each=None):
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        F.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
        if each is not None:
            each(s)


# -- the exact cases -------------------------------------------------------------------------


def _diloco_run(rank, world, sync_every, momentum, steps, simulate=False):
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    model = make_model(seed=rank)  # different starts: DiLoCo broadcasts rank 0's
    opt = DiLoCo(
        _sgd(model.parameters(), momentum=momentum),
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        sync_every=sync_every,
        timeout=60,
        cost_model="default",
    )
    _train(model, opt, rank, world, steps)
    if simulate:  # the host reads the parameters: as .cpu() would on a GPU, wait first
        from hybridcomm.gpu.runtime import runtime_for

        runtime_for("cpu").synchronize()
    out = flat(model.parameters()), flat(opt.global_parameters()), opt.bytes_sent
    opt.close()
    return out


def _one_process(steps):
    model = make_model()
    opt = _sgd(model.parameters())
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return flat(model.parameters())


def _model_averaging(world, period, steps, momentum=0.9):
    """Each rank's model trained alone on its shard from rank 0's start, replaced
    by the ranks' mean every ``period`` steps; the inner state stays each rank's."""
    models = [make_model() for _ in range(world)]
    opts = [_sgd(m.parameters(), momentum=momentum) for m in models]
    for s in range(steps):
        x, y = batch(s)
        for r, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            F.mse_loss(m(shard(x, r, world)), shard(y, r, world)).backward()
            o.step()
        if (s + 1) % period == 0:
            with torch.no_grad():
                for ps in zip(*[m.parameters() for m in models]):
                    mean = torch.stack([p for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
    return flat(models[0].parameters())


@pytest.mark.parametrize("world", [2, 3])
def test_sync_every_step_with_outer_sgd_lr_1_is_synchronous_data_parallel_sgd(world):
    results = run_ranks(world, _diloco_run, 1, 0.0, 4)
    want = _one_process(4)
    for params, glob, _ in results:
        assert torch.equal(params, results[0][0]) and torch.equal(params, glob)
        assert torch.allclose(params, want, **TOL), (params - want).abs().max()


def test_on_the_simulated_gpu_sync_every_step_is_synchronous_sgd():
    results = run_ranks(2, _diloco_run, 1, 0.0, 3, True)
    want = _one_process(3)
    for params, glob, _ in results:
        assert torch.equal(params, results[0][0])
        assert torch.allclose(params, want, **TOL), (params - want).abs().max()


@pytest.mark.parametrize("world", [2, 3])
def test_sync_every_h_with_outer_sgd_lr_1_is_model_averaging(world):
    results = run_ranks(world, _diloco_run, 3, 0.9, 6)
    want = _model_averaging(world, 3, 6)
    for params, glob, sent in results:
        assert torch.equal(params, results[0][0]) and torch.equal(params, glob)
        assert torch.allclose(params, want, **TOL), (params - want).abs().max()
    assert results[0][2] == 2 * run_ranks(world, _diloco_run, 6, 0.9, 6)[0][2]  # half the syncs


# -- streaming: every fragment count, delay and mixing, against a re-enactment ---------------

STREAMING = [  # (sync_every, fragments, delay, mixing, compression)
    (4, 1, 0, 0.5, None),
    (4, 2, 0, 0.5, None),
    (4, 2, 1, 0.5, None),
    (4, 4, 3, 0.5, None),
    (4, 3, 2, 0.0, None),
    (3, 2, 2, 1.0, None),
    (4, 2, 1, 0.5, "fp16"),
    (4, 2, 1, "carry", None),
    (4, 1, 3, "carry", None),
]
STEPS = 9


INNER = {  # (on the simulated GPU AdamW's step count is read by the host: a host sync
    # there that a GPU, where it stays in host memory, does not make)
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
}


def _streaming(rank, world, cases, simulate=False, inner="adamw"):
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    out = []
    for H, K, tau, mixing, compression in cases:
        model = make_model()
        opt = DiLoCo(
            INNER[inner](model.parameters()),
            model,
            _nesterov(model.parameters()),
            sync_every=H,
            fragments=K,
            delay=tau,
            mixing=mixing,
            compression=compression,
            timeout=60,
            cost_model="default",
        )
        globals_ = []
        _train(
            model, opt, rank, world, STEPS, lambda s: globals_.append(flat(opt.global_parameters()))
        )
        local = flat(model.parameters())
        opt.synchronize()
        out.append(
            {
                "globals": globals_,
                "local": local,
                "synced": flat(model.parameters()),
                "fragments": [f.params for f in opt.fragments],
            }
        )
        opt.close()
    if simulate:  # every read ordered after the writes it needs; no host wait in a step
        from hybridcomm.testing import simgpu

        simgpu.check()
        return out, simgpu.stats()
    return out


def _reenact(world, H, K, tau, mixing, fragments, inner="adamw"):
    """Streaming DiLoCo in one process, written from the papers' rule: ranks' models,
    a global copy, and per fragment a sync started at its offset, merged tau later.
    One thread, as the ranks: the same kernels, the same summation order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reenacted(world, H, K, tau, mixing, fragments, inner)
    finally:
        torch.set_num_threads(threads)


def _reenacted(world, H, K, tau, mixing, fragments, inner):
    models = [make_model() for _ in range(world)]
    inners = [INNER[inner](m.parameters()) for m in models]
    glob = make_model()
    outer = _nesterov(glob.parameters())
    offsets = [(k + 1) * H // K for k in range(K)]
    in_flight, globals_ = {}, []
    for t in range(1, STEPS + 1):
        x, y = batch(t - 1)
        for r, (m, o) in enumerate(zip(models, inners)):
            o.zero_grad()
            F.mse_loss(m(shard(x, r, world)), shard(y, r, world)).backward()
            o.step()
        g = list(glob.parameters())
        for k in range(K):
            if t % H == offsets[k] % H:
                deltas = []
                for i in fragments[k]:
                    mine = [g[i].detach() - list(m.parameters())[i].detach() for m in models]
                    deltas.append(sum(mine[1:], mine[0]) * (1.0 / world))
                starts = [
                    [list(m.parameters())[i].detach().clone() for i in fragments[k]] for m in models
                ]
                in_flight[k] = (t + tau, deltas, starts)
        for k in [k for k, (at, _, _) in in_flight.items() if at == t]:
            _, deltas, starts = in_flight.pop(k)
            for p in g:
                p.grad = None
            for i, d in zip(fragments[k], deltas):
                g[i].grad = d
            outer.step()
            with torch.no_grad():
                for m, started in zip(models, starts):
                    mp = list(m.parameters())
                    for i, s0 in zip(fragments[k], started):
                        if tau and mixing == "carry":  # θ_global + the progress since the start
                            mp[i].copy_(g[i] + (mp[i] - s0))
                        else:
                            mp[i].copy_(torch.lerp(g[i], mp[i], mixing) if tau else g[i])
        globals_.append(flat(g))
    return globals_


def test_streaming_keeps_the_ranks_equal_and_follows_the_algorithm():
    """Every (fragments, delay, mixing): the global copies are bitwise equal on every
    rank after every step and equal the re-enactment's (bitwise at 2 ranks, where
    each mean is one addition; fp16 Δ within its rounding); after synchronize() the
    parameters are equal too, and between syncs they differ (training went on)."""
    results = run_ranks(2, _streaming, STREAMING, timeout=240)
    for case, mine, theirs in zip(STREAMING, results[0], results[1]):
        H, K, tau, mixing, compression = case
        for step, (a, b) in enumerate(zip(mine["globals"], theirs["globals"])):
            assert torch.equal(a, b), (case, step)
        assert torch.equal(mine["synced"], theirs["synced"]), case
        assert not torch.equal(mine["local"], theirs["local"]), case
        want = _reenact(2, H, K, tau, mixing, mine["fragments"])
        for step, (got, w) in enumerate(zip(mine["globals"], want)):
            if compression is None:
                assert torch.equal(got, w), (case, step, (got - w).abs().max())
            else:  # each Δ rounded to fp16 (and summed in it): a few of its ulps of |Δ|
                fp16 = torch.finfo(torch.float16).eps
                assert torch.allclose(got, w, rtol=0, atol=64 * fp16 * 0.05), (case, step)


def test_streaming_on_the_simulated_gpu_keeps_the_ranks_equal():
    cases = [(4, 2, 1, 0.5, None), (4, 2, 0, 0.5, "int4")]
    results = run_ranks(2, _streaming, cases, True, "sgd", timeout=240)
    for _, stats in results:
        assert stats["defects"] == 0 and stats["host_syncs"] == 0, stats
    results = [r for r, _ in results]
    for case, mine, theirs in zip(cases, results[0], results[1]):
        assert all(torch.equal(a, b) for a, b in zip(mine["globals"], theirs["globals"])), case
        assert torch.equal(mine["synced"], theirs["synced"]), case
    want = _reenact(2, 4, 2, 1, 0.5, results[0][0]["fragments"], "sgd")
    assert all(torch.equal(a, b) for a, b in zip(results[0][0]["globals"], want))


def test_three_ranks_quantized_keep_the_same_global_copy():
    cases = [(4, 2, 1, 0.5, "int8"), (4, 4, 2, 0.0, "int4")]
    results = run_ranks(3, _streaming, cases, timeout=240)
    for i, case in enumerate(cases):
        for r in (1, 2):
            assert all(
                torch.equal(a, b)
                for a, b in zip(results[0][i]["globals"], results[r][i]["globals"])
            ), case
            assert torch.equal(results[0][i]["synced"], results[r][i]["synced"]), case


# -- set-up at construction ---------------------------------------------------------------


def _set_up_when(rank, world, tmp):
    """With no cost model saved or kept: is the start-up probe kept (rank 0) right
    after construction, before any sync?"""
    os.environ.pop("HYBRIDCOMM_COST_MODEL", None)
    os.environ["XDG_CACHE_HOME"] = tmp
    os.environ["HYBRIDCOMM_PROBE_CACHE"] = "1"
    from hybridcomm.comm import calibration

    calibration.set_active(None)
    model = make_model()
    opt = DiLoCo(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        model,
        _sgd(model.parameters(), lr=1.0),
        sync_every=2,
        fragments=2,
        compression="int4",
        timeout=60,
    )
    kept = [
        name for name in os.listdir(os.path.join(tmp, "hybridcomm")) if name.startswith("probe")
    ]
    _train(model, opt, rank, world, 4)
    opt.close()
    return kept


def test_the_cost_model_and_buckets_are_made_at_construction(tmp_path):
    """The averager's set-up (the cost model's agreement: a probe where none is kept,
    seconds on a slow link; each fragment's plan and buffers) happens in the
    constructor, a collective already, not inside the first syncs' waits."""
    kept = run_ranks(2, _set_up_when, str(tmp_path))
    assert kept[0], "rank 0 kept no start-up probe at construction"


# -- checkpoints ----------------------------------------------------------------------------

AT, END = 4, 9  # H=4, K=2, tau=1: fragment 1 started after step 4 is in flight at AT


def _build(rank, mixing):
    model = make_model(seed=rank)
    opt = DiLoCo(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        model,
        _nesterov(model.parameters()),
        sync_every=4,
        fragments=2,
        delay=1,
        mixing=mixing,
        global_device="cpu",  # (host memory: the same device here, pinned beside a GPU)
        timeout=60,
        cost_model="default",
    )
    return model, opt


def _run(model, opt, rank, world, first, last):
    for s in range(first, last):
        x, y = batch(s)
        opt.zero_grad()
        F.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()


def _straight(rank, world, path, mixing):
    model, opt = _build(rank, mixing)
    _run(model, opt, rank, world, 0, AT)
    assert list(opt._in_flight) == [1]  # (the case this test is about)
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    if rank == 0:
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()
    _run(model, opt, rank, world, AT, END)
    out = flat(model.parameters()), flat(opt.global_parameters())
    opt.close()
    return out


def _resumed(rank, world, path, mixing):
    model, opt = _build(rank, mixing)
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    _run(model, opt, rank, world, AT, END)
    out = flat(model.parameters()), flat(opt.global_parameters())
    opt.close()
    return out


@pytest.mark.parametrize("mixing", [0.5, "carry"])
def test_resume_from_a_checkpoint_with_a_sync_in_flight_is_bitwise(tmp_path, mixing):
    path = str(tmp_path / "ckpt.pt")
    want = run_ranks(3, _straight, path, mixing, timeout=180)
    got = run_ranks(3, _resumed, path, mixing, timeout=180)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g[0], w[0]), f"rank {rank}: parameters differ"
        assert torch.equal(g[1], w[1]), f"rank {rank}: global copies differ"
    assert not torch.equal(want[0][0], want[1][0])  # mid-period: the ranks' own models


# -- a dead or stalled peer ------------------------------------------------------------------

TIMEOUT, SLACK = 5.0, 10.0


def _peer_fails(rank, world, how, delay):
    dist.barrier()
    model = make_model()
    opt = DiLoCo(
        _sgd(model.parameters()),
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        sync_every=2,
        delay=delay,
        timeout=TIMEOUT,
        cost_model="default",
    )
    t0 = None
    try:
        for s in range(6):
            if rank == 1 and s == 3:  # after one sync; before the next
                if how == "dies":
                    os._exit(0)
                time.sleep(TIMEOUT + 3)
            if s == 3:
                t0 = time.monotonic()
            x, y = batch(s)
            opt.zero_grad()
            F.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        opt.synchronize()
        return "no error"
    except hybridcomm.HybridCommError as e:
        return type(e).__name__, time.monotonic() - t0, str(e)


@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_dead_or_stalled_peer_is_our_error_naming_it_within_the_timeout(how, delay):
    results = run_ranks(2, _peer_fails, how, delay, timeout=120, allow_errors=True)
    assert isinstance(results[0], tuple), results[0]
    kind, elapsed, msg = results[0]
    assert kind in ("HybridCommTimeout", "HybridCommError"), results[0]
    if how == "stalls":
        assert kind == "HybridCommTimeout", msg
    assert elapsed < TIMEOUT + SLACK, (elapsed, msg)
    assert "rank 1" in msg and "DiLoCo: fragment 0's sync" in msg, msg


# -- refused input ---------------------------------------------------------------------------


def _refusals(rank, world):
    out = {}
    model = make_model()
    other = make_model(seed=5)

    def attempt(name, **kw):
        args = dict(
            inner_optimizer=_sgd(model.parameters()),
            model=model,
            outer_optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            sync_every=4,
            timeout=30,
            cost_model="default",
        )
        args.update(kw)
        try:
            DiLoCo(**args).close()
            out[name] = "built"
        except hybridcomm.HybridCommError as e:
            out[name] = str(e)

    attempt("outer elsewhere", outer_optimizer=torch.optim.SGD(other.parameters(), lr=1.0))
    attempt("outer partial", outer_optimizer=torch.optim.SGD(list(model.parameters())[:2], lr=1))
    attempt("too many fragments", fragments=5)
    attempt("fragments over H", fragments=3, sync_every=2)
    attempt("delay reaches next sync", delay=4)
    attempt("shard", shard="optimizer")
    attempt("bad compression", compression="int3")
    attempt("only rank 1 wrong", delay=4 if rank == 1 else 0)
    attempt("fine", fragments=2, delay=3)
    return out


def test_bad_input_is_a_clear_error_on_every_rank_at_construction():
    for out in run_ranks(2, _refusals, timeout=120):
        assert "not one of model's" in out["outer elsewhere"]
        assert "'conv2.weight' is trainable but not in outer_optimizer" in out["outer partial"]
        assert "fragments=5 but the model has 4 layers" in out["too many fragments"]
        assert "fragments=3 > sync_every=2" in out["fragments over H"]
        assert "delay=4 reaches each fragment's own next sync" in out["delay reaches next sync"]
        assert "shard='optimizer' does not combine with DiLoCo" in out["shard"]
        assert "compression must be" in out["bad compression"]
        assert "DiLoCo on rank(s) 1: delay=4" in out["only rank 1 wrong"]
        assert out["fine"] == "built"
