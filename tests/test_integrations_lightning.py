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
import sys

import pytest
import torch

from launch_script import ROOT, run_script

sys.path.insert(0, f"{ROOT}/examples")
import lightning_train  # noqa: E402

SCRIPT = "examples/lightning_train.py"
TOL = dict(rtol=64 * torch.finfo(torch.float32).eps, atol=64 * torch.finfo(torch.float32).eps)
# Every step defers (no re-plan after measuring, which could apply them at once here).
ALWAYS_DEFER = '{"cost_model": "default", "measure_iters": 0}'


def _two_processes(tmp_path, name, *args):
    out = tmp_path / f"{name}.pt"
    run_script(SCRIPT, ["--devices", "2", *args, "--out", str(out)], nprocs=2)
    return torch.load(out)


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


def test_ddp_hook_route(tmp_path, two_epochs):
    """DDPStrategy(ddp_comm_hook=hybrid_hook, ddp_comm_state=HybridState())."""
    got = _two_processes(tmp_path, "hook", "--route", "hook", "--epochs", "2")
    assert got["proof"]["algorithms"], "the hook never ran"
    _close(got, two_epochs)


def test_strategy_forward_overlap_and_resume_from_a_checkpoint(tmp_path, two_epochs):
    """HybridStrategy, forward mode deferring every step's update; a checkpoint at
    the end of epoch 1 (with an update pending) and a run resumed from it end
    bitwise where the uninterrupted run ends."""
    ckpt = tmp_path / "ckpt"
    full = _two_processes(tmp_path, "full", "--route", "strategy", "--overlap", "forward",
                          "--epochs", "2", "--ckpt-dir", str(ckpt),
                          "--hybridcomm-options", ALWAYS_DEFER)
    assert full["proof"] == {"wrapped": ["SGD"], "buckets": [1], "defers": [True]}
    _close(full, two_epochs)
    resumed = _two_processes(tmp_path, "resumed", "--route", "strategy", "--overlap", "forward",
                             "--epochs", "2", "--resume", str(ckpt / "epoch=0.ckpt"),
                             "--hybridcomm-options", ALWAYS_DEFER)
    assert resumed["steps"] == full["steps"]
    assert torch.equal(resumed["params"], full["params"])


def test_strategy_accumulation_and_clipping(tmp_path):
    """accumulate_grad_batches=2 (the first micro-batch under no_sync) and
    gradient_clip_val (the clip reads the reduced gradients)."""
    args = ["--route", "strategy", "--accumulate", "2", "--clip", "0.05",
            "--hybridcomm-options", ALWAYS_DEFER]
    got = _two_processes(tmp_path, "accum", *args, "--batch-size", "8")
    ref = _one_process(tmp_path, "accum_ref", "--accumulate", "2", "--clip", "0.05",
                       "--batch-size", "16")
    _close(got, ref)


def test_strategy_bf16_autocast_equals_stock_ddp(tmp_path):
    """precision="bf16-mixed", backward overlap, against Lightning's own DDP."""
    got = _two_processes(tmp_path, "bf16", "--route", "strategy", "--overlap", "backward",
                         "--precision", "bf16-mixed")
    ddp = _two_processes(tmp_path, "bf16_ddp", "--route", "ddp", "--precision", "bf16-mixed")
    assert got["proof"]["wrapped"] == ["SGD"] and ddp["proof"] == {}
    assert torch.equal(got["params"], ddp["params"])
