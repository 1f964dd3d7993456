"""The multi-rank GPU path (issue 20's missing cases): one process per GPU over
NCCL where there are enough GPUs, else every rank on GPU 0 over the one-device
transport (issue 29; ``gpu_common.placement``), so one GPU runs them all but the
``TorchNcclTransport`` cases (``gpus(2)``: torch's NCCL refuses two ranks on a GPU):
``TorchNcclTransport``, unused parameters, fp16/bf16/top-k compression, forced
``native``, ``split_bytes`` segments, Adam, AMP with clipping, 8 ranks, and a
dead peer. Each compares with one process on the whole batch (the simulated-GPU
tests' models, data and references, imported from tests/), exactly or within a
tolerance derived next to it. Launched as tests/gpu/test_optimizer_cuda.py
launches (``hybridcomm.tools.launch``, spawn, NCCL, a deadline on every launch); the
world is 4 (12 samples split evenly; with 2-3 GPUs, one per GPU), 8 ranks for the 8-rank
case.

Written on a machine without a GPU. At 33fac8d every case but the ``gpus(2)`` ones passed
on one H200, all ranks on the one GPU (docs/GPU.md); later cases have not run on a GPU.
Run: TRITON_INTERPRET=0 pytest tests/gpu/test_multi_gpu.py   (or make gpu-check)
"""

import contextlib
import math
import os
import sys
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

# tests/ (the shared models and references) for this module and the spawned ranks
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import hybridcomm  # noqa: E402
from gpu_common import (
    ieee_fp32,
    ieee_fp32_here,
    no_host_sync,
    placement,  # noqa: E402
    record,
    skip_if_interpreting,
)
from hybridcomm.tools.launch import launch  # noqa: E402
from optim_models import (
    batch,
    flat,
    make_model,
    make_optimizer,
    make_scheduler,  # noqa: E402
    shard,
    train_single,
)
from test_allreduce_cupy_gpu import ALGOS, DTYPES, _inputs  # noqa: E402
from test_optimizer_features import (
    Branchy,
    branchy_data,
    branchy_loss,  # noqa: E402
    branchy_reference,
)
from test_training_loops import IN, INF_STEP, MAX_NORM, OUT, _mlp, _whole  # noqa: E402


STEPS = 4  # as tests/test_optimizer_equivalence.py (train_single's references)
TIMEOUT = 60  # the library's timeout in the ranks
LAUNCH_S = 600  # every launch's own deadline: a hang fails the test, never blocks it
EPS32 = torch.finfo(torch.float32).eps
# Summation order differs from one process (per-rank means, then the all-reduce):
# a few fp32 roundings per step, scaled by the values' size (the CPU suites' bound).
RTOL = ATOL = 64 * EPS32


def fixed_cost_model(native=False):
    """No probe, the same plan on every run (tests/gpu/test_single_gpu.py's); with
    ``native``, one that also predicts NCCL's own all-reduce (for forced native)."""
    from hybridcomm.plan.cost_model import CostModel

    if native:
        return CostModel(2e-5, 1e-9, 1e-10, native_alpha=2e-5, native_beta=1e-9)
    return CostModel(2e-5, 1e-9, 1e-10)


@pytest.fixture(autouse=True)
def _compiled_kernels():
    skip_if_interpreting()  # the ranks inherit TRITON_INTERPRET


def _world():
    """4 ranks: one per GPU with 4+ GPUs, else on one GPU; 2-3 GPUs: one per GPU."""
    n = torch.cuda.device_count()
    return min(n, 4) if n >= 2 else 4


def _setup(transport="cupy"):
    """In a rank: the transport pinned (never a silent fallback), IEEE fp32. Ranks
    that share one GPU keep the one-device transport ``launch`` gave them."""
    if os.environ.get("HYBRIDCOMM_TRANSPORT") != "one-device":
        os.environ["HYBRIDCOMM_TRANSPORT"] = transport
    ieee_fp32()
    return torch.device("cuda", torch.cuda.current_device())


