"""What a serious wrapper handles: unused, frozen and tied parameters, accumulation,
no_sync, state_dict, GradScaler, mismatched models, misuse, the plan."""

import copy
import os

import pytest
import torch
import torch.nn as nn

import hybridcomm
from hybridcomm.sync.pending import is_pending
from multiproc import run_ranks
from optim_models import GLOBAL_BATCH, batch, flat, make_model, shard

TOL = dict(rtol=64 * torch.finfo(torch.float32).eps, atol=64 * torch.finfo(torch.float32).eps)


class Branchy(nn.Module):
    """`a` is used only by the first shard, `never` by nobody, `frozen` is frozen,
    and `tied_*` share one weight."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.a = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.tied_1 = nn.Linear(4, 4, bias=False)
        self.tied_2 = nn.Linear(4, 4, bias=False)
        self.tied_2.weight = self.tied_1.weight

    def forward(self, x, use_a):
        h = torch.tanh(self.body(x))
        if use_a:
            h = h + self.a(h)
        return self.tied_2(torch.tanh(self.tied_1(self.frozen(h))))


def branchy_data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def branchy_loss(model, x, y, shard_index):
    return nn.functional.mse_loss(model(x, use_a=shard_index == 0), y)


def branchy_reference(world, steps):
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for s in range(steps):
        x, y = branchy_data(s)
        opt.zero_grad()
        # the average of the per-shard losses: what P ranks compute together
        loss = (
            sum(
                branchy_loss(model, shard(x, r, world), shard(y, r, world), r) for r in range(world)
            )
            / world
        )
        loss.backward()
        opt.step()
    return model


def _branchy(rank, world, overlap, steps):
    torch.manual_seed(0)
    model = Branchy()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
        model=model,
        overlap=overlap,
        timeout=60,
    )
    plan_params = sum(len(b.params) for b in opt.plan.buckets)
    for s in range(steps):
        x, y = branchy_data(s)
        opt.zero_grad()
        branchy_loss(model, shard(x, rank, world), shard(y, rank, world), rank).backward()
        opt.step()
    opt.synchronize()
    opt.close()
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        plan_params,
        model.never.weight.grad,
    )


@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_unused_frozen_and_tied_parameters(overlap):
    world, steps = 3, 3
    results = run_ranks(world, _branchy, overlap, steps)
    ref = branchy_reference(world, steps).state_dict()
    torch.manual_seed(0)
    init = Branchy().state_dict()
    for rank, (state, plan_params, never_grad) in enumerate(results):
        # trainable: body (2), a (2), never (2), tied (1, reduced once): frozen left out
        assert plan_params == 7
        assert never_grad is None  # no rank produced one: left as one process leaves it
        for k in state:
            assert torch.allclose(state[k], ref[k], **TOL), f"rank {rank}: {k}"
            assert torch.equal(state[k], results[0][0][k]), f"rank {rank} differs: {k}"
        # unused everywhere: not even weight decay touched it
        assert torch.equal(state["never.weight"], init["never.weight"])
        assert torch.equal(state["frozen.weight"], init["frozen.weight"])
        assert not torch.equal(state["a.weight"], init["a.weight"])  # used on one rank only


def _accumulate(rank, world, how):
    model = make_model()
    kwargs = {"backward_passes_per_step": 2} if how == "passes" else {}
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model=model,
        overlap="backward",
        timeout=60,
        **kwargs,
    )
    for s in range(2):
        x, y = batch(s)
        x, y = shard(x, rank, world), shard(y, rank, world)
        half = x.shape[0] // 2
        opt.zero_grad()
        for i, sl in enumerate((slice(0, half), slice(half, None))):
            loss = nn.functional.mse_loss(model(x[sl]), y[sl]) / 2
            if how == "no_sync" and i == 0:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
    opt.close()
    return flat(model.parameters())


@pytest.mark.parametrize("how", ["passes", "no_sync"])
def test_gradient_accumulation_syncs_once(how):
    world = 2
    results = run_ranks(world, _accumulate, how)
    # reference: one process, whole batch, plain SGD with momentum
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(2):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    want = flat(model.parameters())
    for r in results:
        assert torch.allclose(r, want, **TOL)
        assert torch.equal(r, results[0])


def _state_roundtrip(rank, world):
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), model=model, overlap="forward", timeout=60
    )
    x, y = batch(0)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    # forward mode: the second update is still pending; state_dict must include it
    sd = copy.deepcopy(opt.state_dict())  # as saved to disk: no tensors shared with opt
    steps = [float(s["step"]) for s in sd["state"].values()]
    model2 = make_model()
    model2.load_state_dict(model.state_dict())
    opt2 = hybridcomm.DistributedOptimizer(
        torch.optim.Adam(model2.parameters(), lr=1e-2), model=model2, overlap="forward", timeout=60
    )
    opt2.load_state_dict(sd)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        nn.functional.mse_loss(m(shard(x, rank, world)), shard(y, rank, world)).backward()
        o.step()
        o.synchronize()
        o.close()
    return steps, flat(model.parameters()), flat(model2.parameters())


def test_state_dict_roundtrip_includes_pending_updates():
    for steps, a, b in run_ranks(2, _state_roundtrip):
        assert steps and all(s == 2.0 for s in steps)
        assert torch.equal(a, b)


def _grad_scaler(rank, world, overlap):
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), model=model, overlap=overlap, timeout=60
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    params, scales = [], []
    for s in range(3):
        x, y = batch(s)
        x = shard(x, rank, world).clone()
        if s == 1 and rank == 1:
            x[0, 0, 0, 0] = float("inf")  # only rank 1 overflows
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), shard(y, rank, world))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.synchronize()
        params.append(flat(model.parameters()))
        scales.append(scaler.get_scale())
    opt.close()
    return params, scales


@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_grad_scaler_skips_the_same_step_on_every_rank(overlap):
    results = run_ranks(2, _grad_scaler, overlap)
    (p0, s0), (p1, s1) = results
    assert s0 == s1 == [2.0**8, 2.0**7, 2.0**7]  # the inf step halved the scale everywhere
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
    assert torch.equal(p0[1], p0[0])  # step 1 skipped
    assert not torch.equal(p0[2], p0[1])


def _mismatch(rank, world):
    model = make_model()
    if rank == 1:
        model.extra = nn.Linear(2, 2)
    try:
        hybridcomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    except hybridcomm.HybridCommError as e:
        return str(e)
    return "no error"


def test_parameter_mismatch_is_a_clear_error():
    for msg in run_ranks(2, _mismatch):
        assert (
            "differ across ranks" in msg and "only rank 1 has ['extra.weight', 'extra.bias']" in msg
        )


def _dropped_and_plan(rank, world, overlap):
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, overlap=overlap, timeout=60
    )
    before = flat(model.parameters())
    x, y = batch(0)
    nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
    opt.zero_grad()  # in flight (backward/forward) or not yet sent (none): dropped, as in one process
    opt.step()
    opt.synchronize()
    unchanged = torch.equal(flat(model.parameters()), before)
    x, y = batch(1)
    opt.zero_grad()
    nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
    opt.step()
    opt.synchronize()
    table = str(opt.plan)
    opt.close()
    os.environ["HYBRIDCOMM_ALGO"] = "halving_doubling"
    forced = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model
    )
    algos = {b.algorithm for b in forced.plan.buckets}
    forced.close()
    return unchanged, flat(model.parameters()), table, algos


@pytest.mark.parametrize("overlap", ["forward", "backward", "none"])
def test_zero_grad_drops_unstepped_gradients_and_plan_is_visible_and_overridable(overlap):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(1)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    want = flat(model.parameters())
    for unchanged, params, table, algos in run_ranks(2, _dropped_and_plan, overlap):
        assert unchanged  # the dropped gradients were never applied
        assert torch.allclose(params, want, **TOL)
        assert "bucket" in table and "algorithm" in table and "fc1" in table
        assert "launched in backward pass 1" in table
        assert algos == {"halving_doubling"}


def _forward_mode_defers(rank, world):
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, overlap="forward", timeout=60
    )
    x, y = batch(0)
    before = flat(model.parameters())
    nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
    opt.step()
    opt.zero_grad()  # allowed: the reduced gradients wait in the library's buffers
    deferred = all(is_pending(p) for p in model.parameters())
    with torch.no_grad():
        model(shard(x, rank, world))  # the forward's reads apply the updates
    applied = not any(is_pending(p) for p in model.parameters())
    changed_after_forward = not torch.equal(flat(model.parameters()), before)
    grads_none = all(p.grad is None for p in model.parameters())
    opt.close()
    return deferred, applied and changed_after_forward, grads_none


def test_forward_mode_applies_updates_in_the_next_forward():
    for deferred, applied, grads_none in run_ranks(2, _forward_mode_defers):
        assert deferred and applied and grads_none


def _closure_defers(rank, world, clip):
    """A framework's step (Lightning's): ``opt.step(closure)`` whose closure runs
    the forward and backward (and, to clip, ``synchronize()`` then the clip)."""
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, overlap="forward", timeout=60
    )
    deferred = []
    for s in range(4):
        x, y = batch(s)

        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world))
            loss.backward()
            if clip:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            return loss

        loss = opt.step(closure)
        assert loss is not None and loss.ndim == 0
        deferred.append(all(is_pending(p) for p in model.parameters()))
    opt.synchronize()
    out = flat(model.parameters())
    opt.close()
    return deferred, out


def _closure_reference(clip):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(4):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    return flat(model.parameters())


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clip_in_closure"])
def test_step_with_a_closure_defers_in_forward_mode(clip):
    """SGD evaluates a closure once, first thing: step(closure) is then a step
    like any other, and forward mode defers its update to the next forward
    (not after a synchronize() inside the closure: the clip needs the reduced
    gradients, so that step is applied at once). One process's numbers."""
    ref = _closure_reference(clip)
    for deferred, got in run_ranks(2, _closure_defers, clip):
        # Step 0 (later steps follow the measured plan, which may apply at once;
        # their closures' forwards apply the previous step's updates anyway).
        assert deferred[0] == (not clip)
        assert torch.allclose(got, ref, **TOL), (got - ref).abs().max()


