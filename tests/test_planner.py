"""The planner: fusion, split, algorithm per bucket, and the one fixed issue order."""

import pytest

from hybridcomm.algorithms import Topology
from hybridcomm.plan.cost_model import CostModel
from hybridcomm.base.errors import HybridCommError
from hybridcomm.plan.planner import (
    FUSION_BALANCE,
    MAX_FUSION,
    MIN_FUSION,
    MIN_SPLIT,
    Layer,
    forced_algorithm,
    issue_order,
    make_plan,
)

pytestmark = pytest.mark.fast  # in this process alone (tests/tiers.py)

GOOD = CostModel(1e-3, 1e-9, 1e-10)  # alpha/beta = 1 MB


def tiny_layers(n=300, numel=100):
    return [Layer(f"l{i}", [i], numel) for i in range(n)]


def test_big_bucket_goes_native_and_small_butterfly_by_window():
    m = CostModel(1e-3, 1e-9, 1e-10, native_alpha=3e-3, native_beta=5e-10)
    plan = make_plan(
        [Layer("fc", [0], 1 << 22), Layer("conv", [1], 1000)],
        world_size=4,
        model=m,
        fusion_bytes=0,
        split_bytes=0,
        windows={"fc": 1.0, "conv": 1e-3},
        ready={"fc": 0.0, "conv": 0.001},
    )
    assert [b.algorithm for b in plan.buckets] == ["native", "butterfly"]
    assert "native" in str(plan) and "issue order" in str(plan)


def test_300_tiny_layers_under_a_zero_beta_model_make_a_handful_of_buckets():
    plan = make_plan(tiny_layers(), world_size=3, model=CostModel(1e-3, 0.0, 0.0))
    assert len(plan.buckets) <= 5
    assert plan.fusion_bytes == MAX_FUSION and "beta = 0" in " ".join(plan.notes)
    assert sorted(p for b in plan.buckets for p in b.params) == list(range(300))


