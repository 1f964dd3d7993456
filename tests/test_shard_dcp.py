"""Sharded optimizer state through torch.distributed.checkpoint (DCP): each rank
hands DCP its own part, never the whole state; a DCP checkpoint resumes at
another world size and into plain torch with one process's numbers, through
``get_state_dict``/``set_state_dict``, the ``Stateful`` recipe and ``async_save``."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import hybridcomm
from hybridcomm.sync.dcp import StatePieces
from multiproc import run_ranks

EPS32 = torch.finfo(torch.float32).eps
TOL = 64 * EPS32  # summation order differs from one process: a few roundings per step
STEPS, SAVED_AT = 6, 3
OPTIMIZERS = {  # element slices, and whole parameters
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 5))


def _batches(world, rank):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(12, 5, generator=g), torch.randn(12, 5, generator=g)
        out.append((x.chunk(world)[rank], y.chunk(world)[rank]))
    return out


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class _App(Stateful):
    """DCP's recipe: the model and optimizer as one Stateful."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state):
        set_state_dict(
            self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )


def _elements_handed_to_dcp(optim_state) -> int:
    """Per-element state this rank hands DCP: its pieces of element-sliced state and
    the whole parameters' tensors it owns."""
    total = 0
    for entry in optim_state["state"].values():
        for v in entry.values():
            if isinstance(v, StatePieces):
                total += v.pieces_numel()
            elif torch.is_tensor(v) and v.dim():
                total += v.numel()
    return total


def _job(rank, world, name, mode, path, overlap, simulate=False):
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    model = _model()
    opt = hybridcomm.DistributedOptimizer(
        OPTIMIZERS[name](model.parameters()),
        model=model,
        shard="optimizer",
        overlap=overlap,
        fusion_bytes=200,
        cost_model="default",
        timeout=30,
    )
    batches = _batches(world, rank)
    app = {"app": _App(model, opt)}
    if mode == "save":
        _train(model, opt, batches[:SAVED_AT])
        handed = _elements_handed_to_dcp(get_state_dict(model, opt)[1])
        if overlap == "forward":
            dcp.async_save(app, checkpoint_id=path).result()
        else:
            dcp.save(app, checkpoint_id=path)
        _train(model, opt, batches[SAVED_AT:])
        out = (_flat(model), handed)
    else:
        dcp.load(app, checkpoint_id=path)
        _train(model, opt, batches[SAVED_AT:])
        out = (_flat(model), opt.plan.world_size)
    opt.close()
    return out


def _plain_resume(name, path):
    """Plain torch, one process, from the sharded checkpoint."""
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    app = {"app": _App(model, opt)}
    dcp.load(app, checkpoint_id=path)
    _train(model, opt, _batches(1, 0)[SAVED_AT:])
    return _flat(model)


def _one_process(name):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    _train(model, opt, _batches(1, 0))
    replicated = sum(
        v.numel()
        for st in opt.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.dim()
    )
    return _flat(model), replicated


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize(
    "overlap,simulate", [("forward", False), ("backward", False), ("forward", True)],
    ids=["forward-host", "backward-host", "forward-simgpu"],
)  # fmt: skip
@pytest.mark.timeout(240)  # a job saves, three jobs resume
def test_a_dcp_checkpoint_holds_each_ranks_part_and_resumes_anywhere(
    tmp_path, name, overlap, simulate
):
    ref, replicated = _one_process(name)
    path = str(tmp_path / "ckpt")
    saved = run_ranks(2, _job, name, "save", path, overlap, simulate, timeout=180)
    # each rank handed DCP its part alone: together the state once, no rank all of it
    handed = [h for _, h in saved]
    assert sum(handed) == replicated and max(handed) < replicated, handed
    for params, _ in saved:
        assert torch.allclose(params, ref, rtol=TOL, atol=TOL)
    for world in (2, 3):  # the same world size, and another
        resumed = run_ranks(world, _job, name, "resume", path, overlap, simulate, timeout=180)
        for params, plan_world in resumed:
            assert torch.equal(params, resumed[0][0]) and plan_world == world
            assert torch.allclose(params, ref, rtol=TOL, atol=TOL), (params - ref).abs().max()
    assert torch.allclose(_plain_resume(name, path), ref, rtol=TOL, atol=TOL)
