"""`make gpu-check`: run every test under tests/gpu and write a JSON report.

    python tests/gpu/gpu_check.py [--output gpu-check.json] [-- extra pytest args]

The report says what ran (each test's node id, outcome, seconds, skip or
failure reason), on what device, with which torch/CUDA/CuPy/NCCL/Triton, the
kernel timings the tests recorded, and the total wall time. Tests that need
more GPUs than there are skip. Without CUDA it is a dry run: pytest still runs
(everything skips), the report says ``"dry_run": true``, and it exits 0. The
exit status is non-zero when any test failed or errored, or pytest itself did
not finish.

It is also the pytest plugin (``-p gpu_check``) that records the outcomes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS_ENV = "HYBRIDCOMM_GPU_CHECK_RESULTS"
RECORDS_ENV = "HYBRIDCOMM_GPU_CHECK_RECORDS"  # tests/gpu/gpu_common.record writes here


# -- the plugin (inside the pytest process) ----------------------------------------

def pytest_runtest_logreport(report):
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    reason = None
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
    elif report.failed:
        reason = str(report.longrepr)[-4000:]
    with open(path, "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "when": report.when,
                            "outcome": report.outcome, "seconds": report.duration,
                            "reason": reason}) + "\n")


def pytest_collectreport(report):
    if report.failed and os.environ.get(RESULTS_ENV):  # a module that does not even import
        with open(os.environ[RESULTS_ENV], "a") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "when": "collect", "outcome": "failed",
                                "seconds": 0.0, "reason": str(report.longrepr)[-4000:]}) + "\n")


# -- the runner ------------------------------------------------------------------------

def _version(*dists):
    from importlib import metadata

    for name in dists:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def environment():
    import torch

    cuda = torch.cuda.is_available()
    info = {
        "dry_run": not cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run: no CUDA device)",
        "device_count": torch.cuda.device_count() if cuda else 0,
        "host": platform.node(),
        "python": platform.python_version(),
        "versions": {
            "torch": torch.__version__,
            "cuda (torch built with)": torch.version.cuda,
            "cupy": _version("cupy-cuda13x", "cupy-cuda12x", "cupy"),
            "nccl (pip)": _version("nvidia-nccl-cu13", "nvidia-nccl-cu12"),
            "triton": _version("triton", "pytorch-triton"),
        },
    }
    if cuda:
        p = torch.cuda.get_device_properties(0)
        info["capability"] = f"{p.major}.{p.minor}"
        info["memory_gib"] = round(p.total_memory / 2**30, 1)
        try:
            info["versions"]["nccl (torch)"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001 - informational only
            info["versions"]["nccl (torch)"] = f"unknown ({e})"
    return info


def collect(lines):
    """Per test: the outcome (failed/error beat skipped beat passed) and its seconds."""
    tests = {}
    for r in lines:
        t = tests.setdefault(r["nodeid"], {"nodeid": r["nodeid"], "outcome": "passed",
                                           "seconds": 0.0, "reason": None})
        t["seconds"] += r["seconds"]
        if r["outcome"] == "failed":
            t["outcome"] = "failed" if r["when"] == "call" else "error"
            t["reason"] = r["reason"]
        elif r["outcome"] == "skipped" and t["outcome"] == "passed":
            t["outcome"], t["reason"] = "skipped", r["reason"]
    for t in tests.values():
        t["seconds"] = round(t["seconds"], 4)
    return list(tests.values())


def _read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", "-o", default="gpu-check.json",
                    help="where the JSON report goes (default gpu-check.json)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)

    started = time.monotonic()
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info = environment()
    env = dict(os.environ)
    if not info["dry_run"]:
        env["TRITON_INTERPRET"] = "0"  # compile the kernels for the device
    env["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in [env.get("PYTHONPATH")] if p])
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        env[RESULTS_ENV] = os.path.join(tmp, "results.jsonl")
        env[RECORDS_ENV] = os.path.join(tmp, "records.jsonl")
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "gpu_check",
               os.path.join(ROOT, "tests", "gpu"), *args.pytest_args]
        print("[gpu-check]", "dry run (no CUDA device):" if info["dry_run"] else
              f"on {info['device']}:", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
        tests = collect(_read_jsonl(env[RESULTS_ENV]))
        records = _read_jsonl(env[RECORDS_ENV])

    summary = {}
    for t in tests:
        summary[t["outcome"]] = summary.get(t["outcome"], 0) + 1
    # 0: all passed (or skipped); 5: nothing collected; anything else is a failure
    ok = rc in (0, 5) and not summary.get("failed") and not summary.get("error")
    report = {
        **info,
        "ok": ok,
        "started": stamp,
        "command": cmd,
        "pytest_exit_code": rc,
        "summary": summary,
        "wall_seconds": round(time.monotonic() - started, 2),
        "tests": tests,
        "kernel_timings": [r for r in records if r.get("kind") == "kernel_timing"],
        "records": [r for r in records if r.get("kind") != "kernel_timing"],
    }
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"[gpu-check] {summary} in {report['wall_seconds']} s; report: {args.output}"
          + ("" if ok else " (FAILED)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
