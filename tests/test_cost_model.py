"""The alpha-beta-gamma model: formulas, robust least-squares fitting, choice."""

import json
import math

import pytest

from hybridcomm.plan.cost_model import MODELED, CostModel, coefficients, fit, rounded

pytestmark = pytest.mark.fast  # in this process alone (tests/tiers.py)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_coefficients_at_powers_of_two(p):
    n, k = 1 << 20, int(math.log2(p))
    assert coefficients("ring", n, p) == (2 * (p - 1), 2 * (p - 1) / p * n, (p - 1) / p * n)
    assert coefficients("butterfly", n, p) == (k, k * n, k * n)
    assert coefficients("halving_doubling", n, p) == (2 * k, 2 * (p - 1) / p * n, (p - 1) / p * n)


def test_fold_adds_two_messages_and_a_whole_buffer_each_way():
    n = 1000
    a4, b4, g4 = coefficients("butterfly", n, 4)
    assert coefficients("butterfly", n, 6) == (a4 + 2, b4 + 2 * n, g4 + n)
    assert coefficients("ring", n, 1) == (0, 0, 0)
    with pytest.raises(ValueError):
        coefficients("tree", n, 4)


@pytest.mark.parametrize(
    "true",
    [
        CostModel(700e-6, 1 / 0.4e9, 1 / 2e9),
        CostModel(20e-6, 1 / 12e9, 1 / 50e9),
        CostModel(5e-6, 1 / 100e9, 0.0),
    ],
)
def test_fit_recovers_known_parameters_from_synthetic_timings(true):
    sizes = [4 << 10 << (2 * i) for i in range(8)]  # 4K .. 64M
    samples = [(a, n, p, true.predict(a, n, p)) for a in MODELED for n in sizes for p in (4, 6)]
    model, rep = fit(samples + [("torch", 4096, 4, 1.0)])  # foreign rows are ignored
    assert model.alpha == pytest.approx(true.alpha, rel=1e-6, abs=1e-15)
    assert model.beta == pytest.approx(true.beta, rel=1e-6, abs=1e-18)
    assert model.gamma == pytest.approx(true.gamma, rel=1e-6, abs=1e-18)
    assert rep.n_points == len(samples) and rep.max_rel_err < 1e-6


def test_fit_with_noise_stays_close_and_non_negative():
    import random

    rng = random.Random(0)
    true = CostModel(300e-6, 1 / 1e9, 1 / 4e9)
    samples = [
        (a, n, 4, true.predict(a, n, 4) * rng.uniform(0.9, 1.1))
        for a in MODELED
        for n in [1 << s for s in range(12, 27, 2)]
    ]
    model, rep = fit(samples)
    assert model.alpha == pytest.approx(true.alpha, rel=0.15)
    assert model.beta == pytest.approx(true.beta, rel=0.15)
    assert min(model.alpha, model.beta, model.gamma) >= 0
    assert 0 < rep.rms_rel_err < 0.1


def test_fit_refuses_too_few_samples():
    with pytest.raises(ValueError, match="too few"):
        fit([("torch", 4096, 4, 1e-3)])
    with pytest.raises(ValueError, match="two or more sizes"):
        fit([(a, 4096, 4, 1e-3) for a in MODELED])


def test_fit_with_gamma_measured_separates_beta_from_noise():
    """The probe's case: two sizes, butterfly and ring, 10% noise. With gamma held
    at its measured value beta comes out right; it is never negative."""
    import random

    rng = random.Random(3)
    true = CostModel(1e-3, 8e-8, 2e-10)  # a 100 Mbit/s wire, slow per message
    for _ in range(20):
        pts = [
            (a, n, 4, true.predict(a, n, 4) * rng.uniform(0.9, 1.1))
            for a in ("butterfly", "ring")
            for n in (4096, 1 << 20)
            for _ in range(3)
        ]
        model, rep = fit(pts, gamma=true.gamma)
        assert model.gamma == true.gamma
        assert model.beta == pytest.approx(true.beta, rel=0.2)
        assert model.alpha == pytest.approx(true.alpha, rel=0.3)
        assert not rep.degenerate


def test_fit_drops_outliers_and_reports_confidence():
    true = CostModel(300e-6, 1 / 1e9, 1 / 4e9)
    pts = [(a, n, 4, true.predict(a, n, 4)) for a in MODELED for n in (4096, 1 << 20, 16 << 20)]
    spoiled = pts[:-1] + [(pts[-1][0], pts[-1][1], 4, pts[-1][3] * 20)]  # one run disturbed
    model, rep = fit(spoiled)
    assert rep.dropped == 1
    assert model.alpha == pytest.approx(true.alpha, rel=1e-6)
    assert rep.confidence == "high"
    # Times that shrink as messages grow: no non-negative model explains them.
    nonsense = [(a, n, 4, 1e-3 * (1 << 24) / n) for a in MODELED for n in (4096, 1 << 20, 16 << 20)]
    assert fit(nonsense)[1].confidence == "low"


