"""Where cost models come from: saved calibrations, the probe, rank 0's model for all."""

import dataclasses
import json
import os

import pytest

from hybridcomm.comm import calibration
from hybridcomm.plan.cost_model import DEFAULT_MODEL, MODELED, CostModel, fit
from multiproc import run_ranks


def test_save_load_round_trip_and_active_model(tmp_path, monkeypatch):
    path = tmp_path / "cm.json"
    monkeypatch.setenv(calibration.ENV_PATH, str(path))
    calibration.set_active(None)
    assert calibration.load() is None
    assert calibration.active_model() is DEFAULT_MODEL
    model, rep = fit(
        [
            (a, n, 4, CostModel(1e-3, 1e-9, 1e-10).predict(a, n, 4))
            for a in MODELED
            for n in (4096, 1 << 20, 16 << 20)
        ]
    )
    assert calibration.save(model, report=rep, world_size=4, backend="gloo") == str(path)
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["world_size"] == 4 and "rms_rel_err" in data["fit"]
    assert data["fit"]["confidence"] == "high"
    loaded = calibration.load()
    assert (loaded.alpha, loaded.beta, loaded.gamma) == (model.alpha, model.beta, model.gamma)
    assert calibration.active_model() == loaded
    assert calibration.choose_algorithm(4096, 4) == loaded.choose(4096, 4)
    path.write_text("{not json")
    with pytest.raises(ValueError):
        calibration.load()
    assert calibration.active_model() is DEFAULT_MODEL  # a broken file: warn, default


def test_choose_algorithm_is_total():
    calibration.set_active(None)
    for p in (1, 2, 3, 4, 5, 8):
        for n in (0, 1, 4096, 1 << 30):
            assert calibration.choose_algorithm(n, p) in MODELED


def test_measure_gamma_is_positive_and_plausible():
    gamma = calibration.measure_gamma(__import__("torch").device("cpu"), nbytes=1 << 20, iters=3)
    assert 1e-12 < gamma < 1e-7  # a CPU add runs between 10 MB/s and 1 TB/s


def _agree(rank, world, tmp):
    # only rank 0 has a calibration file; every rank must end up with rank 0's model
    path = os.path.join(tmp, f"model{rank}.json")
    if rank == 0:
        calibration.save(CostModel(3e-3, 2e-9, 1e-10), path)
    os.environ["HYBRIDCOMM_COST_MODEL"] = path
    calibration.set_active(None)
    saved = calibration.agree(timeout=60)
    os.environ["HYBRIDCOMM_COST_MODEL"] = os.path.join(tmp, "nowhere.json")
    calibration.set_active(None)
    probed = calibration.agree(timeout=60)  # nobody has one: all probe, rank 0's fit for all
    return (
        (saved.alpha, saved.beta),
        (probed.alpha, probed.beta, probed.gamma, probed.native_alpha),
        probed.source,
        probed.uncertainty,
    )


def test_agree_takes_rank_0s_calibration_else_probes(tmp_path):
    results = run_ranks(2, _agree, str(tmp_path))
    assert all(r[0] == (3e-3, 2e-9) for r in results)
    assert results[0][1] == results[1][1] and results[0][1][3] is not None  # native measured
    assert results[0][1][2] > 0  # gamma measured on its own
    assert "probe" in results[0][2]
    # rounded to two significant digits: the same machine gives the same model
    for v in results[0][1]:
        assert v == float(f"{v:.1e}")
    # its uncertainty, rounded, is rank 0's on every rank (the planner weighs native by it)
    uncertainty = results[0][3]
    assert results[1][3] == uncertainty and uncertainty == float(f"{uncertainty:.1e}")
    assert uncertainty > 0  # (timings of a real link: never all equal)


def _agree_with_a_bad_file(rank, world, path, content):
    import logging

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("hybridcomm").addHandler(Keep())
    if rank == 0:
        with open(path, "w") as f:
            f.write(content)
    os.environ["HYBRIDCOMM_COST_MODEL"] = path
    calibration.set_active(None)
    model = calibration.agree(timeout=60)
    return model.source, [line for line in lines if "probing instead" in line]


_GOOD = CostModel(3e-3, 2e-9, 1e-10).to_json()