def _run(name, fn, world, *args, allow_errors=False, timeout=LAUNCH_S, torch_nccl=False):
    """``launch`` of ``world`` ranks (``gpu_common.placement``: one per GPU, or all on
    one), its wall time recorded for make gpu-check. ``torch_nccl``: one per GPU over
    torch's NCCL group (the TorchNcclTransport cases)."""
    how, transport = ({"backend": "nccl"}, "torch") if torch_nccl else placement(world)
    t0 = time.monotonic()
    out = launch(
        fn, world, *args, start_method="spawn", timeout=timeout, allow_errors=allow_errors, **how
    )
    record(
        "multi_gpu",
        test=name,
        world=world,
        transport=transport,
        launch_s=round(time.monotonic() - t0, 2),
        device=torch.cuda.get_device_name(0),
    )
    return out


def _close(got, want, what, rtol=RTOL, atol=ATOL):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.allclose(got, want, rtol=rtol, atol=atol), (
        f"{what}: max diff from one process {(got - want).abs().max():.3g}"
    )


def _same_on_every_rank(values, what):
    for rank, v in enumerate(values[1:], 1):
        assert torch.equal(v, values[0]), f"{what}: rank {rank} differs from rank 0"


# --- the common training loop ------------------------------------------------------------


def batch24(step):
    """24 samples (8 ranks x 3): two of optim_models' batches."""
    (x1, y1), (x2, y2) = batch(2 * step), batch(2 * step + 1)
    return torch.cat([x1, x2]), torch.cat([y1, y2])


def _case(name, opt="sgd", env=None, keep_splits=False, **options):
    return {
        "name": name,
        "opt": opt,
        "env": env or {},
        "keep_splits": keep_splits,
        "options": options,
    }


def _train(rank, world, cases, data=batch, transport="cupy"):
    """Each case: make_model() trained STEPS steps on this rank's shard of ``data``
    (tests/test_optimizer_equivalence.py's loop, on the GPU); name -> (parameters,
    the plan's algorithms, segments per bucket, the transport's class name)."""
    from hybridcomm.plan import planner

    dev = _setup(transport)
    merge = planner.merge_adjacent
    out = {}
    for case in cases:
        saved = {k: os.environ.get(k) for k in case["env"]}
        os.environ.update(case["env"])
        if case["keep_splits"]:
            # The planner merges segments the issue order sends back to back; which
            # stay split depends on measured timings. Keep every split, so that the
            # segments really are reduced one by one on the GPU.
            planner.merge_adjacent = lambda buckets, order: list(order)
        try:
            model = make_model().to(dev)
            base = make_optimizer(case["opt"], model.parameters())
            options = dict(
                {
                    "cost_model": fixed_cost_model(),
                    "fusion_bytes": 0,
                    "measure_iters": 2,
                    "timeout": TIMEOUT,
                },
                **case["options"],
            )
            opt = hybridcomm.DistributedOptimizer(base, model=model, **options)
            sched = make_scheduler(case["opt"], opt)
            for s in range(STEPS):
                x, y = data(s)
                opt.zero_grad()
                nn.functional.mse_loss(
                    model(shard(x, rank, world).to(dev)), shard(y, rank, world).to(dev)
                ).backward()
                opt.step()
                if sched:
                    sched.step()
            opt.synchronize()
            plan = opt.plan
            out[case["name"]] = (
                flat(model.parameters()).cpu(),
                sorted({b.algorithm for b in plan.buckets}),
                [len(b.segments) for b in plan.buckets],
                type(opt._hc_sync.transport).__name__,
            )
            opt.close()
        finally:
            planner.merge_adjacent = merge
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return out


def _check_cases(results, cases, reference):
    """Every case equals one process (``reference(case)``) and is bitwise the same
    on every rank."""
    for case in cases:
        name = case["name"]
        got = [r[name][0] for r in results]
        _close(got[0], reference(case), name)
        _same_on_every_rank(got, name)


def _train_single_24(opt_name):
    """optim_models.train_single over batch24 (the 8-rank case's whole batch)."""
    return flat(train_single(opt_name, STEPS, data=batch24))


# --- TorchNcclTransport ------------------------------------------------------------------


def _torch_transport_sums(rank, world):
    from hybridcomm.comm.transport.select import close_transports, select_transport

    dev = _setup("torch")
    kind = type(select_transport(dev)).__name__
    wrong = []
    for algorithm in ALGOS + ("native",):
        for n in (1, 1000, (1 << 20) + 7):
            for dtype_name, dtype in DTYPES.items():
                data = _inputs(world, n, dtype)
                want = torch.stack([x.float() for x in data]).sum(0).to(dtype)
                buf = data[rank].to(dev)
                hybridcomm.all_reduce(buf, op="sum", algorithm=algorithm, timeout=TIMEOUT)
                if not torch.equal(buf.cpu(), want):
                    wrong.append((algorithm, n, dtype_name))
    close_transports()
    return kind, wrong