def test_degenerate_fit_is_flagged():
    # Times that do not grow with size: the best non-negative fit has beta = gamma = 0.
    pts = [(a, n, 4, 5e-3) for a in ("butterfly", "ring") for n in (4096, 1 << 20)]
    model, rep = fit(pts)
    assert model.beta == 0 and rep.degenerate


def test_rounded_models_repeat_across_close_measurements():
    a = rounded(CostModel(1.013e-3, 8.04e-8, 2.02e-10))
    b = rounded(CostModel(1.009e-3, 7.96e-8, 1.98e-10))
    assert a == b and a.alpha == 1.0e-3 and a.beta == 8.0e-8


def test_choice_follows_the_model_and_window():
    m = CostModel(700e-6, 1 / 0.4e9, 1 / 2e9)
    assert m.choose(4096, 4) == "butterfly"
    assert m.choose(64 << 20, 4) in ("ring", "halving_doubling")
    assert m.choose(64 << 20, 6) == "ring"  # folding costs two whole buffers
    # A generous window prefers the fewest bytes sent; none that fits: the fastest.
    assert m.choose(4096, 4, window=1.0) in ("ring", "halving_doubling")
    assert m.choose(4096, 4, window=1e-9) == "butterfly"
    c = m.crossover(4)
    assert c and m.predict("ring", c, 4) <= m.predict("butterfly", c, 4)
    assert m.predict("ring", c - 1, 4) > m.predict("butterfly", c - 1, 4)


def test_native_is_fitted_offered_and_round_trips():
    true = CostModel(1e-3, 1e-9, 1e-10, native_alpha=2e-4, native_beta=5e-10)
    pts = [(a, n, 4, true.predict(a, n, 4)) for a in MODELED for n in (4096, 1 << 20)]
    assert fit(pts)[0].offers("native") is False  # never measured: not offered
    pts += [("torch", n, 4, true.predict("native", n, 4)) for n in (4096, 1 << 20, 1 << 24)]
    m, _ = fit(pts)
    assert m.native_alpha == pytest.approx(2e-4, rel=1e-9)
    assert m.native_beta == pytest.approx(5e-10, rel=1e-9)
    back = CostModel.from_json(m.to_json())
    assert (back.native_alpha, back.native_beta) == (m.native_alpha, m.native_beta)
    # uncalibrated: choose() skips it even when asked
    assert CostModel(1e-3, 1e-9, 1e-10).choose(1 << 24, 4, candidates=("ring", "native")) == "ring"
    assert m.choose(1 << 24, 4, candidates=("ring", "native")) == "native"


def _level_with_native(native_gain: float, error=None, spread=None) -> CostModel:
    """A model whose native all-reduce of 1 MiB at P = 2 is ``native_gain`` faster
    than the butterfly, with the fit's ``error`` and the samples' ``spread``
    recorded as the probe records them."""
    ours = CostModel(1e-4, 1e-9, 1e-10)
    t = ours.predict("butterfly", 1 << 20, 2)
    fit = {k: v for k, v in (("rms_rel_err", error), ("spread", spread)) if v is not None}
    return CostModel(
        1e-4,
        1e-9,
        1e-10,
        meta={"fit": fit} if fit else {},
        native_alpha=t * (1 - native_gain),
        native_beta=0.0,
    )


@pytest.mark.parametrize(
    "gain,error,spread,window,expected",
    [
        (0.10, 0.25, None, None, "butterfly"),  # faster by less than the fit can tell: ours
        (0.10, 0.25, None, 1.0, "butterfly"),  # (with a window both fit in)
        (0.10, 0.05, 0.25, None, "butterfly"),  # a close fit of noisy samples: ours
        (0.40, 0.25, 0.05, None, "native"),  # faster by more than either
        (
            0.10,
            None,
            None,
            None,
            "native",
        ),  # nothing recorded (a model built by hand): as predicted
        (0.10, 0.0, 0.0, None, "native"),
    ],
)
def test_native_wins_only_by_more_than_the_uncertainty(gain, error, spread, window, expected):
    m = _level_with_native(gain, error, spread)
    assert m.uncertainty == max(error or 0.0, spread or 0.0)
    assert m.choose(1 << 20, 2, window, candidates=("butterfly", "native")) == expected
    # it travels with a saved model (a calibration, the kept probe)
    assert CostModel.from_json(json.loads(json.dumps(m.to_json()))).uncertainty == m.uncertainty


def test_a_plan_says_when_it_kept_ours_over_a_native_predicted_faster():
    from hybridcomm.plan.planner import Layer, make_plan

    layers = [Layer("fc", [0], (1 << 20) // 4)]
    kept = make_plan(layers, world_size=2, model=_level_with_native(0.10, 0.25))
    assert [b.algorithm for b in kept.buckets] == ["butterfly"]
    assert any("native predicted faster" in n and "25%" in n for n in kept.notes), kept.notes
    chose = make_plan(layers, world_size=2, model=_level_with_native(0.40, 0.25))
    assert [b.algorithm for b in chose.buckets] == ["native"]
    assert not any("native predicted faster" in n for n in chose.notes)
