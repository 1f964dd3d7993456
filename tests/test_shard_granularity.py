"""Sharded state for every optimizer: element slices where the optimizer is known to
be element-wise, whole parameters for every other (Adafactor, Muon, a LARS and a
Lion written here), in every shard mode and overlap mode, against one process.

Each rank trains on its shard of the same global batches; the reference is one
process on the whole batch. No parameter's size is divided by 2 or 3 (35, 7, 77,
11, 55, 5 elements), and the buckets are small, so element slices cut parameters
in the middle and whole-parameter parts are uneven."""

import os

import pytest
import torch
import torch.nn as nn

import hybridcomm
from hybridcomm import HybridCommError
from multiproc import run_ranks

EPS32 = torch.finfo(torch.float32).eps
TOL = 64 * EPS32  # summation order differs from one process: a few roundings per step
STEPS = 4


class LARS(torch.optim.Optimizer):
    """SGD with momentum scaled per tensor by the trust ratio ||w|| / ||g|| (You et
    al. 2017): a norm of the whole parameter, so a slice of it steps wrong."""

    def __init__(self, params, lr=0.05, momentum=0.9, trust=0.02):
        super().__init__(params, dict(lr=lr, momentum=momentum, trust=trust))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                w_norm, g_norm = p.norm(), p.grad.norm()
                ratio = group["trust"] * w_norm / g_norm if w_norm > 0 and g_norm > 0 else 1.0
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad, alpha=float(ratio))
                p.add_(buf, alpha=-group["lr"])


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): the sign of an interpolated momentum; element-wise,
    but a class the library cannot know: whole parameters unless declared."""

    def __init__(self, params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(m.mul(b1).add(p.grad, alpha=1 - b1).sign_(), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def _muon_and_adamw(model):
    """Muon for the 2-D hidden weights, AdamW for the rest (the head and biases),
    as Muon's users run it: two optimizers over one model."""
    hidden = [model[0].weight, model[2].weight]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=0.01)]


OPTIMIZERS = {
    "sgd": lambda m: [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True)],
    "adam": lambda m: [torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=True)],
    "adamw": lambda m: [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)],
    "adamax": lambda m: [torch.optim.Adamax(m.parameters(), lr=0.01)],
    "nadam": lambda m: [torch.optim.NAdam(m.parameters(), lr=0.01)],
    "radam": lambda m: [torch.optim.RAdam(m.parameters(), lr=0.01)],
    "adagrad": lambda m: [torch.optim.Adagrad(m.parameters(), lr=0.05)],
    "adadelta": lambda m: [torch.optim.Adadelta(m.parameters(), lr=0.5)],
    "rmsprop": lambda m: [torch.optim.RMSprop(m.parameters(), lr=0.01, centered=True)],
    "rprop": lambda m: [torch.optim.Rprop(m.parameters(), lr=0.01)],
    "asgd": lambda m: [torch.optim.ASGD(m.parameters(), lr=0.05, t0=2)],
    "adafactor": lambda m: [torch.optim.Adafactor(m.parameters(), lr=0.01)],
    "muon+adamw": _muon_and_adamw,
    "lars": lambda m: [LARS(m.parameters())],
    "lion": lambda m: [Lion(m.parameters())],
}
# What the library chooses without shard_by
WHOLE = {"adafactor", "muon+adamw", "lars", "lion"}
SHARDS = (None, "optimizer", "gradients")
OVERLAPS = ("forward", "backward", "none")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 5))


def _batches(world, rank, steps=STEPS):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        x, y = torch.randn(12, 5, generator=g), torch.randn(12, 5, generator=g)
        out.append((x.chunk(world)[rank], y.chunk(world)[rank]))
    return out


def _train(model, opts, batches):
    for x, y in batches:
        for opt in opts:
            opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for opt in opts:
            opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _state_elements(opt):
    """Per-element state this rank keeps (tensors shaped as the parameters or their
    slices), and the parameters it holds state for."""
    return sum(
        v.numel()
        for st in opt.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.dim()
    )


def _reference(name):
    model = _model()
    return _train(model, OPTIMIZERS[name](model), _batches(1, 0))