@pytest.mark.gpus(2)
def test_torch_nccl_transport_all_reduce_is_exact():
    """HYBRIDCOMM_TRANSPORT=torch (select.py: a transport asked for by name never
    falls back): every algorithm and native over torch.distributed's NCCL. Small
    integers (tests/gpu/test_allreduce_cupy_gpu.py's inputs): every partial sum is
    an integer below 2**8, exact in fp32, fp16 and bf16, so the sum is exact."""
    for kind, wrong in _run(
        "torch_transport_sums", _torch_transport_sums, _world(), torch_nccl=True
    ):
        assert kind == "TorchNcclTransport"
        assert wrong == [], wrong


@pytest.mark.gpus(2)
@pytest.mark.parametrize("overlap", ["forward", "backward", "none"])
def test_training_over_torch_nccl_transport_matches_one_process(overlap):
    cases = [_case(f"torch-{overlap}", overlap=overlap)]
    results = _run(
        f"torch_transport_train[{overlap}]",
        _train,
        _world(),
        cases,
        batch,
        "torch",
        torch_nccl=True,
    )
    assert all(r[cases[0]["name"]][3] == "TorchNcclTransport" for r in results)
    _check_cases(results, cases, lambda case: flat(train_single("sgd", STEPS)))


# --- unused parameters -------------------------------------------------------------------

SYNC_STEPS, WARMUP = 8, 5  # as test_single_gpu.py: steps 5-7 are steady (past the re-plan)


def _unused(rank, world, overlap):
    """tests/test_optimizer_features.py's Branchy: ``a`` used by rank 0's shard only,
    ``never`` by nobody, ``frozen``, ``tied_*``. find_unused_parameters=True: the
    steady steps run under gpu_common.no_host_sync() (set_sync_debug_mode("error")
    and the explicit waits it misses); the last step reads .grad after
    synchronize() (under it too) and steps inside skip_synchronize()."""
    dev = _setup()
    torch.manual_seed(0)
    model = Branchy().to(dev)
    # on the device before the checked steps: a copy from pageable memory syncs
    data = [tuple(t.to(dev) for t in branchy_data(s)) for s in range(SYNC_STEPS)]
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
        model=model,
        overlap=overlap,
        find_unused_parameters=True,
        cost_model=fixed_cost_model(),
        fusion_bytes=0,
        measure_iters=2,
        timeout=TIMEOUT,
    )
    no_grad = None
    t_steady = None
    with contextlib.ExitStack() as checked:
        for s, (x, y) in enumerate(data):
            if s == WARMUP:
                torch.cuda.synchronize()
                checked.enter_context(no_host_sync())  # a host sync from here on fails
                t_steady = time.perf_counter()
            opt.zero_grad()
            branchy_loss(model, shard(x, rank, world), shard(y, rank, world), rank).backward()
            if s == len(data) - 1:
                opt.synchronize()
                no_grad = {name: p.grad is None for name, p in model.named_parameters()}
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        opt.synchronize()
    torch.cuda.synchronize()
    steady_s = (time.perf_counter() - t_steady) / (SYNC_STEPS - WARMUP)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    opt.close()
    return state, no_grad, steady_s


@pytest.mark.parametrize("overlap", ["forward", "backward", "none"])
def test_unused_parameters_without_a_host_sync(overlap):
    world = _world()
    results = _run(f"unused[{overlap}]", _unused, world, overlap)
    ref = branchy_reference(world, SYNC_STEPS).state_dict()
    for rank, (state, no_grad, steady_s) in enumerate(results):
        # no rank had one: None, as one process leaves it; rank 0's reaches every rank
        assert no_grad["never.weight"] and no_grad["never.bias"], (rank, no_grad)
        assert not no_grad["a.weight"] and not no_grad["a.bias"], (rank, no_grad)
        assert not no_grad["body.weight"] and not no_grad["tied_1.weight"], (rank, no_grad)
        assert no_grad["frozen.weight"], (rank, no_grad)
        for k in ref:
            _close(state[k], ref[k], f"rank {rank}: {k}")
            assert torch.equal(state[k], results[0][0][k]), f"rank {rank} differs: {k}"
        record(
            "multi_gpu_steady_step",
            test=f"unused[{overlap}]",
            rank=rank,
            world=world,
            ms=round(steady_s * 1e3, 3),
        )


