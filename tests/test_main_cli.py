"""``python -m hybridcomm``: --version, env, plan (without training) and calibrate. The
entry point (``--version``), calibrate and the old module paths run as a user runs them
(a subprocess); help, env and plan run the same ``main`` in this process (``_main``),
which spares a start-up of torch (about 3 CPU-seconds here) per call."""

import json
import os
import subprocess
import sys

import hybridcomm
from hybridcomm.config import env
from hybridcomm.plan.cost_model import DEFAULT_MODEL
from hybridcomm.plan.planner import make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, env_vars=None, ok=True, timeout=120):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDCOMM_")}
    environ.update(env_vars or {})
    r = subprocess.run(
        [sys.executable, "-m", "hybridcomm", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=environ,
    )
    assert (r.returncode == 0) == ok, f"rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def _main(monkeypatch, capsys, *args, env_vars=None, ok=True):
    """``python -m hybridcomm ARGS`` in this process, the environment as ``_run``
    gives it: (exit code, stdout, stderr)."""
    from hybridcomm.tools.cli import main

    for k in [k for k in os.environ if k.startswith("HYBRIDCOMM_")]:
        monkeypatch.delenv(k)
    for k, v in (env_vars or {}).items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse's errors
        rc = e.code
    out, err = capsys.readouterr()
    assert (rc == 0) == ok, f"rc {rc}\n{out}\n{err}"
    return rc, out, err


def test_version_and_help(monkeypatch, capsys):
    r = _run("--version")
    assert f"hybridcomm {hybridcomm.__version__}" in r.stdout
    _, out, _ = _main(monkeypatch, capsys)
    for command in ("env", "plan", "calibrate"):
        assert command in out


def test_env_lists_every_variable_with_its_value_default_and_help(monkeypatch, capsys):
    _, stdout, _ = _main(
        monkeypatch, capsys, "env", env_vars={"HYBRIDCOMM_TIMEOUT": "60", "HYBRIDCOMM_TIMOUT": "5"}
    )
    lines = stdout.splitlines()
    for v in env.VARIABLES.values():
        line = next((ln for ln in lines if ln.startswith(v.name + " ")), None)
        assert line is not None, f"{v.name} missing:\n{stdout}"
        assert "default " + ("unset" if v.default is None else repr(v.default)) in line
        assert lines[lines.index(line) + 1].strip() == v.help
    timeout = next(ln for ln in lines if ln.startswith("HYBRIDCOMM_TIMEOUT "))
    assert "value '60' -> 60.0" in timeout and "default 300.0" in timeout
    algo = next(ln for ln in lines if ln.startswith("HYBRIDCOMM_ALGO "))
    assert "value unset" in algo
    typo = next(ln for ln in lines if ln.startswith("HYBRIDCOMM_TIMOUT "))
    assert "UNKNOWN" in typo and "did you mean HYBRIDCOMM_TIMEOUT?" in typo
    assert "host C++ extension: built (" in stdout  # (make setup built it)
    _, off, _ = _main(monkeypatch, capsys, "env", env_vars={"HYBRIDCOMM_HOST_EXT": "0"})
    assert "host C++ extension: off (HYBRIDCOMM_HOST_EXT=0)" in off
    rc, bad, _ = _main(
        monkeypatch, capsys, "env", env_vars={"HYBRIDCOMM_TIMEOUT": "soon"}, ok=False
    )
    assert rc == 1 and "INVALID" in bad


def test_plan_of_listed_layers_is_the_planners(monkeypatch, capsys):
    spec = "conv1:1728,conv2:18432,fc1:4M,fc2:2560"
    _, out, _ = _main(
        monkeypatch, capsys, "plan", "--layers", spec, "--world", "8", "--cost-model", "default"
    )
    from hybridcomm.tools.cli import parse_layers

    want = str(make_plan(parse_layers(spec), world_size=8, model=DEFAULT_MODEL))
    assert want in out, out
    assert "# cost model: built-in defaults" in out and "world size 8" in out
    assert "butterfly" in out and "ring" in out  # small layers and a large one
    rc, _, err = _main(monkeypatch, capsys, "plan", "--layers", "conv1", ok=False)
    assert rc == 2 and "NAME:NUMEL" in err


def test_plan_of_a_model_groups_its_modules_as_the_optimizer_does(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # benchmarks.models, importable from the checkout as in _run
    monkeypatch.syspath_prepend(ROOT)
    _, out, _ = _main(
        monkeypatch,
        capsys,
        "plan",
        "--model",
        "benchmarks.models:vgg_small",
        "--world",
        "4",
        env_vars={"HYBRIDCOMM_COST_MODEL": str(tmp_path / "none.json")},
    )
    assert "# cost model: built-in defaults (no saved calibration" in out
    table = out[out.index("hybridcomm plan:") :]
    for layer in ("classifier.4", "classifier.2", "classifier.0", "features.0"):
        assert layer in table  # one layer per module, named as the model names it
    assert table.index("classifier.4") < table.index("features.0")  # backward order


def test_calibrate_saves_what_plan_then_uses(tmp_path, monkeypatch, capsys):
    saved = tmp_path / "cm.json"
    variables = {"HYBRIDCOMM_COST_MODEL": str(saved)}
    r = _run(
        "calibrate",
        "--nprocs",
        "2",
        "-b",
        "4K",
        "-e",
        "16K",
        "-n",
        "2",
        "-w",
        "0",
        "--algo",
        "ring,butterfly,native",
        env_vars=variables,
        timeout=180,
    )
    assert f"saved to {saved}" in r.stdout, r.stdout
    model = json.loads(saved.read_text())
    assert model["world_size"] == 2 and model["alpha_s"] >= 0
    _, out, _ = _main(
        monkeypatch, capsys, "plan", "--layers", "conv:1728,fc:1M", env_vars=variables
    )
    assert f"# cost model: {saved}" in out
    assert "# world size 2 (the calibration's)" in out
    _, out, _ = _main(
        monkeypatch,
        capsys,
        "plan",
        "--layers",
        "conv:1728,fc:1M",
        "--world",
        "4",
        env_vars=variables,
    )
    assert "the calibration was measured on 2 ranks" in out


def test_without_a_calibration_plan_uses_the_probe_a_job_of_that_size_kept(
    tmp_path, monkeypatch, capsys
):
    from hybridcomm.plan.auto_model import save
    from hybridcomm.plan.cost_model import CostModel

    probe = tmp_path / "probe-w4-gloo-cpu-localna.json"  # as calibration.py keeps it
    save(CostModel(1e-4, 1e-8, 1e-10), str(probe), world_size=4, device="cpu")
    variables = {"HYBRIDCOMM_COST_MODEL": str(tmp_path / "cost_model.json")}  # absent
    _, out, _ = _main(
        monkeypatch,
        capsys,
        "plan",
        "--layers",
        "conv:1728,fc:1M",
        "--world",
        "4",
        env_vars=variables,
    )
    assert "# cost model: built-in defaults" in out  # kept without its uncertainty: a job reprobes
    save(
        CostModel(1e-4, 1e-8, 1e-10, meta={"fit": {"rms_rel_err": 0.1, "spread": 0.2}}),
        str(probe),
        world_size=4,
        device="cpu",
    )
    _, out, _ = _main(
        monkeypatch,
        capsys,
        "plan",
        "--layers",
        "conv:1728,fc:1M",
        "--world",
        "4",
        env_vars=variables,
    )
    assert f"# cost model: probe saved at {probe}" in out
    _, out, _ = _main(
        monkeypatch,
        capsys,
        "plan",
        "--layers",
        "conv:1728,fc:1M",
        "--world",
        "8",
        env_vars=variables,
    )
    assert "# cost model: built-in defaults" in out  # another world size: not that probe


def test_python_m_on_an_old_module_path_runs_it_where_it_moved():
    """Issue 39: ``python -m hybridcomm.bench`` (the flat layout's path, which
    base/moved.py keeps importing) ended in ``'_Alias' object has no attribute
    'get_code'``; it now says where the module is and runs it there."""
    for old, new, args, says in (
        ("hybridcomm.bench", "hybridcomm.tools.bench", ["--help"], "usage: hybridcomm-bench"),
        ("hybridcomm.planner", "hybridcomm.plan.planner", [], ""),
    ):
        r = subprocess.run(
            [sys.executable, "-m", old, *args], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr
        assert f"hybridcomm: {old} is now {new}" in r.stderr, r.stderr
        assert says in r.stdout
