"""hybridcomm-bench end to end (2 ranks, tiny sweep), its JSON, and argument parsing."""

import json
import subprocess
import sys

import pytest

import hybridcomm
from hybridcomm.tools.bench import report
from hybridcomm.tools.bench.cli import build_parser, sweep_sizes
from hybridcomm.tools.bench.report import bandwidths, measured_crossover, validate
from hybridcomm.base.units import format_bytes as human, parse_size, parse_time


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
    rows = [
        {"algo": a, "bytes": n, "time_us": t}
        for a, n, t in [
            ("butterfly", 1, 1),
            ("ring", 1, 5),
            ("butterfly", 2, 5),
            ("ring", 2, 4),
            ("butterfly", 3, 9),
            ("ring", 3, 6),
        ]
    ]
    assert measured_crossover(rows) == 2


def _run_cli(args, timeout=120):
    r = subprocess.run(
        [sys.executable, "-m", "hybridcomm.tools.bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_cli_end_to_end_two_ranks(tmp_path):
    out, png, cal = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "cm.json"
    text = _run_cli(
        [
            "--nprocs",
            "2",
            "-b",
            "4K",
            "-e",
            "64K",
            "-f",
            "4",
            "-n",
            "3",
            "-w",
            "1",
            "-d",
            "bfloat16",
            "-o",
            "avg",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--calibrate",
            str(cal),
        ]
    )
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["world_size"] == 2 and doc["dtype"] == "bfloat16" and doc["op"] == "avg"
    assert doc["shape"] is None and doc["latency"] == 0
    algos = {"ring", "butterfly", "halving_doubling", "auto", "native"}
    assert {(r["algo"], r["bytes"]) for r in doc["results"]} == {
        (a, n) for a in algos for n in (4096, 16384, 65536)
    }
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in doc["results"])
    r = next(r for r in doc["results"] if r["algo"] == "ring" and r["bytes"] == 65536)
    assert r["count"] == 32768 and r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])  # P=2: x1
    assert doc["calibration"]["path"] == str(cal)
    assert json.loads(cal.read_text())["alpha_s"] == doc["calibration"]["alpha_s"]
    assert png.stat().st_size > 1000
    for col in (
        "size",
        "count",
        "type",
        "redop",
        "algo",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "#wrong",
    ):
        assert col in text
    assert "Avg bus bandwidth" in text and "crossover" in text and "alpha" in text
    # the noise verdict and auto's check, in the text and the JSON alike
    assert doc["noise_threshold"] == report.NOISE_THRESHOLD
    for r in doc["results"]:
        assert r["spread"] == max(r["iter_spread"], r["rank_spread"]) >= 0
        assert len(r["p20_us_per_rank"]) == len(r["p80_us_per_rank"]) == 2
    noisy = sorted({r["bytes"] for r in doc["results"] if r["spread"] > doc["noise_threshold"]})
    assert doc["noisy_sizes"] == noisy
    warning = [line for line in text.splitlines() if line.startswith("# WARNING: noisy")]
    if noisy:
        assert len(warning) == 1 and "unreliable" in warning[0]
        assert all(human(n) in warning[0] for n in noisy)
    else:
        assert not warning and "# Noise: every point within 25%" in text
    auto_lines = [
        line for line in text.splitlines() if line.startswith(("# auto at ", "# auto vs this run"))
    ]
    if doc["auto_check"]:
        assert len(auto_lines) == len(doc["auto_check"])
        assert "--calibrate" in text
    else:
        assert auto_lines == [
            "# auto vs this run: its choice was the fastest measured, within "
            "the noise, at every size"
        ]


def test_cli_latency_rows_say_native_has_none(tmp_path):
    out = tmp_path / "lat.json"
    text = _run_cli(
        [
            "--nprocs",
            "2",
            "-b",
            "4K",
            "-e",
            "4K",
            "-n",
            "2",
            "-w",
            "0",
            "--algo",
            "butterfly,ring,native",
            "--latency",
            "200us",
            "--json",
            str(out),
        ]
    )
    doc = json.loads(out.read_text())
    assert doc["latency"] == pytest.approx(200e-6)
    rows = {r["algo"]: r for r in doc["results"]}
    assert rows["butterfly"]["latency_emulated"] and not rows["native"]["latency_emulated"]
    # ring at P=2: 2 steps, each at least the emulated 200 us
    assert rows["ring"]["time_us"] >= 400 and rows["butterfly"]["time_us"] >= 200
    assert "no latency emulation" in text and "EMULATED" in text
    assert doc["latency_check"]["rows"][0]["bytes"] == 4096


