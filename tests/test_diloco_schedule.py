"""Streaming DiLoCo's fragments and schedule (strategies/fragments.py), no processes:
layers in module order, fragments of consecutive layers of about equal bytes, each
fragment started once per period at its own step and merged tau steps later."""

import pytest

import torch.nn as nn

from hybridcomm.strategies import fragments as F
from optim_models import ConvNet


def test_layers_are_the_modules_owning_parameters_in_module_order():
    model = ConvNet()
    layers = F.layers_of(model, list(model.parameters()))
    assert [layer.name for layer in layers] == ["conv1", "conv2", "fc1", "fc2"]
    assert [layer.params for layer in layers] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert sum(layer.nbytes for layer in layers) == 4 * sum(p.numel() for p in model.parameters())


def test_a_parameter_shared_by_two_modules_counts_once():
    a = nn.Linear(3, 3)
    model = nn.Sequential(a, nn.ReLU(), a)
    layers = F.layers_of(model, list(model.parameters()))
    assert [layer.params for layer in layers] == [(0, 1)]


@pytest.mark.parametrize(
    "sizes,parts,want",
    [
        ([5, 5, 5, 5], 2, [0, 2, 4]),
        ([5, 5, 5, 5], 4, [0, 1, 2, 3, 4]),
        ([1, 1, 100, 1], 2, [0, 2, 4]),  # the big layer alone cannot be split
        ([100, 1, 1, 1], 3, [0, 1, 2, 4]),  # every run keeps at least one layer
        ([3, 1, 1, 1, 1, 1], 2, [0, 2, 6]),
    ],
)
def test_cut_makes_non_empty_runs_near_equal_shares(sizes, parts, want):
    assert F.cut(sizes, parts) == want


def test_cut_balances_bytes_as_well_as_contiguity_allows():
    sizes = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5]
    for parts in range(1, len(sizes) + 1):
        bounds = F.cut(sizes, parts)
        runs = [sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])]
        assert len(runs) == parts and all(b > a for a, b in zip(bounds, bounds[1:]))
        # each boundary is the nearest allowed one to its share
        total = sum(sizes)
        for j, b in enumerate(bounds[1:-1], start=1):
            lo, hi = bounds[j - 1] + 1, len(sizes) - (parts - j)
            best = min(abs(sum(sizes[:i]) - total * j / parts) for i in range(lo, hi + 1))
            assert abs(sum(sizes[:b]) - total * j / parts) == best


@pytest.mark.parametrize("H,K", [(1, 1), (4, 1), (4, 2), (4, 4), (10, 3), (7, 7)])
@pytest.mark.parametrize("tau", [0, 1, 3])
def test_every_fragment_starts_once_a_period_at_its_offset(H, K, tau):
    if tau >= H:
        pytest.skip("delay must be < sync_every")
    schedule = F.SyncSchedule(sync_every=H, offsets=F.offsets(H, K), delay=tau)
    assert len(set(schedule.offsets)) == K and max(schedule.offsets) == H
    starts = {k: [] for k in range(K)}
    for t in range(0, 3 * H + 1):
        for k in schedule.launches_at(t):
            starts[k].append(t)
    for k, steps in starts.items():
        o = (k + 1) * H // K
        assert steps == [o, o + H, o + 2 * H][: len(steps)] and len(steps) >= 2, (k, steps)
        # merged tau steps later, before its own next start
        assert all(schedule.merge_step(s) == s + tau < s + H for s in steps)
    # K = 1 is DiLoCo: the whole model every H steps
    if K == 1:
        assert starts[0][:3] == [H, 2 * H, 3 * H]


def test_split_keeps_layer_order_and_covers_every_parameter():
    model = ConvNet()
    params = list(model.parameters())
    layers = F.layers_of(model, params)
    for K in range(1, 5):
        frags = F.split(layers, K, sync_every=4)
        assert [i for f in frags for i in f.params] == list(range(len(params)))
        assert [f.offset for f in frags] == list(F.offsets(4, K))
        assert sum(f.nbytes for f in frags) == sum(layer.nbytes for layer in layers)
    table = F.describe(F.split(layers, 2, 4), F.SyncSchedule(4, F.offsets(4, 2), 1))
    assert "conv1, conv2" in table and "fc1, fc2" in table and "delay 1" in table


def test_a_transformer_cuts_into_blocks_of_about_equal_bytes():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    frags = F.split(F.layers_of(model, list(model.parameters())), 4, sync_every=8)
    assert [len(f.layers) for f in frags] == [2, 2, 2, 2]
    assert len({f.nbytes for f in frags}) == 1