# --- fp16 / bf16 wire compression --------------------------------------------------------

COMPRESSED_LR = 0.05


def _compressed(rank, world, compression, overlap):
    """Step 0's reduced gradients (read after synchronize(), before any update) and
    the parameters after STEPS steps of SGD, gradients sent in ``compression``."""
    dev = _setup()
    model = make_model().to(dev)
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=COMPRESSED_LR),
        model=model,
        overlap=overlap,
        compression=compression,
        cost_model=fixed_cost_model(),
        fusion_bytes=0,
        measure_iters=2,
        timeout=TIMEOUT,
    )
    grads0 = None
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(
            model(shard(x, rank, world).to(dev)), shard(y, rank, world).to(dev)
        ).backward()
        if s == 0:
            opt.synchronize()
            grads0 = flat(p.grad for p in model.parameters()).cpu()
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    opt.synchronize()
    wire = {b.nbytes / b.numel for b in opt.plan.buckets}  # bytes per element sent
    params = flat(model.parameters()).cpu()
    opt.close()
    return params, grads0, wire


def _shard_grads(world):
    """One process, at the initial parameters: each shard's gradient (a rank's
    local gradient) and the whole batch's."""
    model = make_model()
    x, y = batch(0)

    def grad(xs, ys):
        model.zero_grad()
        nn.functional.mse_loss(model(xs), ys).backward()
        return flat(p.grad for p in model.parameters())

    return [grad(shard(x, r, world), shard(y, r, world)) for r in range(world)], grad(x, y)


@pytest.mark.parametrize("overlap", ["forward", "backward"])
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_wire_compression_within_its_dtype_of_one_process(compression, overlap):
    world = _world()
    results = _run(
        f"compression[{compression}-{overlap}]", _compressed, world, compression, overlap
    )
    wire_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[compression]
    fi = torch.finfo(wire_dtype)
    per_rank, whole = _shard_grads(world)
    # The tolerance, per gradient element: each rank's gradient G_r is rounded to the
    # wire dtype once (<= u |G_r| + s, u = eps/2, s = half the subnormal spacing,
    # smallest_normal * eps / 2); the all-reduce adds P of them with P - 1 roundings
    # of partial sums (each <= u * sum_r |G_r| + s); the average's scale one more.
    # At most 2P roundings of a sum <= P max_r |G_r|, over P for the average:
    #     |got - G| <= P eps max_r |G_r| + 2 s        (+ the fp32 summation order)
    M = torch.stack(per_rank).abs().max(0).values
    s = fi.smallest_normal * fi.eps / 2
    grad_tol = world * fi.eps * M + 2 * s + ATOL + RTOL * whole.abs()
    got_params, got_grads, wire = results[0]
    assert wire == {2.0}, wire  # 16 bits on the wire
    over = (got_grads - whole).abs() - grad_tol
    assert (over <= 0).all(), (
        f"step 0's reduced gradient: {int((over > 0).sum())} elements "
        f"beyond the bound, worst by {over.max():.3g}"
    )
    # The parameters: STEPS SGD updates of lr * gradient, each off by at most the bound
    # (the largest element's), times 4 for the trajectory's feedback (the later
    # gradients are taken at parameters already that far apart; lr x the loss's
    # curvature stays below 1/2 here, and 1.5 ** 3 < 4).
    param_tol = STEPS * COMPRESSED_LR * float(grad_tol.max()) * 4
    ref = flat(_train_single_plain_sgd())
    assert (got_params - ref).abs().max() <= param_tol + ATOL, (
        f"max diff {(got_params - ref).abs().max():.3g}, bound {param_tol:.3g}"
    )
    _same_on_every_rank([r[0] for r in results], compression)
    _same_on_every_rank([r[1] for r in results], f"{compression} gradients")


def _train_single_plain_sgd():
    """One process, whole batch, the compression test's optimizer (no momentum)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=COMPRESSED_LR)
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return list(model.parameters())


# --- top-k -------------------------------------------------------------------------------

TOPK_N, TOPK_STEPS = 1 << 16, 6


class Dot(nn.Module):
    """loss = <w, c>: the gradient is c exactly, whatever w."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(TOPK_N))

    def forward(self, c):
        return (self.w * c).sum()