def _comm_threads(rank, world, overlap, fusion_bytes, here="1"):
    """Which thread ran each bucket's reduction, per step (the trace's spans): the host
    path's channel, also in the simulated-GPU run of this file."""
    os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "0"  # (this rank's process only)
    os.environ["HYBRIDCOMM_HOST_HERE"] = here
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        overlap=overlap,
        trace=True,
        timeout=60,
        cost_model="default",
        measure_iters=0,
        fusion_bytes=fusion_bytes,
    )
    x, y = batch(0)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    opt.synchronize()
    spans = sorted(
        (e for e in opt.timeline.events if e["cat"] == "comm/channel"), key=lambda e: e["ts"]
    )
    n = len(opt.plan.buckets)
    opt.close()
    return n, [[e["tid"] for e in spans[i : i + n]] for i in range(0, len(spans), n)]


@pytest.mark.parametrize(
    "overlap,fusion_bytes", [("backward", 1 << 30), ("backward", 1), ("none", 1)]
)
def test_a_reduction_the_step_waits_for_at_once_runs_in_the_trainers_thread(overlap, fusion_bytes):
    """On the host path an operation the trainer waits for next, with nothing to
    overlap it with, runs in the trainer's thread: the last of a backward-mode
    round, every one of none mode's (all in step()). The first ones of a round
    (and forward mode's, which run on into the next forward) go to the
    channel's thread, and run there unless the trainer comes to wait for one
    the thread has not started (then the trainer runs it, which only timing
    decides: tests/test_engine.py makes it certain). With
    ``HYBRIDCOMM_HOST_HERE=0`` the channel's thread runs them all."""
    n, steps = run_ranks(2, _comm_threads, overlap, fusion_bytes)[0]
    assert len(steps) == 3 and all(len(s) == n for s in steps)
    assert (n == 1) == (fusion_bytes > 1)
    for threads in steps:
        assert threads[-1] == "MainThread", threads
        if overlap == "none" or n == 1:
            assert set(threads) == {"MainThread"}, threads