def test_cli_rejects_bad_arguments():
    from hybridcomm.tools.bench.cli import main

    for args in (["-b", "4X"], ["-b", "1M", "-e", "4K"]):  # in-process: nothing starts
        with pytest.raises(SystemExit) as e:
            main(["--nprocs", "1", *args])
        assert e.value.code not in (0, None)
    r = subprocess.run(
        [sys.executable, "-m", "hybridcomm.tools.bench", "--nprocs", "1", "--algo", "tree"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # the module too
    assert r.returncode != 0


def test_version_and_a_help_text_for_every_flag():
    r = subprocess.run(
        [sys.executable, "-m", "hybridcomm.tools.bench", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and hybridcomm.__version__ in r.stdout, r.stdout + r.stderr
    ap = build_parser()
    bare = [a.option_strings for a in ap._actions if not a.help]
    assert bare == [], f"flags without help text: {bare}"
    text = ap.format_help()
    assert "``" not in text and "torch.distributed.all_reduce" in text


def _raw(algo, nbytes, medians_us, p20_us=None, p80_us=None, chosen=None):
    """A harness row as rank 0 merges it (seconds), for report's functions."""
    s = [t * 1e-6 for t in medians_us]
    return {
        "algo": algo,
        "chosen": chosen or algo,
        "bytes": nbytes,
        "count": nbytes // 4,
        "time_s": sum(s) / len(s),
        "wrong": 0,
        "time_s_per_rank": s,
        "p20_s_per_rank": [t * 1e-6 for t in (p20_us or medians_us)],
        "p80_s_per_rank": [t * 1e-6 for t in (p80_us or medians_us)],
    }


def _summary(raw):
    doc = {"results": report.result_rows(raw, 2, 0.0), "auto_model": {"source": "probe"}}
    return doc, report.summary(doc)


def test_a_noisy_point_is_named_and_the_crossover_called_unreliable():
    quiet = [
        _raw("butterfly", 4096, [100, 102], [98, 99], [103, 104]),
        _raw("ring", 4096, [200, 201]),
        _raw("butterfly", 1 << 20, [900, 905]),
        _raw("ring", 1 << 20, [800, 801]),
    ]
    _, lines = _summary(quiet)
    assert not any("WARNING" in line for line in lines)
    assert any(line.startswith("# Noise: every point within 25%") for line in lines)
    crossover = next(line for line in lines if "crossover" in line)
    assert "UNRELIABLE" not in crossover
    # ring at 1M: iterations from 500 to 1200 us around an 800 us median
    noisy_iters = quiet[:3] + [_raw("ring", 1 << 20, [800, 801], [500, 790], [1200, 810])]
    doc, lines = _summary(noisy_iters)
    assert [r["bytes"] for r in report.noisy(doc["results"])] == [1 << 20]
    warning = next(line for line in lines if line.startswith("# WARNING: noisy"))
    assert "at 1M:" in warning and "4K" not in warning and "ring at 1M" in warning
    assert "across iterations" in warning and "crossover verdict" in warning
    assert "UNRELIABLE: noisy at 1M" in next(line for line in lines if "crossover" in line)
    row = next(
        line
        for line in (
            report.row_line(r, {"dtype": "float32", "op": "sum", "latency": 0})
            for r in doc["results"]
        )
        if " ring " in line and "1048576" in line
    )
    assert "noisy (88% spread)" in row
    # the ranks disagree (100 and 200 us medians), each rank's iterations steady
    _, lines = _summary([_raw("native", 4096, [100, 200])])
    assert "across ranks" in next(line for line in lines if "WARNING" in line)


def test_auto_is_checked_against_the_same_runs_measurements():
    def run(auto_us, native_us, native_p80=None):
        return _summary(
            [
                _raw("butterfly", 1 << 20, [auto_us, auto_us]),
                _raw("auto", 1 << 20, [auto_us, auto_us], chosen="butterfly"),
                _raw(
                    "native",
                    1 << 20,
                    [native_us, native_us],
                    p80_us=native_p80 and [native_p80, native_p80],
                ),
            ]
        )[1]

    slow = run(1000, 600)  # auto's butterfly 1.67x slower than native, both points steady
    line = next(line for line in slow if line.startswith("# auto at 1M"))
    assert "chose butterfly" in line and "native measured 600 us" in line and "1.67x" in line
    assert any("--calibrate" in line and "probe" in line for line in slow)
    ok = run(1000, 980)  # 2% apart: within the 5% floor
    assert (
        "# auto vs this run: its choice was the fastest measured, within the noise, "
        "at every size" in ok
    )
    noisy = run(1000, 800, native_p80=1500)  # 25% apart, but native spreads 88%
    assert not any(line.startswith("# auto at") for line in noisy)
    assert report.auto_check(report.result_rows([_raw("ring", 4096, [5, 5])], 2, 0.0)) == []