@pytest.mark.parametrize(
    "content,why",
    [
        ('{"version": 1, "alpha_s": 0.00', "cannot read"),  # truncated
        ("not json at all", "cannot read"),
        ('{"version": 999, "alpha_s": 1}', "cannot read"),  # another format
        (json.dumps({k: v for k, v in _GOOD.items() if k != "beta_s_per_byte"}), "cannot read"),
        (json.dumps({**_GOOD, "world_size": 8}), "on 8 ranks, and this group has 2"),
        (json.dumps({**_GOOD, "world_size": 2, "device": "cuda"}), "on cuda"),
    ],
)
def test_a_bad_or_foreign_calibration_file_warns_and_probes(tmp_path, content, why):
    """Never a crash, never a silent misuse: rank 0 warns, and every rank uses a fresh probe."""
    results = run_ranks(2, _agree_with_a_bad_file, str(tmp_path / "model.json"), content)
    for source, _ in results:
        assert "probe" in source
    assert any(why in line for line in results[0][1]), results[0][1]


def test_a_calibration_for_this_world_is_used(tmp_path):
    results = run_ranks(
        2,
        _agree_with_a_bad_file,
        str(tmp_path / "model.json"),
        json.dumps({**_GOOD, "world_size": 2, "device": "cpu"}),
    )
    for source, warnings in results:
        assert "model.json" in source and not warnings


def _probes_kept_in(tmp):
    """This rank's process: no calibration saved, start-up probes kept under ``tmp``."""
    os.environ.pop("HYBRIDCOMM_COST_MODEL", None)
    os.environ["XDG_CACHE_HOME"] = tmp
    os.environ["HYBRIDCOMM_PROBE_CACHE"] = "1"


def _agree_over_an_old_cache(rank, world, tmp):
    """A job whose kept probe an older release wrote: no uncertainty in it."""
    _probes_kept_in(tmp)
    import torch.distributed as dist  # noqa: F401 - (the group is up: run_ranks)

    path = calibration.probe_cache_path()
    if rank == 0:
        calibration.save(
            CostModel(3e-3, 2e-9, 1e-10, native_alpha=1e-6, native_beta=1e-12),
            path,
            world_size=2,
            device="cpu",
            backend="gloo",
        )
    calibration.set_active(None)
    model = calibration.agree(timeout=60)
    # (rank 0 keeps the new probe once it is agreed: read there, after)
    kept = json.loads(open(path).read()).get("fit") if rank == 0 else None
    return model.source, model.uncertainty, kept


def test_a_probe_an_older_release_kept_is_probed_again_and_replaced(tmp_path):
    results = run_ranks(2, _agree_over_an_old_cache, str(tmp_path))
    for source, uncertainty, _ in results:
        assert source.startswith("probe at start-up") and uncertainty > 0
    kept = results[0][2]
    assert kept is not None and kept["rms_rel_err"] >= 0  # the new probe replaced it


def _agree_twice_with_the_cache(rank, world, tmp):
    """Two runs of one job in a fresh cache directory, no calibration saved."""
    _probes_kept_in(tmp)
    out = []
    for _ in range(2):
        calibration.set_active(None)
        model = calibration.agree(timeout=60)
        out.append((model.source, model.alpha, model.beta, model.gamma, model.native_alpha))
    return out


def test_the_first_run_keeps_its_probe_and_the_next_run_plans_from_it(tmp_path):
    for first, second in run_ranks(2, _agree_twice_with_the_cache, str(tmp_path)):
        assert first[0].startswith("probe at start-up")
        assert second[0].startswith("probe saved at") and second[1:] == first[1:]
    saved = list((tmp_path / "hybridcomm").glob("probe-w2-gloo-cpu-*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["world_size"] == 2


def _a_kept_probe_the_steps_contradict(rank, world, tmp):
    """A job whose kept probe predicts communication 1000x faster than it runs."""
    import torch

    import hybridcomm

    _probes_kept_in(tmp)
    path = calibration.probe_cache_path()
    if rank == 0:
        fast = CostModel(1e-9, 1e-15, 1e-15, native_alpha=1e-9, native_beta=1e-15)
        fast = dataclasses.replace(fast, meta={"fit": {"rms_rel_err": 0.1, "spread": 0.1}})
        calibration.save(fast, path, world_size=world, device="cpu", backend="gloo")
    calibration.set_active(None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, timeout=60
    )
    for _ in range(6):
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
    opt.close()
    # another network, another job: MASTER_ADDR and the socket interface are in the key
    os.environ["GLOO_SOCKET_IFNAME"] = "eth-elsewhere"
    elsewhere = calibration.probe_cache_path()
    return os.path.exists(path), path != elsewhere


def test_a_kept_probe_the_measured_steps_contradict_is_removed(tmp_path):
    """Planned from a probe kept by an earlier run (on another network, say) and
    measured 1000x slower than it predicts: the kept probe is removed after the
    first measured steps, so the job's next run probes again."""
    for kept, distinct in run_ranks(2, _a_kept_probe_the_steps_contradict, str(tmp_path)):
        assert not kept  # (a fresh probe, had it been taken, would be kept there)
        assert distinct
