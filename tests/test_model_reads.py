"""Issue 27: whatever reads the model between ``opt.step()`` and the next forward
sees what one process on the whole batch would see, in every overlap mode and
every step, and the wrapped model stays an ordinary ``nn.Module``.

Each pattern is a function ``pattern(loop)`` in the style of
tests/test_training_loops.py (whose loops, models and helpers this file
reuses): it runs on P ranks through ``hybridcomm.DistributedOptimizer`` and in
one process (the reference), and returns what it trained *and what it read*
(the EMA model, logged norms, state_dict values, evaluations, a deep copy's or
a torch.load-ed copy's parameters, a checkpoint's contents). Those values must
match the reference (64 fp32 eps) and be bitwise equal across ranks.

The patterns:

- ``ema_*``: an EMA updated right after every ``step()``, reading ``param``
  (timm's ModelEmaV3 style: ``ema_p.lerp_(p, 1 - decay)``) or ``param.data``
  (DiT's ``update_ema``: ``mul_(decay).add_(param.data, alpha=1 - decay)``),
  the EMA model made with ``copy.deepcopy(model)`` before or after wrapping.
- ``torch_save_whole_module`` / ``deepcopy_whole_module``: a copy of the whole
  module right after ``step()`` (inside and after the measured steps):
  ``torch.save(model, buffer)`` then ``torch.load(weights_only=False)``, or
  ``copy.deepcopy(model)``; the copies' parameters and outputs.
- ``late_reads_*``: reads that start only at step ``LATE_FROM`` (after the
  library's measured steps, measure_iters=2), one kind per pattern so that no
  read applies an update another one should have: ``p.norm()``,
  ``p.data.norm()``, ``p.detach().norm()``, ``model.state_dict()`` values, a
  ``torch.no_grad()`` evaluation.
- module objects replaced after wrapping, keeping the Parameter objects:
  ``SyncBatchNorm.convert_sync_batchnorm`` (the BatchNorm in eval mode: a
  shard's batch statistics are not the whole batch's, and SyncBatchNorm in
  train mode needs a process group in forward), right after wrapping and at
  step ``LATE_FROM``; an adapter around a Linear (same parameters, plus new
  ones the optimizer does not hold: they stay as they are); a new head whose
  parameters join through ``add_param_group``.
- ``torch.compile`` (backend ``COMPILE_BACKEND``, aot_eager): the compiled
  module passed as ``model=`` (compiled before wrapping), or compiled after
  wrapping and trained through; its outputs from step ``LATE_FROM`` on.
- ``step_calls_adam``: the ``step()`` calls a plain optimizer allows: before any
  backward, after ``zero_grad()`` with no backward, twice on the same gradients.
- ``resume_*`` (Horovod's pattern): rank 0 alone writes ``model.state_dict()``
  and ``opt.state_dict()``; training goes on, or a restarted job (a fresh model
  and optimizer on every rank, initialized differently per rank) has rank 0
  alone load them, then ``broadcast_optimizer_state`` and
  ``broadcast_parameters`` on every rank (a no-op in one process; plain
  torch.distributed broadcasts for ManualDataParallel). These run with
  ``timeout=RESUME_TIMEOUT`` so that a hang fails fast. ``resume_topk_*``
  (compression="topk:0.3", overlap="backward", whatever the run's overlap) only
  has to complete with the ranks bitwise equal: top-k is not one process's
  arithmetic.

The matrix (``COMBOS``), economical because ``make test`` runs on 2 cores:
forward mode at P = 3 with a bucket per layer (fusion_bytes=0, buckets applied
one layer at a time) on the host and on the simulated GPU
(HYBRIDCOMM_SIMULATE_GPU=1, set in the ranks), each with HYBRIDCOMM_DEFER=always
(forward mode's deferral kept on after the measured steps, so reads after them
meet deferred updates) and with it unset (deferral as the measured steps
decide); backward and none modes at P = 2 with the library's own plan, on the
host. Every pattern runs in one ``run_ranks`` launch per combination (the
torch.compile ones on the host only: ``HOST_ONLY``); a test id holds ``simgpu``
where the GPU path is simulated (the Makefile runs those under coverage).
ManualDataParallel (no hybridcomm) runs every pattern at P = 3 to show that the
references and the sharding are right.
"""

