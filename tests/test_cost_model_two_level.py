"""The two-level algorithms in the cost model: formulas, inter-node links, fit, choice."""

import json

import pytest

from hybridcomm.plan import cost_model
from hybridcomm.algorithms import Topology
from hybridcomm.plan.cost_model import (
    MODELED,
    TWO_LEVEL,
    CostModel,
    LinkCoefficients,
    coefficients,
    fit,
    link_coefficients,
)

pytestmark = pytest.mark.fast  # in this process alone (tests/tiers.py)

N = 1 << 20


@pytest.mark.parametrize("p,node", [(4, 2), (6, 3), (8, 2), (8, 4), (12, 3), (16, 4)])
def test_full_groups_send_the_rings_bytes_in_fewer_messages(p, node):
    m = p // node
    want = (2 * (node - 1) + 2 * (m - 1), 2 * (p - 1) / p * N, (p - 1) / p * N)
    for algo, topo in (
        ("hierarchical", Topology(node_size=node)),
        ("torus2d", Topology(grid=(m, node))),
    ):
        assert coefficients(algo, N, p, topo) == pytest.approx(want)


def test_short_last_node_by_hand():
    # P=3 in nodes {0,1},{2}: rank 2 owns both chunks, so it runs two rings of
    # n/4 messages at once: n/2 in, n across, n/2 out.
    assert coefficients("hierarchical", N, 3, Topology(node_size=2)) == pytest.approx((4, 2 * N, N))
    assert coefficients("torus2d", N, 7, Topology(grid=(1, 7))) == coefficients("ring", N, 7)
    assert coefficients("hierarchical", N, 1) == (0, 0, 0)


@pytest.mark.parametrize("algo", MODELED + TWO_LEVEL)
@pytest.mark.parametrize("p", [2, 3, 5, 6, 8, 12])
def test_link_accounting_on_one_node_is_the_flat_formula(algo, p):
    for grid in {cost_model._topology(None, p).grid, (-(-p // 2), 2)}:
        for node in (p, 1):  # all on one node, or every rank its own node
            topo = Topology(node_size=node, grid=grid)
            flat = coefficients(algo, N, p, topo)
            c = link_coefficients(algo, N, p, topo)
            assert (
                c.messages + c.inter_messages,
                c.bytes + c.inter_bytes,
                c.reduced,
            ) == pytest.approx(flat)


def test_shared_node_link_by_hand():
    two = Topology(node_size=2)
    # ring over 2 nodes of 2: every step crosses; each node link carries one chunk per step
    assert link_coefficients("ring", N, 4, two) == pytest.approx(
        LinkCoefficients(0, 0, 0.75 * N, 6, 1.5 * N)
    )
    # hierarchical: one step in each node each way; across, both ranks of a node send n/4
    assert link_coefficients("hierarchical", N, 4, two) == pytest.approx(
        LinkCoefficients(2, N, 0.75 * N, 2, N)
    )
    # butterfly: step 1 inside (n per rank), step 2 both ranks cross: 2n on the node link
    assert link_coefficients("butterfly", N, 4, two) == pytest.approx(
        LinkCoefficients(1, N, 2 * N, 1, 2 * N)
    )


def test_no_inter_coefficients_predicts_as_before():
    flat = CostModel(1e-3, 1e-9, 1e-10)
    for algo in MODELED:
        for p in (2, 4, 6):
            a, b, g = coefficients(algo, N, p)
            want = a * 1e-3 + b * 1e-9 + g * 1e-10
            assert flat.predict(algo, N, p, Topology(node_size=2)) == want
    same = CostModel(1e-3, 1e-9, 1e-10, inter_alpha=1e-3, inter_beta=1e-9)
    # one node: the inter-node values are never used
    assert same.predict("halving_doubling", N, 8, Topology(node_size=8)) == pytest.approx(
        flat.predict("halving_doubling", N, 8)
    )


def test_json_round_trip_old_and_new():
    old = {
        "version": 1,
        "alpha_s": 1e-3,
        "beta_s_per_byte": 1e-9,
        "gamma_s_per_byte": 1e-10,
        "world_size": 4,
    }
    m = CostModel.from_json(json.loads(json.dumps(old)))
    assert not m.two_level and m.inter_alpha is None and "inter_alpha_s" not in m.to_json()
    two = CostModel(1e-3, 1e-9, 1e-10, inter_alpha=2e-3, inter_beta=8e-8)
    back = CostModel.from_json(two.to_json())
    assert (back.inter_alpha, back.inter_beta) == (2e-3, 8e-8) and back.two_level
    lat = two.with_latency(5e-4)
    assert lat.alpha == pytest.approx(1.5e-3) and lat.inter_alpha == pytest.approx(2.5e-3)


def test_fit_recovers_inter_node_coefficients():
    true = CostModel(300e-6, 1 / 2e9, 1 / 4e9, inter_alpha=800e-6, inter_beta=1 / 12.5e6)
    topo = Topology(node_size=2)
    sizes = [4 << 10 << (2 * i) for i in range(7)]
    samples = [
        (a, n, p, true.predict(a, n, p, topo))
        for a in MODELED + ("hierarchical",)
        for n in sizes
        for p in (4, 6)
    ]
    model, rep = fit(samples, topo)
    for name in ("alpha", "beta", "gamma", "inter_alpha", "inter_beta"):
        assert getattr(model, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    assert rep.max_rel_err < 1e-6
    flat, _ = fit(samples)  # without a topology: the three-number model, as before
    assert not flat.two_level


def test_choice_with_a_slow_link_between_nodes(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    m = CostModel(300e-6, 1 / 2e9, 1 / 4e9, inter_alpha=400e-6, inter_beta=1 / 12.5e6)
    two = Topology(node_size=2)
    every = MODELED + TWO_LEVEL
    assert m.choose(16 << 20, 4, candidates=every, topology=two) == "hierarchical"
    assert m.choose(4096, 4, candidates=every, topology=two) in ("butterfly", "hierarchical")
    c = m.crossover(4, "ring", "hierarchical", topology=two)
    assert c == 1  # fewer steps and fewer bytes across: ahead at every size
    # auto: hierarchical only where the topology has several nodes
    from hybridcomm.comm import calibration

    calibration.set_active(m)
    try:
        assert calibration.choose_algorithm(16 << 20, 4, two) == "hierarchical"
        assert calibration.choose_algorithm(16 << 20, 4) != "hierarchical"  # one node
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert calibration.choose_algorithm(16 << 20, 4) == "hierarchical"
    finally:
        calibration.set_active(None)


def test_planner_offers_and_forces_them(monkeypatch):
    from hybridcomm.plan.planner import Layer, make_plan

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    m = CostModel(300e-6, 1 / 2e9, 1 / 4e9, inter_alpha=400e-6, inter_beta=1 / 12.5e6)
    layers = [Layer("fc", [0], 1 << 22), Layer("conv", [1], 1000)]
    auto = make_plan(layers, world_size=4, model=m, strategy="auto")
    assert auto.buckets[0].algorithm == "hierarchical"
    hybrid = make_plan(layers, world_size=4, model=m)  # several nodes: hybrid offers it too
    assert hybrid.buckets[0].algorithm == "hierarchical"
    for algo in TWO_LEVEL:
        forced = make_plan(layers, world_size=6, model=m, strategy=algo)
        assert {b.algorithm for b in forced.buckets} == {algo}
        assert all(b.predicted_s > 0 for b in forced.buckets)
