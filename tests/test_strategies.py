"""Parallel SGD, local SGD, ADMM and Downpour with real processes: their numbers,
their bytes, and Downpour's concurrency and failure paths."""

import os
import tempfile
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridcomm
from hybridcomm.strategies import ADMM, DownpourSGD, LocalSGD, ParallelSGD, init_downpour, serve
from multiproc import run_ranks
from optim_models import batch, flat, make_model, shard

EPS = torch.finfo(torch.float32).eps
TOL = dict(rtol=64 * EPS, atol=64 * EPS)


def _one_process(steps, momentum=0.9):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return flat(model.parameters())


def _local(rank, world, period, warmup, steps):
    model = make_model(seed=rank)  # different starts: the wrapper broadcasts rank 0's
    opt = LocalSGD(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model,
        period=period,
        warmup_steps=warmup,
        timeout=60,
    )
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        F.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    return flat(model.parameters()), opt.bytes_sent


def test_local_sgd_with_period_1_is_synchronous_sgd():
    results = run_ranks(3, _local, 1, 0, 4)
    assert torch.allclose(results[0][0], _one_process(4), **TOL)
    assert all(torch.equal(r[0], results[0][0]) for r in results)


def test_local_sgd_sends_a_period_fraction_of_the_bytes_and_warms_up_synchronously():
    per_step = run_ranks(2, _local, 1, 0, 8)[0][1]
    every4 = run_ranks(2, _local, 4, 0, 8)[0][1]
    assert every4 == per_step // 4
    warm = run_ranks(2, _local, 4, 4, 8)  # 4 synchronous steps (gradients averaged), then 4 local
    assert torch.allclose(warm[0][0], warm[1][0], **TOL)  # averaged at step 8
    first4 = run_ranks(2, _local, 1, 4, 4)[0][0]  # warm-up only: synchronous SGD
    assert torch.allclose(first4, _one_process(4), **TOL)


def _parallel(rank, world, epochs):
    model = make_model(seed=rank)
    opt = ParallelSGD(torch.optim.SGD(model.parameters(), lr=0.05), model, timeout=60)
    for epoch in range(epochs):
        for s in range(2):
            x, y = batch(10 * epoch + s)
            opt.zero_grad()
            F.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        opt.end_epoch()
    return flat(model.parameters()), opt.bytes_sent


