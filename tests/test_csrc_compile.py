"""csrc/ compiles: the CUDA kernels with nvcc (compile only, nothing runs here),
the loader says plainly why it cannot build on a machine without CUDA, and a
build that fails (faked here) is reported: logged, ``build_failed()``, an error
with ``required=True``, and a failure (not a skip) in the GPU tests' fixture."""

import logging
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from hybridcomm.gpu import cuda_ext

CSRC = Path(__file__).resolve().parent.parent / "csrc"
GPU_TESTS = str(Path(__file__).resolve().parent / "gpu")


def test_kernels_compile_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    obj = tmp_path / "hybridcomm_kernels.o"
    # One architecture keeps this quick; bf16 conversions need sm_80+ for native code.
    cmd = [
        nvcc,
        "-std=c++17",
        "-O3",
        "-c",
        str(CSRC / "hybridcomm_kernels.cu"),
        "-o",
        str(obj),
        "-gencode",
        "arch=compute_80,code=sm_80",
        "-Werror",
        "all-warnings",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    nm = shutil.which("nm")
    if nm:
        symbols = subprocess.run([nm, "-g", str(obj)], capture_output=True, text=True).stdout
        for name in ("hc_copy_scaled", "hc_reduce"):
            assert f" T {name}" in symbols, f"{name} not exported with C linkage"


def test_header_is_plain_c():
    """The C API header compiles as C (no torch, no CUDA headers)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    r = subprocess.run(
        [cc, "-x", "c", "-fsyntax-only", "-Wall", "-Werror", "-"],
        input='#include "hybridcomm_kernels.h"\nint main(void){return HC_BFLOAT16;}\n',
        capture_output=True,
        text=True,
        cwd=CSRC,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(
    not os.environ.get("HYBRIDCOMM_SLOW_TESTS"), reason="~30 s; set HYBRIDCOMM_SLOW_TESTS=1"
)
def test_bindings_syntax_with_torch_headers(tmp_path):
    """bindings.cpp against torch's headers (a CPU torch lacks one generated CUDA
    header, stubbed here; CUDA headers from the CUDA toolkit)."""
    from torch.utils.cpp_extension import CUDA_HOME

    cxx, cuda_home = shutil.which("g++"), Path(CUDA_HOME or "/usr/local/cuda")
    if cxx is None or not (cuda_home / "include" / "cuda_runtime_api.h").is_file():
        pytest.skip("needs g++ and the CUDA toolkit headers")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    real = Path(torch.__file__).parent / "include" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    (stub / "cuda_cmake_macros.h").write_text(
        real.read_text() if real.is_file() else "#define C10_CUDA_BUILD_SHARED_LIBS\n"
    )
    inc = Path(torch.__file__).parent / "include"
    r = subprocess.run(
        [
            cxx,
            "-std=c++20",
            "-fsyntax-only",
            f"-I{tmp_path}",
            f"-I{inc}",
            f"-I{inc / 'torch/csrc/api/include'}",
            f"-I{cuda_home / 'include'}",
            f"-I{sysconfig.get_paths()['include']}",
            f"-I{CSRC}",
            "-DTORCH_EXTENSION_NAME=hybridcomm_cuda",
            str(CSRC / "bindings.cpp"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]


def test_loader_explains_why_not_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu covers the built extension")
    assert cuda_ext.load() is None
    assert "CPU build" in cuda_ext.why_not() or "no CUDA device" in cuda_ext.why_not()
    assert all((cuda_ext.csrc_dir() / s).is_file() for s in cuda_ext.SOURCES)


@pytest.fixture
def failing_build(monkeypatch):
    """The loader as on a CUDA machine with a toolkit, whose build raises."""
    monkeypatch.setattr(cuda_ext, "_state", {})
    monkeypatch.setattr(cuda_ext, "_why_not_buildable", lambda: None)
    calls = []

    def build(verbose):
        calls.append(verbose)
        raise RuntimeError('hybridcomm_kernels.cu(12): error: expected a ";"')

    monkeypatch.setattr(cuda_ext, "_build", build)
    return calls


def test_a_failing_build_is_reported_not_swallowed(failing_build, caplog):
    with caplog.at_level(logging.WARNING, logger="hybridcomm"):
        assert cuda_ext.load() is None  # optional: None, but never quietly
    assert cuda_ext.build_failed()
    assert 'expected a ";"' in cuda_ext.why_not()
    assert any(
        'expected a ";"' in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records
    ), caplog.text
    with pytest.raises(cuda_ext.CsrcBuildError, match='expected a ";"'):
        cuda_ext.load(required=True)
    assert failing_build == [False]  # tried once, not retried


def test_the_gpu_tests_fail_on_a_failed_build_and_skip_only_without_a_toolkit(
    failing_build, monkeypatch
):
    monkeypatch.syspath_prepend(GPU_TESTS)
    from gpu_common import require_csrc

    def outcome():  # pytest's Failed and Skipped, told apart (a skip must not pass here)
        with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as e:
            require_csrc()
        return e.type, str(e.value)

    kind, why = outcome()
    assert kind is pytest.fail.Exception and "csrc build failed" in why, (kind, why)
    monkeypatch.setattr(cuda_ext, "_state", {})
    monkeypatch.setattr(cuda_ext, "_why_not_buildable", lambda: "no CUDA toolkit found")
    kind, why = outcome()
    assert kind is pytest.skip.Exception and "no CUDA toolkit found" in why, (kind, why)
    assert not cuda_ext.build_failed()
    with pytest.raises(cuda_ext.CsrcBuildError, match="no CUDA toolkit found"):
        cuda_ext.load(required=True)
