"""benchmarks/scale.py: the step-time simulation, on cases worked out by hand."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import scale  # noqa: E402
from scale import Comm, LayerProfile, Network, simulate  # noqa: E402

from hybridcomm.plan.cost_model import CostModel  # noqa: E402

pytestmark = pytest.mark.fast  # in this process alone (tests/tiers.py)


def two_layers():
    return [LayerProfile("a", 1.0, 2.0, [4]), LayerProfile("b", 1.0, 2.0, [4])]


def test_no_communication_is_the_compute_time():
    assert simulate(two_layers(), [], "backward")[0] == pytest.approx(6.0)


def test_stock_waits_for_backward_then_pays_every_all_reduce():
    comms = [Comm(1.5, [0, 1]), Comm(0.5, [0, 1])]
    assert simulate(two_layers(), comms, "after")[0] == pytest.approx(8.0)


def test_backward_overlap_hides_a_comm_behind_the_rest_of_backward():
    # b's gradient is ready at t=4 (fwd 2 + bwd b 2); its 2 s comm runs beside bwd a
    comms = [Comm(2.0, [1], [1]), Comm(0.5, [0], [0])]
    assert simulate(two_layers(), comms, "backward")[0] == pytest.approx(6.5)


def test_forward_overlap_runs_into_the_next_forward_until_the_layer_is_needed():
    # b's 2.5 s comm starts at 4 and ends at 6.5; a's (0.5 s) then ends at 7: the next
    # forward of a starts at 7, and b (needed at 8) is long done.
    comms = [Comm(2.5, [1], [1]), Comm(0.5, [0], [0])]
    assert simulate(two_layers(), comms, "forward")[0] == pytest.approx(7.0)
    # backward mode would wait for both before the next forward: the same here
    assert simulate(two_layers(), comms, "backward")[0] == pytest.approx(7.0)
    # the channel's order is fixed: a's short comm waits behind b's long one
    order = [Comm(3.0, [1], [1]), Comm(0.5, [0], [0])]
    assert simulate(two_layers(), order, "forward")[0] == pytest.approx(7.5)
    assert simulate(two_layers(), order, "backward")[0] == pytest.approx(7.5)


def test_forward_mode_is_never_slower_than_backward_mode_for_the_same_comms():
    layers = [LayerProfile(f"l{i}", 0.1 * (i + 1), 0.2 * (i + 1), [4]) for i in range(6)]
    comms = [Comm(0.3 * (5 - i) + 0.05, [i], [i]) for i in reversed(range(6))]
    fwd = simulate(layers, comms, "forward")[0]
    bwd = simulate(layers, comms, "backward")[0]
    assert fwd <= bwd + 1e-12


def test_cpu_share_slows_compute_only_while_the_channel_is_busy():
    # comm of b (2 s from t=4) overlaps bwd a (t=4..6): at share 0.5 bwd a runs at half
    # speed for those 2 s, doing 1 s of its 2 s of work; the rest takes 1 s after 6.
    comms = [Comm(2.0, [1], [1])]
    period = simulate(two_layers(), comms, "backward", cpu_share=0.5)[0]
    assert period == pytest.approx(7.0)


def test_ddp_buckets_follow_torch_first_1mb_then_the_cap():
    mb = 1 << 20
    layers = [LayerProfile(f"l{i}", 0.0, 0.0, [mb // 2]) for i in range(8)]
    net = Network("n", CostModel(0.0, 1e-9, 0.0))
    comms = scale.ddp_comms(layers, net, 4, cap_mb=2)
    assert [c.after for c in comms] == [[7, 6], [5, 4, 3, 2], [1, 0]]


def test_hybrid_comms_come_from_the_products_planner():
    layers = scale.profile_from_flops(scale.vgg16_layers(), 64)
    net = scale.NETWORKS["nvlink+ib"]
    plan = scale.hybrid_plan(layers, net, 64)
    comms = scale.hybrid_comms(layers, net, 64)
    assert len(comms) == len(plan.order)
    covered = sorted(i for c in comms for i in c.gates)
    assert covered == list(range(len(layers)))  # every layer gated by its bucket, once


def test_projection_covers_three_models_to_1024_gpus_with_sane_efficiency():
    rows = scale.project(gpus=[4, 1024])
    assert {r["model"] for r in rows} >= {"VGG-16", "ResNet-50", "BERT-base"}
    assert max(r["gpus"] for r in rows) == 1024
    for r in rows:
        assert 0 < r["scaling_efficiency"] <= 1 + 1e-9
        assert r["step_ms"] >= r["compute_ms"] * (1 - 1e-9)


def test_published_shapes_have_their_published_sizes():
    def params(spec):
        return sum(b for _, _, ts in spec for b in ts) // 4

    assert params(scale.vgg16_layers()) == pytest.approx(138.36e6, rel=0.001)
    assert params(scale.resnet50_layers()) == pytest.approx(25.56e6, rel=0.01)
    assert params(scale.bert_base_layers()) == pytest.approx(109.5e6, rel=0.01)
    macs = sum(f for _, f, _ in scale.resnet50_layers()) / 2
    assert macs == pytest.approx(4.1e9, rel=0.05)


def test_validation_reads_a_train_json_and_predicts_each_config(tmp_path):
    results = [
        {"config": c, "batch_size": 8, "step_ms": ms, "cpu_busy_pct": cpu}
        for c, ms, cpu in [
            ("compute", 50.0, 100.0),
            ("comm", 40.0, 20.0),
            ("stock", 120.0, 60.0),
            ("ddp:2", 70.0, 80.0),
            ("hybrid-forward", 60.0, 90.0),
        ]
    ]
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"results": results, "nprocs": 4, "shape": None}))
    model = CostModel(1e-4, 4e-9, 1e-10, native_alpha=1e-4, native_beta=4e-9, meta={"points": []})
    out = scale.validate(str(path), calibration=model)
    rows = {r["config"]: r for r in out["validation"]}
    assert set(rows) == {"stock", "ddp:2", "hybrid-forward"}
    for r in rows.values():
        assert r["predicted_ms"] >= 50.0 * (1 - 1e-9)  # never below the compute it was given
        assert r["error"] == pytest.approx(r["predicted_ms"] / r["measured_ms"] - 1)
    assert rows["stock"]["predicted_ms"] > rows["ddp:2"]["predicted_ms"]