import copy
import functools
import io
import os

import pytest
import torch

# What every compiling rank would import (1.3 CPU-s here), imported once in this
# process: the ranks it forks inherit it (tests/conftest.py does so for torch._dynamo).
import torch._dynamo.backends.common  # noqa: F401
import torch._inductor.pattern_matcher  # noqa: F401
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hybridcomm
from multiproc import run_ranks
from test_training_loops import (
    IN,
    OUT,
    STEPS,
    HybridComm,
    ManualDataParallel,
    Reference,
    _adam,
    _all_patterns,
    _flat,
    _mlp,
    _run,
    _sgd,
    _whole,
)
from test_training_loops import _compare as compare

DECAY = 0.8  # EMA decay: small, so that a stale read shows in a few steps
LATE_FROM = 3  # reads that start after the measured steps (measure_iters=2) and the re-plan
SAVE_STEPS = (1, LATE_FROM)  # whole-module copies: inside and after the measured steps
SAVE_AT = 2  # resume: rank 0 writes the checkpoint after this step
RESUME_TIMEOUT = 10  # the library's timeout in the resume patterns: a hang fails fast
# aot_eager: dynamo's capture (guards, graph breaks at the library's hooks, AOTAutograd)
# without inductor's C++ compile per graph and recompile, which takes seconds per rank
# on this 2-core machine (the library's hooks change between steps: recompiles).
COMPILE_BACKEND = "aot_eager"
# Patterns whose numbers are not one process's (top-k): the ranks must agree, that's all.
NO_REFERENCE = {"resume_topk_rank0_state_dict"}
# Patterns run on the host path only: torch.compile costs seconds per launch (more under
# coverage), and what it exercises (compiled code runs no __torch_function__; the library's
# hook on the model) is the same on the simulated GPU.
HOST_ONLY = {"compile_before_wrap", "compile_after_wrap"}


# --------------------------------------------------------------------------- runs
# The loops of test_training_loops, with what these patterns need besides:
# wrap(..., **options) (extra DistributedOptimizer options; one process ignores
# them), ``rank``, ``from_root(obj)`` (rank 0's object on every rank: to return
# a checkpoint only rank 0 wrote), ``broadcast_optimizer_state(opt)``,
# ``broadcast_parameters(state_dict)`` and ``retire(opt)`` (a restarted job
# drops its old optimizer).


class OneProcess(Reference):
    rank = 0

    def wrap(self, optimizer, model, **options):
        return optimizer

    def from_root(self, obj):
        return obj

    def broadcast_optimizer_state(self, opt):
        pass

    def broadcast_parameters(self, state):
        pass

    def retire(self, opt):
        pass


def _from_root(loop, obj):
    box = [obj]
    src = 0 if loop.group is None else dist.get_global_rank(loop.group, 0)
    dist.broadcast_object_list(box, src=src, group=loop.group)
    return box[0]


class Hybrid(HybridComm):
    def wrap(self, optimizer, model, **options):
        kwargs = dict(overlap=self.overlap, measure_iters=2, timeout=60, process_group=self.group)
        kwargs.update(self.options)
        kwargs.update(options)
        opt = hybridcomm.DistributedOptimizer(optimizer, model=model, **kwargs)
        self.opts.append(opt)
        return opt

    from_root = _from_root

    def broadcast_optimizer_state(self, opt):
        hybridcomm.broadcast_optimizer_state(
            opt, root_rank=0, process_group=self.group, timeout=RESUME_TIMEOUT
        )

    def broadcast_parameters(self, state):
        hybridcomm.broadcast_parameters(
            state, root_rank=0, process_group=self.group, timeout=RESUME_TIMEOUT
        )

    def retire(self, opt):
        self.opts.remove(opt)
        opt.close()


class Manual(ManualDataParallel):
    def wrap(self, optimizer, model, **options):
        return super().wrap(optimizer, model)

    from_root = _from_root

    def broadcast_optimizer_state(self, opt):
        state = self.from_root(opt.state_dict() if self.rank == 0 else None)
        if self.rank != 0:
            opt.load_state_dict(state)

    def broadcast_parameters(self, state):
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        for t in state.values():
            dist.broadcast(t, src=src, group=self.group)

    def retire(self, opt):
        pass


