"""The alpha-beta-gamma model: formulas, calibration by least squares, save/load, choice."""
import json
import math

import pytest

from hybridcomm import cost_model
from hybridcomm.cost_model import MODELED, CostModel, coefficients, fit


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


@pytest.mark.parametrize("true", [CostModel(700e-6, 1 / 0.4e9, 1 / 2e9),
                                  CostModel(20e-6, 1 / 12e9, 1 / 50e9),
                                  CostModel(5e-6, 1 / 100e9, 0.0)])
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
    samples = [(a, n, 4, true.predict(a, n, 4) * rng.uniform(0.9, 1.1))
               for a in MODELED for n in [1 << s for s in range(12, 27, 2)]]
    model, rep = fit(samples)
    assert model.alpha == pytest.approx(true.alpha, rel=0.15)
    assert model.beta == pytest.approx(true.beta, rel=0.15)
    assert min(model.alpha, model.beta, model.gamma) >= 0
    assert 0 < rep.rms_rel_err < 0.1


def test_fit_refuses_nothing_to_fit():
    with pytest.raises(ValueError):
        fit([("torch", 4096, 4, 1e-3)])


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


def test_save_load_round_trip_and_active_model(tmp_path, monkeypatch):
    path = tmp_path / "cm.json"
    monkeypatch.setenv(cost_model.ENV_PATH, str(path))
    cost_model.set_active(None)
    assert cost_model.load() is None
    assert cost_model.active_model() is cost_model.DEFAULT_MODEL
    model, rep = fit([(a, n, 4, CostModel(1e-3, 1e-9, 1e-10).predict(a, n, 4))
                      for a in MODELED for n in (4096, 1 << 20, 16 << 20)])
    assert cost_model.save(model, report=rep, world_size=4, backend="gloo") == str(path)
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["world_size"] == 4 and "rms_rel_err" in data["fit"]
    loaded = cost_model.load()
    assert (loaded.alpha, loaded.beta, loaded.gamma) == (model.alpha, model.beta, model.gamma)
    assert cost_model.active_model() == loaded
    assert cost_model.choose_algorithm(4096, 4) == loaded.choose(4096, 4)
    path.write_text("{not json")
    with pytest.raises(ValueError):
        cost_model.load()
    assert cost_model.active_model() is cost_model.DEFAULT_MODEL  # a broken file: warn, default


def test_choose_algorithm_is_total():
    cost_model.set_active(None)
    for p in (1, 2, 3, 4, 5, 8):
        for n in (0, 1, 4096, 1 << 30):
            assert cost_model.choose_algorithm(n, p) in MODELED


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


def test_planner_puts_the_big_bucket_on_native_and_small_on_butterfly():
    from hybridcomm.planner import Layer, make_plan
    m = CostModel(1e-3, 1e-9, 1e-10, native_alpha=2e-3, native_beta=5e-10)
    plan = make_plan([Layer("fc", [0], 1 << 22), Layer("conv", [1], 1000)], world_size=4,
                     element_size=4, model=m, fusion_bytes=0,
                     windows={"fc": 1.0, "conv": 1e-3}, ready={"fc": 0.0, "conv": 0.001})
    assert [(b.algorithm, b.lane) for b in plan.buckets] == [("native", "bandwidth"),
                                                            ("butterfly", "latency")]
    assert "native" in str(plan)


def _agree(rank, world, tmp):
    import os
    # only rank 0 has a calibration file; every rank must end up with rank 0's model
    path = os.path.join(tmp, f"model{rank}.json")
    if rank == 0:
        cost_model.save(CostModel(3e-3, 2e-9, 1e-10), path)
    os.environ["HYBRIDCOMM_COST_MODEL"] = path
    cost_model.set_active(None)
    saved = cost_model.agree()
    os.environ["HYBRIDCOMM_COST_MODEL"] = os.path.join(tmp, "nowhere.json")
    cost_model.set_active(None)
    probed = cost_model.agree()  # nobody has one: all probe, rank 0's fit for all
    return (saved.alpha, saved.beta), (probed.alpha, probed.native_alpha), probed.source


def test_agree_takes_rank_0s_calibration_else_probes(tmp_path):
    from multiproc import run_ranks
    results = run_ranks(2, _agree, str(tmp_path))
    assert all(r[0] == (3e-3, 2e-9) for r in results)
    assert results[0][1] == results[1][1] and results[0][1][1] is not None  # native measured
    assert "probe" in results[0][2]
