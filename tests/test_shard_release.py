"""``shard="gradients"`` releases a bucket's memory in backward (ZeRO-2): once its
reduce-scatter is done, a bucket keeps only this rank's part, and ``.grad`` of its
parameters is a placeholder until the step (or ``synchronize()``) (sync/scatter.py).

A layer whose backward waits until no reduction is in flight sits between the
buckets, so that each bucket's reduce-scatter is done before the next bucket
launches: the release then happens in every step (asserted), and everything a
user does between backward and step meets a released bucket.
"""

import gc
import os
import time
import weakref

import pytest
import torch
import torch.nn as nn

import hybridcomm
from hybridcomm.base.errors import HybridCommError
from multiproc import run_ranks

EPS32 = torch.finfo(torch.float32).eps
TOL = 64 * EPS32  # summation order differs from one process: a few roundings per step
PAUSE = 0.05  # s in each slow layer's backward
_DONE_BEFORE_NEXT = []  # the optimizer whose reductions in flight each slow layer waits for


class _Pause(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        """Sleeps, then waits (up to 10 s) until no reduction is in flight: the bucket
        launched before it is done when the next one launches."""
        time.sleep(PAUSE)
        for opt in _DONE_BEFORE_NEXT:
            group, t0 = opt._hc_sync.group, time.perf_counter()
            while time.perf_counter() - t0 < 10 and not all(
                group.engine.done(s.index) for s in group.states if s.launched
            ):
                time.sleep(0.001)
        return g


class Slow(nn.Module):
    def forward(self, x):
        return _Pause.apply(x)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 40), Slow(), nn.Tanh(), nn.Linear(40, 30), Slow(), nn.Tanh(), nn.Linear(30, 3)
    )


# what each step does between backward and step(); one process does the same
KINDS = (
    "plain",
    "two passes",
    "synchronize, then torch's clip",
    "opt.clip_grad_norm_",
    "grad scaler",
    "zero_grad after backward",
    "plain",
)


def _batch(g, world, rank):
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _steps(model, opt, world, rank, seen=None):
    """The loop of KINDS; ``seen(opt)`` after each backward (the distributed run)."""
    g = torch.Generator().manual_seed(5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    loss_of = lambda x, y: nn.functional.mse_loss(model(x), y)  # noqa: E731
    norms = []
    for kind in KINDS:
        opt.zero_grad()
        x, y = _batch(g, world, rank)
        if kind == "grad scaler":
            scaler.scale(loss_of(x, y)).backward()
            seen and seen(opt)
            scaler.step(opt)
            scaler.update()
            continue
        if kind == "two passes":  # a second backward adds to what the first released
            loss_of(x, y).backward()
            seen and seen(opt)
            x, y = _batch(g, world, rank)
            loss_of(x, y).backward()  # (a late pass: reduced again at its end, not released)
        else:
            loss_of(x, y).backward()
            seen and seen(opt)
        if kind == "synchronize, then torch's clip":
            if world > 1:
                opt.synchronize()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        elif kind == "opt.clip_grad_norm_":
            norms.append(
                float(opt.clip_grad_norm_(0.05))
                if world > 1
                else float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            )
        elif kind == "zero_grad after backward":
            opt.zero_grad()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), norms


def _released(opt):
    """Per bucket: (its memory released, the numel it keeps, what this rank owns of it,
    every .grad a placeholder or None)."""
    shards = opt._hc_shards
    out = []
    for s in opt._hc_sync.group.states:
        b = s.bucket
        owned = sum(z - a for a, z in shards.owned[s.index]) if shards else None
        out.append(
            (
                b.released,
                None if b.part is None else b.part.numel(),
                owned,
                all(p.grad is None or type(p.grad).__name__ == "ReleasedGrad" for p in b.params)
                if b.released
                else None,
            )
        )
    return out


def _sharded(model, inner, overlap, timeout=60):
    """``shard="gradients"`` with three small buckets, whose reductions the slow
    layers wait for."""
    opt = hybridcomm.DistributedOptimizer(
        inner,
        model=model,
        overlap=overlap,
        shard="gradients",
        fusion_bytes=256,
        split_bytes=200,
        cost_model="default",
        measure_iters=0,
        timeout=timeout,
    )
    _DONE_BEFORE_NEXT.append(opt)
    return opt


def _buffers_reserved() -> list:
    """Weak references to the bucket buffers whose part is reserved at a launch
    (the GPU path's release in flight), as they are."""
    from hybridcomm.sync.buckets import GradBucket

    refs, reserve = [], GradBucket.reserve_part

    def spied(self, keep):
        refs.append(weakref.ref(self.buffer))
        return reserve(self, keep)

    GradBucket.reserve_part = spied
    return refs


def _freed(refs, within=10.0) -> int:
    """How many buffers ``refs`` holds (those of the pass just ended), -1 where
    some buffer is still alive after ``within`` seconds."""
    t0, n = time.perf_counter(), len(refs)
    while any(r() is not None for r in refs) and time.perf_counter() - t0 < within:
        gc.collect()
        time.sleep(0.01)
    alive = any(r() is not None for r in refs)
    refs.clear()
    return -1 if alive else n