def test_parallel_sgd_averages_the_local_models_every_epoch():
    world = 3
    got = run_ranks(world, _parallel, 1)
    # the reference: each shard trained alone from rank 0's start, then the mean
    locals_ = []
    for r in range(world):
        model = make_model(seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for s in range(2):
            x, y = batch(s)
            opt.zero_grad()
            F.mse_loss(model(shard(x, r, world)), shard(y, r, world)).backward()
            opt.step()
        locals_.append(flat(model.parameters()))
    assert torch.allclose(got[0][0], torch.stack(locals_).mean(0), **TOL)
    assert all(torch.equal(g[0], got[0][0]) for g in got) and got[0][1] > 0


def _admm(rank, world):
    torch.manual_seed(0)
    a = torch.randn(30, 5)
    b = a @ torch.arange(1.0, 6.0) + 0.01 * torch.randn(30)
    model = nn.Linear(5, 1, bias=False)
    opt = ADMM(
        torch.optim.SGD(model.parameters(), lr=0.01), model, rho=1.0, local_steps=5, timeout=60
    )
    rows = slice(rank * 10, (rank + 1) * 10)  # each rank its third of the least squares
    for _ in range(600):
        opt.zero_grad()
        F.mse_loss(model(a[rows]).squeeze(1), b[rows], reduction="sum").backward()
        opt.step()
    with opt.consensus() as m:
        z = m.weight.detach().clone().reshape(-1)
    solution = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.reshape(-1)
    return z, solution, opt.rounds


def test_admm_reaches_the_global_least_squares_solution():
    results = run_ranks(3, _admm, timeout=120)
    z, solution, rounds = results[0]
    assert rounds == 120
    assert torch.allclose(z, solution, atol=2e-3), (z, solution)
    assert all(torch.equal(r[0], z) for r in results)  # one consensus on every rank


# --- Downpour ---------------------------------------------------------------------------


def _downpour(rank, world, workers, scenario, rdv):
    role, name = init_downpour(rank, workers, world - workers, f"file://{rdv}", timeout=10)
    servers = [f"server{i}" for i in range(world - workers)]
    if role == "server":
        if scenario == "kill" and name == "server0":
            threading.Timer(2, os._exit, (0,)).start()  # serve, then die mid-run for good
        try:
            # the kill scenario's survivor gives up soon after the workers do
            return ("server", serve(timeout=1 if scenario == "kill" else 30))
        except hybridcomm.HybridCommError as e:
            return ("server", str(e))
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    if scenario == "count":  # every push is ones: nothing may be lost
        opt = DownpourSGD(model, servers, lr=1.0, n_fetch=1, n_push=1, timeout=10)
        for _ in range(20):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
        opt.close()
        return ("worker", None)
    opt = DownpourSGD(model, servers, lr=0.05, timeout=3)
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            opt.zero_grad()
            x = torch.randn(8, 4)
            F.mse_loss(model(x), x[:, :3]).backward()
            opt.step()
            time.sleep(0.01)
    except hybridcomm.HybridCommError as e:
        return ("worker", (type(e).__name__, time.monotonic() - t0, str(e)))
    return ("worker", "no error")


def test_downpour_loses_no_update_under_concurrent_pushes():
    workers, servers = 3, 2
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(
            workers + servers, _downpour, workers, "count", os.path.join(tmp, "rdv"), timeout=120
        )
    applied = [r[1] for r in results if r[0] == "server"]
    assert applied == [workers * 20] * servers  # every push, on every shard


def _final_params(rank, world, workers, rdv):
    role, _ = init_downpour(rank, workers, world - workers, f"file://{rdv}", timeout=10)
    servers = [f"server{i}" for i in range(world - workers)]
    if role == "server":
        return serve(timeout=30)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = DownpourSGD(model, servers, lr=1.0, timeout=10)
    for _ in range(10):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    # make sure every worker's pushes landed before reading: wait for the others
    import torch.distributed as dist

    opt._finish_pushes()
    dist.barrier(group=dist.new_group(list(range(workers)), use_local_synchronization=True))
    opt.fetch()
    out = flat(model.parameters())
    opt.close()
    return out


def test_downpour_applies_every_worker_every_push_exactly():
    workers = 3
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(
            workers + 1, _final_params, workers, os.path.join(tmp, "rdv"), timeout=120
        )
    for params in results[:workers]:
        assert torch.equal(params, torch.full_like(params, -30.0))  # 3 workers x 10 pushes


def test_a_killed_server_is_a_clear_error_on_every_worker_within_its_timeout():
    """Killed and not restarted: the workers' reconnects end after their timeout."""
    workers = 3
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(
            workers + 2,
            _downpour,
            workers,
            "kill",
            os.path.join(tmp, "rdv"),
            timeout=120,
            allow_errors=True,
        )
    for role, outcome in results[:workers]:
        kind, elapsed, msg = outcome
        assert kind in ("HybridCommError", "HybridCommTimeout")
        assert "server0" in msg and elapsed < 2 + 3 + 5  # dies at ~2 s; a 3 s timeout


def _local_sgd_set_up_when(rank, world, tmp):
    """With no cost model saved or kept: is the start-up probe kept (rank 0) right
    after LocalSGD's construction, before its first average?"""
    os.environ.pop("HYBRIDCOMM_COST_MODEL", None)
    os.environ["XDG_CACHE_HOME"] = tmp
    os.environ["HYBRIDCOMM_PROBE_CACHE"] = "1"
    from hybridcomm.comm import calibration

    calibration.set_active(None)
    model = nn.Linear(8, 4)
    opt = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, period=2, timeout=60)
    kept = [n for n in os.listdir(os.path.join(tmp, "hybridcomm")) if n.startswith("probe")]
    opt.synchronize()
    return kept


def test_local_sgd_makes_its_cost_model_at_construction(tmp_path):
    """The start-up probe (seconds on a slow link) runs in the constructor, a
    collective already, not inside the first average's step."""
    kept = run_ranks(2, _local_sgd_set_up_when, str(tmp_path))
    assert kept[0], "rank 0 kept no start-up probe at construction"
