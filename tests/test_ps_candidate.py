"""The summation servers (hybridcomm/comm/servers.py) as a planner candidate, ``ps``: the
plan picks it where its cost model says so, the optimizer runs buckets through
the servers (same bits as a plain all-reduce on integer-valued gradients), its
fitted line survives the calibration file, and the bench's ``--servers``."""

import json
import os

import pytest
import torch
import torch.nn as nn

import hybridcomm
import hybridcomm.comm.servers as ps
from hybridcomm.comm import calibration
from hybridcomm.tools.bench import cli
from hybridcomm.plan.cost_model import CostModel
from hybridcomm.base.errors import HybridCommError
from hybridcomm.plan.planner import Layer, make_plan
from multiproc import run_ranks

BASE = CostModel(alpha=1e-4, beta=1e-9, gamma=1e-10, native_alpha=1e-4, native_beta=1e-9)
LAYERS = [Layer("fc", [0, 1], 1 << 20), Layer("head", [2], 1 << 10)]


def _plan(model, servers, strategy="hybrid"):
    return make_plan(
        LAYERS,
        world_size=4,
        model=model,
        servers=servers,
        strategy=strategy,
        fusion_bytes=64 << 10,
        split_bytes=0,
    )


def test_the_planner_picks_ps_where_its_line_is_faster_and_not_otherwise():
    cheap = BASE.with_ps(alpha=1e-6, beta=1e-12, servers=4)  # faster than any ring here
    dear = BASE.with_ps(alpha=1.0, beta=1e-6, servers=4)
    assert [b.algorithm for b in _plan(cheap, 4).buckets] == ["ps", "ps"]
    assert "ps" in str(_plan(cheap, 4))  # the plan's table shows it
    assert "ps" not in [b.algorithm for b in _plan(dear, 4).buckets]
    assert "ps" not in [b.algorithm for b in _plan(cheap, 0).buckets]  # no servers
    assert "ps" not in [b.algorithm for b in _plan(BASE, 4).buckets]  # no ps line
    other = _plan(cheap, 2)  # the line was measured with 4 servers, the job has 2
    assert "ps" not in [b.algorithm for b in other.buckets]
    assert any("no ps line for 2 servers" in n for n in other.notes)
    assert [b.algorithm for b in _plan(dear, 4, "ps").buckets] == ["ps", "ps"]  # forced
    with pytest.raises(ValueError, match="needs summation servers"):
        _plan(cheap, 0, "ps")


def test_a_fitted_ps_line_round_trips_through_the_calibration_file(tmp_path, monkeypatch):
    path = tmp_path / "model.json"
    monkeypatch.setenv("HYBRIDCOMM_COST_MODEL", str(path))
    samples = [
        (a, n, 4, BASE.predict(a, n, 4)) for a in ("ring", "butterfly") for n in (4096, 1 << 20)
    ]
    samples += [("ps", n, 4, 2e-3 + n * 3e-9) for n in (4096, 1 << 20, 16 << 20)]
    model, _ = hybridcomm.plan.cost_model.fit(samples, ps_servers=4)
    assert model.ps_servers == 4
    assert model.ps_alpha == pytest.approx(2e-3) and model.ps_beta == pytest.approx(3e-9)
    calibration.save(model, world_size=4, backend="gloo")
    loaded = calibration.load()
    assert (loaded.ps_alpha, loaded.ps_beta, loaded.ps_servers) == (
        model.ps_alpha,
        model.ps_beta,
        4,
    )
    assert loaded.offers("ps", 4) and not loaded.offers("ps", 2)
    assert loaded.predict("ps", 1 << 20, 4) == model.predict("ps", 1 << 20, 4)


@pytest.mark.parametrize(
    "argv,why",
    [
        (["--servers", "-1"], "--servers must be >= 0"),
        (["--algo", "ring,ps"], "--algo ps needs summation servers"),
        (["--servers", "2", "--node-size", "2"], "flat network"),
        (["--servers", "2", "--latency", "100us"], "emulated latency"),
    ],
)
def test_the_bench_checks_servers(argv, why):
    with pytest.raises(SystemExit, match=why):
        cli.config_from(cli.build_parser().parse_args(argv))


def test_the_bench_adds_ps_with_servers():
    cfg = cli.config_from(cli.build_parser().parse_args(["--servers", "2", "--algo", "ring"]))
    assert cfg.algos == ["ring", "ps"] and cfg.servers == 2


