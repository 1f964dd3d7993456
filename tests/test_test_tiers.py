"""The fast tier stays what it says (tests/tiers.py): the concepts it must cover are
marked ``fast``, ``make test-fast`` selects them in one process, and the refusal
of process starts that keeps a fast test in that process does refuse each way
Python starts one, and undoes itself."""

import importlib
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tiers

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent

# What the fast tier covers, by the module that tests it (make test-fast's promise)
COVERED = {
    "the planner": "test_planner",
    "the cost model": "test_cost_model",
    "the schedules": "test_schedules",
    "the kernels (pack, unpack)": "test_kernels_pack",
    "the kernels (reduce)": "test_kernels_reduce",
    "the engine's issue order": "test_engine",
    "the executor over the fake network": "test_executor_fake_network",
    "the bucket lifecycle over the fake network": "test_bucket_lifecycle_fake",
    "the hooks at one rank": "test_hooks_one_rank",
}


def _marks(module):
    marks = getattr(module, "pytestmark", [])
    return {m.name for m in (marks if isinstance(marks, list) else [marks])}


@pytest.mark.parametrize("concept", sorted(COVERED))
def test_each_concept_of_the_fast_tier_is_marked_fast(concept):
    module = importlib.import_module(COVERED[concept])
    assert tiers.FAST in _marks(module), (
        f"{COVERED[concept]}.py ({concept}) is not marked '{tiers.FAST}': make test-fast "
        "would leave it out"
    )


def test_make_test_fast_runs_the_fast_tier_in_one_process_under_the_refusal():
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test-fast:.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "the Makefile has no test-fast target"
    line = recipe.group(1)
    assert f"{tiers.TIER_ENV}={tiers.FAST}" in line
    assert f'-m "{tiers.FAST} and not {tiers.SLOW}"' in line
    assert " -n " not in line and "xdist" not in line  # one process
    test = re.search(r"^test: .*\n((?:\t.*\n|\s+\\\n|    .*\n)+)", text, re.M)
    assert test and f"-m {tiers.FAST}" not in test.group(1)  # make test runs everything


def test_every_way_to_start_a_process_is_refused_inside_and_restored_after():
    saved = (subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start, os.system)
    with tiers.refusing("this check"):
        with pytest.raises(tiers.ProcessStarted, match="this check is marked 'fast'.*Popen"):
            subprocess.run([sys.executable, "-c", "pass"])
        with pytest.raises(tiers.ProcessStarted, match="multiprocessing"):
            multiprocessing.get_context("fork").Process(target=print).start()
        with pytest.raises(tiers.ProcessStarted, match=r"os\.system"):
            os.system("true")
        with pytest.raises(tiers.ProcessStarted, match=r"os\.fork"):
            os.fork()
    assert (subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start, os.system) == (
        saved
    )


def test_the_spawn_log_records_without_refusing(tmp_path):
    log = tiers.SpawnLog(str(tmp_path / "log.jsonl"))
    log.begin()
    with tiers.watching(log.started.append):
        with pytest.raises(FileNotFoundError):  # started (and failed): recorded, not refused
            subprocess.Popen(["/nonexistent/hybridcomm-test-binary"])
    log.end("t::x", marked=False)
    row = (tmp_path / "log.jsonl").read_text()
    assert '"spawned": true' in row and "Popen" in row