def test_with_host_here_off_the_channels_thread_runs_every_reduction():
    for overlap, fusion_bytes in (("backward", 1), ("none", 1 << 30)):
        n, steps = run_ranks(2, _comm_threads, overlap, fusion_bytes, "0")[0]
        assert all(set(threads) == {"hybridcomm-channel"} for threads in steps), steps


def _traced(rank, world, path):
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        overlap="forward",
        trace=True,
        timeout=60,
    )
    x, y = batch(0)
    per_step = []
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
        per_step.append(dict(opt.last_step_stats))
    opt.synchronize()
    if rank == 0:
        opt.export_trace(path)
    opt.close()
    return per_step


def test_trace_and_step_stats(tmp_path):
    import json

    path = str(tmp_path / "trace.json")
    per_step = run_ranks(2, _traced, path)[0]
    # In forward mode a step's communication may still be running when step()
    # returns (it is counted at the step it finishes in), so only the sum over
    # steps is sure to be positive: step 1's buckets finish before step 2 ends.
    assert sum(s["comm_busy_s"] for s in per_step) > 0
    for stats in per_step:
        assert stats["exposed_comm_s"] >= 0
        assert (
            abs(stats["hidden_comm_s"] - max(0, stats["comm_busy_s"] - stats["exposed_comm_s"]))
            < 1e-12
        )
    events = json.load(open(path))["traceEvents"]
    cats = {e["cat"] for e in events}
    assert "compute" in cats and any(c.startswith("comm/") for c in cats)
    assert all(e["dur"] >= 0 for e in events)


