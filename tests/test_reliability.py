"""What a demanding user hits: fp64, inputs the library cannot reduce (an error at
construction, on every rank, naming the parameter), broadcasts of mismatched
tensors, a dead or a stalled peer at every blocking point (our error within the
timeout, never a raw backend error or a hang), and no deprecation warnings."""

import os
import time
import warnings

import pytest
import torch
import torch.nn as nn

import hybridcomm
from multiproc import run_ranks
from optim_models import batch, flat, make_model, shard

TIMEOUT = 3.0  # seconds; every scenario must fail within this plus start-up slack
SLACK = 15.0  # start-up (process groups, the plan) on 2 busy cores


# --- fp64 -------------------------------------------------------------------------------


def _fp64(rank, world, strategy):
    model = make_model().double()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model=model,
        strategy=strategy,
        fusion_bytes=0,
        timeout=60,
    )
    for s in range(3):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(
            model(shard(x, rank, world).double()), shard(y, rank, world).double()
        ).backward()
        opt.step()
    opt.synchronize()
    return flat(model.parameters())


@pytest.mark.parametrize("strategy", ["ring", "butterfly", "hybrid"])
def test_fp64_models_reduce_with_our_algorithms(strategy):
    results = run_ranks(3, _fp64, strategy)
    model = make_model().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(3):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.double()), y.double()).backward()
        opt.step()
    eps = torch.finfo(torch.float64).eps
    assert torch.allclose(results[0], flat(model.parameters()), rtol=64 * eps, atol=64 * eps)
    assert all(torch.equal(r, results[0]) for r in results)


# --- inputs we cannot reduce: an error at construction, on every rank ------------------


def _bad_model(rank, world, kind):
    if kind == "sparse":  # the device path has no sparse reduction
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    model = make_model()
    if kind == "sparse":
        model.emb = nn.Embedding(10, 4, sparse=True)
    elif kind == "complex":
        model.c = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    elif kind == "devices" and rank == 1:  # only one rank is wrong: all must say so
        model.m = nn.Parameter(torch.zeros(3, device="meta"))
    elif kind == "devices":
        model.m = nn.Parameter(torch.zeros(3))
    elif kind == "integer":  # integer parameters cannot require grad: frozen, skipped
        model.i = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    try:
        opt = hybridcomm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model=model, timeout=30
        )
    except hybridcomm.HybridCommError as e:
        return str(e)
    opt.close()
    return "accepted"


@pytest.mark.parametrize(
    "kind,expect",
    [
        ("sparse", "'emb.weight' belongs to a module with sparse"),
        ("complex", "'c' is complex"),
        ("devices", "several devices"),
        ("integer", None),
    ],
)
def test_unreducible_parameters_fail_at_construction_on_every_rank(kind, expect):
    for msg in run_ranks(2, _bad_model, kind):
        if expect is None:
            assert msg == "accepted"
        else:
            assert expect in msg, msg


class SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 6, sparse=True)
        self.fc = nn.Linear(6, 3)

    def forward(self, ids):
        return self.fc(self.emb(ids).mean(1))


def _sparse_batch(s):
    g = torch.Generator().manual_seed(7 + s)
    # each rank's shard touches some rows the others do not, and some in common
    return torch.randint(0, 50, (12, 5), generator=g), torch.randn(12, 3, generator=g)


def _sparse_train(rank, world, overlap):
    torch.manual_seed(0)
    model = SparseNet()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), model=model, overlap=overlap, timeout=60
    )
    for s in range(4):
        ids, y = _sparse_batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(ids, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    opt.synchronize()
    opt.close()
    return flat(model.parameters())


@pytest.mark.parametrize("overlap", ["forward", "backward", "none"])
def test_sparse_embeddings_train_like_one_process(overlap):
    results = run_ranks(3, _sparse_train, overlap)
    torch.manual_seed(0)
    model = SparseNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for s in range(4):
        ids, y = _sparse_batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(ids), y).backward()
        opt.step()
    eps = torch.finfo(torch.float32).eps
    assert torch.allclose(results[0], flat(model.parameters()), rtol=64 * eps, atol=64 * eps)
    assert all(torch.equal(r, results[0]) for r in results)