def _topk_grad(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(-4, 5, (TOPK_N,), generator=g).float()


def _topk(rank, world, overlap):
    """compression="topk:0.01", op="sum", plain SGD at lr 1 from w = 0 (no momentum:
    error feedback alone): everything integer-valued, so exact."""
    dev = _setup()
    model = Dot().to(dev)
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model=model,
        overlap=overlap,
        op="sum",
        compression="topk:0.01",
        cost_model=fixed_cost_model(),
        fusion_bytes=0,
        measure_iters=2,
        timeout=TIMEOUT,
    )
    sent_bytes = []
    for s in range(TOPK_STEPS):
        c = _topk_grad(rank, s).to(dev)
        opt.zero_grad()
        model(c).backward()
        opt.step()
        sent_bytes.append(opt.last_step_stats["bytes_sent"])
    opt.synchronize()
    algos = sorted({b.algorithm for b in opt.plan.buckets})
    applied = -model.w.detach().cpu()  # lr 1 from 0: minus the sum of the decoded gradients
    residual = opt.state[model.w]["hc_topk_residual"].reshape(-1).cpu()
    opt.close()
    return applied, residual, algos, sent_bytes


@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_topk_error_feedback_is_exact_against_one_process(overlap):
    """One process on the whole batch (op="sum") applies the sum of every rank's
    gradients; top-k applied exactly that minus what is still in the ranks'
    residuals (tests/test_compression.py's bookkeeping invariant, through the GPU's
    top-k, ring all-gather and decode). Integers below 2**8: no rounding at all."""
    world = _world()
    results = _run(f"topk[{overlap}]", _topk, world, overlap)
    whole = sum(_topk_grad(r, s) for r in range(world) for s in range(TOPK_STEPS))
    applied, _, algos, sent = results[0]
    assert algos == ["topk"], algos
    left = sum(r[1] for r in results)
    assert torch.equal(applied + left, whole), (applied + left - whole).abs().max()
    assert applied.abs().sum() > 0 and left.abs().sum() > 0
    _same_on_every_rank([r[0] for r in results], "top-k parameters")
    dense = 2 * (world - 1) / world * TOPK_N * 4  # a ring's bytes for the dense gradient
    assert max(sent) <= 0.1 * dense, (sent, dense)


# --- PowerSGD ----------------------------------------------------------------------------

PSGD_N, PSGD_M, PSGD_STEPS = 256, 192, 5


