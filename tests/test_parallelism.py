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
    params, plan = pipeline.train(schedule, steps=STEPS, overlap=overlap, measure_iters=2,
                                  timeout=60, cost_model="default")
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
        assert torch.allclose(got, want[stage], **TOL), \
            f"rank {rank} (stage {stage}): max diff {(got - want[stage]).abs().max():.3g}"
    # the replicas of a stage are bitwise equal (they applied the same reduced gradients)
    assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[3])


def _scaled_by_the_schedule(rank, world):
    try:
        params, _ = pipeline.train("gpipe", steps=STEPS, scale_grads=True, measure_iters=2,
                                   timeout=60, cost_model="default")
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