def test_the_bench_times_and_calibrates_ps(tmp_path, capsys):
    """2 workers + 1 server: ps timed beside ring and checked, its line fitted and saved."""
    path, doc = tmp_path / "cal.json", tmp_path / "out.json"
    rc = cli.main(
        [
            "--nprocs",
            "2",
            "--servers",
            "1",
            "-b",
            "4K",
            "-e",
            "64K",
            "-f",
            "16",
            "-n",
            "2",
            "-w",
            "0",
            "--algo",
            "ring,butterfly",
            "--calibrate",
            str(path),
            "--json",
            str(doc),
            "--timeout",
            "60",
        ]
    )
    assert rc == 0, capsys.readouterr().out  # every result checked exact (#wrong 0)
    rows = json.loads(doc.read_text())["results"]
    assert {r["algo"] for r in rows} == {"ring", "butterfly", "ps"}
    assert all(r["wrong"] == 0 for r in rows)
    saved = calibration.load(str(path))
    assert saved.ps_servers == 1 and saved.offers("ps", 1)


def test_summation_servers_check_their_flow_control_arguments():
    role = ps.Role(False, [0], [1], None)
    with pytest.raises(ValueError, match="window must be >= 1"):
        ps.SummationServers(role, window=0)
    with pytest.raises(ValueError, match="chunk_bytes must be positive"):
        ps.SummationServers(role, chunk_bytes=0)


# ---- the optimizer through the servers (W workers + K servers, real processes) ---------

STEPS = 4


def _coef(rank, i, p):
    """Integer-valued gradients: every sum (and the mean over 2 workers) is exact."""
    n = torch.arange(p.numel(), dtype=torch.float64)
    return ((n * 7 + rank * 3 + i) % 11 - 5).to(p.dtype).view(p.shape)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 40), nn.Linear(40, 30), nn.Linear(30, 3))


def _train(opt, model, rank):
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(torch.ones(2, 6)).sum() * 0  # the forward uses the parameters (first use)
        loss = loss + sum((p * _coef(rank, i, p)).sum() for i, p in enumerate(model.parameters()))
        loss.backward()
        opt.step()
    opt.synchronize()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _workers_and_servers(rank, world, k):
    role = ps.split_world(k)
    if role.is_server:
        return "server", ps.serve(role, timeout=60)
    out = {}
    servers = ps.SummationServers(role, timeout=60)
    for strategy, overlap in (("ps", "forward"), ("ps", "backward"), ("ring", "backward")):
        model = _model()
        opt = hybridcomm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5),
            model=model,
            strategy=strategy,
            overlap=overlap,
            servers=servers,
            cost_model="default",
            fusion_bytes=4 << 10,
            measure_iters=2,
            timeout=60,
        )
        out[strategy, overlap] = _train(opt, model, rank)
        out[strategy, overlap, "plan"] = {b.algorithm for b in opt.plan.buckets}
        opt.close()
    # the start-up probe adds a ps line for this many servers (hybrid may then pick ps)
    model = _model()
    opt = hybridcomm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), model=model, servers=servers, timeout=60
    )
    out["probed"] = opt._hc_sync.cost_model.offers("ps", k)
    opt.close()
    servers.close()
    return "worker", out


def test_the_optimizer_with_ps_forced_gives_the_one_process_parameters_bitwise():
    workers, k = 2, 2
    results = run_ranks(workers + k, _workers_and_servers, k, timeout=120)
    model = _model()  # one process: the mean gradient, the same SGD
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    for _ in range(STEPS):
        for i, p in enumerate(model.parameters()):
            p.grad = sum(_coef(r, i, p) for r in range(workers)) / workers
        opt.step()
    want = torch.cat([p.detach().flatten() for p in model.parameters()])
    outs = [r[1] for r in results if r[0] == "worker"]
    assert len(outs) == workers
    for out in outs:
        for key in (("ps", "forward"), ("ps", "backward"), ("ring", "backward")):
            assert torch.equal(out[key], want), key
        assert out["ps", "forward", "plan"] == {"ps"}
        assert out["probed"]
    assert all(r[1] > 0 for r in results if r[0] == "server")


def _gpu_path(rank, world):
    os.environ["HYBRIDCOMM_SIMULATE_GPU"] = "1"
    role = ps.split_world(1)
    if role.is_server:
        return ps.serve(role, timeout=60)  # returns: the worker's failed optimizer closed it
    model = _model()
    try:
        hybridcomm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model=model,
            servers=role,
            cost_model="default",
            timeout=60,
        )
    except HybridCommError as e:
        return str(e)
    return "no error"


def test_ps_on_the_gpu_path_is_a_clear_error_at_construction():
    worker, served = run_ranks(2, _gpu_path, timeout=60)
    assert "host path only" in worker and "leave servers out on the GPU path" in worker
    assert served == 0


def _forced_without_servers(rank, world):
    os.environ["HYBRIDCOMM_ALGO"] = "ps"
    model = _model()
    try:
        hybridcomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    except HybridCommError as e:
        return str(e)
    return "no error"


def test_ps_forced_without_servers_is_a_clear_error():
    assert "needs the summation servers" in run_ranks(1, _forced_without_servers, timeout=60)[0]