def _two_backwards(rank, world, overlap):
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, overlap=overlap, timeout=60
    )
    x, y = batch(0)
    loss = nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world))
    loss.backward(retain_graph=True)
    loss.backward()  # after the buckets were launched: reduced again, never left local
    opt.step()
    opt.synchronize()
    opt.close()
    return flat(model.parameters())


@pytest.mark.parametrize("overlap", ["forward", "backward", "none"])
def test_backward_twice_before_step_is_reduced_like_one_process(overlap):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    opt.step()
    want = flat(model.parameters())
    results = run_ranks(2, _two_backwards, overlap)
    for got in results:
        assert torch.allclose(got, want, **TOL), f"max diff {(got - want).abs().max():.3g}"
        assert torch.equal(got, results[0])


def _compressed(rank, world, overlap):
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model=model,
        overlap=overlap,
        compression="fp16",
        timeout=60,
    )
    grads = []
    for s in range(3):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        if overlap == "backward":
            opt.synchronize()
            grads.append(flat(p.grad for p in model.parameters()))
        opt.step()
    opt.synchronize()
    wire_bytes = {b.nbytes / b.numel for b in opt.plan.buckets}  # bytes per element sent
    opt.close()
    return flat(model.parameters()), grads, wire_bytes


@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_fp16_compression(overlap):
    world = 2
    results = run_ranks(world, _compressed, overlap)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_grads = []
    for s in range(3):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        ref_grads.append(flat(p.grad for p in model.parameters()))
        opt.step()
    want = flat(model.parameters())
    got, grads, wire = results[0]
    assert wire == {2.0}  # fp16 on the wire
    assert torch.equal(got, results[1][0])  # identical on every rank
    eps16 = torch.finfo(torch.float16).eps
    if overlap == "backward":
        # each gradient went over the wire in fp16: a few fp16 roundings, relative
        for g, ref in zip(grads, ref_grads):
            assert torch.allclose(g, ref, rtol=4 * eps16, atol=4 * eps16 * ref.abs().max())
    # three updates of lr * grad, each off by at most the bound above
    bound = 3 * 0.05 * 4 * eps16 * max(r.abs().max() for r in ref_grads)
    assert (got - want).abs().max() <= bound + 64 * torch.finfo(torch.float32).eps


