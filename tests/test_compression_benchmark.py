"""benchmarks/compression.py runs end to end and writes the rows the issue asks for."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import compression  # noqa: E402


@pytest.mark.timeout(180)  # a benchmark run
def test_a_quick_run_writes_one_row_per_config_and_seed(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert (
        compression.main(
            ["--quick", "--shape", "none", "--configs", "ddp-fp16,hybrid-fp16", "--json", str(out)]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert [(r["config"], r["seed"]) for r in rows] == [("ddp-fp16", 0), ("hybrid-fp16", 0)]
    for r in rows:
        assert 0.0 <= r["final_accuracy"] <= 1.0
        assert r["seconds_to_target"] is None or r["seconds_to_target"] > 0
        assert r["curve"][-1][0] == r["steps"]
    assert rows[1]["bytes_sent"] > 0  # the library reports what it sent
    assert "time to 93% test accuracy" in capsys.readouterr().out


def test_time_to_target_is_the_first_evaluation_that_reaches_it():
    curve = [(2, 0.5, 0.80), (4, 1.0, 0.96), (6, 1.5, 0.94), (8, 2.0, 0.97)]
    assert compression.to_target(curve, 0.95) == (4, 1.0)
    assert compression.to_target(curve, 0.99) == (None, None)


def test_the_summary_takes_the_median_and_needs_every_seed_to_reach_the_target():
    rows = [
        {
            "config": "hybrid",
            "seconds_to_target": t,
            "steps_to_target": 10,
            "final_accuracy": a,
            "seconds": 2 * t,
            "steps": 20,
        }
        for t, a in ((3.0, 0.96), (1.0, 0.97), (2.0, 0.98))
    ]
    s = compression.summarize(rows, 0.95)["hybrid"]
    assert s["seconds_to_target"] == 2.0 and s["reached"] == 3
    assert s["ms_per_step"] == 200.0  # the median run's 4 s over 20 steps
    assert abs(s["final_spread"] - 0.02) < 1e-12
    rows[0]["seconds_to_target"] = None
    assert compression.summarize(rows, 0.95)["hybrid"]["seconds_to_target"] is None


def test_a_config_that_cannot_run_here_is_a_row_with_its_reason(tmp_path):
    out = tmp_path / "c.json"
    assert (
        compression.main(
            ["--quick", "--shape", "none", "--configs", "ddp-bf16", "--json", str(out)]
        )
        == 0
    )
    row = json.loads(out.read_text())["results"][0]
    assert row["final_accuracy"] is None and "BF16" in row["error"]


def test_what_an_evaluation_waits_for_goes_on_the_clock():
    """A first read of a parameter whose update is pending waits for it (forward
    mode): settle() reads every parameter once and times that wait."""
    import time

    import torch

    class Pending(torch.Tensor):  # as a deferred update's first read would
        waits = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if Pending.waits:
                time.sleep(Pending.waits.pop())
            return super().__torch_function__(func, types, args, kwargs or {})

    model = torch.nn.Linear(3, 3)
    model.weight = torch.nn.Parameter(torch.zeros(3, 3).as_subclass(Pending))
    Pending.waits.append(0.3)  # step() left its update pending
    assert 0.25 < compression.settle(model) < 0.6
    assert compression.settle(model) < 0.05  # nothing pending any more


def test_the_report_sets_the_best_hook_against_the_compute_floor():
    def row(config, to_target, steps, seconds):
        return {
            "config": config,
            "seed": 0,
            "seconds_to_target": to_target,
            "steps_to_target": steps,
            "final_accuracy": 0.96,
            "seconds": seconds,
            "steps": 50,
            "bytes_sent": 0,
        }

    rows = [
        row("compute", None, None, 4.0),
        row("ddp-powersgd-r4", 6.0, 40, 7.5),
        row("hybrid-fp16", 9.0, 40, 11.0),
    ]
    text = compression.report(rows, {"target": 0.95, "shape": None, "epochs": 5, "seeds": [0]})
    # compute alone: 80 ms a step, so DDP's 40 steps cannot take under 3.2 s
    assert "floor: compute alone for ddp-powersgd-r4's 40 steps takes 3.2 s, 0.53x" in text
    assert "1.50x (goal <= 0.80x)" in text


def test_hybridcomm_configs_take_options_and_ddp_ones_do_not():
    assert compression.config_options("hybrid-powersgd-r4-fp16/fusion_bytes=64K") == (
        "hybrid-powersgd-r4-fp16",
        {"fusion_bytes": 65536},
    )
    assert compression.config_options("ddp-fp16") == ("ddp-fp16", {})
    for bad in ("ddp-fp16/fusion_bytes=64K", "hybrid/colour=blue"):
        with pytest.raises(SystemExit):
            compression.main(["--configs", bad, "--shape", "none"])


def test_the_report_names_the_goals_baseline_when_a_config_outside_it_is_fastest():
    rows = [
        {
            "config": c,
            "seed": 0,
            "seconds_to_target": t,
            "steps_to_target": 10,
            "final_accuracy": 0.95,
            "seconds": 2 * t,
            "steps": 20,
            "bytes_sent": 1,
        }
        for c, t in (
            ("ddp-powersgd-r4", 6.0),
            ("ddp-powersgd-r4-fp16", 5.0),
            ("hybrid-powersgd-r4-fp16", 4.0),
        )
    ]
    out = compression.report(rows, {"target": 0.93, "shape": None, "epochs": 1, "seeds": [0]})
    assert "best DDP: ddp-powersgd-r4-fp16 5.0 s" in out and "0.80x (goal" in out
    assert "best of the issue's DDP hooks: ddp-powersgd-r4 6.0 s" in out and "0.67x" in out
