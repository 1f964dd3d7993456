"""`make gpu-check` (tests/gpu/gpu_check.py) on this CPU machine: a dry run that
still runs pytest over tests/gpu (everything skips), writes the JSON report and
exits 0; and a run that does not finish exits non-zero."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "gpu", "gpu_check.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import gpu_check  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for CPU machines")


def _run(tmp_path, *extra):
    out = tmp_path / "report.json"
    p = subprocess.run([sys.executable, SCRIPT, "--output", str(out), *extra], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    return p, out


def test_dry_run_writes_the_report_and_exits_zero(tmp_path):
    p, out = _run(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["dry_run"] is True and r["ok"] is True and r["pytest_exit_code"] == 0
    assert "no CUDA" in r["device"] and r["device_count"] == 0
    assert r["versions"]["torch"] == torch.__version__
    files = {t["nodeid"].split("::")[0] for t in r["tests"]}
    assert {"tests/gpu/test_single_gpu.py", "tests/gpu/test_kernels_cuda.py",
            "tests/gpu/test_allreduce_cupy_gpu.py", "tests/gpu/test_optimizer_cuda.py"} <= files
    assert r["tests"] and all(t["outcome"] == "skipped" and t["reason"] for t in r["tests"])
    assert r["summary"] == {"skipped": len(r["tests"])}
    single = [t["nodeid"] for t in r["tests"] if "test_single_gpu" in t["nodeid"]]
    assert len(single) == 7, single  # 1 transport + 3 overlap modes + 1 graph + 2 kernel cases
    assert r["kernel_timings"] == [] and r["wall_seconds"] > 0


def test_pytest_not_finishing_exits_non_zero(tmp_path):
    p, out = _run(tmp_path, "--", "--no-such-pytest-option")
    assert p.returncode == 1
    r = json.loads(out.read_text())
    assert r["ok"] is False and r["pytest_exit_code"] not in (0, 5)


def test_outcomes_failed_and_error_beat_skipped_and_passed():
    lines = [
        {"nodeid": "a", "when": "setup", "outcome": "passed", "seconds": 0.5, "reason": None},
        {"nodeid": "a", "when": "call", "outcome": "failed", "seconds": 1.0, "reason": "boom"},
        {"nodeid": "a", "when": "teardown", "outcome": "passed", "seconds": 0.25, "reason": None},
        {"nodeid": "b", "when": "setup", "outcome": "skipped", "seconds": 0.0, "reason": "no"},
        {"nodeid": "c", "when": "setup", "outcome": "passed", "seconds": 0.0, "reason": None},
        {"nodeid": "c", "when": "call", "outcome": "passed", "seconds": 2.0, "reason": None},
        {"nodeid": "c", "when": "teardown", "outcome": "failed", "seconds": 0.0, "reason": "x"},
        {"nodeid": "d", "when": "call", "outcome": "passed", "seconds": 3.0, "reason": None},
    ]
    got = {t["nodeid"]: (t["outcome"], t["seconds"]) for t in gpu_check.collect(lines)}
    assert got == {"a": ("failed", 1.75), "b": ("skipped", 0.0), "c": ("error", 2.0),
                   "d": ("passed", 3.0)}