def _broadcasts(rank, world):
    model = make_model(seed=rank)  # different on every rank
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if rank == 0:  # only rank 0 has optimizer state
        x, y = batch(0)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    hybridcomm.broadcast_parameters(model.state_dict(), root_rank=0)
    hybridcomm.broadcast_optimizer_state(opt, root_rank=0)
    momentum = flat(opt.state[p]["momentum_buffer"] for p in model.parameters())
    return flat(model.parameters()), momentum


def test_broadcast_parameters_and_optimizer_state():
    results = run_ranks(3, _broadcasts)
    for params, momentum in results[1:]:
        assert torch.equal(params, results[0][0])
        assert torch.equal(momentum, results[0][1])


def _drift(rank, world, change):
    from hybridcomm.plan.cost_model import CostModel

    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model=model,
        overlap="forward",
        cost_model=CostModel(1e-3, 1e-9, 1e-10),
        measure_iters=2,
        replan_every=5,
        timeout=60,
    )
    plans = []
    for s in range(9):
        if s == 4 and change:  # the network got faster for the group's own all_reduce
            opt._hc_sync.planning.cost_model = CostModel(
                1e-3, 1e-9, 1e-10, native_alpha=1e-7, native_beta=1e-13
            )
        x, y = batch(s % 4)
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
        plans.append(opt.plan)
    opt.synchronize()
    opt.close()
    algos = [sorted({b.algorithm for b in p.buckets}) for p in plans]
    rebuilt = [plans[i] is not plans[i - 1] for i in range(1, len(plans))]
    return algos, rebuilt, flat(model.parameters())


@pytest.mark.parametrize("change", [False, True])
def test_replans_only_when_measurements_change_a_decision(change):
    results = run_ranks(2, _drift, change)
    algos, rebuilt, params = results[0]
    # step index i has run i + 1 steps: first re-plan after step 2 (i=1), check after step 7 (i=6)
    assert rebuilt == [True] + [False] * 4 + [change] + [False] * 2
    assert ("native" in algos[-1]) == change and "native" not in algos[0]
    assert torch.equal(params, results[1][2])
    # the same numbers as one process, across the re-plans
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(9):
        x, y = batch(s % 4)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert torch.allclose(params, flat(model.parameters()), **TOL)


def _logged(rank, world):
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelno, record.getMessage()))

    logger = logging.getLogger("hybridcomm")
    logger.setLevel(logging.INFO)  # the default (a forked rank inherits the parent's)
    logger.addHandler(Keep())
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, timeout=60
    )
    opt.close()
    return [(lvl, msg.splitlines()[0]) for lvl, msg in records if msg.startswith("initial plan")]


def test_the_plan_is_logged_at_info_once_on_rank_0():
    import logging

    logs = run_ranks(2, _logged)
    assert logs[0] == [(logging.INFO, "initial plan:")]
    assert logs[1] == []  # the same plan: DEBUG on the other ranks, below the default level


def _lazy(rank, world):
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model=model,
        lazy_bytes=4096,
        timeout=60,
    )
    for s in range(3):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    opt.synchronize()
    notes = " ".join(opt.plan.notes)
    opt.close()
    return flat(model.parameters()), notes


