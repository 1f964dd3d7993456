"""torch.compile as people train with it, in every overlap mode, on 2 ranks against one
process on the whole batch: the whole model compiled (``fullgraph=True`` or not,
``torch.compile(model)`` or ``model.compile()``, or the compiled model handed to the
optimizer), each transformer block compiled alone with ``fullgraph=True``
(torchtitan's pattern), a compiled training step (and the same with
``fullgraph=True``: refused, with a message that names the optimizer's verb), and
compiled autograd (a smaller model: each of the library's hooks is a graph break
there, compiled piece by piece); then forward mode's three ways of keeping compiled
code off a stale weight (hybridcomm/sync/compiled.py), each checked by what it costs:

- a block compiled alone applies its parameters' updates as it begins: no update
  is applied inside a graph, and each block compiles once;
- the whole forward compiled: the updates are applied in ``step()`` (one graph);
- a pending parameter read inside a graph anyway (a block compiled after the
  optimizer was made, ``fullgraph=True``): the graph's own operator applies it
  first, and from the next step on the block's entry does.

Compiled autograd runs through the gradient guards of C++ (no environment
variable): one backward pass a step, micro-batches accumulated under ``no_sync()``,
and micro-batches each reduced in its own pass.

One ``run_ranks`` per (overlap mode, simulated GPU) runs every pattern in turn
inside the ranks (``torch._dynamo.reset()`` between them); the references run
once in the test process.
"""

import contextlib
import os
import traceback

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridcomm
from multiproc import run_ranks
from optim_models import flat, shard

STEPS = 4
BATCH = 8
WIDTH = 16
# Per-rank means, then the all-reduce: another summation order than one process.
# A few fp32 roundings a step, on values of order one.
TOL = dict(rtol=64 * torch.finfo(torch.float32).eps, atol=64 * torch.finfo(torch.float32).eps)
BACKEND = "aot_eager"  # functionalization included (forward mode's operator copies into it)
MODES = ("forward", "backward", "none")


class Blocks(nn.Module):
    """An input layer, two transformer encoder blocks, an output layer."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True)
            for _ in range(2)
        )
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h.mean(1))


def _model():
    torch.manual_seed(0)
    return Blocks()


def _batch(step, rank=None, world=1):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, 4, 6, generator=g), torch.randn(BATCH, 3, generator=g)
    return (x, y) if rank is None else (shard(x, rank, world), shard(y, rank, world))


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _reference(build=None):
    """One process's parameters after STEPS steps of the model ``build`` makes."""
    model = (build or _model)()
    opt = _sgd(model)
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return flat(model.parameters())


def _compile_blocks(model, fullgraph=True):
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=BACKEND, fullgraph=fullgraph)


def _compiled(model, pattern):
    """The model as the loop calls it; blocks compiled alone are compiled before
    the optimizer is made (torchtitan's order: _prepared)."""
    if pattern == "whole":
        return torch.compile(model, backend=BACKEND)
    if pattern == "whole_fullgraph":
        return torch.compile(model, backend=BACKEND, fullgraph=True)
    if pattern == "module_compile":
        model.compile(backend=BACKEND)
    return model


def _prepared(pattern):
    """The model the optimizer is given: compiled already for ``per_block`` and
    ``handed_compiled`` (the OptimizedModule itself)."""
    model = _model()
    if pattern == "per_block":
        _compile_blocks(model)
    if pattern == "handed_compiled":
        return torch.compile(model, backend=BACKEND, fullgraph=True)
    return model


def _train(opt, run, pattern, rank, world):
    """STEPS steps of ``run`` (the model as compiled); ``compiled_step`` compiles
    the whole step."""

    def step(x, y):
        opt.zero_grad()
        F.mse_loss(run(x), y).backward()
        opt.step()

    if pattern == "compiled_step":
        step = torch.compile(step, backend=BACKEND)
    for s in range(STEPS):
        step(*_batch(s, rank, world))