def _sparse_grad_anyway(rank, world):
    model = nn.Linear(4, 4)
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, timeout=30
    )
    model.weight.grad = torch.zeros(4, 4).to_sparse()  # as a custom sparse op would leave it
    try:
        opt.step()
    except hybridcomm.HybridCommError as e:
        return str(e)
    return "accepted"


def test_a_sparse_gradient_that_slips_through_is_our_error():
    for msg in run_ranks(2, _sparse_grad_anyway):
        assert "sparse gradient" in msg


# --- broadcasts -------------------------------------------------------------------------


def _broadcast_mismatch(rank, world, bigger):
    model = make_model()
    if rank == 1:
        n = 33 if bigger else 31
        model.fc2 = nn.Linear(n, 3)  # another shape on one rank
    try:
        hybridcomm.broadcast_parameters(model.state_dict(), root_rank=0, timeout=30)
    except hybridcomm.HybridCommError as e:
        return str(e)
    return "copied"


@pytest.mark.parametrize("bigger", [True, False])
def test_broadcast_parameters_checks_shapes_first(bigger):
    for msg in run_ranks(3, _broadcast_mismatch, bigger):
        assert "fc2.weight" in msg and "rank 1" in msg, msg


def _optimizer_state_mismatch(rank, world):
    model = make_model()
    params = list(model.parameters())
    opt = torch.optim.SGD(params if rank == 0 else params[:-1], lr=0.1, momentum=0.9)
    try:
        hybridcomm.broadcast_optimizer_state(opt, root_rank=0, timeout=30)
    except hybridcomm.HybridCommError as e:
        return str(e)
    return "loaded"


def test_broadcast_optimizer_state_checks_groups_first():
    for msg in run_ranks(2, _optimizer_state_mismatch):
        assert "parameter groups differ" in msg


# --- a dead or stalled peer at every blocking point -------------------------------------


def _peer_fails(rank, world, where, how):
    from hybridcomm.comm import calibration

    def fail():
        if how == "dies":
            os._exit(0)
        time.sleep(TIMEOUT + 5)

    # Both ranks past gloo's connection set-up before rank 1 fails (else rank 0 can
    # fail inside init_process_group, before any of our code runs).
    torch.distributed.barrier()
    if rank == 1:
        if where == "construction":
            fail()
        elif where == "probe":
            calibration.measure_gamma = lambda *a, **k: fail()
        elif where == "broadcast":
            fail()
    model = make_model()
    t0 = time.monotonic()
    try:
        if where == "broadcast":
            hybridcomm.broadcast_parameters(model.state_dict(), timeout=TIMEOUT)
            return "no error"
        kw = {"cost_model": "probe"} if where == "probe" else {}
        opt = hybridcomm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            measure_iters=2,
            timeout=TIMEOUT,
            **kw,
        )
        for s in range(4):
            x, y = batch(s)
            opt.zero_grad()
            nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        opt.synchronize()
        t1 = time.monotonic()
        opt.close()
        return "no error", time.monotonic() - t1
    except hybridcomm.HybridCommError as e:
        return type(e).__name__, time.monotonic() - t0, str(e)


@pytest.mark.parametrize("how", ["dies", "stalls"])
@pytest.mark.parametrize("where", ["construction", "probe", "broadcast"])
def test_a_dead_or_stalled_peer_is_our_error_within_the_timeout(where, how):
    results = run_ranks(2, _peer_fails, where, how, timeout=120, allow_errors=True)
    assert isinstance(results[0], tuple), results[0]  # else: rank 0's traceback
    kind, elapsed, msg = results[0]
    assert kind in ("HybridCommTimeout", "HybridCommError"), results[0]
    if how == "stalls":
        assert kind == "HybridCommTimeout"
    assert elapsed < TIMEOUT + SLACK and "rank 0" in msg


