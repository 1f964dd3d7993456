"""`make gpu-check`: run every test under tests/gpu and write a JSON report.

    python tests/gpu/gpu_check.py [--output gpu-check.json] [-- extra pytest args]

The report says what ran (each test's node id, outcome, seconds, skip or
failure reason, and ``gpus_needed``: its ``@pytest.mark.gpus(n)``, default 1),
on what device, with which torch/CUDA/CuPy/NCCL/Triton, whether the CUDA C++
extension built, the kernel timings the tests recorded, and the total wall
time; its summary counts the outcomes and the tests per number of GPUs needed,
with the share that needs one. Tests that need more GPUs than there are skip.

Without CUDA it is a dry run: pytest still runs, every collected test skips,
the report says ``"dry_run": true``, and it exits 0. The exit status is
non-zero (and ``problems`` says why) when a test failed or errored, a module
did not collect, pytest collected nothing (its exit 5, e.g. a ``-k`` that
matches nothing) or did not finish, the csrc build failed, or on a GPU no test
passed at all. "Dry run, everything skipped" is told from "nothing collected"
by the count: a dry run has tests, each with its skip reason.

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


def pytest_itemcollected(item):
    from gpu_common import gpus_needed  # the gpus(n) marker, read as conftest.py reads it

    item.user_properties.append(("gpus_needed", gpus_needed(item)))  # copied to each report


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
        f.write(
            json.dumps(
                {
                    "nodeid": report.nodeid,
                    "when": report.when,
                    "outcome": report.outcome,
                    "seconds": report.duration,
                    "reason": reason,
                    "gpus_needed": dict(report.user_properties).get("gpus_needed", 1),
                }
            )
            + "\n"
        )


def pytest_collectreport(report):
    if report.failed and os.environ.get(RESULTS_ENV):  # a module that does not even import
        with open(os.environ[RESULTS_ENV], "a") as f:
            # (the node id is empty for a path outside the rootdir; the reason names it)
            f.write(
                json.dumps(
                    {
                        "nodeid": report.nodeid or "(collection)",
                        "when": "collect",
                        "outcome": "failed",
                        "seconds": 0.0,
                        "reason": str(report.longrepr)[-4000:],
                        "gpus_needed": None,
                    }
                )
                + "\n"
            )


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
    """Per test: the outcome (failed/error beat skipped beat passed), its seconds and
    the GPUs it needs; a module that did not collect is a "collection_error" (no
    ``gpus_needed``: its tests are unknown)."""
    tests = {}
    for r in lines:
        t = tests.setdefault(
            r["nodeid"],
            {
                "nodeid": r["nodeid"],
                "outcome": "passed",
                "seconds": 0.0,
                "reason": None,
                "gpus_needed": r.get("gpus_needed", 1),
            },
        )
        t["seconds"] += r["seconds"]
        if r["outcome"] == "failed":
            t["outcome"] = {"call": "failed", "collect": "collection_error"}.get(r["when"], "error")
            t["reason"] = r["reason"]
        elif r["outcome"] == "skipped" and t["outcome"] == "passed":
            t["outcome"], t["reason"] = "skipped", r["reason"]
    for t in tests.values():
        t["seconds"] = round(t["seconds"], 4)
    return list(tests.values())


def summarize(tests):
    """Outcome counts, tests per number of GPUs needed, and the share needing one."""
    outcomes, by_gpus = {}, {}
    for t in tests:
        outcomes[t["outcome"]] = outcomes.get(t["outcome"], 0) + 1
        if t["gpus_needed"] is not None:
            key = str(t["gpus_needed"])
            by_gpus[key] = by_gpus.get(key, 0) + 1
    counted = sum(by_gpus.values())
    return {
        "tests": counted,
        "outcomes": outcomes,
        "gpus_needed": dict(sorted(by_gpus.items(), key=lambda kv: int(kv[0]))),
        "one_gpu_share": round(by_gpus.get("1", 0) / counted, 4) if counted else None,
    }


def csrc_status():
    """The CUDA C++ extension here: built, or why not, and whether a build failed
    (a toolchain was there and the build raised: a failure, never a skip)."""
    try:
        from hybridcomm.gpu import cuda_ext

        built = cuda_ext.load() is not None
        return {
            "built": built,
            "build_failed": cuda_ext.build_failed(),
            "why_not": cuda_ext.why_not(),
        }
    except Exception as e:  # noqa: BLE001 - the package itself does not import
        return {"built": False, "build_failed": True, "why_not": f"{type(e).__name__}: {e}"}


def problems(rc, tests, csrc, dry_run):
    """Why the check failed (empty: it passed)."""
    found = []
    if rc == 5:
        found.append("pytest collected no tests (exit 5): nothing was checked")
    elif rc != 0:
        found.append(f"pytest exited {rc}")
    if not tests and rc != 5:
        found.append("no test reported an outcome")
    for outcome in ("collection_error", "failed", "error"):
        bad = [t["nodeid"] for t in tests if t["outcome"] == outcome]
        if bad:
            found.append(
                f"{len(bad)} {outcome}: " + ", ".join(bad[:10]) + (" ..." if len(bad) > 10 else "")
            )
    if csrc["build_failed"]:
        found.append(f"the csrc build failed: {csrc['why_not']}")
    if not dry_run and tests and not any(t["outcome"] == "passed" for t in tests):
        found.append("CUDA is here but no test passed (every one skipped)")
    return found


def _read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--output",
        "-o",
        default="gpu-check.json",
        help="where the JSON report goes (default gpu-check.json)",
    )
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
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rfEs",
            "-p",
            "gpu_check",
            os.path.join(ROOT, "tests", "gpu"),
            *args.pytest_args,
        ]
        print(
            "[gpu-check]",
            "dry run (no CUDA device):" if info["dry_run"] else f"on {info['device']}:",
            " ".join(cmd),
            flush=True,
        )
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
        tests = collect(_read_jsonl(env[RESULTS_ENV]))
        records = _read_jsonl(env[RECORDS_ENV])

    # on a GPU: built by the kernel tests already (torch's cache), else here
    csrc = (
        {"built": False, "build_failed": False, "why_not": "dry run: no CUDA device"}
        if info["dry_run"]
        else csrc_status()
    )
    summary = summarize(tests)
    found = problems(rc, tests, csrc, info["dry_run"])
    ok = not found
    report = {
        **info,
        "ok": ok,
        "problems": found,
        "started": stamp,
        "command": cmd,
        "pytest_exit_code": rc,
        "summary": summary,
        "csrc": csrc,
        "wall_seconds": round(time.monotonic() - started, 2),
        "tests": tests,
        "kernel_timings": [r for r in records if r.get("kind") == "kernel_timing"],
        "records": [r for r in records if r.get("kind") != "kernel_timing"],
    }
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(
        f"[gpu-check] {summary['outcomes']} ({summary['gpus_needed']} by GPUs needed) in "
        f"{report['wall_seconds']} s; report: {args.output}" + ("" if ok else " (FAILED)")
    )
    for p in found:
        print(f"[gpu-check] FAILED: {p}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
