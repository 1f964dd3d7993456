"""What a steady training step asks of the CUDA runtime and of Python, counted
exactly on the simulated GPU, per bucket and per parameter (issue 38's guard).

On a fast GPU a step of a small model is bound by host time, and whatever the
library does per parameter and step is paid on every step. So the GPU path's
cost is pinned here as counts, not times: per bucket, the events it records,
the stream waits, the allocations (none), the schedule's kernels and NCCL
calls and the post-accumulate hook (only each bucket's closer keeps it in a
steady step); per parameter, autograd's call of the pre-hook and nothing
else (no event, no kernel, no slow path: a cleared ``.grad`` is taken in per
bucket, in one multi-tensor copy). Event queries depend on how far the (simulated)
GPU has got, so they have a bound per bucket; the watchdog's, which follow
the clock, are apart. A per-parameter event or launch creeping back in fails
here with the count it added. (The simulator keeps the pre-hooks on to check
each in-place add; off it, on the host path and a real GPU, they are on only
while a bucket is launched, in flight or pending: a steady step calls none,
and a late pass still does.)
"""

import os

import pytest
import torch
import torch.nn as nn

from multiproc import run_ranks
from optim_models import batch, flat, make_model, shard
from plan_counts import schedule_counts, sharded_counts

STEADY = 3  # steps counted, after the measured steps and the re-plan


def _counted_step(
    rank, world, overlap, simulate=True, lean=True, sharded=None, algorithm=None, compression=None
):
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    if not lean:
        os.environ["HYBRIDCOMM_LEAN_HOOKS"] = "0"
    import hybridcomm
    from hybridcomm.plan.cost_model import CostModel
    from hybridcomm.sync.bucket_group import BucketGroup
    from hybridcomm.sync.grad_hooks import GradientHooks
    from hybridcomm.testing import simgpu

    calls = {}

    def counting(cls, name):
        method = getattr(cls, name)

        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return method(*args, **kwargs)

        setattr(cls, name, counted)

    for name in ("before_grad", "after_grad"):
        counting(GradientHooks, name)
    make_pre_hook = GradientHooks._before

    def counted_pre_hook(self, p):  # the hook autograd calls before it accumulates
        hook = make_pre_hook(self, p)

        def pre_hook(*grad):  # (a guard of C++ passes no gradient)
            calls["pre_hook"] = calls.get("pre_hook", 0) + 1
            return hook(*grad)

        return pre_hook

    GradientHooks._before = counted_pre_hook
    for name in ("open", "absorb", "launch", "wait"):
        counting(BucketGroup, name)
    model = make_model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model=model,
        overlap=overlap,
        fusion_bytes=0,
        cost_model=CostModel(2e-5, 1e-9, 1e-10),
        measure_iters=2,
        timeout=60,
        shard=sharded,
        compression=compression,
        **({"strategy": algorithm} if algorithm else {}),
    )
    calls_before = {}
    for s in range(5 + STEADY):
        if s == 5:  # past the measured steps and the re-plan: the steady state
            opt.synchronize()
            if simulate:
                simgpu.reset_stats()
            calls_before = dict(calls)
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    opt.synchronize()  # forward mode: the last step's updates applied
    stats = simgpu.stats() if simulate else {}
    hooks = {k: v - calls_before.get(k, 0) for k, v in calls.items()}
    plan = opt.plan
    kernels, nccl = (sharded_counts if sharded else schedule_counts)(plan, rank, world)
    params = sum(len(b.params) for b in plan.buckets)
    opt.close()
    return (
        stats,
        hooks,
        len(plan.buckets),
        params,
        kernels,
        nccl,
        sorted({b.algorithm for b in plan.buckets}),
    )