# ------------------------------------------------------------------------- models


class Net(nn.Module):
    """inp -> (BatchNorm) -> fc -> out, and a ``head`` once one is set."""

    def __init__(self, bn=False):
        super().__init__()
        self.inp = nn.Linear(IN, 16)
        self.bn = nn.BatchNorm1d(16) if bn else nn.Identity()
        self.fc = nn.Linear(16, 16)
        self.out = nn.Linear(16, OUT)
        self.head = None

    def forward(self, x):
        h = torch.tanh(self.bn(self.inp(x)))
        out = self.out(torch.tanh(self.fc(h)))
        return out if self.head is None else out + self.head(torch.tanh(out))


class Adapter(nn.Module):
    """Wraps a Linear (its parameters as they are) and adds a bottleneck of its own."""

    def __init__(self, base, rank=4):
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.out_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        h = self.base(x)
        return h + self.up(torch.tanh(self.down(h)))


def _iteration(model, opt, loop, seed):
    x, y = map(loop.data, _whole(seed, (IN,), (OUT,)))
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def _x_eval(seed):
    return _whole(seed, (IN,))[0]


# ----------------------------------------------------------------------- patterns
# Each returns what it trained and what it read (modules, or tensors).


@torch.no_grad()
def _ema_lerp(ema, model):
    """timm ModelEmaV3's update (over parameters)."""
    for ema_p, p in zip(ema.parameters(), model.parameters()):
        ema_p.lerp_(p, 1.0 - DECAY)


@torch.no_grad()
def _ema_dit(ema, model):
    """DiT's update_ema: reads ``param.data``."""
    ema_params = dict(ema.named_parameters())
    for name, param in model.named_parameters():
        ema_params[name].mul_(DECAY).add_(param.data, alpha=1 - DECAY)


def ema(loop, update, copy_after_wrap):
    torch.manual_seed(11)
    model = _mlp(IN, 16, 16, OUT)
    if not copy_after_wrap:
        ema_model = copy.deepcopy(model)
    opt = loop.wrap(_sgd(model.parameters()), model)
    if copy_after_wrap:
        ema_model = copy.deepcopy(model)
    ema_model.requires_grad_(False)
    for s in range(STEPS):
        _iteration(model, opt, loop, 11000 + s)
        update(ema_model, model)
    return [model, ema_model]