def _fullgraph_refusal(opt, run, rank, world):
    """What dynamo says to a training step compiled with ``fullgraph=True``: it must
    refuse the optimizer's verbs by name (they run eagerly), before running anything."""

    def step(x, y):
        opt.zero_grad()
        F.mse_loss(run(x), y).backward()
        opt.step()

    try:
        torch.compile(step, backend=BACKEND, fullgraph=True)(*_batch(0, rank, world))
    except Exception as e:  # noqa: BLE001 - dynamo's Unsupported, whatever its class
        return str(e)
    return "ran: nothing refused"


PATTERNS = (
    "whole",
    "whole_fullgraph",
    "handed_compiled",
    "module_compile",
    "per_block",
    "per_block_late",
    "compiled_step",
)  # (compiled autograd: test_compiled_autograd_in_every_loop)


def _every_pattern(rank, world, mode, simulate):
    """Each pattern in turn: its parameters after STEPS steps (or its error), and
    forward mode's counts (compiled.py's stats, the graphs dynamo made)."""
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    os.environ["HYBRIDCOMM_DEFER"] = "always"  # (loopback: forward mode defers anyway)
    import torch._dynamo
    from torch._dynamo.utils import counters

    from hybridcomm.sync import compiled

    out = {}
    for pattern in PATTERNS:
        torch._dynamo.reset()
        counters.clear()
        before = compiled.stats()
        model = _prepared(pattern)
        opt = hybridcomm.DistributedOptimizer(
            _sgd(model), model=model, overlap=mode, fusion_bytes=0, measure_iters=2, timeout=60
        )
        try:
            if pattern == "per_block_late":
                _compile_blocks(model)  # (after the optimizer: found at the first step)
            _train(opt, _compiled(model, pattern), pattern, rank, world)
            opt.synchronize()
            after = compiled.stats()
            notes = [n for n in opt.plan.notes if "torch.compile" in n]
            counts = {k: after[k] - before[k] for k in after}
            counts["graphs"] = counters["stats"]["unique_graphs"]
            out[pattern] = (flat(model.parameters()), counts, notes)
            if pattern == "compiled_step":
                counts["fullgraph"] = _fullgraph_refusal(opt, model, rank, world)
        except Exception:  # noqa: BLE001 - reported by pattern, the others still run
            out[pattern] = traceback.format_exc()
        finally:
            opt.close()
    return out


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.timeout(300)  # every pattern compiled in turn on 2 ranks (~30 s alone, load 9)
@pytest.mark.parametrize("simulate", [False, True], ids=["host", "simgpu"])
@pytest.mark.parametrize("mode", MODES)
def test_every_compile_pattern_gives_one_process_numbers(reference, mode, simulate):
    results = run_ranks(2, _every_pattern, mode, simulate, timeout=280)
    failed = {p: r for p, r in results[0].items() if isinstance(r, str)}
    assert not failed, "\n".join(f"{p}:\n{r}" for p, r in failed.items())
    for pattern in PATTERNS:
        params, counts, notes = results[0][pattern]
        assert torch.equal(params, results[1][pattern][0]), pattern  # the ranks agree
        assert torch.allclose(params, reference, **TOL), (
            pattern,
            (params - reference).abs().max().item(),
        )
        if mode != "forward":
            assert counts["in_graph"] == counts["at_entry"] == 0 and not notes, pattern
    # the step compiled with fullgraph=True: the first verb refused, named in the message
    refusal = results[0]["compiled_step"][1]["fullgraph"]
    assert "DistributedOptimizer.zero_grad() runs eagerly" in refusal, refusal
    if mode == "forward":
        _check_forward_mode_costs({p: r[1:] for p, r in results[0].items()})