@pytest.mark.parametrize("overlap", ["forward", "backward", "none"])
def test_a_steady_step_costs_a_fixed_count_per_bucket_and_none_per_parameter(overlap):
    for stats, hooks, buckets, params, kernels, nccl, algos in run_ranks(
        2, _counted_step, overlap, timeout=180
    ):
        assert buckets > 1 and set(algos) <= {"butterfly", "ring"}, algos
        per_step = {k: v / STEADY for k, v in stats.items()}
        # the schedules' own work, nothing per parameter
        assert stats["kernel_launches"] == STEADY * kernels, (stats, kernels)
        assert stats["nccl_ops"] == STEADY * nccl, (stats, nccl)
        assert stats["host_syncs"] == 0 and stats["defects"] == 0, stats
        assert stats["allocations"] == 0, stats  # scratch and buckets are reused
        # per bucket: a ready event on the trainer's stream, a start and a done event
        # on the comm stream (timed: the channel's busy time), and where the trainer's
        # stream waits (timed: the exposed time); the comm stream waits for the first,
        # the trainer's stream for the done one
        assert per_step["event_records"] == 4 * buckets, (per_step, buckets)
        assert per_step["events"] == 4 * buckets, (per_step, buckets)
        assert per_step["stream_waits"] == 2 * buckets, (per_step, buckets)
        # queries read events already recorded, a few per bucket whatever the progress
        assert per_step["event_queries"] <= 4 * buckets, (per_step, buckets)
        # (overlap="none": also where backward completes a bucket, freeing autograd's
        # tensors then, not at step())
        _assert_python_per_bucket(hooks, buckets, params, 2 if overlap == "none" else 1)


def test_a_steady_step_with_a_wire_copy_records_the_same_events():
    """``compression="fp16"``: the reduced wire copy goes back into the buffer on the
    comm stream behind the reduction, under the reduction's own done event (no second
    one); the same events, waits and hooks per bucket as without it."""
    for stats, hooks, buckets, params, *_ in run_ranks(
        2, _counted_step, "backward", True, True, None, None, "fp16", timeout=180
    ):
        per_step = {k: v / STEADY for k, v in stats.items()}
        assert stats["host_syncs"] == 0 and stats["defects"] == 0, stats
        assert per_step["event_records"] == 4 * buckets, (per_step, buckets)
        assert per_step["stream_waits"] == 2 * buckets, (per_step, buckets)
        _assert_python_per_bucket(hooks, buckets, params)


def _assert_python_per_bucket(hooks, buckets, params, taken_in=1):
    """Autograd calls each parameter's pre-hook once (a cleared .grad never enters
    its body) and each bucket's closer's post-accumulate hook (the other
    parameters' are off in a steady step); opening, taking in (``taken_in``
    times), launching, waiting: per bucket."""
    assert hooks["pre_hook"] == STEADY * params, (hooks, params)
    assert hooks["after_grad"] == STEADY * buckets < STEADY * params, (hooks, params)
    assert hooks.get("before_grad", 0) == 0, hooks
    for name in ("open", "launch", "wait"):
        assert hooks[name] == STEADY * buckets, (name, hooks, buckets)
    assert hooks["absorb"] == STEADY * taken_in * buckets, (hooks, buckets)


SHARDED_CASES = [("forward", "optimizer", None), ("backward", "gradients", "native")]


@pytest.mark.parametrize(
    "overlap,shard,algorithm",
    SHARDED_CASES,
    ids=[f"{o}-{s}-{a or 'chosen'}" for o, s, a in SHARDED_CASES],
)
def test_a_steady_sharded_step_costs_a_fixed_count_per_bucket(overlap, shard, algorithm):
    """The same under ``shard``: each bucket reduce-scattered in backward and
    all-gathered at ``step()`` (forward mode: before its first read), with the
    ring's phases or the process group's own (``native``): per bucket and phase
    the events, the waits and the schedule's kernels and NCCL calls, and the
    buffer made again where ``"gradients"`` freed it; nothing per parameter but
    autograd's call of the pre-hook."""
    for stats, hooks, buckets, params, kernels, nccl, algos in run_ranks(
        2, _counted_step, overlap, True, True, shard, algorithm, timeout=180
    ):
        assert buckets > 1 and algos == [algorithm or "ring"], algos
        per_step = {k: v / STEADY for k, v in stats.items()}
        assert stats["kernel_launches"] == STEADY * kernels, (stats, kernels)  # (native: 0)
        assert stats["nccl_ops"] == STEADY * nccl, (stats, nccl)
        assert stats["host_syncs"] == 0 and stats["defects"] == 0, stats
        # "gradients" (released in backward): per bucket its part, made at the launch;
        # the buffer made again for the gather, and again at the next backward's first
        # gradient (freed after the gather)
        released = shard == "gradients"
        assert stats["allocations"] == STEADY * buckets * 3 * released, stats
        # per bucket and phase: a ready event, the comm stream's start and done (behind
        # the part's copy under "gradients"), and where the trainer's stream waits;
        # each stream waits once
        assert per_step["event_records"] == 8 * buckets, (per_step, buckets)
        assert per_step["stream_waits"] == 4 * buckets, (per_step, buckets)
        assert per_step["event_queries"] <= 8 * buckets, (per_step, buckets)
        _assert_python_per_bucket(hooks, buckets, params)