def test_zero_alpha_fuses_to_the_floor_not_to_nothing():
    plan = make_plan(tiny_layers(), world_size=3, model=CostModel(0.0, 1e-9, 1e-10))
    assert plan.fusion_bytes == MIN_FUSION
    assert len(plan.buckets) == -(-300 * 400 // MIN_FUSION)  # 400-byte layers, 64 KiB buckets


def test_fusion_threshold_balances_the_rings_fixed_and_byte_costs_and_never_mixes_dtypes():
    layers = [
        Layer("a", [0], 1000, 4, "torch.float32"),
        Layer("b", [1], 1000, 2, "torch.bfloat16"),
        Layer("c", [2], 1000, 2, "torch.bfloat16"),
    ]
    plan = make_plan(layers, world_size=4, model=GOOD)
    # ring at P=4: 6 alpha fixed, (1.5 beta + 0.75 gamma) per byte; bytes >= 4x fixed
    expected = FUSION_BALANCE * 6 * GOOD.alpha / (1.5 * GOOD.beta + 0.75 * GOOD.gamma)
    assert abs(plan.fusion_bytes - min(MAX_FUSION, expected)) <= 1  # float rounding
    assert [b.layers for b in plan.buckets] == [["a"], ["b", "c"]]
    assert [b.dtype for b in plan.buckets] == ["torch.float32", "torch.bfloat16"]
    assert plan.buckets[1].nbytes == 4000


def test_small_layers_ride_with_the_large_layer_after_them():
    """ResNet's backward order: a BatchNorm (small) before its convolution (large).
    Each BN joins the next conv's bucket instead of paying a message of its own; a
    medium layer that does not fit starts a bucket; nothing joins a bucket already
    past the threshold; fusion_bytes=0 keeps one bucket per layer."""
    fusion = 100_000
    layers = [
        Layer("fc", [0], 5000),
        Layer("bn2", [1], 1000),
        Layer("conv2", [2], 1 << 20),
        Layer("bn1", [3], 1000),
        Layer("conv1", [4], 1 << 20),
        Layer("conv0", [5], 1 << 20),
        Layer("mid", [6], 20_000),
        Layer("tail", [7], 10_000),
    ]
    plan = make_plan(layers, world_size=4, model=GOOD, fusion_bytes=fusion, split_bytes=0)
    assert [b.layers for b in plan.buckets] == [
        ["fc", "bn2", "conv2"],
        ["bn1", "conv1"],
        ["conv0"],
        ["mid"],
        ["tail"],
    ]
    plan = make_plan(layers, world_size=4, model=GOOD, fusion_bytes=0, split_bytes=0)
    assert len(plan.buckets) == len(layers)


def test_without_measurements_the_order_is_backward_order_and_no_split_survives():
    layers = [Layer("fc", [0, 1], 10 << 20), Layer("conv", [2], 1000)]
    plan = make_plan(layers, world_size=4, model=GOOD, fusion_bytes=0)
    # 10x the ring's balance at P=4: 6 alpha over (1.5 beta + 0.75 gamma) per byte
    expected = 10 * 6 * GOOD.alpha / (1.5 * GOOD.beta + 0.75 * GOOD.gamma)
    assert abs(plan.split_bytes - max(MIN_SPLIT, expected)) <= 1  # float rounding
    # nothing goes between fc's segments in backward order: they are sent as one
    fc = plan.buckets[0]
    assert fc.segments == [(0, fc.numel + 2)]  # the flags ride at the end
    assert plan.order == [(0, 0), (1, 0)]


def test_a_split_stays_exactly_where_another_bucket_goes_between():
    layers = [Layer("fc", [0], 8 << 20), Layer("conv", [1], 1000)]
    plan = make_plan(
        layers,
        world_size=4,
        model=GOOD,
        fusion_bytes=0,
        split_bytes=1 << 20,
        ready={"fc": 0.0, "conv": 0.004},
        need={"conv": 0, "fc": 1},
    )
    fc = plan.buckets[0]
    assert plan.order == [(0, 0), (1, 0), (0, 1)]  # two parts of fc, conv between them
    assert fc.segments[0][1] == fc.segments[1][0] and fc.segments[1][1] == fc.numel + 1
    assert fc.segments[0][1] % ((1 << 20) // 4) == 0  # cut on a split boundary
    # merging re-prices the bucket: one fixed cost per remaining segment
    one = make_plan(layers, world_size=4, model=GOOD, fusion_bytes=0, split_bytes=1 << 20)
    assert one.buckets[0].predicted_s < fc.predicted_s


def test_the_measured_communication_speed_times_the_order():
    layers = [Layer("fc", [0], 8 << 20), Layer("conv", [1], 1000)]
    kw = dict(
        world_size=4,
        model=GOOD,
        fusion_bytes=0,
        split_bytes=1 << 20,
        ready={"fc": 0.0, "conv": 0.02},
        need={"conv": 0, "fc": 1},
    )
    fast, slow = make_plan(layers, **kw), make_plan(layers, comm_scale=4.0, **kw)
    # conv is ready after 20 ms: more of fc went before it at the predicted speed
    # than when the wire is four times slower
    first_fc = [b.segments[0] for b in (fast.buckets[0], slow.buckets[0])]
    assert first_fc[0][1] > first_fc[1][1]
    assert "communication took 4.00x the time the cost model predicts" in " ".join(slow.notes)


def test_priority_order_puts_the_urgent_bucket_between_segments_of_the_big_one():
    # fc's gradient is ready first and takes ~8 segments; conv is ready shortly after
    # and is needed first by the next forward: it must not wait for all of fc.
    layers = [Layer("fc", [0], 8 << 20), Layer("conv", [1], 1000)]
    plan = make_plan(
        layers,
        world_size=4,
        model=GOOD,
        fusion_bytes=0,
        split_bytes=1 << 20,
        ready={"fc": 0.0, "conv": 0.004},
        need={"conv": 0, "fc": 1},
    )
    conv_at = plan.order.index((1, 0))
    assert 0 < conv_at < len(plan.order) - 1
    assert plan.order[:conv_at] == [(0, s) for s in range(conv_at)]
    # every (bucket, segment) exactly once
    assert sorted(plan.order) == sorted(
        (b.index, s) for b in plan.buckets for s in range(len(b.segments))
    )


def test_the_same_inputs_give_the_same_plan():
    kw = dict(
        world_size=4,
        model=GOOD,
        windows={"fc": 0.02, "conv": 0.001},
        ready={"fc": 0.0, "conv": 0.01},
        need={"conv": 0, "fc": 1},
    )
    layers = [Layer("fc", [0], 4 << 20), Layer("conv", [1], 1000)]
    assert make_plan(layers, **kw).decisions() == make_plan(layers, **kw).decisions()


def test_forcing(monkeypatch):
    monkeypatch.delenv("HYBRIDCOMM_ALGO", raising=False)
    assert forced_algorithm("hybrid") is None and forced_algorithm("ring") == "ring"
    with pytest.raises(ValueError, match="unknown strategy"):
        forced_algorithm("tree")
    monkeypatch.setenv("HYBRIDCOMM_ALGO", "butterfly")
    plan = make_plan([Layer("fc", [0], 1 << 22)], world_size=4, model=GOOD, strategy="ring")
    assert plan.buckets[0].algorithm == "butterfly"
    monkeypatch.setenv("HYBRIDCOMM_ALGO", "tree")
    with pytest.raises(HybridCommError, match="HYBRIDCOMM_ALGO='tree' is invalid"):
        forced_algorithm("hybrid")


def test_issue_order_without_ready_times_is_stable():
    plan = make_plan(tiny_layers(10, 1 << 20), world_size=4, model=GOOD, fusion_bytes=0)
    assert issue_order(plan.buckets) == plan.order


def test_lazy_pools_close_once_past_the_threshold_and_explain_the_gain():
    layers = tiny_layers(300, 68) + [Layer("big", [300], 1 << 20)]  # 272-byte layers, then 4 MiB
    plan = make_plan(layers, world_size=4, model=GOOD, lazy_bytes=64 << 10)
    sizes = [b.nbytes for b in plan.buckets]
    assert all(s >= 64 << 10 for s in sizes[:-1])  # every pool but the last passed it
    assert all(s - 272 < 64 << 10 for s in sizes[:-2])  # ...by at most the layer that did
    assert sorted(p for b in plan.buckets for p in b.params) == list(range(301))
    assert len(plan.buckets) < 10
    note = " ".join(plan.notes)
    assert "lazy:" in note and "pools win" in note


def test_fusion_grows_with_the_world_size_and_across_nodes():
    model = CostModel(5e-6, 1 / 150e9, 1 / 400e9, inter_alpha=15e-6, inter_beta=1 / 100e9)
    sizes = [
        make_plan(
            tiny_layers(), world_size=p, model=model, topology=Topology(node_size=8)
        ).fusion_bytes
        for p in (4, 8, 64, 1024)
    ]
    assert sizes == sorted(sizes) and sizes[-1] == MAX_FUSION and sizes[0] < MAX_FUSION


def test_when_nothing_was_left_at_step_the_plan_says_forward_overlap_cannot_pay():
    from hybridcomm.sync.measure import StepMeasurements

    m = StepMeasurements(measure_iters=2, replan_every=0)
    m.window(["conv"], 0.0, 0.001)  # the next forward needed conv first, then fc
    m.window(["fc"], 0.0, 0.5)
    m.running_at_step([])
    m.running_at_step([["conv"]])  # only the first-needed bucket: it is waited for at once
    assert m.take([]).defer_pays is False
    m.window(["conv"], 0.0, 0.001)
    m.running_at_step([["conv"], ["fc"]])  # fc still running: the forward can hide it
    assert m.take([]).defer_pays is True and m.take([]).defer_pays is None  # taken: forgotten
    layers = [Layer("fc", [0], 1 << 20)]
    plan = make_plan(layers, world_size=4, model=GOOD, defer_pays=False)
    assert not plan.defer_updates and "updates in step()" in str(plan)
    assert "forward overlap cannot pay" in " ".join(plan.notes)
    assert make_plan(layers, world_size=4, model=GOOD, defer_pays=True).defer_updates
    assert make_plan(layers, world_size=4, model=GOOD).defer_updates  # not measured yet


@pytest.mark.parametrize("esize,dtype", [(4, "torch.float32"), (2, "torch.float16")])
def test_segments_start_at_aligned_offsets(esize, dtype):
    """A bucket's segments start at multiples of ALIGN_BYTES (split_bytes rounded down to
    it), so their chunks, transfers and reductions start aligned too (issue 20, defect 7).
    As above: conv goes between fc's parts, so fc keeps two segments."""
    from hybridcomm.plan.planner import ALIGN_BYTES

    layers = [Layer("fc", [0], 8 << 20, esize, dtype), Layer("conv", [1], 1000, esize, dtype)]
    for split in ((1 << 20) + esize, (1 << 20) + 3 * esize, 3_000_001):
        plan = make_plan(
            layers,
            world_size=4,
            model=GOOD,
            fusion_bytes=0,
            split_bytes=split,
            ready={"fc": 0.0, "conv": 0.004},
            need={"conv": 0, "fc": 1},
        )
        segments = plan.buckets[0].segments
        assert len(segments) == 2 and segments[-1][1] == plan.buckets[0].numel + 1  # + flag
        assert all(a * esize % ALIGN_BYTES == 0 for a, _ in segments), (split, segments)


def _deep_net_measured():
    """ResNet/VGG-like (64 MB layers: over the default split): big layers first in backward and needed last, the small first
    layer ready last and needed first (seconds from the first gradient)."""
    layers = [
        Layer("top", [0], 16 << 20),
        Layer("upper", [1], 16 << 20),
        Layer("lower", [2], 16 << 20),
        Layer("stem", [3], 1000),
    ]
    return layers, dict(
        world_size=4,
        model=GOOD,
        fusion_bytes=0,
        ready={"top": 0.0, "upper": 0.002, "lower": 0.004, "stem": 0.006},
        need={"stem": 0, "lower": 1, "upper": 2, "top": 3},
    )


def test_a_default_split_that_cannot_pay_is_dropped_and_the_plan_says_why():
    layers, kw = _deep_net_measured()
    split = make_plan(layers, **kw)  # forward's compute unknown: the cost model's split
    assert any(len(b.segments) > 1 for b in split.buckets)
    # Without a split, ~3 buckets' reductions are still queued once the stem's is done:
    # far more than a 5 ms forward needs to hide behind, so the split only adds calls.
    plan = make_plan(layers, forward_s=0.005, **kw)
    assert all(len(b.segments) == 1 for b in plan.buckets) and plan.split_bytes == 0
    assert plan.order == [(0, 0), (3, 0), (2, 0), (1, 0)]  # top first (ready), then by need
    note = next(n for n in plan.notes if n.startswith("no split"))
    assert "than that forward's ~5 ms of compute" in note and "split off" in str(plan)
    assert sum(b.predicted_s for b in plan.buckets) < sum(b.predicted_s for b in split.buckets)


def test_a_split_that_lets_the_forward_start_early_is_kept():
    # the thesis's shape: one large late layer, ready first and needed last; the small
    # conv, ready last and needed first, would wait for all of it, and then nothing
    # would be left on the wire for the forward to overlap
    layers = [Layer("fc", [0], 16 << 20), Layer("conv", [1], 1000)]  # 64 MB: 2 segments
    plan = make_plan(
        layers,
        world_size=4,
        model=GOOD,
        fusion_bytes=0,
        forward_s=0.005,
        ready={"fc": 0.0, "conv": 0.004},
        need={"conv": 0, "fc": 1},
    )
    assert len(plan.buckets[0].segments) == 2 and plan.order[1] == (1, 0)
    assert not any(n.startswith("no split") for n in plan.notes)


def test_a_split_the_user_asked_for_is_kept():
    layers, kw = _deep_net_measured()
    plan = make_plan(layers, forward_s=0.005, split_bytes=1 << 20, **kw)
    assert any(len(b.segments) > 1 for b in plan.buckets) and plan.split_bytes == 1 << 20


def test_what_each_call_cost_beyond_the_model_widens_fusion():
    fast = CostModel(1e-5, 1e-9, 1e-10)  # 60 us before any byte: fusion ~150 KB
    layers = [Layer(f"l{i}", [i], 20_000) for i in range(8)]  # 80 KB each
    plain = make_plan(layers, world_size=4, model=fast)
    measured = make_plan(layers, world_size=4, model=fast, call_s=0.01)
    assert len(plain.buckets) == 8 and len(measured.buckets) == 1
    # 10 ms a call at the ring's ~1.6 ns a byte (P=4): ~6.3 MB more of balance
    assert measured.fusion_bytes - plain.fusion_bytes == pytest.approx(
        FUSION_BALANCE * 0.01 / (1.5e-9 + 0.75e-10), rel=1e-6
    )
    assert any("10 ms each all-reduce call cost beyond the cost model" in n for n in measured.notes)
    assert (
        make_plan(layers, world_size=4, model=fast, call_s=0.0).fusion_bytes == plain.fusion_bytes
    )


def test_the_measured_steps_price_each_call():
    from hybridcomm.plan.planner import Bucket, Plan
    from hybridcomm.sync.measure import StepMeasurements, op_samples

    plan = Plan(
        4,
        "hybrid",
        [
            Bucket(
                0, ["fc"], [0], 9, 36, "native", 0.020, segments=[(0, 10)], compressor="powersgd"
            ),
            Bucket(1, ["conv"], [1], 1, 4, "ring", 0.004, segments=[(0, 1), (1, 2)]),
        ],
        [(0, 0), (1, 0), (1, 1)],
    )
    old = Plan(4, "hybrid", plan.buckets, plan.order)
    ops = [
        ((plan, 0, 0), 0.030),
        ((plan, 1, 0), 0.012),
        ((plan, 1, 1), 0.012),
        ((old, 0, 0), 9.0),
    ]  # a replaced plan's operation, finished late: left out
    samples = op_samples(plan, ops)
    assert samples == [(0.020, 2, 0.030), (0.002, 1, 0.012), (0.002, 1, 0.012)]
    m = StepMeasurements(measure_iters=1, replan_every=0)
    m.ops(samples)
    call = m.take([]).call_s  # 30 ms = x 20 ms + 2c and 12 ms = x 2 ms + c: c ~ 11 ms
    assert 0.010 < call < 0.012
    assert m.take([]).call_s is None  # taken: forgotten
