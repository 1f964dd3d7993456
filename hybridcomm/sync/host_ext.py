"""The host C++ extension (csrc/host_ops.cpp): built once per machine, then imported.

It holds grad_fields.py's per-parameter loops (``.grad`` reads, writes and
copies) in C++; each has a Python twin there, so this is speed, never meaning.
Compiled with the system C++ compiler against the running torch, keyed by the
source, torch's version and Python's (``make setup`` builds it);
``HYBRIDCOMM_HOST_EXT=0`` turns it off. Where it cannot be had, :func:`load`
returns None and :func:`why_not` says why; a failed build is a warning, not
retried for the same source and torch (delete ``hybridcomm_host.failed`` to retry).

Example::

    >>> from hybridcomm.sync import host_ext
    >>> ext = host_ext.load()            # None where it cannot be built (see why_not())
    >>> ext is None or callable(ext.bound)
    True
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from ..config import env
from ..gpu.cuda_ext import csrc_dir

log = logging.getLogger("hybridcomm")

NAME = "hybridcomm_host"
SOURCE = "host_ops.cpp"
# (-O3 vectorizes the copy loop; no loop idiom: the loop must not become a memcpy call)
CXX_FLAGS = ("-O3", "-fno-tree-loop-distribute-patterns", "-std=c++17", "-shared", "-fPIC", "-w")

_lock = threading.Lock()
_state: dict = {}


def _torch_lib() -> Path:
    return Path(torch.__file__).resolve().parent / "lib"


def _include_dirs() -> list:
    include = Path(torch.__file__).resolve().parent / "include"
    return [
        str(include),
        str(include / "torch" / "csrc" / "api" / "include"),
        sysconfig.get_paths()["include"],
    ]


def _command(source: Path, target: Path) -> list:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib = _torch_lib()
    return (
        [os.environ.get("CXX") or "c++", *CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
        + [f"-I{d}" for d in _include_dirs()]
        + [
            str(source),
            "-o",
            str(target),
            f"-L{lib}",
            "-lc10",
            "-ltorch_cpu",
            "-ltorch",
            "-ltorch_python",
            f"-Wl,-rpath,{lib}",
        ]
    )


def built_path(source: Optional[Path] = None) -> Path:
    """Where the built module for this source, torch and Python lives (built or not)."""
    source = source or csrc_dir() / SOURCE
    key = hashlib.sha256(source.read_bytes())
    key.update(f"{torch.__version__}|{sys.version}|{' '.join(CXX_FLAGS)}".encode())
    root = Path(
        os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    )
    return root / NAME / key.hexdigest()[:16] / f"{NAME}.so"


def _build(source: Path, target: Path) -> None:
    """Compile into ``target`` (atomically: a process that loads it sees all or none)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (one builder; the others find it built)
        if target.is_file():
            return
        failed = target.with_suffix(".failed")
        if failed.is_file():  # (a build of this very source and torch failed: not again)
            raise RuntimeError(failed.read_text())
        log.info("hybridcomm: building the host C++ extension (%s, once)", target)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run(_command(source, Path(tmp)), capture_output=True, text=True)
            if done.returncode != 0:
                error = done.stderr.strip()[-2000:] or f"exit {done.returncode}"
                failed.write_text(error)
                raise RuntimeError(error)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def _import(path: Path):
    # The built file directly: no compiler, no ninja, no torch.utils.cpp_extension import
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load():
    """The extension module, or None (off, or it could not be had: :func:`why_not`).

    Tried once per process; builds where it is not built yet, logging a failed
    build once as a warning.
    """
    with _lock:
        if "module" not in _state:
            module, reason = None, None
            source = csrc_dir() / SOURCE
            if not env.get("HYBRIDCOMM_HOST_EXT"):
                reason = "HYBRIDCOMM_HOST_EXT=0"
            elif not source.is_file():
                reason = f"{source} not found (set HYBRIDCOMM_CSRC)"
            else:
                target = built_path(source)
                try:
                    if not target.is_file():
                        _build(source, target)
                    module = _import(target)
                except Exception as e:  # noqa: BLE001 - no compiler, ABI mismatch...: Python
                    reason = f"building or loading {target} failed: {e}"
                    log.warning(
                        "hybridcomm: the host C++ extension is unavailable (%s), per-"
                        "parameter loops run in Python: %s",
                        target,
                        str(e)[-600:],
                    )
            _state.update(module=module, reason=reason)
        return _state["module"]


def status() -> str:
    """One line on the extension here, without building it (``python -m hybridcomm env``)."""
    source = csrc_dir() / SOURCE
    if not env.get("HYBRIDCOMM_HOST_EXT"):
        return "off (HYBRIDCOMM_HOST_EXT=0): the Python loops"
    if not source.is_file():
        return f"no source ({source}): the Python loops"
    target = built_path(source)
    failed = target.with_suffix(".failed")
    if target.is_file():
        return f"built ({target})"
    if failed.is_file():
        return f"its build failed ({failed}): the Python loops"
    return f"not built yet (the first optimizer builds it: {target})"


def why_not() -> Optional[str]:
    """Why :func:`load` returned None (None if it has not been tried or it worked)."""
    return _state.get("reason")
