"""benchmarks/train.py runs end to end (2 ranks, tiny settings) and writes the documented JSON."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "train.py")
HYBRID = ["ring", "butterfly", "hybrid-backward", "hybrid-forward"]
ROW_KEYS = {"config", "batch_size", "step_ms", "compute_ms", "exposed_comm_ms",
            "speedup_vs_stock", "speedup_vs_ddp"}


def _run(tmp_path, *extra, timeout=120):
    out = tmp_path / "train.json"
    cmd = [sys.executable, SCRIPT, "--nprocs", "2", "--batch-sizes", "4", "--iters", "2",
           "--warmup", "1", "--json", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(out.read_text()), proc.stdout


def _check(doc, configs):
    assert doc["nprocs"] == 2 and doc["shape"] is None
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
        if r["config"] != "compute":
            assert r["same"] is True  # parameters bitwise identical across ranks
        if r["config"] not in ("compute", "comm"):
            assert r["max_abs_diff_vs_stock"] < 1e-4  # same training as stock, up to sum order
    assert rows["stock"]["speedup_vs_stock"] == pytest.approx(1.0)
    if "ddp" in rows:
        assert rows["ddp"]["speedup_vs_ddp"] == pytest.approx(1.0)


def test_stock_and_ddp(tmp_path):
    doc, stdout = _run(tmp_path, "--configs", "stock,ddp")
    _check(doc, ["stock", "ddp"])
    assert "same" in stdout and "stock" in stdout


def test_hybridcomm_configs(tmp_path):
    doc, _ = _run(tmp_path, "--configs", ",".join(["stock"] + HYBRID))
    _check(doc, ["stock"] + HYBRID)



def test_ddp_caps_comm_and_the_bound(tmp_path):
    configs = ["comm", "stock", "ddp:0.5", "ddp:25", "hybrid-forward"]
    doc, stdout = _run(tmp_path, "--configs", ",".join(configs))
    _check(doc, configs)
    rows = {r["config"]: r for r in doc["results"]}
    bound = max(rows["compute"]["step_ms"], rows["comm"]["step_ms"])
    best = min(("ddp:0.5", "ddp:25"), key=lambda c: rows[c]["step_ms"])
    for r in rows.values():
        assert r["bound_ms"] == pytest.approx(bound)
        assert r["vs_bound"] == pytest.approx(r["step_ms"] / bound)
        assert r["best_ddp"] == best
        assert r["speedup_vs_ddp"] == pytest.approx(rows[best]["step_ms"] / r["step_ms"])
        assert 0 <= r["cpu_busy_pct"] <= 100
    assert "bound" in stdout and "cpu%" in stdout


def test_config_names_are_checked_before_anything_runs():
    for bad in ("ddp:0", "ddp:x", "ddp:-1", "nccl"):
        proc = subprocess.run([sys.executable, SCRIPT, "--configs", bad], capture_output=True,
                              text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 2 and bad in proc.stderr


def test_regime_cells_and_the_demo_line():
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import train

    def row(config, ms):
        return {"config": config, "batch_size": 256, "step_ms": ms, "compute_ms": 900.0,
                "bound_ms": 1200.0, "vs_bound": ms / 1200.0, "best_ddp": "ddp:2",
                "cpu_busy_pct": 24.0 if config == "comm" else 99.0}

    results = [row("compute", 900.0), row("comm", 1200.0), row("stock", 2400.0),
               row("ddp:2", 1800.0), row("hybrid-forward", 1500.0)]
    (cell,) = train.regime_cells("100mbit", results)
    assert cell["hybrid_vs_best_ddp"] == pytest.approx(1500 / 1800)
    assert cell["comm_cpu_busy_pct"] == 24.0 and cell["best_ddp"] == "ddp:2"
    line = train.demo_line(results, "100mbit")
    assert "38% less time than stock" in line and "17% less than the best DDP" in line
    assert "1.25x the bound" in line