class Frobenius(nn.Module):
    """loss = <W, C>: the gradient is C exactly, whatever W."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(PSGD_N, PSGD_M))

    def forward(self, c):
        return (self.w * c).sum()


def _psgd_grad(rank, step):
    return torch.randn(PSGD_N, PSGD_M, generator=torch.Generator().manual_seed(1000 * step + rank))


def _psgd(rank, world, overlap):
    """compression="powersgd:2:1", op="sum", plain SGD at lr 1 from W = 0: the first
    step exact, then rank 2 through P, its orthogonalization, Q and the decode on the
    comm stream."""
    dev = _setup()
    model = Frobenius().to(dev)
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model=model,
        overlap=overlap,
        op="sum",
        compression="powersgd:2:1",
        cost_model=fixed_cost_model(),
        measure_iters=2,
        timeout=TIMEOUT,
    )
    for s in range(PSGD_STEPS):
        opt.zero_grad()
        model(_psgd_grad(rank, s).to(dev)).backward()
        opt.step()
    opt.synchronize()
    compressors = sorted({str(b.compressor) for b in opt.plan.buckets})
    applied = -model.w.detach().cpu().reshape(-1)
    residual = opt.state_dict()["hybridcomm"]["powersgd"]["residuals"][: PSGD_N * PSGD_M]
    opt.close()
    return applied, residual, compressors


@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_powersgd_error_feedback_keeps_what_was_not_sent(overlap):
    """What PowerSGD applied (op="sum") plus what every rank's error feedback still
    holds is the sum of every rank's gradients (tests/test_powersgd.py's bookkeeping,
    through the comm stream's P, orthogonalization, Q and decode), to fp32 rounding;
    the same bits on every rank."""
    world = _world()
    results = _run(f"powersgd[{overlap}]", _psgd, world, overlap)
    whole = sum(_psgd_grad(r, s) for r in range(world) for s in range(PSGD_STEPS)).reshape(-1)
    applied, _, compressors = results[0]
    assert compressors == ["powersgd"], compressors
    held = sum(r[1] for r in results)
    scale = max(whole.abs().max().item(), held.abs().max().item(), applied.abs().max().item())
    # a few roundings of the largest term per step and rank
    tol = 64 * torch.finfo(torch.float32).eps * scale * PSGD_STEPS * world
    assert (applied + held - whole).abs().max().item() <= tol
    assert held.abs().sum() > 0  # low rank: not everything went
    _same_on_every_rank([r[0] for r in results], "PowerSGD parameters")


# --- forced native, split_bytes segments, Adam -------------------------------------------


def test_forced_native_matches_one_process():
    """strategy="native" and HYBRIDCOMM_ALGO=native: NCCL's own all-reduce for
    every bucket (CuPy's ncclAllReduce on the comm stream), every overlap mode."""
    cases = [
        _case(
            f"{how}-{overlap}",
            overlap=overlap,
            env={"HYBRIDCOMM_ALGO": "native"} if how == "env" else None,
            cost_model=fixed_cost_model(native=True),
            **({"strategy": "native"} if how == "strategy" else {}),
        )
        for how in ("strategy", "env")
        for overlap in ("forward", "backward", "none")
    ]
    results = _run("forced_native", _train, _world(), cases)
    for case in cases:
        assert results[0][case["name"]][1] == ["native"], (case["name"], results[0][case["name"]])
    _check_cases(results, cases, lambda case: flat(train_single("sgd", STEPS)))


SPLIT_BYTES = 4000  # rounded down to 16-byte multiples: fc1's 4640 + 2 elements in 5 segments


def test_split_bytes_segments_match_one_process():
    """Buckets over split_bytes reduced segment by segment (each its own all-reduce;
    the last holds the usage flags), per algorithm and overlap mode."""
    cases = [
        _case(
            f"{strategy}-{overlap}",
            strategy=strategy,
            overlap=overlap,
            split_bytes=SPLIT_BYTES,
            keep_splits=True,
            cost_model=fixed_cost_model(native=strategy == "native"),
        )
        for strategy, overlap in [
            ("ring", "backward"),
            ("butterfly", "backward"),
            ("halving_doubling", "backward"),
            ("native", "backward"),
            ("hybrid", "forward"),
            ("hybrid", "none"),
        ]
    ]
    results = _run("split_bytes", _train, _world(), cases)
    for case in cases:
        segments = results[0][case["name"]][2]
        assert max(segments) > 1, (case["name"], segments)
    _check_cases(results, cases, lambda case: flat(train_single("sgd", STEPS)))


def test_adam_and_adamw_match_one_process():
    """Adam, and AdamW with an lr schedule that changes every step (optim_models'),
    in every overlap mode (forward: deferred updates with the hyper-parameters of
    the step() that deferred them)."""
    cases = [
        _case(f"{name}-{overlap}", opt=name, overlap=overlap)
        for name in ("adam", "adamw")
        for overlap in ("forward", "backward", "none")
    ]
    results = _run("adam", _train, _world(), cases)
    _check_cases(results, cases, lambda case: flat(train_single(case["opt"], STEPS)))


def test_sharded_optimizer_state_matches_one_process():
    """shard="optimizer" and "gradients" (issue 40): buckets reduce-scattered on the
    comm stream, each rank steps its slices, the parameters all-gathered (forward
    mode: before their first read), in SGD with its schedule and Adam; and with the
    process group's own reduce-scatter and all-gather (``native``)."""
    cases = [
        _case(f"{name}-{shard}-{overlap}", opt=name, shard=shard, overlap=overlap)
        for name in ("sgd", "adam")
        for shard in ("optimizer", "gradients")
        for overlap in ("forward", "backward")
    ]
    cases += [
        _case(
            f"native-{shard}-{overlap}", opt="adam", shard=shard, overlap=overlap, strategy="native"
        )
        for shard, overlap in (("optimizer", "forward"), ("gradients", "backward"))
    ]
    results = _run("shard", _train, _world(), cases)
    _check_cases(results, cases, lambda case: flat(train_single(case["opt"], STEPS)))


# --- AMP with clipping -------------------------------------------------------------------

AMP_STEPS, AMP_LR = 5, 0.1
AMP_LAYERS = 3  # _mlp(IN, 16, 16, OUT)


def _amp_loop(dev, part, wrap):
    """tests/test_training_loops.py's amp_clip pattern on the GPU, under fp16
    autocast, stepping as docs/API.md documents for clipping: synchronize(),
    unscale_, clip, then scaler.step inside skip_synchronize(). ``part`` takes
    this run's share of a batch, ``wrap`` wraps the optimizer (None: one
    process). Returns the model, each step's (unclipped) norm and the scales."""
    torch.manual_seed(4)
    model = _mlp(IN, 16, 16, OUT).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=AMP_LR)
    if wrap is not None:
        opt = wrap(opt, model)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
    norms, scales = [], []
    for s in range(AMP_STEPS):
        x, y = _whole(4000 + s, (IN,), (OUT,))
        if s == INF_STEP:
            x[0, 0] = float("inf")  # on P ranks, only rank 0's shard holds it
        x, y = part(x).to(dev), part(y).to(dev)
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if wrap is not None:
            opt.synchronize()  # the reduced gradients, before unscale_ reads them
        scaler.unscale_(opt)
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        if wrap is not None:
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    if wrap is not None:
        opt.synchronize()
        opt.close()
    return model, norms, scales


