"""Forward mode never trains on a stale weight, whatever reads the parameter:
a parent's ``F.linear(x, self.head.weight)``, the loss, code between ``step()``
and the next forward (an EMA), a module called twice, a weight shared by two
modules, a layer the watched forwards skip, a layer that joins after the
measured steps. Each is compared with one process on the whole batch."""

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridcomm
from multiproc import run_ranks
from hybridcomm.sync.pending import is_pending
from optim_models import batch, flat, shard

STEPS = 6
TOL = dict(rtol=64 * torch.finfo(torch.float32).eps, atol=64 * torch.finfo(torch.float32).eps)


class ParentUsesChildWeight(nn.Module):
    """``head``'s forward never runs: the root reads its weight directly."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(72, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.body(x.flatten(1)))
        return F.linear(h, self.head.weight, self.head.bias)


class LossOnlyParameter(nn.Module):
    """``calib.temperature`` is read only by the loss, outside ``model(x)``; its
    owner's forward never runs."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(72, 3)
        self.calib = nn.Module()
        self.calib.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.body(x.flatten(1))


class CalledTwiceAndShared(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(72, 8)
        self.block = nn.Linear(8, 8)  # called twice
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight  # shared by two modules
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x.flatten(1)))
        h = torch.tanh(self.block(torch.tanh(self.block(h))))
        return self.out(self.b(self.a(h)))


class SometimesUsed(nn.Module):
    """``branch`` is skipped by the 2nd and 3rd forward, the ones forward mode
    watches to learn first uses, and used by every other: a use it never saw."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(72, 8)
        self.branch = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.body(x.flatten(1)))
        if self.calls not in (2, 3):
            h = torch.tanh(self.branch(h))
        return self.out(h)


class LateJoinerParentReads(nn.Module):
    """``extra`` joins the optimizer after the measured steps (the next forward is
    watched again, while updates are applied in batches) and is read by the
    root (its owner's forward never runs)."""

    JOIN_STEP = 3

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(72, 16)
        self.head = nn.Linear(16, 3)
        self.extra = nn.Linear(3, 3)
        self.extra.requires_grad_(False)

    def forward(self, x):
        out = self.head(torch.relu(self.body(x.flatten(1))))
        return out + F.linear(out, self.extra.weight, self.extra.bias)

    def join(self, opt):
        self.extra.requires_grad_(True)
        opt.add_param_group({"params": list(self.extra.parameters())})


MODELS = {
    "parent": ParentUsesChildWeight,
    "loss": LossOnlyParameter,
    "twice": CalledTwiceAndShared,
    "ema": ParentUsesChildWeight,
    "sometimes": SometimesUsed,
    "late_joiner": LateJoinerParentReads,
}


def _loss(model, out, y):
    t = model.calib.temperature if hasattr(model, "calib") else None
    return F.mse_loss(out * t if t is not None else out, y)


def _run(name, opt, model, rank, world, ema):
    for s in range(STEPS):
        x, y = batch(s)
        if rank is not None:
            x, y = shard(x, rank, world), shard(y, rank, world)
        if s == getattr(model, "JOIN_STEP", None):
            model.join(opt)
        opt.zero_grad()
        _loss(model, model(x), y).backward()
        opt.step()
        if ema is not None:  # read between step() and the next forward
            with torch.no_grad():
                for e, p in zip(ema, model.parameters()):
                    e.mul_(0.9).add_(p, alpha=0.1)


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _make(name):
    torch.manual_seed(0)
    return MODELS[name]()


def _distributed(rank, world, name, simulate):
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    model = _make(name)
    ema = [p.detach().clone() for p in model.parameters()] if name == "ema" else None
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(_trainable(model), lr=0.1, momentum=0.9),
        model=model,
        overlap="forward",
        fusion_bytes=0,
        measure_iters=2,
        timeout=60,
    )
    _run(name, opt, model, rank, world, ema)
    opt.synchronize()
    opt.close()
    return flat(model.parameters()), None if ema is None else flat(ema)


def _single(name):
    model = _make(name)
    ema = [p.detach().clone() for p in model.parameters()] if name == "ema" else None
    _run(name, torch.optim.SGD(_trainable(model), lr=0.1, momentum=0.9), model, None, 1, ema)
    return flat(model.parameters()), None if ema is None else flat(ema)


