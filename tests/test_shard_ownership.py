"""Whole-parameter shards, decided without a network: which optimizers get which
granularity, each parameter's owner, the bucket layout that makes each rank's
part of a reduce-scatter exactly its own parameters, and the balance the plan
reports (the benchmark transformer and ResNet-18 at 4 ranks)."""

import os
import sys

import pytest
import torch

from hybridcomm import HybridCommError
from hybridcomm.algorithms import SHARD_BOUNDS
from hybridcomm.config.config import SyncConfig
from hybridcomm.plan.cost_model import CostModel
from hybridcomm.plan.ownership import WHOLE_BALANCE, owner_layout
from hybridcomm.plan.planner import Layer, make_plan
from hybridcomm.sync import granularity
from hybridcomm.sync.reshard import owned_ranges

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
)
import models  # noqa: E402

pytestmark = pytest.mark.fast  # in this process alone (tests/tiers.py)

# 100 Mbit/s-like: a message costs 1 ms, a byte 80 ns
SLOW_LINK = CostModel(alpha=1e-3, beta=8e-8, gamma=1e-10)


def _layers(model):
    """A module's own trainable parameters a layer, in backward order (the registry's)."""
    out, index = [], 0
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own:
            sizes = [p.numel() for p in own]
            out.append(
                Layer(
                    name,
                    list(range(index, index + len(own))),
                    sum(sizes),
                    sizes=sizes,
                    shapes=[tuple(p.shape) for p in own],
                )
            )
            index += len(own)
    return out[::-1]


def _whole_plan(layers, world, strategy="sharded-host", **kwargs):
    return make_plan(
        layers,
        world_size=world,
        model=SLOW_LINK,
        strategy=strategy,
        shard=True,
        whole_params=True,
        **kwargs,
    )


def _shares(plan, layers, world):
    sizes = {p: n for x in layers for p, n in zip(x.params, x.sizes)}
    share = [0] * world
    for b in plan.buckets:
        for p, rank in zip(b.params, b.owners):
            share[rank] += sizes[p]
    return share


@pytest.mark.parametrize("name", ["transformer", "resnet18"])
def test_the_largest_rank_holds_at_most_115_percent_of_an_equal_share_at_4_ranks(name):
    layers = _layers(models.build(name))
    plan = _whole_plan(layers, 4)
    share = _shares(plan, layers, 4)
    assert max(share) * 4 <= 1.15 * sum(share), share
    # the plan reports it, as computed
    assert any(f"{100 * share[0] / sum(share):.1f}%" in n for n in plan.notes), plan.notes
    # every parameter is owned once
    owned = sorted(p for b in plan.buckets for p in b.params)
    assert owned == sorted(p for x in layers for p in x.params)
    # each bucket but the last closed with its parts within WHOLE_BALANCE of equal
    sizes = {p: n for x in layers for p, n in zip(x.params, x.sizes)}
    for b in plan.buckets[:-1]:
        parts = [0] * 4
        for p, rank in zip(b.params, b.owners):
            parts[rank] += sizes[p]
        assert 4 * max(parts) <= WHOLE_BALANCE * sum(parts), (b.index, parts)


def test_a_parameter_larger_than_an_equal_share_is_reported():
    layers = [Layer("embed", [0], 5000, sizes=[5000]), Layer("head", [1, 2], 130, sizes=[100, 30])]
    notes = " ".join(_whole_plan(layers, 4).notes)
    assert "larger than 1/4 of the state" in notes and "embed" in notes


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "native"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_ranks_part_of_the_reduce_scatter_is_exactly_its_own_parameters(algorithm, world):
    if algorithm == "halving_doubling" and world & (world - 1):
        pytest.skip("halving-doubling's reduce-scatter needs a power of two")
    layers = [
        Layer("a", [0, 1], 35 + 7, sizes=[35, 7]),
        Layer("b", [2, 3], 77 + 11, sizes=[77, 11]),
        Layer("c", [4, 5], 55 + 5, sizes=[55, 5]),
    ]
    plan = _whole_plan(layers, world, strategy=algorithm, fusion_bytes=1 << 20)
    sizes = {p: n for x in layers for p, n in zip(x.params, x.sizes)}
    for b in plan.buckets:
        assert len(b.segments) == 1 and b.grad_numel % world == 0
        part = b.grad_numel // world
        for rank in range(world):
            lo, hi = SHARD_BOUNDS[b.algorithm](rank, world, b.grad_numel)
            assert (lo, hi) == (rank * part, (rank + 1) * part)
            # the synchronizer's view of this rank's part (flags' tail left out)
            assert owned_ranges(b.segments, rank, world, b.algorithm, b.tail) in (
                [(lo, hi)],
                [],
            )
            mine = [(o, sizes[p]) for p, o, r in zip(b.params, b.offsets, b.owners) if r == rank]
            others = [(o, sizes[p]) for p, o, r in zip(b.params, b.offsets, b.owners) if r != rank]
            assert all(lo <= o and o + n <= hi for o, n in mine)
            assert all(o + n <= lo or o >= hi for o, n in others)
        assert all(o % 4 == 0 for o in b.offsets)  # each gradient starts 16-byte aligned


def test_the_owner_layout_pads_every_part_to_the_largest():
    order, offsets, part = owner_layout([40, 30, 20, 10], [0, 1, 1, 0], world=2, element_size=4)
    assert order == [0, 3, 1, 2] and part == 56  # rank 1: 30, pad to 32, 20 -> 52 -> 56
    assert offsets == [0, 40, 56, 88]


class _MyAdam(torch.optim.Adam):
    """Adds a method only: its step is Adam's."""

    def describe(self):
        return "mine"


class _ClippedAdam(torch.optim.Adam):
    """Overrides step: the library cannot know what it does."""

    def step(self, closure=None):
        return super().step(closure)


def test_known_element_wise_optimizers_get_slices_and_every_other_whole_parameters():
    for cls in (torch.optim.SGD, torch.optim.AdamW, torch.optim.Rprop, _MyAdam):
        assert granularity.choose(cls, None)[0] == "elements", cls
    for cls in (torch.optim.Adafactor, torch.optim.Muon, _ClippedAdam):
        kind, why = granularity.choose(cls, None)
        assert kind == "parameters" and cls.__name__ in why, cls
    assert granularity.choose(_ClippedAdam, "elements") == (
        "elements",
        "shard_by='elements' (given)",
    )
    assert granularity.choose(torch.optim.SGD, "parameters")[0] == "parameters"


@pytest.mark.parametrize("cls", [torch.optim.Adafactor, torch.optim.Muon, torch.optim.LBFGS])
def test_an_element_wise_claim_for_an_optimizer_that_needs_whole_tensors_is_refused(cls):
    with pytest.raises(HybridCommError, match=f"shard_by='elements' with {cls.__name__}"):
        granularity.choose(cls, "elements")


def test_shard_by_without_shard_or_unknown_is_refused():
    with pytest.raises(ValueError, match="shard_by='parameters' needs shard="):
        SyncConfig.build(shard_by="parameters")
    with pytest.raises(ValueError, match="shard_by must be"):
        SyncConfig.build(shard="optimizer", shard_by="rows")
    with pytest.raises(HybridCommError, match="shard_by must be"):
        granularity.choose(torch.optim.SGD, "rows")