def _amp(rank, world, overlap):
    dev = _setup()

    def wrap(opt, model):
        return hybridcomm.DistributedOptimizer(
            opt,
            model=model,
            overlap=overlap,
            cost_model=fixed_cost_model(),
            fusion_bytes=0,
            measure_iters=2,
            timeout=TIMEOUT,
        )

    model, norms, scales = _amp_loop(dev, lambda t: shard(t, rank, world), wrap)
    return flat(model.parameters()).cpu(), norms, scales


def _amp_shard_norms(world):
    """One process, on the reference's trajectory: at each step the largest norm of
    a shard's unscaled gradient (a rank's local gradient), max_r ||G_r||."""
    dev = torch.device("cuda", 0)
    torch.manual_seed(4)
    model = _mlp(IN, 16, 16, OUT).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=AMP_LR)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
    out = []
    for s in range(AMP_STEPS):
        x, y = _whole(4000 + s, (IN,), (OUT,))
        if s == INF_STEP:
            x[0, 0] = float("inf")
        x, y = x.to(dev), y.to(dev)
        norms = []
        for r in range(world):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.mse_loss(model(shard(x, r, world)), shard(y, r, world))
            grads = torch.autograd.grad(loss, list(model.parameters()))
            norms.append(float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))))
        out.append(max(norms))
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
    return out


@pytest.mark.parametrize("overlap", ["forward", "backward", "none"])
def test_amp_with_clipping_matches_one_process(overlap):
    world = _world()
    results = _run(f"amp_clip[{overlap}]", _amp, world, overlap)
    with ieee_fp32_here():
        ref_model, ref_norms, ref_scales = _amp_loop(torch.device("cuda", 0), lambda t: t, None)
        ref = flat(ref_model.parameters()).cpu()
        shard_norms = _amp_shard_norms(world)
    got, norms, scales = results[0]
    # The overflowing step is skipped and the scale halved on every rank, as in one process.
    assert scales == ref_scales and ref_scales[INF_STEP] == ref_scales[0] / 2, (scales, ref_scales)
    # The tolerance. Under fp16 autocast each layer rounds its matmul's output and its
    # activation to fp16, forward and backward: 4 roundings per layer, each <= u =
    # eps16 / 2 relative to what it rounds, in each of the two runs (one process and
    # a rank's shard round different sums): K = 8 L roundings. Per gradient element,
    # relative to the largest rank's |G_r| (not to |G|: the ranks' sums may cancel),
    # so ||got - G|| <= K u sqrt(P) max_r ||G_r||. Clipping divides by the norm
    # (itself off by at most that much): the clipped gradient's error is <=
    # 2 MAX_NORM ||got - G|| / ||G||, each update's lr times it; summed over the
    # steps, times 4 for the trajectory's feedback (as for fp16 compression above).
    K = 8 * AMP_LAYERS
    u16 = torch.finfo(torch.float16).eps / 2
    param_tol = 0.0
    for s, (n, want, m) in enumerate(zip(norms, ref_norms, shard_norms)):
        if s == INF_STEP:  # the inf step: non-finite on both, and skipped
            assert not math.isfinite(n) and not math.isfinite(want), (s, n, want)
            continue
        assert want > MAX_NORM, f"step {s}: norm {want:.3g} does not clip"
        dg = K * u16 * math.sqrt(world) * m
        assert abs(n - want) <= dg + RTOL * want, (s, n, want, dg)
        param_tol += AMP_LR * 2 * MAX_NORM * dg / want
    param_tol *= 4
    assert (got - ref).abs().max() <= param_tol + ATOL, (
        f"max diff {(got - ref).abs().max():.3g}, bound {param_tol:.3g}"
    )
    _same_on_every_rank([r[0] for r in results], "AMP parameters")


