"""PyTorch Lightning's real Trainer, 2 CPU processes (accelerator="cpu",
devices=2, gloo), through hybridcomm's DDP hook and through HybridStrategy
(forward and backward overlap, accumulation, clipping, bf16 autocast,
checkpoints): the parameters after the run equal one process's on the whole
batch (examples/lightning_train.py; its sampler gives rank r the samples r,
r+2, ...: the two ranks' batches are the one process's batch).

Summation order differs from one process (per-rank means, then the
all-reduce): a few fp32 roundings per step, scaled by the values' size. With
2 ranks every all-reduce algorithm adds the same two numbers, so hybridcomm
and stock DDP give the same bits: the bf16-autocast run (whose bf16 roundings
depend on the batch size) is compared with stock DDP bitwise."""

import json
import sys

import pytest
import torch

from launch_script import ROOT, run_script

sys.path.insert(0, f"{ROOT}/examples")
import lightning_train  # noqa: E402

# The module's one launch of every run is made in the setup of whichever test comes first.
pytestmark = pytest.mark.timeout(300)

SCRIPT = "examples/lightning_train.py"
TOL = dict(rtol=64 * torch.finfo(torch.float32).eps, atol=64 * torch.finfo(torch.float32).eps)
# Every step defers (no re-plan after measuring, which could apply them at once here).
ALWAYS_DEFER = '{"cost_model": "default", "measure_iters": 0}'


# Every 2-process run of this module, in order, in ONE launch of 2 rank processes
# (tests/lightning_runs.py: Lightning imported once per rank, not once per run):
# name -> lightning_train.py arguments. "resumed" reads "full"'s checkpoint.
RUNS = {
    "hook": ["--route", "hook", "--epochs", "2"],
    "full": [
        "--route",
        "strategy",
        "--overlap",
        "forward",
        "--epochs",
        "2",
        "--ckpt-dir",
        "{tmp}/ckpt",
        "--hybridcomm-options",
        ALWAYS_DEFER,
    ],
    "resumed": [
        "--route",
        "strategy",
        "--overlap",
        "forward",
        "--epochs",
        "2",
        "--resume",
        "{tmp}/ckpt/epoch=0.ckpt",
        "--hybridcomm-options",
        ALWAYS_DEFER,
    ],
    "accum": [
        "--route",
        "strategy",
        "--accumulate",
        "2",
        "--clip",
        "0.05",
        "--hybridcomm-options",
        ALWAYS_DEFER,
        "--batch-size",
        "8",
    ],
    "bf16": ["--route", "strategy", "--overlap", "backward", "--precision", "bf16-mixed"],
    "bf16_ddp": ["--route", "ddp", "--precision", "bf16-mixed"],
}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """name -> what rank 0 saved for that run (the parameters, steps, proof)."""
    tmp = tmp_path_factory.mktemp("two")
    runs = [
        [
            name,
            [
                "--devices",
                "2",
                *(a.replace("{tmp}", str(tmp)) for a in args),
                "--out",
                str(tmp / f"{name}.pt"),
            ],
        ]
        for name, args in RUNS.items()
    ]
    run_script("tests/lightning_runs.py", [json.dumps(runs)], nprocs=2, timeout=480)
    return {name: torch.load(tmp / f"{name}.pt") for name in RUNS}


def _one_process(tmp_path, name, *args):
    """The reference, in this process: Lightning on one device, the doubled batch."""
    out = tmp_path / f"{name}.pt"
    lightning_train.main(["--devices", "1", "--batch-size", "32", *args, "--out", str(out)])
    return torch.load(out)


def _close(got, ref):
    assert got["steps"] == ref["steps"]
    diff = (got["params"] - ref["params"]).abs().max()
    assert torch.allclose(got["params"], ref["params"], **TOL), f"max diff {diff:.3g}"


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory):
    return _one_process(tmp_path_factory.mktemp("ref"), "ref", "--epochs", "2")


def test_ddp_hook_route(two_processes, two_epochs):
    """DDPStrategy(ddp_comm_hook=hybrid_hook, ddp_comm_state=HybridState())."""
    got = two_processes["hook"]
    assert got["proof"]["algorithms"], "the hook never ran"
    _close(got, two_epochs)


def test_strategy_forward_overlap_and_resume_from_a_checkpoint(two_processes, two_epochs):
    """HybridStrategy, forward mode deferring every step's update; a checkpoint at
    the end of epoch 1 (with an update pending) and a run resumed from it end
    bitwise where the uninterrupted run ends."""
    full, resumed = two_processes["full"], two_processes["resumed"]
    assert full["proof"] == {"wrapped": ["SGD"], "buckets": [1], "defers": [True]}
    _close(full, two_epochs)
    assert resumed["steps"] == full["steps"]
    assert torch.equal(resumed["params"], full["params"])


def test_strategy_accumulation_and_clipping(two_processes, tmp_path):
    """accumulate_grad_batches=2 (the first micro-batch under no_sync) and
    gradient_clip_val (the clip reads the reduced gradients)."""
    got = two_processes["accum"]
    ref = _one_process(
        tmp_path, "accum_ref", "--accumulate", "2", "--clip", "0.05", "--batch-size", "16"
    )
    _close(got, ref)


def test_strategy_bf16_autocast_equals_stock_ddp(two_processes):
    """precision="bf16-mixed", backward overlap, against Lightning's own DDP."""
    got, ddp = two_processes["bf16"], two_processes["bf16_ddp"]
    assert got["proof"]["wrapped"] == ["SGD"] and ddp["proof"] == {}
    assert torch.equal(got["params"], ddp["params"])
