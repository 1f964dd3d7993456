"""hybridcomm under Hugging Face Accelerate (hybridcomm.integrations.accelerate).

examples/accelerate_train.py runs on 2 CPU processes (gloo) started by
Accelerate's own launcher, in one launch: both routes (the DDP hook through
``register``, backward overlap; hybridcomm's optimizer through ``prepare``,
forward overlap), each without and with gradient accumulation through
``accelerator.accumulate``, every step clipped by ``accelerator.clip_grad_norm_``.
Each run's parameters must equal one process's on the whole batch (the same
script, no launcher), which runs at the same time. The rest checks the
helpers' answers to a single process and to bad input, in this process.
"""

import ast
import os
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
)

import hybridcomm.integrations.accelerate as hca
from hybridcomm.base.errors import HybridCommError
from launch_script import ROOT, finish_all, free_port, start

SCRIPT = os.path.join(ROOT, "examples", "accelerate_train.py")
# Two processes average two per-process means where one process takes the mean
# of the whole batch: the same numbers summed in another order, a few fp32
# roundings per step, scaled by the values' size (the repository's convention).
RTOL = ATOL = 64 * torch.finfo(torch.float32).eps
ARGS = [
    "--steps",
    "6",
    "--global-batch-size",
    "16",
    "--accumulation",
    "1,2",
    "--overlap",
    "backward,forward",
    "--max-grad-norm",
    "0.1",
]  # 0.1: every step clips
RUNS = [(o, a) for o in ("backward", "forward") for a in (1, 2)]


def _line(out, pattern):
    """The group of the one line of ``out`` that ends matching ``pattern`` (the
    examples write each line whole, but another rank's stderr may precede it)."""
    found = re.findall(rf"{pattern}$", out, re.M)
    assert len(found) == 1, (pattern, out[-3000:])
    return found[0]


@pytest.mark.timeout(180)  # accelerate launches two processes
def test_two_processes_equal_one_on_the_whole_batch(tmp_path):
    two = start(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            SCRIPT,
            *ARGS,
            "--bucket-cap-mb",
            "0.005",  # DDP: two buckets
            "--params-out",
            str(tmp_path / "two"),
        ]
    )
    one = start([sys.executable, SCRIPT, *ARGS, "--params-out", str(tmp_path / "one")])
    out_one, out_two = finish_all(one, two)

    for overlap, acc in RUNS:
        label = f"overlap {overlap}, accumulation {acc}"
        # the same clipping in both: all 6 steps, on the averaged gradients
        summary_two, summary_one = (
            _line(out, rf"{label}: final loss (.*)") for out in (out_two, out_one)
        )
        assert "over 6 steps (6 clipped), 2 process(es), hybridcomm" in summary_two, summary_two
        assert "over 6 steps (6 clipped), 1 process(es)" in summary_one, summary_one
        # hybridcomm ran: the hook's buckets, or the optimizer's plan and bytes
        if overlap == "backward":
            algos = ast.literal_eval(_line(out_two, rf"{label}: hybridcomm algorithms (.*)"))
            assert len(algos) == 2, algos  # both DDP buckets went through the hook
        else:
            m = re.search(
                rf"{label}: hybridcomm optimizer algorithms (\[.*\]), last step sent "
                rf"(\d+) bytes",
                out_two,
            )
            assert m and ast.literal_eval(m.group(1)) and int(m.group(2)) > 0, out_two[-3000:]
        digests = set(
            re.findall(rf"\[rank \d\] {label}: parameters sha256 ([0-9a-f]{{16}})$", out_two, re.M)
        )
        assert len(re.findall(rf"\[rank \d\] {label}: parameters", out_two)) == 2
        assert len(digests) == 1, digests  # every rank holds the same parameters
        got = torch.load(tmp_path / f"two.{overlap}.acc{acc}.pt")
        want = torch.load(tmp_path / f"one.{overlap}.acc{acc}.pt")
        assert torch.allclose(got, want, rtol=RTOL, atol=ATOL), (
            label,
            (got - want).abs().max().item(),
        )
    # the two routes train the same: in one process they are the same code
    for acc in (1, 2):
        assert torch.equal(
            torch.load(tmp_path / f"one.backward.acc{acc}.pt"),
            torch.load(tmp_path / f"one.forward.acc{acc}.pt"),
        )


