"""hybridcomm-bench end to end (2 ranks, tiny sweep), its JSON, and argument parsing."""
import json
import subprocess
import sys

import pytest

from hybridcomm.bench.cli import sweep_sizes
from hybridcomm.bench.report import bandwidths, measured_crossover, validate
from hybridcomm.units import format_bytes as human, parse_size, parse_time


def test_parse_size():
    assert parse_size("4096") == 4096
    assert parse_size("4K") == parse_size("4k") == parse_size("4KB") == parse_size("4KiB") == 4096
    assert parse_size("16M") == 16 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("1.5M") == 3 << 19
    for bad in ("", "K", "4X", "-1K", "1.1"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_parse_time_and_sweep():
    assert parse_time("200us") == pytest.approx(200e-6)
    assert parse_time("0.5ms") == pytest.approx(5e-4)
    assert parse_time("1s") == 1.0
    assert parse_time("250") == pytest.approx(250e-6)
    with pytest.raises(ValueError):
        parse_time("fast")
    assert sweep_sizes(4096, 64 << 10, 4) == [4096, 16384, 65536]
    assert sweep_sizes(8, 8, 2) == [8]
    assert sweep_sizes(4096, 10000, 2) == [4096, 8192]


def test_bus_bandwidth_and_helpers():
    algbw, busbw = bandwidths(1e9, 1.0, 4)
    assert algbw == 1.0 and busbw == 1.5
    assert human(4096) == "4K" and human(64 << 20) == "64M" and human(100) == "100B"
    rows = [{"algo": a, "bytes": n, "time_us": t} for a, n, t in
            [("butterfly", 1, 1), ("ring", 1, 5), ("butterfly", 2, 5), ("ring", 2, 4),
             ("butterfly", 3, 9), ("ring", 3, 6)]]
    assert measured_crossover(rows) == 2


def _run_cli(args, timeout=120):
    r = subprocess.run([sys.executable, "-m", "hybridcomm.bench", *args],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_cli_end_to_end_two_ranks(tmp_path):
    out, png, cal = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "cm.json"
    text = _run_cli(["--nprocs", "2", "-b", "4K", "-e", "64K", "-f", "4", "-n", "3", "-w", "1",
                     "-d", "bfloat16", "-o", "avg", "--json", str(out), "--plot", str(png),
                     "--calibrate", str(cal)])
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["world_size"] == 2 and doc["dtype"] == "bfloat16" and doc["op"] == "avg"
    assert doc["shape"] is None and doc["latency"] == 0
    algos = {"ring", "butterfly", "halving_doubling", "auto", "native"}
    assert {(r["algo"], r["bytes"]) for r in doc["results"]} == {
        (a, n) for a in algos for n in (4096, 16384, 65536)}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in doc["results"])
    r = next(r for r in doc["results"] if r["algo"] == "ring" and r["bytes"] == 65536)
    assert r["count"] == 32768 and r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])  # P=2: x1
    assert doc["calibration"]["path"] == str(cal)
    assert json.loads(cal.read_text())["alpha_s"] == doc["calibration"]["alpha_s"]
    assert png.stat().st_size > 1000
    for col in ("size", "count", "type", "redop", "algo", "time(us)", "algbw(GB/s)",
                "busbw(GB/s)", "#wrong"):
        assert col in text
    assert "Avg bus bandwidth" in text and "crossover" in text and "alpha" in text


def test_cli_latency_rows_say_native_has_none(tmp_path):
    out = tmp_path / "lat.json"
    text = _run_cli(["--nprocs", "2", "-b", "4K", "-e", "4K", "-n", "2", "-w", "0",
                     "--algo", "butterfly,ring,native", "--latency", "200us", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["latency"] == pytest.approx(200e-6)
    rows = {r["algo"]: r for r in doc["results"]}
    assert rows["butterfly"]["latency_emulated"] and not rows["native"]["latency_emulated"]
    # ring at P=2: 2 steps, each at least the emulated 200 us
    assert rows["ring"]["time_us"] >= 400 and rows["butterfly"]["time_us"] >= 200
    assert "no latency emulation" in text and "EMULATED" in text
    assert doc["latency_check"]["rows"][0]["bytes"] == 4096


def test_cli_rejects_bad_arguments():
    from hybridcomm.bench.cli import main

    for args in (["-b", "4X"], ["-b", "1M", "-e", "4K"]):  # in-process: nothing starts
        with pytest.raises(SystemExit) as e:
            main(["--nprocs", "1", *args])
        assert e.value.code not in (0, None)
    r = subprocess.run([sys.executable, "-m", "hybridcomm.bench", "--nprocs", "1", "--algo",
                        "tree"], capture_output=True, text=True, timeout=60)  # the module too
    assert r.returncode != 0