@pytest.mark.parametrize(
    "overlap,shard",
    [
        ("forward", None),
        ("backward", None),
        ("none", None),
        ("forward", "optimizer"),
        ("backward", "gradients"),
    ],
)
def test_a_steady_host_step_calls_no_pre_hook(overlap, shard):
    """Off the simulator the pre-hooks are armed only while a bucket is launched,
    in flight or pending, or reduce-scattered under ``shard`` (grad_hooks.py), so
    a steady step's backward, which adds only into accumulating buckets, calls
    none: autograd's call into Python is ~1 us per parameter. The post-accumulate
    hook is called once per bucket, on its closer. (A late pass, which must wait
    for the reduction in flight, is below.)"""
    for _, hooks, buckets, params, *_ in run_ranks(
        2, _counted_step, overlap, False, True, shard, timeout=180
    ):
        assert buckets > 1
        assert hooks.get("pre_hook", 0) == 0, (hooks, params)
        assert hooks["after_grad"] == STEADY * buckets < STEADY * params, (hooks, params)
        assert hooks["launch"] == STEADY * buckets, (hooks, buckets)


def test_lean_hooks_off_keeps_every_parameters_post_accumulate_hook():
    """HYBRIDCOMM_LEAN_HOOKS=0: the post-accumulate hook is called once per
    parameter in every step, steady or not (the choice is the user's)."""
    for _, hooks, buckets, params, *_ in run_ranks(
        2, _counted_step, "backward", False, False, timeout=180
    ):
        assert hooks["after_grad"] == STEADY * params > STEADY * buckets, (hooks, params)
        assert hooks["launch"] == STEADY * buckets, (hooks, buckets)


def _late_pass(rank, world, overlap, sharded=None):
    import hybridcomm
    from hybridcomm.sync.grad_hooks import GradientHooks

    entered = []
    before_grad = GradientHooks.before_grad

    def counted(self, p):
        entered.append(self.sync.group.where[id(p)][0].phase.value)
        return before_grad(self, p)

    GradientHooks.before_grad = counted
    model = make_model()
    # measure_iters=0: the launching pass stays the first, so the second is late
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model=model,
        overlap=overlap,
        fusion_bytes=0,
        measure_iters=0,
        timeout=60,
        shard=sharded,
    )
    late = []
    for s in range(3):
        x, y = batch(s)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world))
        loss.backward(retain_graph=True)
        del entered[:]
        loss.backward()  # late: every bucket was launched by the first pass
        late.append(list(entered))
        opt.step()
    opt.synchronize()  # forward mode: the last step's update applied
    buckets, params = len(opt.plan.buckets), sum(len(b.params) for b in opt.plan.buckets)
    opt.close()
    return late, buckets, params, flat(model.parameters())


def _late_pass_in_one_process():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for s in range(3):
        x, y = batch(s)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
    return flat(model.parameters())


@pytest.mark.parametrize(
    "overlap,shard", [("forward", None), ("backward", None), ("backward", "optimizer")]
)
def test_a_late_pass_enters_the_pre_hook_of_every_launched_parameter(overlap, shard):
    """The pre-hooks are off in a steady step, but a pass after the launching one
    adds into buckets launched or in flight: the pre-hook of each bucket's first
    parameter to arrive must run (it waits for the reduction before autograd adds
    in place; the bucket, accumulating again, turns its hooks off). The steps
    give one process's numbers (each gradient counted twice)."""
    want = _late_pass_in_one_process()
    for late, buckets, params, got in run_ranks(2, _late_pass, overlap, shard, timeout=180):
        assert buckets > 1
        for entered in late:
            assert buckets <= len(entered) <= params, (entered, buckets)
            assert set(entered) <= {"launched", "in flight"}, entered
        eps = torch.finfo(torch.float32).eps
        assert torch.allclose(got, want, rtol=64 * eps, atol=64 * eps), (got - want).abs().max()