@pytest.mark.parametrize("simulate", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_forward_mode_matches_one_process(name, simulate):
    results = run_ranks(3, _distributed, name, simulate, timeout=180)
    ref, ref_ema = _single(name)
    params, ema = results[0]
    assert torch.allclose(params, ref, **TOL), f"max diff {(params - ref).abs().max():.3g}"
    if ref_ema is not None:
        assert torch.allclose(ema, ref_ema, **TOL), "EMA read stale weights"
    assert all(torch.equal(r[0], params) for r in results)


def _state_dict_after_step(rank, world):
    model = _make("parent")
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, overlap="forward", timeout=60
    )
    x, y = batch(0)
    opt.zero_grad()
    _loss(model, model(shard(x, rank, world)), shard(y, rank, world)).backward()
    opt.step()
    saved = flat(model.state_dict().values())  # a checkpoint right after step()
    opt.close()
    return saved


def test_a_checkpoint_right_after_step_holds_the_update():
    model = _make("parent")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0)
    _loss(model, model(x), y).backward()
    opt.step()
    want = flat(model.state_dict().values())
    for got in run_ranks(3, _state_dict_after_step):
        assert torch.allclose(got, want, **TOL)


def _optimizers_in_turn(rank, world):
    """Three steps with one optimizer, closed, then three with a new one on the same
    parameters: each step's update deferred to the next forward's first read."""
    os.environ["HYBRIDCOMM_DEFER"] = "always"
    model = _make("parent")
    plain_after_close = []
    for first in (0, 3):
        opt = hybridcomm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            overlap="forward",
            measure_iters=0,
            timeout=60,
        )
        for s in range(first, first + 3):
            x, y = batch(s)
            opt.zero_grad()
            _loss(model, model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        opt.close()  # applies the last step's update
        plain_after_close.append(not any(map(is_pending, model.parameters())))
    return flat(model.parameters()), plain_after_close


def test_a_new_optimizer_on_closed_ones_parameters_applies_its_own_deferred_updates():
    """A parameter keeps who applies its update from step to step (pending.py): a
    new optimizer must take that over, and close() must leave every parameter plain."""
    model = _make("parent")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(6):
        x, y = batch(s)
        opt.zero_grad()
        _loss(model, model(x), y).backward()
        opt.step()
    want = flat(model.parameters())
    for got, plain_after_close in run_ranks(2, _optimizers_in_turn):
        assert plain_after_close == [True, True]
        assert torch.allclose(got, want, **TOL), f"max diff {(got - want).abs().max():.3g}"


def _closed_after_a_freeze(rank, world):
    import gc
    import weakref

    os.environ["HYBRIDCOMM_DEFER"] = "always"
    model = _make("parent")
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        overlap="forward",
        measure_iters=0,
        timeout=60,
    )
    for s in range(4):
        if s == 2:
            model.body.requires_grad_(False)  # leaves the buckets at the next step
        x, y = batch(s)
        opt.zero_grad()
        _loss(model, model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    sync = weakref.ref(opt._hc_sync)
    opt.close()
    del opt
    gc.collect()
    return sync() is None


def test_a_closed_optimizer_is_freed_even_after_a_layer_left_its_buckets():
    """close() drops every registration of its deferred updates (pending.py), also
    a frozen layer's: a registration left behind would keep the synchronizer and
    its buckets' memory alive as long as that parameter lives."""
    assert run_ranks(2, _closed_after_a_freeze) == [True, True]


def _gradients_between_zero_grad_and_forward(opt, model, rank, world):
    """``.grad`` as one process has it while forward mode's updates wait: None after
    ``zero_grad()`` (the update still takes the reduced gradient; one set by hand
    before it is dropped too), a gradient set by hand after it kept, and a backward
    over a graph built before ``step()`` (the update goes first, autograd then
    starts a gradient of its own)."""
    seen, before_step = [], None
    for s in range(STEPS):
        x, y = batch(s)
        if rank is not None:
            x, y = shard(x, rank, world), shard(y, rank, world)
        if s % 3 == 2:
            model.head.weight.grad = torch.ones(model.head.weight.shape)  # (reads no data)
        opt.zero_grad()
        seen.append(
            (
                sum(map(is_pending, model.parameters())),
                all(p.grad is None for p in model.parameters()),
            )
        )
        if s % 3 == 1:  # (reads no data: set while the update is pending)
            model.body.bias.grad = torch.full(model.body.bias.shape, 0.01)
        if s % 3 == 2:
            before_step.backward()
        _loss(model, model(x), y).backward()
        before_step = (model.head.bias * 0.5).sum()  # saves no parameter
        opt.step()
    return flat(model.parameters()), seen


def _zeroed_while_pending(rank, world, simulate):
    os.environ["HYBRIDCOMM_DEFER"] = "always"
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    model = _make("parent")
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model=model,
        overlap="forward",
        measure_iters=0,
        timeout=60,
    )
    out = _gradients_between_zero_grad_and_forward(opt, model, rank, world)
    opt.synchronize()
    opt.close()
    return out