# --- 8 ranks -----------------------------------------------------------------------------


def test_eight_ranks_match_one_process():
    """8 ranks (3 samples each of batch24): every algorithm forced, and the hybrid
    plan (the library's default cost model: a probe) in every overlap mode."""
    cases = [
        _case(
            f"{strategy}-backward",
            strategy=strategy,
            overlap="backward",
            cost_model=fixed_cost_model(native=strategy == "native"),
        )
        for strategy in ("ring", "butterfly", "halving_doubling", "native")
    ]
    cases += [
        _case(f"hybrid-{overlap}", overlap=overlap, cost_model=None)
        for overlap in ("forward", "backward", "none")
    ]
    results = _run("eight_ranks", _train, 8, cases, batch24)
    ref = _train_single_24("sgd")
    _check_cases(results, cases, lambda case: ref)


# --- a dead peer -------------------------------------------------------------------------

DEAD_TIMEOUT = 20.0  # the library's timeout in this test
DEAD_SLACK = 15.0  # a step, the watchdog's period, the abort
DIE_AT = 4  # past the measured steps and the re-plan (measure_iters=2)


def _dead_peer(rank, world, overlap):
    """The last rank leaves (os._exit) at step DIE_AT; the others keep training, as
    a loop that logs its loss does (float(loss): the host waits for the step's
    forward), until our error, for at most DEAD_TIMEOUT + DEAD_SLACK seconds."""
    import faulthandler

    dev = _setup()
    # a hang shows where it is in the test's output before the launch's deadline
    faulthandler.dump_traceback_later(4 * (DEAD_TIMEOUT + DEAD_SLACK), exit=False)
    model = make_model().to(dev)
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model=model,
        overlap=overlap,
        cost_model=fixed_cost_model(),
        fusion_bytes=0,
        measure_iters=2,
        timeout=DEAD_TIMEOUT,
    )
    data = [tuple(shard(t, rank, world).to(dev) for t in batch(s)) for s in range(STEPS)]
    t0 = None
    try:
        s = 0
        while t0 is None or time.monotonic() - t0 < DEAD_TIMEOUT + DEAD_SLACK:
            if s == DIE_AT:
                if rank == world - 1:
                    os._exit(0)
                t0 = time.monotonic()
            x, y = data[s % STEPS]
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            float(loss)
            s += 1
        return "no error", time.monotonic() - t0, "", 0.0
    except hybridcomm.HybridCommError as e:  # HybridCommTimeout is one
        if t0 is None:
            raise  # before the peer left: a failure of its own
        elapsed = time.monotonic() - t0
        t1 = time.monotonic()
        opt.close()  # never raises, returns though a peer is gone
        return type(e).__name__, elapsed, str(e), time.monotonic() - t1
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_a_dead_peer_is_our_error_within_the_timeout(overlap):
    """Real NCCL: the survivors' comm-stream work waits for a peer that is gone; the
    transport's watchdog aborts the communicator at the timeout (or NCCL reports
    the error) and the next call raises, naming the rank. Never a hang: the launch's
    own deadline bounds the test."""
    world = _world()
    results = _run(
        f"dead_peer[{overlap}]", _dead_peer, world, overlap, allow_errors=True, timeout=240
    )
    assert "without reporting" in str(results[-1]), results[-1]  # the rank that left
    for rank, r in enumerate(results[:-1]):
        assert isinstance(r, tuple), f"rank {rank}: {r}"  # else its traceback
        kind, elapsed, msg, close_s = r
        assert kind in ("HybridCommTimeout", "HybridCommError"), (rank, r)
        assert elapsed < DEAD_TIMEOUT + DEAD_SLACK, (rank, r)
        assert f"rank {rank}" in msg, (rank, msg)
        assert close_s < DEAD_TIMEOUT + DEAD_SLACK, (rank, r)
        record(
            "multi_gpu_dead_peer",
            overlap=overlap,
            rank=rank,
            world=world,
            error=kind,
            detected_s=round(elapsed, 2),
            close_s=round(close_s, 2),
        )
