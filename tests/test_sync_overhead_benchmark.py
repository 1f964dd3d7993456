"""benchmarks/sync_overhead.py runs end to end: every config in every table, a verdict
per model and world, and JSON with the per-parameter figures (no speed is asserted)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "sync_overhead.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import sync_overhead  # noqa: E402


@pytest.mark.timeout(180)  # a benchmark run
def test_a_tiny_quick_run_prints_every_config_and_verdict_and_writes_json(tmp_path):
    out = tmp_path / "overhead.json"
    tiny = [
        "--quick",
        "--layers",
        "3",
        "--width",
        "8",
        "--batch",
        "4",
        "--channels",
        "2",
        "--image",
        "4",
        "--conv-batch",
        "2",
        "--steps",
        "3",
        "--warmup",
        "2",
        "--rounds",
        "1",
    ]
    proc = subprocess.run(
        [sys.executable, SCRIPT, *tiny, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    configs = list(sync_overhead.CONFIGS)
    assert {"plain", "ddp", "ddp-view", "forward", "backward", "none"} <= set(configs)
    lines = proc.stdout.splitlines()
    tables = [i for i, line in enumerate(lines) if line.startswith("## ")]
    assert [lines[i].split(":")[0] for i in tables] == [
        "## linear, world 1",
        "## conv, world 1",
        "## linear, world 2",
        "## conv, world 2",
    ]
    for i in tables:  # header, one row per config in order, the verdict
        assert [row.split()[0] for row in lines[i + 2 : i + 2 + len(configs)]] == configs
        assert lines[i + 2 + len(configs)].startswith("hybridcomm added <= DDP in every mode: ")
    verdicts = [line for line in lines if "hybridcomm added <= DDP in every mode: " in line]
    assert len(verdicts) == 8  # under each table and in the summary
    for line in verdicts:
        assert line.split(": ")[-1].split(" (")[0] in ("yes", "no")
        assert "forward" in line and "backward" in line and "none" in line and "x DDP" in line

    doc = json.loads(out.read_text())
    assert doc["settings"]["launches"] == 1 and doc["hybridcomm_options"] == sync_overhead.HYBRID
    assert [(r["model"], r["world"]) for r in doc["results"]] == [
        ("linear", 1),
        ("conv", 1),
        ("linear", 2),
        ("conv", 2),
    ]
    for r in doc["results"]:
        assert r["parameters"] == (6 if r["model"] == "linear" else 62)
        assert list(r["configs"]) == configs and r["best_ddp"] in configs
        assert isinstance(r["hybridcomm_le_ddp"], bool)
        for c, fig in r["configs"].items():
            for key in ("forward", "backward", "step", "total", "added_ms", "added_us_per_param"):
                assert isinstance(fig[key], float), (c, key)
            assert abs(fig["added_us_per_param"] * r["parameters"] - fig["added_ms"] * 1e3) < 1e-6
        assert r["configs"]["plain"]["added_ms"] == 0.0


def test_the_figures_are_medians_over_launches_and_the_verdict_follows_the_best_ddp():
    def launch(scale):
        rows = {c: {k: 1.0 for k in sync_overhead.FIGURES} for c in sync_overhead.CONFIGS}
        rows["plain"]["added"] = 0.0
        for c in sync_overhead.DDPS:
            rows[c]["added"] = 4.0
        rows["ddp-view"]["added"] = 2.0 * scale  # the best DDP: +2 ms (median)
        rows["forward"]["added"] = 1.0 * scale  # +1 ms (median)
        rows["backward"]["added"] = 2.0  # +2 ms: equal counts as <=
        rows["none"]["added"] = 3.0 * scale  # +3 ms: more than DDP
        rows["none"]["total"] = scale  # every figure is a median over launches
        return {1: {"linear": rows}}

    [res] = sync_overhead.figures([launch(1.0), launch(0.5), launch(2.0)], {"linear": 4})
    rows = res["configs"]
    assert res["best_ddp"] == "ddp-view"
    assert rows["forward"]["added_ms"] == 1.0 and rows["forward"]["added_us_per_param"] == 250.0
    assert rows["forward"]["x_ddp"] == 0.5 and rows["backward"]["x_ddp"] == 1.0
    assert rows["none"]["x_ddp"] == 1.5 and not res["hybridcomm_le_ddp"]
    assert rows["none"]["total"] == 1.0 and rows["plain"]["x_ddp"] is None
    assert sync_overhead.verdict(res) == (
        "hybridcomm added <= DDP in every mode: no (forward 0.50, backward 1.00, none 1.50 x DDP)"
    )


def test_the_hook_cost_benchmark_runs_and_reports_each_hook_kind():
    """benchmarks/hook_cost.py (the Python-hook floor PERFORMANCE.md cites) at a tiny size."""
    script = os.path.join(ROOT, "benchmarks", "hook_cost.py")
    proc = subprocess.run(
        [sys.executable, script, "--layers", "3", "--width", "4", "--rounds", "1", "--steps", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# 6 parameters, backward without hooks ")
    assert [line.split()[0] for line in lines[1:]] == ["pre", "post", "both", "emptied"]
    assert all(line.endswith("us per parameter and pass") for line in lines[1:])
