"""The wheel and sdist: they ship every module, the kernels only as
hybridcomm.kernels, the CUDA C++ sources, py.typed and the license, and an
installed wheel works outside the checkout."""

import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # No build isolation: nothing is downloaded; the venv's setuptools builds.
    for cmd in (["wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],):
        subprocess.run([sys.executable, "-m", "pip", *cmd, "-q"], check=True, cwd=out)
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from setuptools import build_meta as b; b.build_sdist({str(out)!r})",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    return next(out.glob("*.whl")), next(out.glob("*.tar.gz"))


def _version():
    ns = {}
    exec((ROOT / "hybridcomm" / "_version.py").read_text(), ns)
    return ns["__version__"]


def test_the_wheel_ships_every_module_and_the_sources(built):
    wheel, _ = built
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {
        f"hybridcomm/{p.relative_to(ROOT / 'hybridcomm').as_posix()}"
        for p in (ROOT / "hybridcomm").rglob("*.py")
    }
    modules |= {f"hybridcomm/kernels/{p.name}" for p in (ROOT / "kernels").glob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert {
        "hybridcomm/py.typed",
        "hybridcomm/csrc/hybridcomm_kernels.cu",
        "hybridcomm/csrc/bindings.cpp",
        "hybridcomm/csrc/hybridcomm_kernels.h",
    } <= names
    assert not any(n.startswith("kernels/") for n in names)  # never a top-level `kernels`
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert f"hybridcomm-{_version()}" in wheel.name


def test_the_sdist_ships_kernels_and_csrc(built):
    _, sdist = built
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    assert {
        "kernels/pack.py",
        "csrc/hybridcomm_kernels.cu",
        "pyproject.toml",
        "LICENSE",
        "hybridcomm/py.typed",
    } <= names


def test_an_installed_wheel_works_outside_the_checkout(built, tmp_path):
    wheel, _ = built
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
    )
    probe = (
        "import sys, hybridcomm, hybridcomm.kernels, hybridcomm.gpu.cuda_ext as c;"
        "print(hybridcomm.__version__);"
        "print(hybridcomm.__file__);"
        "print(c.csrc_dir());"
        "print(all((c.csrc_dir() / s).is_file() for s in c.SOURCES));"
        "import importlib.util as u; print(u.find_spec('kernels') is None)"
    )
    # The target first on the path (before site-packages, where torch is, and before
    # the checkout's editable install, whose finder answers only what is not found).
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    version, where, csrc, found, no_top_level = out.stdout.split()
    assert version == _version()
    assert where.startswith(str(target)) and csrc.startswith(str(target))
    assert found == "True" and no_top_level == "True"
    # the front door of an installed copy: python -m hybridcomm
    out = subprocess.run(
        [sys.executable, "-m", "hybridcomm", "--version"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and f"hybridcomm {_version()}" in out.stdout, out.stderr