# ------------------------------------------------------------------ in this process


@pytest.fixture
def accelerator():
    acc = Accelerator(cpu=True)
    yield acc
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    yield
    from hybridcomm.comm.calibration import set_active

    set_active(None)
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _pretend_processes(monkeypatch, n, kind):
    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: n))
    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: kind))


def test_one_process_needs_no_reduction(accelerator, caplog):
    model = _model()
    with caplog.at_level("DEBUG", logger="hybridcomm"):
        assert hca.register(accelerator, accelerator.prepare(model)) is None
    assert "nothing to reduce" in caplog.text
    m, opt = hca.prepare(accelerator, _model(), torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(opt, AcceleratedOptimizer)
    assert not isinstance(m, nn.parallel.DistributedDataParallel)
    hca.synchronize(opt)  # a no-op for a plain optimizer


def test_bad_input_is_refused_clearly(accelerator, monkeypatch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="Accelerator"):
        hca.register(object(), model)
    with pytest.raises(TypeError, match="model"):
        hca.register(accelerator, "model")
    with pytest.raises(TypeError, match="not yet prepared"):
        hca.prepare(accelerator, model, accelerator.prepare(opt))
    _pretend_processes(monkeypatch, 2, DistributedType.MULTI_CPU)
    with pytest.raises(HybridCommError, match="not DistributedDataParallel.*prepare returned"):
        hca.register(accelerator, model)  # the unwrapped module
    # fp16: Accelerate's step hides its GradScaler from DistributedOptimizer.step (SGD
    # then fails on the scaler's grad_scale): the optimizer route refuses it up front
    monkeypatch.setattr(accelerator, "scaler", torch.amp.GradScaler("cpu"))
    with pytest.raises(HybridCommError, match="fp16.*register"):
        hca.prepare(accelerator, model, opt)
    monkeypatch.setattr(accelerator, "scaler", None)
    _pretend_processes(monkeypatch, 2, DistributedType.DEEPSPEED)
    with pytest.raises(HybridCommError, match="DEEPSPEED"):
        hca.register(accelerator, model)
    with pytest.raises(HybridCommError, match="DEEPSPEED"):
        hca.prepare(accelerator, model, opt)


class _Compiled(nn.Module):
    """Stands in for torch.compile's OptimizedModule: the compiled module in ``_orig_mod``."""

    def __init__(self, module):
        super().__init__()
        self._orig_mod = module


def test_register_on_a_ddp_model(accelerator, one_rank, monkeypatch):
    ddp = nn.parallel.DistributedDataParallel(_model())
    state = hca.register(accelerator, ddp, timeout=60)
    assert state.process_group is None  # DDP reduces over the world: the default
    nn.functional.mse_loss(ddp(torch.randn(3, 4)), torch.randn(3, 2)).backward()
    assert state.algorithms  # the hook ran
    with pytest.raises(HybridCommError, match="one\\s+communication hook"):
        hca.register(accelerator, ddp)  # DDP takes one hook
    _pretend_processes(monkeypatch, 2, DistributedType.MULTI_CPU)
    with pytest.raises(HybridCommError, match="DistributedDataParallel already"):
        hca.prepare(accelerator, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    assert hca.find_ddp(_Compiled(ddp)) is ddp and hca.find_ddp(ddp.module) is None
    accelerator.ddp_handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    with pytest.raises(HybridCommError, match="comm_hook"):
        hca.register(accelerator, nn.parallel.DistributedDataParallel(_model()))
