"""benchmarks/shard_phases.py runs end to end: every phase of every sharded
algorithm at 2 ranks, each result right on every rank, a table and JSON (no
speed is asserted)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "shard_phases.py")


@pytest.mark.timeout(180)  # a benchmark run
def test_a_tiny_run_times_every_phase_of_every_algorithm_and_checks_them(tmp_path):
    out = tmp_path / "phases.json"
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--nprocs",
            "2",
            "--sizes",
            "4K,1000",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["world"] == 2 and doc["backend"] == "gloo"
    got = {(r["bytes"], r["phase"], r["algorithm"]) for r in doc["rows"]}
    # each size padded to 2 equal parts of a multiple of 8 elements (native's layout)
    assert got == {
        (n, p, a)
        for n in (4096, 1024)
        for p in ("reduce_scatter", "all_gather", "all_reduce")
        for a in ("ring", "halving_doubling", "native")
    }
    assert all(r["right"] and r["ms"] > 0 for r in doc["rows"]), doc["rows"]
    table = proc.stdout.splitlines()
    assert table[0].startswith("# sharded phases over 2 ranks, gloo")
    assert len(table) == 2 + len(doc["rows"])
    assert all(line.split()[-1] == "yes" for line in table[2:])
