"""benchmarks/train.py runs end to end (2 ranks, tiny settings) and writes the documented JSON."""

import json
import math
import os
import subprocess
import sys
import threading

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "train.py")
HYBRID = ["ring", "butterfly", "hybrid-backward", "hybrid-forward"]
ROW_KEYS = {
    "config",
    "batch_size",
    "step_ms",
    "compute_ms",
    "exposed_comm_ms",
    "speedup_vs_stock",
    "speedup_vs_ddp",
    "limit_ms",
    "vs_limit",
    "peak_rss_mb",
    "footprint_mb",
}
UNSYNCED = ("compute", "limit")  # no gradient averaging: replicas differ by design
LINUX = sys.platform.startswith("linux")


def _train_module():
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import train

    return train


def _run(tmp_path, *extra, timeout=120):
    out = tmp_path / "train.json"
    cmd = [
        sys.executable,
        SCRIPT,
        "--nprocs",
        "2",
        "--batch-sizes",
        "4",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--json",
        str(out),
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(out.read_text()), proc.stdout


def _check(doc, configs):
    assert doc["nprocs"] == 2 and doc["shape"] is None
    assert doc["model"]["arch"] == "vgg_small" and doc["model"]["source"] == "in-repo"
    assert doc["model"]["params"] > doc["model"]["fc_params"] > 0.9 * doc["model"]["params"]
    assert {"cpu", "torch", "cpus"} <= set(doc["machine"])
    assert "train.py" in doc["command"]
    rows = {r["config"]: r for r in doc["results"]}
    assert list(rows) == ["compute"] + configs
    for r in doc["results"]:
        assert ROW_KEYS <= set(r), r
        assert r["batch_size"] == 4
        assert math.isfinite(r["step_ms"]) and r["step_ms"] > 0 and r["compute_ms"] > 0
        assert r["exposed_comm_ms"] == pytest.approx(r["step_ms"] - r["compute_ms"])
        assert r["speedup_vs_stock"] == pytest.approx(rows["stock"]["step_ms"] / r["step_ms"])
        if r["config"] in UNSYNCED:
            assert r["same"] is None and r["max_abs_diff_vs_stock"] is None
        else:
            assert r["same"] is True  # parameters bitwise identical across ranks
        if r["config"] not in UNSYNCED + ("comm",):
            assert r["max_abs_diff_vs_stock"] < 1e-4  # same training as stock, up to sum order
        if LINUX:  # peak resident memory of the timed steps, the largest over ranks
            assert r["peak_rss_mb"] > 0 and r["footprint_mb"] is not None
            assert r["peak_rss_mb"] * 1024 * 1024 > doc["model"]["bytes"] * len(configs)
        if "limit" not in rows:
            assert r["limit_ms"] is None and r["vs_limit"] is None
    assert rows["stock"]["speedup_vs_stock"] == pytest.approx(1.0)


@pytest.mark.timeout(180)  # a benchmark run
def test_hybridcomm_configs(tmp_path):
    doc, _ = _run(tmp_path, "--configs", ",".join(["stock"] + HYBRID))
    _check(doc, ["stock"] + HYBRID)


@pytest.mark.timeout(180)  # a benchmark run
def test_ddp_caps_comm_the_bound_and_the_limit(tmp_path):
    configs = ["comm", "limit", "stock", "ddp:0.5", "ddp:25", "hybrid-forward"]
    doc, stdout = _run(tmp_path, "--configs", ",".join(configs))
    _check(doc, configs)
    rows = {r["config"]: r for r in doc["results"]}
    bound = max(rows["compute"]["step_ms"], rows["comm"]["step_ms"])
    limit = rows["limit"]["step_ms"]
    best = min(("ddp:0.5", "ddp:25"), key=lambda c: rows[c]["step_ms"])
    for r in rows.values():
        assert r["bound_ms"] == pytest.approx(bound)
        assert r["vs_bound"] == pytest.approx(r["step_ms"] / bound)
        assert r["limit_ms"] == pytest.approx(limit)
        assert r["vs_limit"] == pytest.approx(r["step_ms"] / limit)
        assert r["best_ddp"] == best
        assert r["speedup_vs_ddp"] == pytest.approx(rows[best]["step_ms"] / r["step_ms"])
        # cpu% is reported, not judged: the machine's /proc/stat jiffies over two short
        # timed steps may count nothing (None) or run backwards (idle, iowait)
        assert r["cpu_busy_pct"] is None or math.isfinite(r["cpu_busy_pct"])
    for c in ("ddp:0.5", "ddp:25", "hybrid-forward"):  # what is checked: the same training
        assert rows[c]["same"] is True and rows[c]["max_abs_diff_vs_stock"] < 1e-4
    assert rows["limit"]["vs_limit"] == pytest.approx(1.0)
    if LINUX:  # comm and limit hold the model and a flat buffer of all gradients, at least
        for c in ("comm", "limit"):
            assert rows[c]["footprint_mb"] * 1024 * 1024 > 1.5 * doc["model"]["bytes"]
    header = next(line for line in stdout.splitlines() if line.lstrip().startswith("batch"))
    for column in ("bound", "limit", "/bound", "/limit", "cpu%", "peakMB", "footMB"):
        assert column in header.split()
    limit_line = next(line for line in stdout.splitlines() if line.split()[1:2] == ["limit"])
    assert "1.00x" in limit_line
    assert "same" in stdout and "stock" in stdout


@pytest.mark.timeout(360)  # a benchmark run of ResNet-18
def test_a_real_model_resnet18(tmp_path):
    configs = ["stock", "hybrid-forward"]  # a smoke: batch 2, one timed step, one round
    doc, stdout = _run(
        tmp_path,
        "--model",
        "resnet18",
        "--configs",
        ",".join(configs),
        "--batch-sizes",
        "2",
        "--iters",
        "1",
        "--rounds",
        "1",
    )
    model = doc["model"]
    assert model["arch"] == "resnet18" and model["params"] == 11173962  # the CIFAR stem
    assert model["bytes"] == 4 * model["params"] and "torchvision" in model["source"]
    header = next(line for line in stdout.splitlines() if line.startswith("training step"))
    assert "resnet18 (" in header and "11.17M params, 44.7 MB of gradients" in header
    rows = {r["config"]: r for r in doc["results"]}
    assert list(rows) == ["compute"] + configs
    for c in configs:  # BN and residual blocks train alike under every config
        assert rows[c]["same"] is True and rows[c]["max_abs_diff_vs_stock"] < 1e-4


SHARDED = ["zero", "fsdp2", "shard-optimizer", "shard-gradients", "shard-optimizer-backward"]
SHARD_KEYS = {
    "opt_state_bytes",
    "opt_state_bytes_per_rank",
    "opt_state_replicated_bytes",
    "opt_state_ref_bytes",
    "opt_state_vs_ref",
    "own_peak_mb",
    "own_peak_mb_per_rank",
    "peak_rss_mb_per_rank",
    "diff_vs",
}


@pytest.mark.timeout(360)  # a benchmark run of six configs
def test_sharded_optimizer_state_configs_with_adam_on_the_transformer(tmp_path):
    """Issue 40's comparison, tiny: DDP, ZeroRedundancyOptimizer, FSDP2 and hybridcomm's
    shard= configs train the transformer with Adam to DDP's parameters (2 ranks: every
    sum of two is exact, so up to nothing), each keeping its share of the state."""
    doc, stdout = _run(
        tmp_path,
        "--optimizer",
        "adam",
        "--model",
        "transformer",
        "--configs",
        "shard",
        "--batch-sizes",
        "2",
    )
    configs = ["ddp"] + SHARDED
    assert doc["optimizer"] == "Adam(lr=0.001)" and doc["model"]["arch"] == "transformer"
    assert doc["model"]["source"] == "in-repo" and doc["model"]["params"] == 3161610
    rows = {r["config"]: r for r in doc["results"]}
    assert list(rows) == ["compute"] + configs
    replicated = rows["compute"]["opt_state_bytes"]
    assert replicated > 2 * doc["model"]["bytes"]  # Adam: two moments (and a step count)
    for r in doc["results"]:
        assert ROW_KEYS | SHARD_KEYS <= set(r), r
        assert math.isfinite(r["step_ms"]) and r["step_ms"] > 0
        assert len(r["opt_state_bytes_per_rank"]) == 2
        assert r["opt_state_bytes"] == max(r["opt_state_bytes_per_rank"])
        assert r["opt_state_replicated_bytes"] == replicated
        assert r["opt_state_ref_bytes"] == replicated / 2
        assert r["opt_state_vs_ref"] == pytest.approx(2 * r["opt_state_bytes"] / replicated)
        if r["config"] == "compute":
            continue
        assert r["same"] is True and r["diff_vs"] == "ddp"
        assert r["max_abs_diff_vs_stock"] < 1e-4, r["config"]  # DDP's training
        if LINUX:
            assert r["own_peak_mb"] > 0 and len(r["peak_rss_mb_per_rank"]) == 2
    assert rows["ddp"]["opt_state_bytes_per_rank"] == [replicated, replicated]
    for c in ("fsdp2", "shard-optimizer", "shard-gradients", "shard-optimizer-backward"):
        assert rows[c]["opt_state_vs_ref"] < 1.05, c  # 1/P of the state, each rank
    # ZeRO partitions whole parameters: each rank less than all, not necessarily half
    assert max(rows["zero"]["opt_state_bytes_per_rank"]) < replicated
    assert sum(rows["zero"]["opt_state_bytes_per_rank"]) == replicated
    header = next(line for line in stdout.splitlines() if line.lstrip().startswith("batch"))
    for column in ("peakMB", "footMB", "ownMB", "stateMB", "/rep"):
        assert column in header.split()
    assert "Adam(lr=0.001)" in stdout and "max|d| against ddp" in stdout


def test_optimizer_option_defaults_to_the_old_sgd_and_shard_names_the_comparison(capsys):
    train = _train_module()
    assert train.parse_args([]).optimizer == "sgd"  # the thesis runs keep their optimizer
    assert train.parse_args(["--optimizer", "adam"]).optimizer == "adam"
    assert train.parse_args(["--configs", "stock,shard"]).configs == ["stock"] + ["ddp"] + SHARDED
    assert train.reference_config(["ddp:2", "zero"]) == "ddp:2"
    assert train.reference_config(["ddp", "stock"]) == "stock"
    assert train.reference_config(["zero"]) is None
    with pytest.raises(SystemExit) as done:
        train.parse_args(["--optimizer", "lamb"])
    assert done.value.code == 2 and "lamb" in capsys.readouterr().err


def test_fsdp2_shards_each_layer_then_the_root():
    train = _train_module()
    import models

    def names(model):
        units = train.fsdp_units(model)
        return [n for n, m in model.named_modules() if any(m is u for u in units)]

    assert names(models.build("transformer")) == [f"layers.{i}" for i in range(4)] + ["head"]
    resnet = names(models.build("resnet18"))
    assert resnet[:3] == ["conv1", "bn1", "layer1.0"] and resnet[-1] == "fc" and len(resnet) == 11
    assert names(models.build("vgg_small")) == [
        "features.0",
        "features.2",
        "features.5",
        "classifier.0",
        "classifier.2",
        "classifier.4",
    ]


def test_model_is_documented_and_kept_off_the_demo_and_the_regime_map(capsys):
    train = _train_module()  # its parser, in this process: no interpreter start per case
    assert train.parse_args([]).model == "vgg_small"
    assert train.parse_args(["--model", "vgg11"]).model == "vgg11"
    with pytest.raises(SystemExit) as done:
        train.parse_args(["--help"])
    assert done.value.code == 0
    assert "--model {vgg_small,vgg11,resnet18,transformer}" in capsys.readouterr().out
    for run in (["--demo"], ["--regime-map"]):
        with pytest.raises(SystemExit) as done:
            train.parse_args([*run, "--model", "resnet18"])
        assert done.value.code == 2 and "run vgg_small" in capsys.readouterr().err


def test_limit_runs_its_all_reduce_beside_the_step_in_one_persistent_thread():
    train = _train_module()
    inside, calls = threading.Event(), []

    def fn():  # returns only once the caller runs concurrently with it
        calls.append(threading.current_thread())
        assert inside.wait(10)

    worker = train._Concurrent(fn)
    try:
        for _ in range(3):
            inside.clear()
            worker.start()
            inside.set()  # the "compute", while fn runs
            worker.wait()
    finally:
        worker.close()
    assert len(calls) == 3 and len(set(calls)) == 1 and calls[0] is not threading.main_thread()
    assert not calls[0].is_alive()

    def boom():
        raise RuntimeError("all_reduce failed")

    worker = train._Concurrent(boom)
    worker.start()
    with pytest.raises(RuntimeError, match="all_reduce failed"):
        worker.wait()
    worker.close()


@pytest.mark.skipif(not LINUX, reason="VmHWM and clear_refs are Linux's")
def test_peak_resident_memory_is_reset_and_read():
    train = _train_module()
    if not train.reset_peak_rss():
        pytest.skip("/proc/self/clear_refs cannot reset the peak here")
    base = train.peak_rss_kb()
    assert base and base >= train.resident_kb() * 0.9
    x = torch.ones(16 * 1024 * 1024)  # 64 MiB, touched
    del x
    assert train.peak_rss_kb() - base > 48 * 1024
    train.resident_kb(trim=True)  # freed heap (earlier tests') handed back first, so the
    # reset takes the live size, not memory the trim below would drop
    assert train.reset_peak_rss() and train.peak_rss_kb() - train.resident_kb(trim=True) < 48 * 1024


def test_defaults_carry_the_limit_and_the_balanced_batch():
    train = _train_module()
    assert "limit" in train.parse_args([]).configs
    regime = train.parse_args(["--regime-map"])
    assert 512 in regime.batch_sizes and "limit" in regime.configs
    assert "limit" in train.parse_args(["--demo"]).configs


def test_config_names_are_checked_before_anything_runs(capsys):
    train = _train_module()
    for bad in ("ddp:0", "ddp:x", "ddp:-1"):  # main() parses with parse_args first
        with pytest.raises(SystemExit) as e:
            train.parse_args(["--configs", bad])
        assert e.value.code == 2 and bad in capsys.readouterr().err
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--configs", "nccl"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )  # and the script exits with it
    assert proc.returncode == 2 and "nccl" in proc.stderr


@pytest.mark.timeout(180)  # a benchmark run
def test_a_hybridcomm_config_takes_optimizer_options(tmp_path, capsys):
    config = "hybrid-forward/fusion_bytes=32M/split_bytes=0"
    doc, _ = _run(tmp_path, "--configs", "stock," + config)
    _check(doc, ["stock", config])
    plan = doc["plans"][f"loopback {config} batch 4"]
    assert plan.startswith("hybridcomm plan: 1 buckets") and "split off" in plan
    train = _train_module()
    for bad in ("hybrid-forward/fusion=4M", "hybrid-forward/split_bytes=", "ddp:2/fusion_bytes=1"):
        with pytest.raises(SystemExit) as e:
            train.parse_args(["--configs", bad])
        assert e.value.code == 2 and bad in capsys.readouterr().err


def test_regime_cells_and_the_demo_line():
    train = _train_module()

    def row(config, ms):
        return {
            "config": config,
            "batch_size": 256,
            "step_ms": ms,
            "compute_ms": 900.0,
            "bound_ms": 1200.0,
            "vs_bound": ms / 1200.0,
            "best_ddp": "ddp:2",
            "limit_ms": 1250.0,
            "vs_limit": ms / 1250.0,
            "peak_rss_mb": 700.0 if config == "hybrid-forward" else 650.0,
            "cpu_busy_pct": 24.0 if config == "comm" else 99.0,
        }

    results = [
        row("compute", 900.0),
        row("comm", 1200.0),
        row("limit", 1250.0),
        row("stock", 2400.0),
        row("ddp:2", 1800.0),
        row("hybrid-forward", 1500.0),
    ]
    (cell,) = train.regime_cells("100mbit", results)
    assert cell["hybrid_vs_best_ddp"] == pytest.approx(1500 / 1800)
    assert cell["comm_cpu_busy_pct"] == 24.0 and cell["best_ddp"] == "ddp:2"
    assert cell["limit_ms"] == 1250.0 and cell["hybrid_vs_limit"] == pytest.approx(1.2)
    assert cell["hybrid_peak_rss_mb"] == 700.0 and cell["best_ddp_peak_rss_mb"] == 650.0
    train.print_regime_map([cell])  # prints the limit columns without failing
    line = train.demo_line(results, "100mbit")
    assert "38% less time than stock" in line and "17% less than the best DDP" in line
    assert "1.25x the bound" in line and "1.20x the limit" in line
    assert "peak memory 700 MB vs 650 MB (ddp:2)" in line


def test_each_network_keeps_its_own_probe(monkeypatch, tmp_path):
    train = _train_module()
    monkeypatch.delenv("HYBRIDCOMM_COST_MODEL", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with train.cost_models_of("100mbit"):
        fast = os.environ["HYBRIDCOMM_COST_MODEL"]
    with train.cost_models_of("1gbit"):
        slow = os.environ["HYBRIDCOMM_COST_MODEL"]
    assert "HYBRIDCOMM_COST_MODEL" not in os.environ
    assert os.path.dirname(fast) != os.path.dirname(slow)  # the probe cache sits beside it
    assert fast.startswith(str(tmp_path)) and "bench-100mbit" in fast
    monkeypatch.setenv("HYBRIDCOMM_COST_MODEL", str(tmp_path / "mine.json"))
    with train.cost_models_of("1gbit"):  # the caller's own model is kept
        assert os.environ["HYBRIDCOMM_COST_MODEL"] == str(tmp_path / "mine.json")