def _ranks(rank, world, simulate, names):
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    out = {}
    for name in names:
        for shard in SHARDS:
            for overlap in OVERLAPS:
                model = _model()
                opts = [
                    hybridcomm.DistributedOptimizer(
                        opt,
                        model=model,
                        overlap=overlap,
                        shard=shard,
                        fusion_bytes=200,
                        cost_model="default",
                        timeout=30,
                    )
                    for opt in OPTIMIZERS[name](model)
                ]
                params = _train(model, opts, _batches(world, rank))
                notes = " ".join(n for opt in opts for n in opt.plan.notes)
                out[(name, shard, overlap)] = (params, notes, [_state_elements(o) for o in opts])
                for opt in opts:
                    opt.close()
    return out


def _check(results, names):
    for name in names:
        ref = _reference(name)
        for shard in SHARDS:
            for overlap in OVERLAPS:
                case = (name, shard, overlap)
                got = [r[case] for r in results]
                for rank, (params, notes, _) in enumerate(got):
                    assert torch.equal(params, got[0][0]), (case, rank)  # bitwise across ranks
                    diff = (params - ref).abs().max().item()
                    tol = MUON_TOL if name == "muon+adamw" else TOL
                    assert torch.allclose(params, ref, rtol=tol, atol=tol), (case, rank, diff)
                    if shard is not None:  # the plan says which granularity, and why
                        chosen = {"parameters"} if name in WHOLE else {"elements"}
                        chosen |= {"elements"} if name == "muon+adamw" else set()  # AdamW's
                        for kind in chosen:
                            assert f"state sharded by {kind}" in notes, (case, notes)
                if shard is not None:  # the ranks' states split one process's: none twice
                    whole = results[0][(name, None, overlap)][2]
                    split = [sum(r[case][2][k] for r in results) for k in range(len(whole))]
                    assert split == whole, (case, [r[case][2] for r in results], whole)


# Muon orthogonalizes its momentum in bfloat16 (torch's Newton-Schulz): where the
# reduced gradient differs from one process's by a rounding of fp32, its bf16 cast
# can land one bf16 ulp (2^-8 relative) apart, and five iterations spread that
# over the matrix. An update is lr (0.02) times entries of magnitude <= ~1.2, so
# each step may move a parameter by up to lr * 1.2 * 2^-8 * (a handful of ulps)
MUON_TOL = STEPS * 0.02 * 1.2 * 8 * 2**-8

GROUP_A = ["sgd", "adam", "adamw", "adamax", "nadam", "radam", "adagrad", "adadelta"]
GROUP_B = ["rmsprop", "rprop", "asgd", "adafactor", "muon+adamw", "lars", "lion"]


@pytest.mark.parametrize(
    "world,simulate",
    [(2, False), (3, False), (2, True)],
    ids=["P2-host", "P3-host", "P2-simgpu"],
)
@pytest.mark.parametrize("names", [GROUP_A, GROUP_B], ids=["elementwise", "rest"])
@pytest.mark.timeout(300)  # every optimizer x granularity x overlap mode
def test_every_optimizer_sharded_either_way_gives_one_process_numbers(world, simulate, names):
    results = run_ranks(world, _ranks, simulate, names, timeout=600)
    _check(results, names)


def _refused(rank, world):
    model = _model()
    made = {
        "shard_by='elements' with Adafactor": lambda: torch.optim.Adafactor(model.parameters()),
        "shard_by='elements' with Muon": lambda: torch.optim.Muon([model[0].weight]),
    }
    errors = {}
    for what, make in made.items():
        try:
            hybridcomm.DistributedOptimizer(
                make(), model=model, shard="optimizer", shard_by="elements", timeout=30
            ).close()
            errors[what] = None
        except HybridCommError as e:
            errors[what] = str(e)
    try:
        hybridcomm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model=model, shard_by="parameters"
        ).close()
        errors["shard_by without shard"] = None
    except ValueError as e:
        errors["shard_by without shard"] = str(e)
    # nothing hangs: the ranks go on together
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.Adafactor(model.parameters()), model=model, shard="optimizer", timeout=30
    )
    _train(model, [opt], _batches(world, rank)[:1])
    opt.close()
    return errors


def test_a_granularity_that_cannot_work_is_refused_on_every_rank_at_construction():
    for errors in run_ranks(2, _refused, timeout=120):
        for what, error in errors.items():
            assert error is not None and "shard_by" in error, (what, error)
        assert "needs whole tensors" in errors["shard_by='elements' with Adafactor"]
        assert "needs shard=" in errors["shard_by without shard"]