def _replan_peer(rank, world, how):
    from hybridcomm.sync import planning

    real = planning.Planning.agree
    calls = []

    def agree(self, *args, **kwargs):
        calls.append(1)
        if rank == 1 and len(calls) == 2:  # construction's agreement passes; the re-plan's not
            if how == "dies":
                os._exit(0)
            time.sleep(TIMEOUT + 5)
        return real(self, *args, **kwargs)

    planning.Planning.agree = agree
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, measure_iters=2, timeout=TIMEOUT
    )
    t0 = None
    try:
        for s in range(4):
            if s == 1:
                t0 = time.monotonic()
            x, y = batch(s)
            opt.zero_grad()
            nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        opt.synchronize()
    except hybridcomm.HybridCommError as e:
        t1 = time.monotonic()
        opt.close()  # returns, within the timeout, though a peer is gone
        return type(e).__name__, t1 - t0, str(e), time.monotonic() - t1
    return "no error"


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_stalled_or_dead_peer_at_the_replan(how):
    results = run_ranks(2, _replan_peer, how, timeout=120, allow_errors=True)
    kind, elapsed, msg, close_s = results[0]
    assert kind in ("HybridCommTimeout", "HybridCommError")
    if how == "stalls":
        assert kind == "HybridCommTimeout"
    # at the re-plan's agreement, or (a dead peer's socket may still take the plan)
    # at the next reduction
    assert elapsed < TIMEOUT + SLACK and "rank 0" in msg
    if how == "stalls":
        assert "the bucket plan" in msg
    assert close_s < TIMEOUT + SLACK


# --- warnings ---------------------------------------------------------------------------


def _no_warnings(rank, world):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = make_model()
        hybridcomm.broadcast_parameters(model.state_dict(), timeout=30)
        opt = hybridcomm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model=model, timeout=30
        )
        hybridcomm.broadcast_optimizer_state(opt, timeout=30)
        for s in range(4):
            x, y = batch(s)
            opt.zero_grad()
            nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        hybridcomm.all_reduce(torch.ones(10), check="always", timeout=30)
        opt.close()
    return [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, (DeprecationWarning, FutureWarning))
    ]


def test_the_library_raises_no_deprecation_warnings():
    for found in run_ranks(2, _no_warnings):
        assert found == []


class _RunsCodeWhenLoaded:
    """A class a peer could send to run code on load (pickle's __reduce__)."""

    def __reduce__(self):
        return (os.system, ("true",))


def _unsafe_agreement(rank, world):
    from hybridcomm.comm import control
    from hybridcomm.base.errors import HybridCommError
    from hybridcomm.plan.planner import Bucket, Plan

    plan = Plan(
        world, "hybrid", [Bucket(0, ["fc"], [0], 3, 12, "ring", 1e-4, segments=[(0, 4)])], [(0, 0)]
    )
    got = control.broadcast_object(plan if rank == 0 else None, timeout=30, what="a plan")
    try:
        control.broadcast_object(
            _RunsCodeWhenLoaded() if rank == 0 else None, timeout=30, what="a hostile object"
        )
        refused = rank == 0  # the root keeps its own object
    except HybridCommError as e:
        refused = "refused what a peer sent" in str(e)
    return got == plan, refused


def test_agreements_load_only_safe_types_from_peers():
    """Nothing received from the network is unpickled freely: plans and cost models
    load (torch's weights_only unpickler, with hybridcomm's own types allowed),
    an object that would run code when loaded is refused by name."""
    for same, refused in run_ranks(2, _unsafe_agreement):
        assert same and refused


# --- the end of a run ------------------------------------------------------------------

_END_OF_RUN = """
import gc, weakref
import torch, torch.distributed as dist, hybridcomm

dist.init_process_group("gloo")
world = weakref.ref(dist.group.WORLD)
model = torch.nn.Linear(4, 2)
opt = hybridcomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
opt.zero_grad()
model(torch.ones(3, 4)).sum().backward()
opt.step()
opt.close()
dist.destroy_process_group()
gc.collect()
print("RELEASED", world() is None, flush=True)
"""


def test_destroy_process_group_releases_the_default_group(tmp_path):
    """A user's script: hybridcomm imported first, a torch optimizer built after
    init_process_group (torch then imports dynamo). destroy_process_group() releases
    the default group, so its gloo threads end there: one left running into the
    interpreter's exit, still releasing the last collective's tensors, can abort a
    finished run (pytorch/pytorch#190489)."""
    from launch_script import run_script

    script = tmp_path / "end_of_run.py"
    script.write_text(_END_OF_RUN)
    for out in run_script(str(script), [], nprocs=2, timeout=120):
        assert "RELEASED True" in out, out[-2000:]