def _ranks(rank, world, overlap, simulate):
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    model = _model()
    refs = _buffers_reserved()
    opt = _sharded(model, torch.optim.Adam(model.parameters(), lr=0.01), overlap)
    seen = []
    flat, norms = _steps(
        model,
        opt,
        world,
        rank,
        lambda o: seen.append((_released(o), _freed(refs) if simulate else None)),
    )
    buckets = len(opt._hc_sync.group.states)
    opt.close()
    return flat, norms, seen, buckets


@pytest.mark.timeout(180)  # training at 3 ranks
@pytest.mark.parametrize(
    "overlap,simulate",
    [("backward", False), ("forward", False), ("backward", True), ("forward", True)],
    ids=["backward-host", "forward-host", "backward-simgpu", "forward-simgpu"],
)
def test_buckets_keep_only_their_part_from_backward_and_train_as_one_process(overlap, simulate):
    results = run_ranks(2, _ranks, overlap, simulate, timeout=180)
    ref_model = _model()
    ref, ref_norms = _steps(ref_model, torch.optim.Adam(ref_model.parameters(), lr=0.01), 1, 0)
    for rank, (flat, norms, seen, buckets) in enumerate(results):
        assert torch.equal(flat, results[0][0]), rank
        assert torch.allclose(flat, ref, rtol=TOL, atol=TOL), (rank, (flat - ref).abs().max())
        assert norms == pytest.approx(ref_norms, rel=TOL)
        assert buckets == 3
        # after each step's (first) backward: every bucket but the last launched (done
        # by then or not) is released, keeping exactly its part, .grad a placeholder or
        # None; on a GPU every bucket, as its launch is issued (its part copied on the
        # comm stream behind the reduce-scatter)
        assert len(seen) == len(KINDS)
        for step, freed in seen:
            for released, kept, owned, placeholders in step if simulate else step[:-1]:
                assert released and kept == owned and placeholders, (rank, seen)
        if simulate:  # and the memory of each bucket's buffer is free by then
            assert all(freed >= 0 for _, freed in seen), (rank, seen)
            assert all(freed > 0 for _, freed in seen[1:]), (rank, seen)


def _one_rank_keeps_whole(rank, world):
    """Rank 1 keeps every bucket whole until the step (its own setting), rank 0
    releases in backward: which buckets a rank released is its own business."""
    if rank == 1:
        os.environ["HYBRIDCOMM_RELEASE_IN_BACKWARD"] = "0"
    model = _model()
    opt = _sharded(model, torch.optim.Adam(model.parameters(), lr=0.01), "forward", timeout=30)
    seen = []
    flat, _ = _steps(
        model,
        opt,
        world,
        rank,
        lambda o: seen.append(sum(released for released, *_ in _released(o))),
    )
    opt.close()
    return flat, seen


def test_ranks_that_released_different_buckets_gather_alike():
    """The step's gather is a collective, so whether a bucket has anything to gather
    may not depend on what this rank released: after zero_grad() a released bucket
    has nothing, as a whole one has (a rank that released when the other did not
    would otherwise gather alone, and the ranks' collectives mismatch)."""
    (flat0, seen0), (flat1, seen1) = run_ranks(2, _one_rank_keeps_whole, timeout=120)
    assert min(seen0) >= 2 and max(seen1) == 0, (seen0, seen1)
    assert torch.equal(flat0, flat1)
    ref_model = _model()
    ref, _ = _steps(ref_model, torch.optim.Adam(ref_model.parameters(), lr=0.01), 1, 0)
    assert torch.allclose(flat0, ref, rtol=TOL, atol=TOL), (flat0 - ref).abs().max()


def _misuse(rank, world):
    model = _model()
    opt = _sharded(model, torch.optim.SGD(model.parameters(), lr=0.1), "backward")
    g = torch.Generator().manual_seed(5)
    errors = []
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    for step in range(3):
        opt.zero_grad()
        x, y = _batch(g, world, rank)
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if step == 2:
            memory = [
                weakref.ref(s.bucket.part)
                for s in opt._hc_sync.group.states
                if s.bucket.part is not None
            ]
            for misuse in (
                lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05),
                lambda: scaler.unscale_(opt),
                lambda: model[6].weight.grad.sum(),
            ):  # (its bucket released)
                with pytest.raises(HybridCommError, match="opt.synchronize"):
                    misuse()
                errors.append(True)
            text = repr(model[6].weight.grad)
            opt.synchronize()  # whole again: torch's own function works
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            whole = all(type(p.grad) is torch.Tensor for p in model.parameters())
        scaler.step(opt)
        scaler.update()
    gc.collect()
    out = (errors, text, whole, memory and all(m() is None for m in memory))
    opt.close()
    return out


def test_a_released_gradient_refuses_use_until_synchronize():
    for errors, text, whole, freed in run_ranks(2, _misuse, timeout=120):
        assert errors == [True] * 3
        assert "released" in text and "synchronize" in text
        assert whole and freed
