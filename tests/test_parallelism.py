"""Data parallelism inside pipeline parallelism (examples/pipeline.py): 2 replicas
x 2 stages on 4 gloo ranks, GPipe and 1F1B, each stage's gradients reduced by
hybridcomm over its data-parallel group, with no micro-batch count given:
every stage ends with one process's parameters (the whole batch, plain SGD)."""

import os
import sys
import traceback

import pytest
import torch

from multiproc import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import pipeline  # noqa: E402

STEPS = 6  # past the measured steps (measure_iters=2) and the re-plan
# Micro-batch means, then the sum over micro-batches, then the mean over the
# replicas, where one process takes one mean: a few fp32 roundings per step.
TOL = dict(rtol=64 * torch.finfo(torch.float32).eps, atol=64 * torch.finfo(torch.float32).eps)


def _train(rank, world, schedule, overlap):
    params, plan = pipeline.train(
        schedule, steps=STEPS, overlap=overlap, measure_iters=2, timeout=60, cost_model="default"
    )
    return params, plan.launch_pass


@pytest.mark.parametrize("overlap", ["forward", "backward"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dp_x_pp_matches_one_process(schedule, overlap):
    results = run_ranks(4, _train, schedule, overlap, timeout=240)
    want = pipeline.reference(STEPS)
    # learned: the buckets launch in the last micro-batch's backward (4 of 4)
    assert [launch_pass for _, launch_pass in results] == [4] * 4
    results = [params for params, _ in results]
    for rank, got in enumerate(results):
        stage = rank % 2
        assert torch.allclose(got, want[stage], **TOL), (
            f"rank {rank} (stage {stage}): max diff {(got - want[stage]).abs().max():.3g}"
        )
    # the replicas of a stage are bitwise equal (they applied the same reduced gradients)
    assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[3])


def _scaled_by_the_schedule(rank, world):
    try:
        params, _ = pipeline.train(
            "gpipe",
            steps=STEPS,
            scale_grads=True,
            measure_iters=2,
            timeout=60,
            cost_model="default",
        )
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        # pipelining re-raises a stage's error as the cause of its own
        return "error", "".join(traceback.format_exception(e))
    return "ok", params


def test_the_schedules_own_gradient_scaling_is_never_silently_wrong():
    """scale_grads=True divides p.grad in place after the last backward, while
    hybridcomm may be reducing it. A division before the bucket's issue is sent
    divided (right); one after is an error that says what to do instead. So
    either every rank trained right, or some rank names the fix (the job fails)."""
    results = run_ranks(4, _scaled_by_the_schedule, timeout=240, allow_errors=True)
    errors = [r[1] for r in results if r[0] != "ok"]
    if errors:
        assert any("scale_grads=False" in m for m in errors), errors
        return
    want = pipeline.reference(STEPS)
    for rank, (_, got) in enumerate(results):
        assert torch.allclose(got, want[rank % 2], **TOL)


# ----------------------------------------------------------------- DP x TP (DTensor)

TP_STEPS = 5


def _tp_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _tp_batch(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _dp_x_tp(rank, world, overlap, dp_group):
    """A 2 x 2 mesh (dp, tp): the MLP column- then row-parallel over tp; each dp
    replica trains on its half of the batch; hybridcomm reduces over ``dp``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import hybridcomm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(
        _tp_model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    group = mesh["dp"].get_group() if dp_group else None
    try:
        opt = hybridcomm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            model=model,
            process_group=group,
            overlap=overlap,
            measure_iters=2,
            timeout=60,
            cost_model="default",
        )
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return "error", str(e)
    replica = mesh.get_coordinate()[0]
    for step in range(TP_STEPS):
        x, y = (t[replica * 4 : (replica + 1) * 4] for t in _tp_batch(step))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.synchronize()
    opt.close()
    return "ok", torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_dp_x_tp_reduces_the_local_shards_over_dp_and_matches_one_process(overlap):
    model = _tp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(TP_STEPS):
        x, y = _tp_batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    want = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for status, got in run_ranks(4, _dp_x_tp, overlap, True, timeout=240):
        assert status == "ok", got
        assert torch.allclose(got, want, **TOL), f"max diff {(got - want).abs().max():.3g}"


def test_a_tp_sharded_model_is_never_averaged_across_its_shards():
    """The default group holds the tensor-parallel ranks too: refused on every
    rank, with the group to pass instead."""
    for status, msg in run_ranks(4, _dp_x_tp, "backward", False, timeout=240):
        assert status == "error" and "mesh['dp'].get_group()" in msg, msg


@pytest.mark.timeout(180)  # a benchmark run
def test_the_dp_x_pp_benchmark_runs_and_prints_every_config_against_ddp():
    import subprocess

    out = subprocess.run(
        [
            sys.executable,
            os.path.join(os.path.dirname(__file__), "..", "benchmarks", "parallel.py"),
            "--width",
            "32",
            "--batch",
            "16",
            "--warmup",
            "3",
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.split() and line.split()[0] in ("hybrid-forward", "hybrid-backward", "ddp", "local")
    }
    assert set(rows) == {"hybrid-forward", "hybrid-backward", "ddp", "local"}, out
    assert rows["ddp"][2] == "1.00" and float(rows["hybrid-forward"][1]) > 0
    assert "launched in pass 4" in " ".join(rows["hybrid-forward"])  # learned: 4 micro-batches
