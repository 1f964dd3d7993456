"""`make mutation`'s list (tests/mutation/mutations.py) still applies to the source:
each mutation's old text occurs exactly once in its file, so a refactor that makes a
mutation stale fails `make test` here instead of silently weakening `make mutation`.
Also the harness's parsing (SIM_TESTS, pytest's summary). Cheap: no test is run."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # in this process alone (tests/tiers.py)

ROOT = Path(__file__).resolve().parent.parent
MUTATION_DIR = ROOT / "tests" / "mutation"


def _load(name):
    spec = importlib.util.spec_from_file_location(
        f"hybridcomm_mutation_{name}", MUTATION_DIR / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


MUTATIONS = _load("mutations").MUTATIONS
run = _load("run")


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.id)
def test_every_mutation_still_applies_exactly_once(m):
    text = (ROOT / m.file).read_text()
    assert text.count(m.old) == 1, (
        f"{m.id}: stale, its old text occurs {text.count(m.old)} times in {m.file}"
    )
    assert m.new != m.old and text.replace(m.old, m.new) != text
    assert m.guards, f"{m.id}: no guarding test"


def test_the_list_covers_every_fixed_defect():
    ids = [m.id for m in MUTATIONS]
    assert len(ids) == len(set(ids)) and len(ids) >= 15
    defects = {m.defect for m in MUTATIONS}
    want = {f"old {i}" for i in range(1, 11)} | {"new 1", "new 2", "new 10", "pack per parameter"}
    assert want <= defects, want - defects


@pytest.mark.parametrize("guard", sorted({g for m in MUTATIONS for g in m.guards}))
def test_every_guard_names_an_existing_test(guard):
    path, _, rest = guard.partition("::")  # a node id, or a whole test file
    assert (ROOT / path).is_file() and path.startswith("tests/test_"), guard
    if rest:
        func = re.match(r"[A-Za-z_]\w*", rest).group(0)
        assert re.search(rf"^def {func}\(", (ROOT / path).read_text(), re.M), guard


def test_the_makefile_has_the_target_and_the_harness_reads_sim_tests():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\.PHONY:.*\bmutation\b", makefile, re.M)
    assert re.search(r"^mutation:.*\n\t.*tests/mutation/run\.py", makefile, re.M)
    sim = run.sim_tests()
    assert "tests/test_gpu_path.py" in sim and "tests/test_simgpu.py" in sim
    assert all((ROOT / t).is_file() for t in sim)


def test_the_harness_reads_pytests_summary_and_refuses_a_stale_mutation(tmp_path):
    log = (
        "tests/test_a.py::test_x PASSED\ntests/test_a.py::test_y[step-step 0] \n"
        "FAILED tests/test_a.py::test_y[step-step 0] - AssertionError: no - really\n"
    )
    assert run.first_failure(log) == "tests/test_a.py::test_y[step-step 0]"
    assert run.last_started(log) == "tests/test_a.py::test_y[step-step 0]"
    assert run.split_by_env(
        ["tests/s.py::a", "tests/s.py::b", "tests/h.py::c"], ["tests/s.py"]
    ) == [(True, ["tests/s.py::a", "tests/s.py::b"]), (False, ["tests/h.py::c"])]
    m = MUTATIONS[0]
    (tmp_path / m.file).parent.mkdir(parents=True)
    (tmp_path / m.file).write_text(m.old + m.old)  # twice: stale
    with pytest.raises(run.HarnessError, match="2 times"):
        run.apply(m, tmp_path)
    with pytest.raises(run.HarnessError, match="stale"):
        run.check_fresh([m], tmp_path)
