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
    assert {"cpu", "torch", "cpu_count"} <= set(doc["machine"])
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