def _torch_save_load(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def snapshot(loop, copy_model):
    """A copy of the whole module right after step() (``copy_model``: torch.save +
    torch.load, or copy.deepcopy), inside and after the measured steps; the
    copies' parameters at the end (training went on without them) and outputs."""
    torch.manual_seed(12)
    model = _mlp(IN, 16, 16, OUT)
    opt = loop.wrap(_sgd(model.parameters()), model)
    x_eval, copies, outputs = _x_eval(12999), [], []
    for s in range(STEPS):
        _iteration(model, opt, loop, 12000 + s)
        if s in SAVE_STEPS:
            copied = copy_model(model)
            with torch.no_grad():
                outputs.append(copied(x_eval))
            copies.append(copied)
    return [model, *copies, *outputs]


def _read_norm(model, x):
    return torch.stack([p.norm() for p in model.parameters()])


def _read_data_norm(model, x):
    return torch.stack([p.data.norm() for p in model.parameters()])


def _read_detach_norm(model, x):
    return torch.stack([p.detach().norm() for p in model.parameters()])


def _read_state_dict(model, x):
    return torch.cat([v.reshape(-1).clone() for v in model.state_dict().values()])


def _read_eval(model, x):
    with torch.no_grad():
        return model(x)


def late_reads(loop, read):
    """From step LATE_FROM on, after every step(): ``read(model)`` logged."""
    torch.manual_seed(13)
    model = _mlp(IN, 16, 16, OUT)
    opt = loop.wrap(_sgd(model.parameters()), model)
    x_eval, logged = _x_eval(13999), []
    for s in range(STEPS):
        _iteration(model, opt, loop, 13000 + s)
        if s >= LATE_FROM:
            logged.append(read(model, x_eval).detach().clone())
    return [model, torch.stack(logged)]


def sync_batchnorm(loop, at):
    """convert_sync_batchnorm after wrapping: the BatchNorm module is replaced,
    its Parameters kept (eval mode: the running statistics, no process group)."""
    torch.manual_seed(14)
    model = Net(bn=True)
    model.bn.eval()
    opt = loop.wrap(_sgd(model.parameters()), model)
    bn_params = list(model.bn.parameters())
    for s in range(STEPS):
        if s == at:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            assert isinstance(model.bn, nn.SyncBatchNorm) and not model.bn.training
            assert all(a is b for a, b in zip(model.bn.parameters(), bn_params))
        _iteration(model, opt, loop, 14000 + s)
    return [model]


def adapter(loop, at):
    """``model.fc = Adapter(model.fc)``: the Linear's parameters, trained, plus
    new ones the optimizer does not hold (unchanged, as in one process)."""
    torch.manual_seed(15)
    model = Net()
    opt = loop.wrap(_sgd(model.parameters()), model)
    for s in range(STEPS):
        if s == at:
            torch.manual_seed(150)
            model.fc = Adapter(model.fc)
        _iteration(model, opt, loop, 15000 + s)
    return [model]


def new_head(loop, at):
    """A new module ``model.head`` whose parameters join the optimizer at step ``at``
    (add_param_group, every rank)."""
    torch.manual_seed(16)
    model = Net()
    opt = loop.wrap(_sgd(model.parameters()), model)
    for s in range(STEPS):
        if s == at:
            torch.manual_seed(160)
            model.head = nn.Linear(OUT, OUT)
            opt.add_param_group({"params": list(model.head.parameters()), "lr": 0.02})
        _iteration(model, opt, loop, 16000 + s)
    return [model]


def compiled(loop, before_wrap):
    """torch.compile before wrapping (the compiled module is ``model=``) or after."""
    torch._dynamo.reset()  # no cache entries (nor their recompile limit) from other patterns
    torch.manual_seed(17)
    model = _mlp(IN, 16, 16, OUT)
    if before_wrap:
        model = torch.compile(model, backend=COMPILE_BACKEND)
        opt = loop.wrap(_sgd(model.parameters()), model)
        run = model
    else:
        opt = loop.wrap(_sgd(model.parameters()), model)
        run = torch.compile(model, backend=COMPILE_BACKEND)
    x_eval, outputs = _x_eval(17999), []
    for s in range(STEPS):
        _iteration(run, opt, loop, 17000 + s)
        if s >= LATE_FROM:
            with torch.no_grad():
                outputs.append(run(x_eval))
    return [model, *outputs]


def step_calls(loop):
    """The step() calls a plain optimizer allows, with Adam: before any backward;
    after zero_grad() with no backward (both: nothing to do); a second step on
    the same gradients (Adam steps again)."""
    torch.manual_seed(18)
    model = _mlp(IN, 16, 16, OUT)
    opt = loop.wrap(_adam(model.parameters()), model)
    opt.step()
    _iteration(model, opt, loop, 18000)
    opt.zero_grad()
    opt.step()
    _iteration(model, opt, loop, 18001)
    opt.step()
    _iteration(model, opt, loop, 18002)
    opt.step()
    _iteration(model, opt, loop, 18003)
    return [model]


def _checkpoint_values(state):
    """The tensors of {"model": state_dict, "optimizer": state_dict} (hybridcomm's
    own part of the optimizer's left out: one process has none)."""
    model = [state["model"][k] for k in sorted(state["model"])]
    opt = state["optimizer"]["state"]
    return model + [
        v
        for i in sorted(opt)
        for k, v in sorted(opt[i].items())
        if isinstance(v, torch.Tensor) and not k.startswith("hc_")
    ]


def resume(loop, restart):
    """Horovod's checkpointing: rank 0 alone saves model.state_dict() and
    opt.state_dict() after step SAVE_AT; training goes on, or (``restart``) a new
    job's model and optimizer (made anew on every rank, initialized differently
    per rank) take it: rank 0 alone loads it, then the broadcasts."""
    torch.manual_seed(19)
    model = _mlp(IN, 16, OUT)
    opt = loop.wrap(_adam(model.parameters()), model, timeout=RESUME_TIMEOUT)
    checkpoint = None
    for s in range(STEPS):
        if restart and s == SAVE_AT + 1:
            loop.retire(opt)
            torch.manual_seed(190 + loop.rank)
            model = _mlp(IN, 16, OUT)
            opt = loop.wrap(_adam(model.parameters()), model, timeout=RESUME_TIMEOUT)
            if loop.rank == 0:
                state = torch.load(io.BytesIO(checkpoint))
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
            loop.broadcast_optimizer_state(opt)
            loop.broadcast_parameters(model.state_dict())
        _iteration(model, opt, loop, 19000 + s)
        if s == SAVE_AT and loop.rank == 0:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
            checkpoint = buffer.getvalue()
    saved = torch.load(io.BytesIO(loop.from_root(checkpoint)))
    return [model, *_checkpoint_values(saved)]


def resume_topk(loop):
    """Rank 0 alone calls opt.state_dict() with top-k compression (overlap="backward"),
    then training goes on: it must complete, every rank alike."""
    torch.manual_seed(20)
    model = _mlp(IN, 16, OUT)
    opt = loop.wrap(
        _sgd(model.parameters()),
        model,
        compression="topk:0.3",
        overlap="backward",
        timeout=RESUME_TIMEOUT,
    )
    checkpoint = None
    for s in range(STEPS):
        _iteration(model, opt, loop, 20000 + s)
        if s == SAVE_AT and loop.rank == 0:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
            checkpoint = buffer.getvalue()
    saved = torch.load(io.BytesIO(loop.from_root(checkpoint)))
    return [model, *saved["model"].values()]


P = functools.partial
PATTERNS = {
    "ema_param_copy_before_wrap": P(ema, update=_ema_lerp, copy_after_wrap=False),
    "ema_param_copy_after_wrap": P(ema, update=_ema_lerp, copy_after_wrap=True),
    "ema_param_data_copy_before_wrap": P(ema, update=_ema_dit, copy_after_wrap=False),
    "ema_param_data_copy_after_wrap": P(ema, update=_ema_dit, copy_after_wrap=True),
    "torch_save_whole_module": P(snapshot, copy_model=_torch_save_load),
    "deepcopy_whole_module": P(snapshot, copy_model=copy.deepcopy),
    "late_reads_norm": P(late_reads, read=_read_norm),
    "late_reads_data_norm": P(late_reads, read=_read_data_norm),
    "late_reads_detach_norm": P(late_reads, read=_read_detach_norm),
    "late_reads_state_dict": P(late_reads, read=_read_state_dict),
    "late_reads_no_grad_eval": P(late_reads, read=_read_eval),
    "sync_batchnorm_after_wrap": P(sync_batchnorm, at=0),
    f"sync_batchnorm_at_step{LATE_FROM}": P(sync_batchnorm, at=LATE_FROM),
    f"adapter_at_step{LATE_FROM}": P(adapter, at=LATE_FROM),
    f"new_head_add_param_group_at_step{LATE_FROM}": P(new_head, at=LATE_FROM),
    "compile_before_wrap": P(compiled, before_wrap=True),
    "compile_after_wrap": P(compiled, before_wrap=False),
    "step_calls_adam": step_calls,
    "resume_rank0_save_continue": P(resume, restart=False),
    "resume_rank0_load_restart": P(resume, restart=True),
    "resume_topk_rank0_state_dict": resume_topk,
}


# ------------------------------------------------------------------ the harness
# As in test_training_loops (its helpers), over this file's PATTERNS.


def _names(simulate):
    return [name for name in PATTERNS if not (simulate and name in HOST_ONLY)]


def _hybridcomm(rank, world, overlap, simulate, fusion_bytes, defer, measure_iters=2):
    for var, value in (
        ("HYBRIDCOMM_SIMULATE_GPU", "1" if simulate else None),
        ("HYBRIDCOMM_DEFER", defer),
    ):
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    return _all_patterns(
        rank,
        world,
        lambda r, w, g: Hybrid(r, w, g, overlap, fusion_bytes, measure_iters=measure_iters),
        PATTERNS,
        _names(simulate),
    )


def _manual(rank, world):
    return _all_patterns(rank, world, Manual, PATTERNS)


@functools.lru_cache(maxsize=None)
def _references():
    return {name: _run(OneProcess(), name, PATTERNS) for name in PATTERNS}


def _compare(results, names):
    return compare(results, _references(), names, NO_REFERENCE)


def test_references_really_exercise_their_patterns():
    """The references run (their own asserts included) and stay finite; what
    they read moves with training (a stale read would show)."""
    refs = _references()
    assert set(refs) == set(PATTERNS)
    for name, values in refs.items():
        assert torch.isfinite(values).all(), name
    ema_ref = PATTERNS["ema_param_copy_before_wrap"](OneProcess())
    assert not torch.equal(_flat(ema_ref[:1]), _flat(ema_ref[1:])), "the EMA equals the model"
    logged = PATTERNS["late_reads_norm"](OneProcess())[1]
    assert not torch.equal(logged[0], logged[-1]), "the norms do not change"


def test_manual_data_parallel_matches_the_references():
    """Plain torch.distributed all-reduces (and broadcasts) give the references'
    numbers: the references and the sharding are right."""
    failures = _compare(run_ranks(3, _manual, timeout=300, allow_errors=True), list(PATTERNS))
    assert not failures, "\n".join(failures)


# (world, overlap, simulated GPU, fusion_bytes, HYBRIDCOMM_DEFER): see the docstring.
COMBOS = [
    (3, "forward", simulate, 0, defer) for simulate in (False, True) for defer in ("always", None)
] + [(2, overlap, False, None, None) for overlap in ("backward", "none")]


def _id(world, overlap, simulate, fusion_bytes, defer):
    return (
        f"P{world}-{overlap}-{'simgpu' if simulate else 'host'}"
        + ("-layer_buckets" if fusion_bytes == 0 else "")
        + (f"-defer_{defer or 'measured'}" if overlap == "forward" else "")
    )


@pytest.mark.timeout(180)  # every read at up to 3 ranks
@pytest.mark.parametrize(
    "world,overlap,simulate,fusion_bytes,defer", COMBOS, ids=[_id(*c) for c in COMBOS]
)
def test_model_reads_match_one_process(world, overlap, simulate, fusion_bytes, defer):
    results = run_ranks(
        world, _hybridcomm, overlap, simulate, fusion_bytes, defer, timeout=300, allow_errors=True
    )
    failures = _compare(results, _names(simulate))
    assert not failures, (
        f"{len(failures)} failures in {len(_names(simulate))} patterns:\n" + "\n".join(failures)
    )


def test_model_reads_match_one_process_with_lean_hooks():
    """No measured steps (measure_iters=0), forward mode with its updates always
    deferred: the reads after step() (EMA, copies, saves, compile) come while
    only each bucket's closer has its post-accumulate hook (grad_hooks.py)."""
    results = run_ranks(
        3, _hybridcomm, "forward", False, 0, "always", 0, timeout=300, allow_errors=True
    )
    failures = _compare(results, _names(False))
    assert not failures, "\n".join(failures)


# Sharded optimizer state (issue 40): in forward mode each bucket's parameters
# wait for their all-gather, so every read above sees one process's values.
# Left out, as docs/API.md says: the resume patterns save on rank 0 alone
# (under shard, state_dict() is a collective), and step_calls_adam's second
# step() on the same gradients (step() consumes them: .grad is None after it).
SHARDED = [
    name for name in PATTERNS if not name.startswith("resume_") and name != "step_calls_adam"
]
SHARD_COMBOS = [(2, "optimizer", False), (2, "gradients", True)]  # (P = 3: test_shard.py)


def _sharded(rank, world, shard, simulate):
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    names = [n for n in SHARDED if not (simulate and n in HOST_ONLY)]
    return _all_patterns(
        rank, world, lambda r, w, g: Hybrid(r, w, g, "forward", 0, shard=shard), PATTERNS, names
    )


@pytest.mark.timeout(180)  # every read, sharded
@pytest.mark.parametrize(
    "world,shard,simulate",
    SHARD_COMBOS,
    ids=[f"P{w}-{s}-{'simgpu' if g else 'host'}" for w, s, g in SHARD_COMBOS],
)
def test_model_reads_with_sharded_state(world, shard, simulate):
    names = [n for n in SHARDED if not (simulate and n in HOST_ONLY)]
    failures = _compare(
        run_ranks(world, _sharded, shard, simulate, timeout=300, allow_errors=True), names
    )
    assert not failures, "\n".join(failures)
