"""hybridcomm under transformers.Trainer (hybridcomm.integrations.transformers).

examples/hf_trainer.py fine-tunes a tiny random BERT on 2 CPU processes
(torchrun, gloo) with gradient accumulation (2 micro-batches: DDP's no_sync,
then the hook) and clipping (max_grad_norm, most steps clip), first with
hybridcomm's hook, then the stock way from the same start in the same
processes. One process with the doubled batch runs the same script at the
same time. The logged losses, gradient norms (taken on the averaged gradients,
before clipping) and final parameters must agree. The rest checks the
callback's logic on a stand-in Trainer, in this process.
"""

import ast
import json
import os
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import transformers
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType

import hybridcomm.integrations.transformers as hct
from hybridcomm.base.errors import HybridCommError
from launch_script import ROOT, finish_all, start

SCRIPT = os.path.join(ROOT, "examples", "hf_trainer.py")
# Two processes average two per-process means where one process takes the mean
# of the whole batch: the same numbers summed in another order, a few fp32
# roundings per step, scaled by the values' size (the repository's convention).
RTOL = ATOL = 64 * torch.finfo(torch.float32).eps
# The Trainer logs each step's loss rounded to 4 decimals: values a rounding
# apart may fall either side of a rounding boundary.
LOGGED_LOSS_ATOL = 1e-4 + ATOL
ARGS = ["--steps", "6", "--accumulation", "2", "--max-grad-norm", "0.2"]


def _run_logs(out, run):
    """The logged losses, gradient norms and unrounded mean loss of ``run``."""

    def one(pattern):
        found = re.findall(rf"\b{run}: {pattern}$", out, re.M)  # whole lines; a rank's
        # stderr may precede one
        assert len(found) == 1, (run, pattern, out[-3000:])
        return found[0]

    losses = json.loads(one(r"losses (\[.*\])"))
    norms = json.loads(one(r"grad_norms (\[.*\])"))
    mean = float(one(r".*mean loss (\S+)"))
    assert len(losses) == len(norms) == 6
    return losses, norms, mean


def _close(a, b, atol=ATOL):
    return torch.allclose(
        torch.tensor(a, dtype=torch.float64),
        torch.tensor(b, dtype=torch.float64),
        rtol=RTOL,
        atol=atol,
    )


@pytest.mark.timeout(300)  # three Trainer runs
def test_trainer_with_hybridcomm_equals_stock_ddp_and_one_process(tmp_path):
    two = start(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            SCRIPT,
            *ARGS,
            "--per-device-batch-size",
            "8",
            "--also-stock",
            "--params-out",
            str(tmp_path / "two"),
        ]
    )
    one = start(
        [
            sys.executable,
            SCRIPT,
            *ARGS,
            "--per-device-batch-size",
            "16",
            "--params-out",
            str(tmp_path / "one"),
        ]
    )
    out_one, out_two = finish_all(one, two)

    assert "hybridcomm: 2 process(es), accumulation 2" in out_two
    assert "stock: 2 process(es), accumulation 2" in out_two
    assert "hybridcomm: 1 process(es), accumulation 2" in out_one
    # the hook ran (a skipped hook leaves this empty), and never in one process
    found = re.findall(r"\bhybridcomm: hybridcomm algorithms (.*)$", out_two, re.M)
    assert len(found) == 1 and ast.literal_eval(found[0]), out_two[-3000:]
    assert "hybridcomm algorithms" not in out_one

    hybrid, stock, single = (
        _run_logs(out_two, "hybridcomm"),
        _run_logs(out_two, "stock"),
        _run_logs(out_one, "hybridcomm"),
    )
    assert sum(n > 0.2 for n in hybrid[1]) >= 2  # clipping changed some steps
    params = torch.load(tmp_path / "two.hybridcomm.pt")
    for name, (losses, norms, mean), other in (
        ("stock DDP", stock, "two.stock.pt"),
        ("one process", single, "one.hybridcomm.pt"),
    ):
        assert _close(hybrid[0], losses, LOGGED_LOSS_ATOL), (name, hybrid[0], losses)
        assert _close(hybrid[1], norms), (name, hybrid[1], norms)
        assert _close(hybrid[2], mean), (name, hybrid[2], mean)
        want = torch.load(tmp_path / other)
        assert torch.allclose(params, want, rtol=RTOL, atol=ATOL), (
            name,
            (params - want).abs().max().item(),
        )


# ------------------------------------------------------------------ in this process


@pytest.fixture
def stand_in(tmp_path):
    """A Trainer as on_train_begin sees it (its accelerator and wrapped model), on a
    one-rank gloo group; no training loop."""
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    trainer = transformers.Trainer.__new__(transformers.Trainer)
    trainer.accelerator = Accelerator(cpu=True)
    yield trainer
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    from hybridcomm.comm.calibration import set_active

    set_active(None)
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_the_callback_registers_once_per_ddp_model(stand_in, monkeypatch):
    with pytest.raises(TypeError, match="Trainer"):
        hct.HybridCommCallback(object())
    callback = hct.HybridCommCallback(stand_in, timeout=60)
    stand_in.model_wrapped = _model()  # one process: the Trainer does not wrap
    callback.on_train_begin(None, None, None)
    assert callback.state is None

    ddp = nn.parallel.DistributedDataParallel(_model())
    stand_in.model_wrapped = ddp
    callback.on_train_begin(None, None, None)
    state = callback.state
    assert state is not None and state.timeout == 60
    callback.on_train_begin(None, None, None)  # train() again (resume): the hook stays
    assert callback.state is state
    nn.functional.mse_loss(ddp(torch.randn(3, 4)), torch.randn(3, 2)).backward()
    assert state.algorithms

    stand_in.model_wrapped = nn.parallel.DistributedDataParallel(_model())  # re-wrapped
    callback.on_train_begin(None, None, None)
    assert callback.state is not state

    # several processes, but no DDP model: DeepSpeed, FSDP
    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))
    monkeypatch.setattr(
        Accelerator, "distributed_type", property(lambda self: DistributedType.FSDP)
    )
    stand_in.model_wrapped = _model()
    with pytest.raises(HybridCommError, match="FSDP"):
        hct.HybridCommCallback(stand_in).on_train_begin(None, None, None)