def test_lazy_all_reduce_gives_one_process_numbers():
    results = run_ranks(2, _lazy)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(3):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert torch.allclose(results[0][0], flat(model.parameters()), **TOL)
    assert torch.equal(results[0][0], results[1][0]) and "lazy:" in results[0][1]


def _nothing_left_at_step(rank, world):
    import time

    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model=model,
        overlap="forward",
        measure_iters=2,
        timeout=60,
    )
    applied_in_step = []
    for s in range(5):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        time.sleep(0.3)  # every bucket reduced long before step(): nothing to overlap
        opt.step()
        applied_in_step.append(not any(is_pending(p) for p in model.parameters()))
    opt.synchronize()
    text = str(opt.plan)
    opt.close()
    return applied_in_step, text, flat(model.parameters())


def test_forward_mode_applies_in_step_where_forward_overlap_cannot_pay():
    results = run_ranks(2, _nothing_left_at_step)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for s in range(5):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for applied, text, params in results:
        # the first step defers; the re-plan at the end of the second applies that
        # step's pending updates inside step(); from then on step() applies at once
        assert applied == [False, True, True, True, True]
        assert "updates in step()" in text and "forward overlap cannot pay" in text
        assert torch.allclose(params, flat(model.parameters()), **TOL)
        assert torch.equal(params, results[0][2])


def _grads_set_by_hand(rank, world, overlap):
    model = nn.Linear(4, 3)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), model=model, overlap=overlap, timeout=60
    )
    for s in range(2):  # e.g. gradients from torch.autograd.grad, assigned: no backward pass
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.full_like(p, float(rank + 1 + s))
        opt.step()
    opt.synchronize()
    opt.close()
    return flat(model.parameters())


@pytest.mark.parametrize("overlap", ["forward", "backward", "none"])
def test_gradients_set_by_hand_are_reduced_too(overlap):
    world = 3
    # per step the average over ranks of (rank + 1 + s): 2 then 3; SGD lr 1 from 0
    for got in run_ranks(world, _grads_set_by_hand, overlap):
        assert torch.equal(got, torch.full_like(got, -5.0))


def _seeded_apart(rank, world, agree):
    """A user coming from DDP: a different seed per rank and no broadcast of their own."""
    torch.manual_seed(100 + rank)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with torch.no_grad():
        model[1].running_mean.add_(rank + 1)  # a buffer that differs too
    try:
        opt = hybridcomm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            broadcast_parameters=agree,
            timeout=60,
        )
    except hybridcomm.HybridCommError as e:
        return str(e)
    state = flat(model.state_dict().values())
    opt.close()
    return state


def test_construction_gives_every_rank_rank_0s_parameters_and_buffers():
    got = run_ranks(2, _seeded_apart, True)
    torch.manual_seed(100)  # rank 0's
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with torch.no_grad():
        model[1].running_mean.add_(1)
    want = flat(model.state_dict().values())
    assert all(torch.equal(g, want) for g in got)


def test_without_the_broadcast_differing_parameters_are_refused_on_every_rank():
    for msg in run_ranks(2, _seeded_apart, False):
        assert isinstance(msg, str) and "'0.weight' on rank 1 is not rank 0's" in msg


def _bogus_strategy(rank, world):
    model = make_model()
    try:
        hybridcomm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model=model, strategy="bogus", timeout=60
        )
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_bad_strategy_is_refused_alike_on_every_rank():
    for msg in run_ranks(2, _bogus_strategy):
        assert msg.startswith("unknown strategy 'bogus'")


def _last_layer_pending_when_the_first_runs(rank, world):
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        overlap="forward",
        fusion_bytes=0,
        timeout=60,
    )
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    seen = []
    layers[0].register_forward_pre_hook(lambda m, a: seen.append(is_pending(layers[-1].weight)))
    for s in range(2):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    x, _ = batch(2)
    model(shard(x, rank, world))
    opt.close()
    return seen