@pytest.mark.parametrize("simulate", [False, True])
def test_gradients_zeroed_while_an_update_waits_read_as_in_one_process(simulate):
    model = _make("parent")
    ref, ref_seen = _gradients_between_zero_grad_and_forward(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, None, 1
    )
    for params, seen in run_ranks(2, _zeroed_while_pending, simulate, timeout=120):
        assert torch.allclose(params, ref, **TOL), f"max diff {(params - ref).abs().max():.3g}"
        assert [none for _, none in seen] == [none for _, none in ref_seen]
        assert all(n == len(list(model.parameters())) for n, _ in seen[1:])  # all pending


def _compiled(model, how):
    if how == "optimized_module":
        return torch.compile(model, backend="aot_eager")
    if how == "compiled_function":
        return torch.compile(lambda x: model(x), backend="aot_eager")
    model.compile(backend="aot_eager")
    return model


@pytest.mark.parametrize("how", ["optimized_module", "compiled_function", "module_compile"])
@pytest.mark.parametrize("path", ["in_graph", "frame_walk"])
def test_a_compiled_forward_reads_each_pending_update_first(monkeypatch, path, how):
    """Compiled code calls no ``__torch_function__``. Where dynamo traces a pending
    parameter, each read in the graph first calls the operator that applies its
    update (``in_graph``: at run time, with functionalization's copy of the
    parameter filled too), whichever way the model was compiled. On a torch without
    dynamo's flags the model's pre-hook applies every update eagerly before the
    compiled forward, found by the walk of the frames (``frame_walk``), and no
    graph applies one. Each compiled forward gives the eager reference's output."""
    import torch._dynamo

    from hybridcomm.sync import compiled, pending

    hook = pending.ApplyBeforeCompiledForward
    monkeypatch.setattr(pending, "_tracing", pending._never)  # (not armed yet)
    monkeypatch.setattr(pending, "_in_compiled_module", pending._never)
    monkeypatch.setattr(pending, "_apply_before_compiled", pending._apply_all_before_compiled)
    monkeypatch.setattr(pending, "_resolve_eagerly", pending.resolve)
    monkeypatch.setattr(hook, "__call__", hook.__call__)
    if path == "frame_walk":
        monkeypatch.setattr(pending, "_IN_COMPILED_MODULE_FLAG", "not in this torch")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    model.register_forward_pre_hook(hook())
    params, applied = list(model.parameters()), []

    def apply(p):
        pending.release_all(params)
        applied.append(p)
        with torch.no_grad():
            for q in params:
                q.add_(0.5)

    run, x = _compiled(model, how), torch.randn(3, 4)
    try:
        for i in range(3):
            pending.defer(params, apply)
            assert pending._tracing is not pending._never or path == "frame_walk"  # armed
            in_graph = compiled.stats()["in_graph"]
            with torch.no_grad():
                for q in ref.parameters():
                    q.add_(0.5)
                out = run(x)
            assert len(applied) == i + 1 and not any(map(is_pending, params))
            assert torch.equal(out, ref(x))
            in_graph = compiled.stats()["in_graph"] - in_graph
            assert in_graph > 0 if path == "in_graph" else in_graph == 0, (path, in_graph)
    finally:
        pending.forget(apply)


@pytest.mark.parametrize(
    "read",
    [
        lambda ps, x: torch.cat([x, torch.stack([ps[0], ps[1]]).sum(0)]),  # in a list
        lambda ps, x: torch.add(input=x, other=ps[1]),  # keywords only
        lambda ps, x: torch.stack((ps[0], x)),  # in a tuple
        lambda ps, x: torch.einsum("i,i->i", x, ps[2]),  # after a str
        lambda ps, x: torch.nn.utils.parameters_to_vector([ps[0], ps[1], ps[2]]),
    ],
    ids=["list", "keywords", "tuple", "after_a_string", "a_function_of_a_list"],
)
def test_a_read_applies_the_update_of_every_pending_argument(read):
    """However a call passes a pending parameter (in a list or a tuple, by keyword,
    beside arguments that hold no tensor), the call sees its update."""
    from hybridcomm.sync import pending

    params = [nn.Parameter(torch.full((3,), float(i))) for i in range(3)]
    plain = [p.detach().clone() + 1 for p in params]

    def apply(p):
        pending.release_all(params)
        with torch.no_grad():
            for q in params:
                q.add_(1)

    x = torch.ones(3)
    try:
        pending.defer(params, apply)
        assert all(map(is_pending, params))
        out = read(params, x)
        assert not any(map(is_pending, params))
        assert torch.equal(out.detach(), read(plain, x))
    finally:
        pending.forget(apply)