def _check_forward_mode_costs(results):
    """What each of forward mode's ways costs (module doc)."""
    # the whole forward compiled: applied in step(), no graph applies one, one graph
    for pattern in ("whole", "whole_fullgraph", "module_compile", "compiled_step"):
        counts, notes = results[pattern]
        assert counts["in_graph"] == counts["at_entry"] == 0, (pattern, counts)
        assert counts["graphs"] == 1, (pattern, counts)
        assert any("compiled whole" in n for n in notes), (pattern, notes)
    # the compiled model handed to the optimizer: its own pre-hook applies them first
    counts, notes = results["handed_compiled"]
    assert counts["in_graph"] == counts["at_entry"] == 0 and not notes, (counts, notes)
    assert counts["graphs"] == 1, counts
    # blocks compiled alone, before the optimizer: each block's entry applies them
    counts, notes = results["per_block"]
    assert counts["in_graph"] == 0 and counts["at_entry"] > 0, counts
    assert counts["graphs"] == 1, counts  # both blocks share one graph, never recompiled
    assert any("2 compiled block(s)" in n for n in notes), notes
    # compiled after: the first pending reads are the graph's own, then the entries'
    counts, notes = results["per_block_late"]
    assert 0 < counts["in_graph"] and counts["at_entry"] > 0, counts
    assert any("2 compiled block(s)" in n for n in notes), notes


MICRO = 2  # micro-batches a step


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, WIDTH)
        self.b = nn.Linear(WIDTH, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.mean(1))))


def _small():
    torch.manual_seed(0)
    return Small()


LOOPS = ("one_pass", "no_sync", "accumulate")


def _accumulating(rank, world, mode, simulate):
    """Compiled autograd on (through a compiled function, its public switch) in three
    loops: one backward pass a step (``one_pass``), MICRO micro-batches a step with
    all but the last under ``no_sync()``, or each reduced in its own pass."""
    if simulate:
        os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    os.environ["HYBRIDCOMM_DEFER"] = "always"
    import torch._dynamo

    out = {}
    for loop in LOOPS:
        torch._dynamo.reset()
        model = _small()
        opt = hybridcomm.DistributedOptimizer(
            _sgd(model), model=model, overlap=mode, fusion_bytes=0, measure_iters=2, timeout=60
        )
        parts = 1 if loop == "one_pass" else MICRO

        def micro(x, y, parts=parts):  # (each part's mean over parts: the whole batch's mean)
            (F.mse_loss(model(x), y) / parts).backward()

        try:
            with torch._dynamo.config.patch(compiled_autograd=True):
                micro = torch.compile(micro, backend=BACKEND)
                for s in range(STEPS):
                    xs, ys = (t.chunk(parts) for t in _batch(s, rank, world))
                    opt.zero_grad()
                    for i in range(parts):
                        local = loop == "no_sync" and i < parts - 1
                        with opt.no_sync() if local else contextlib.nullcontext():
                            micro(xs[i], ys[i])
                    opt.step()
            opt.synchronize()
            out[loop] = flat(model.parameters())
        except Exception:  # noqa: BLE001 - reported, the other loops still run
            out[loop] = traceback.format_exc()
        finally:
            opt.close()
    return out


@pytest.mark.timeout(300)  # three loops compiled in turn on 2 ranks (~30 s alone, load 9)
@pytest.mark.parametrize("simulate", [False, True], ids=["host", "simgpu"])
@pytest.mark.parametrize("mode", MODES)
def test_compiled_autograd_in_every_loop(mode, simulate):
    """The gradient guards of C++ under compiled autograd, with no setting to change:
    one pass a step, micro-batches accumulated under ``no_sync()`` (reduced once, at
    the last), or each reduced in its own backward pass (a late pass re-reduces the
    sum)."""
    ref = _reference(_small)
    results = run_ranks(2, _accumulating, mode, simulate, timeout=280)
    for loop in LOOPS:
        got = results[0][loop]
        assert not isinstance(got, str), got
        assert torch.equal(got, results[1][loop]), loop
        assert torch.allclose(got, ref, **TOL), (loop, (got - ref).abs().max().item())