def test_an_eager_forward_applies_each_update_at_its_first_use_not_at_the_start(monkeypatch):
    """The overlap with the next forward: when the first layer runs, the last
    layer's update is still pending (an eager script, torch._dynamo imported by
    torch.optim as usual)."""
    monkeypatch.setenv("HYBRIDCOMM_DEFER", "always")
    for seen in run_ranks(2, _last_layer_pending_when_the_first_runs):
        assert seen == [False, True, True]


def _replaced_buckets(rank, world, host=False):
    import gc
    import weakref

    if host:  # (in a rank's own process: the suite's setting stays)
        os.environ.pop("HYBRIDCOMM_SIMULATE_GPU", None)
    gc.disable()  # only reference counting may free them: no cycle may hold them
    try:
        model = make_model()
        opt = hybridcomm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), model=model, measure_iters=2, timeout=60
        )
        first = weakref.ref(opt._hc_sync.group.states[0].bucket.buffer)
        for s in range(4):
            x, y = batch(s)
            opt.zero_grad()
            nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        freed = first() is None
        opt.close()
        return freed
    finally:
        gc.enable()


@pytest.mark.parametrize("host", [False, True], ids=["suite", "host"])
def test_a_replan_frees_the_old_buckets_memory_at_once(host):
    """A re-plan's new buckets replace the old: the old memory must go when they do,
    not at some later cycle collection (a peak-memory premium over DDP otherwise).
    ``host``: on the host path also in the simulated GPU's suite (the operations the
    engine keeps per bucket are the host path's)."""
    assert run_ranks(2, _replaced_buckets, host) == [True, True]


def _users_hooks(rank, world, overlap, late=False):
    """A hook that doubles one parameter's gradient, one that counts another's calls,
    registered: the first at the start, the second before step 2's forward (ours
    are off then, or on while an update waits); or, ``late``, both between step 2's
    backward and its step() (ours are on: they go into the dicts the library handed
    torch; on the host path, also under the simulated GPU's suite: there the library's
    are never off)."""
    if late and world:  # (in a rank's own process: the suite's setting stays)
        os.environ.pop("HYBRIDCOMM_SIMULATE_GPU", None)
    model = make_model()
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if world:
        opt = hybridcomm.DistributedOptimizer(opt, model=model, overlap=overlap, timeout=60)
    counted = []

    def register():
        params[-1].register_hook(lambda g: counted.append(s))
        if late:
            params[0].register_hook(lambda g: g * 2)

    if not late:
        params[0].register_hook(lambda g: g * 2)
    for s in range(5):
        if s == 2 and not late:
            register()
        x, y = batch(s)
        opt.zero_grad()
        xs, ys = (shard(x, rank, world), shard(y, rank, world)) if world else (x, y)
        nn.functional.mse_loss(model(xs), ys).backward()
        if s == 2 and late:
            register()
        opt.step()
    if world:
        opt.close()
    x, y = batch(9)
    nn.functional.mse_loss(model(x), y).backward()  # after close(): the user's hooks only
    return flat(model.parameters()), len(counted), params[0].grad.clone()


@pytest.mark.parametrize("late", [False, True], ids=["before", "late"])
@pytest.mark.parametrize("overlap", ["forward", "backward", "none"])
def test_a_users_own_gradient_hooks_keep_running(overlap, late):
    """The library turns its pre-hooks on and off by the bucket's phase
    (grad_hooks.py); a user's hooks on the same parameters, registered before or
    during training (also while ours are on), run once per backward throughout and
    after close()."""
    want, want_calls, want_grad = _users_hooks(0, 0, overlap, late)
    for got, calls, grad in run_ranks(2, _users_hooks, overlap, late):
        assert torch.allclose(got, want, **TOL), f"max diff {(got - want).abs().max():.3g}"
        # steps 2 (unless late), 3, 4 and the backward after close()
        assert calls == want_calls == (3 if late else 4)
        assert torch.allclose(grad, want_grad, **TOL)
