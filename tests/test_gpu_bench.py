"""`make gpu-bench` (benchmarks/gpu_bench.py) on this CPU machine: its dry run, on the
simulated GPU at tiny sizes, runs every section and code path of the script, writes
the JSON with every config's and kernel's rows and the profile files beside it, prints
the dry-run verdict and exits 0. The real run is for GPUs (~4 min there)."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_bench.py")


@pytest.mark.timeout(420)  # every section of a script, dry
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for CPU machines")
def test_the_dry_run_runs_every_section_and_reports_it(tmp_path):
    out = tmp_path / "bench.json"
    p = subprocess.run(
        [sys.executable, SCRIPT, "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "verdict: dry run: no GPU, nothing measured against the goals" in p.stdout
    assert "DRY RUN" in p.stdout  # its figures are never printed as GPU figures
    r = json.loads(out.read_text())
    assert r["dry_run"] is True and r["verdict"].startswith("verdict: dry run")
    assert set(r["sections"]) == {"kernels", "step", "ranks", "profile"}
    for name, sec in r["sections"].items():
        assert sec["status"] == "ok" and not sec.get("errors") and sec["dry_run"], (name, sec)
    assert r["versions"]["torch"] == torch.__version__ and r["git"]

    k = r["sections"]["kernels"]["rows"]
    got = {(row["op"], row["case"], row["variant"]) for row in k}
    for case in ("large", "small", "tiny"):
        assert {
            ("copy", case, "dst.copy_"),
            ("pack", case, "hybridcomm"),
            ("pack", case, "torch.cat"),
            ("pack", case, "_foreach_copy_"),
            ("unpack", case, "hybridcomm"),
            ("unpack", case, "_foreach_copy_"),
        } <= got
    for dtype in ("float32", "bfloat16"):
        variants = {row["variant"] for row in k if row["op"] == "reduce" and row["dtype"] == dtype}
        assert variants == {"hybridcomm", "torch add_", "hybridcomm scale", "torch add_.mul_"}
    assert all(row["dev_us"] > 0 and row["host_us"] > 0 and row["n"] > 0 for row in k)

    step = {(row["model"], row["config"]): row for row in r["sections"]["step"]["rows"]}
    configs = ("plain", "ddp", "hc-forward", "hc-backward", "hc-none")
    assert set(step) == {(m, c) for m in ("resnet18", "transformer") for c in configs}
    for row in step.values():
        assert row["synced_ms"] > 0 and row["pipelined_ms"] > 0 and row["host_ms"] > 0
        assert row["x_ddp"] > 0 and row["added_host_ms"] is not None

    rows = r["sections"]["ranks"]["rows"]
    ranks = {(row["P"], row["config"], row["rank"]) for row in rows}
    assert ranks == {
        (2, c, rank)
        for c in ("local", "hc-forward", "hc-none", "hc-backward", "hc-zero2", "hc-zero2-at-step")
        for rank in (0, 1)
    }
    assert all(row["peak_mb"] is None for row in rows)  # (a GPU's allocator: none here)

    prof = r["sections"]["profile"]
    assert len(prof["top_tottime"]) == 15 and set(prof["ops_per_step"]) == {"hc-forward", "plain"}
    for path in prof["files"].values():
        assert os.path.getsize(path) > 0 and os.path.dirname(path) == str(tmp_path)
    assert r["goals"] and all(g["met"] is None for g in r["goals"])  # nothing measured
