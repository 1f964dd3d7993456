"""The optional CUDA C++ extension (csrc/): pack / unpack / reduce without Triton.

The fallback where Triton is missing and the baseline the Triton kernels are
measured against: the arguments and semantics of ``hybridcomm.kernels`` (fp32
math, one rounding), CUDA tensors only, on the current stream. Built on first
use with ``torch.utils.cpp_extension.load`` (nvcc and a CUDA torch needed) from
``HYBRIDCOMM_CSRC`` (default: the csrc/ beside the package). :func:`load`
returns None where there is nothing to build with; a failed build is a warning,
and ``load(required=True)`` raises :class:`CsrcBuildError` (the GPU tests: a
compile error fails them, never skips).

Example::

    >>> from hybridcomm import cuda_ext
    >>> ext = cuda_ext.load()              # None (with cuda_ext.why_not()) without CUDA
    >>> if ext is not None:
    ...     ext.reduce(dst, src, 0.5, None)
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from ..base.errors import HybridCommError

log = logging.getLogger("hybridcomm")

EXTENSION_NAME = "hybridcomm_cuda"
SOURCES = ("bindings.cpp", "hybridcomm_kernels.cu")
NVCC_FLAGS = ("-O3",)  # no --use_fast_math: it flushes denormals, unlike the reference

_lock = threading.Lock()
_state: dict = {}


def csrc_dir() -> Path:
    """Where the sources are: ``HYBRIDCOMM_CSRC``, else ``hybridcomm/csrc`` (an
    installed wheel), else ``<checkout>/csrc`` (a source tree, editable install)."""
    from ..config import env

    given = env.get("HYBRIDCOMM_CSRC")
    if given:
        return Path(given)
    here = Path(__file__).resolve().parent.parent  # hybridcomm/
    installed = here / "csrc"
    return installed if installed.is_dir() else here.parent / "csrc"


def _why_not_buildable() -> str | None:
    if torch.version.cuda is None:
        return "this torch is a CPU build (the extension needs a CUDA build of torch)"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    missing = [s for s in SOURCES if not (csrc_dir() / s).is_file()]
    if missing:
        return f"sources {missing} not found in {csrc_dir()} (set HYBRIDCOMM_CSRC)"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "no CUDA toolkit found to build with (nvcc; set CUDA_HOME)"
    return None


class CsrcBuildError(HybridCommError):
    """The CUDA C++ extension is required but could not be had (see :func:`why_not`)."""


def _build(verbose: bool):
    from torch.utils.cpp_extension import load as build

    d = csrc_dir()
    return build(
        name=EXTENSION_NAME,
        sources=[str(d / s) for s in SOURCES],
        extra_include_paths=[str(d)],
        extra_cuda_cflags=list(NVCC_FLAGS),
        verbose=verbose,
    )


def load(verbose: bool = False, required: bool = False):
    """The built extension module, or None where it cannot be built (see :func:`why_not`).

    Builds once per process (and once per machine, thanks to torch's cache);
    a failed build is logged once as a warning and not retried. With
    ``required``, no module raises :class:`CsrcBuildError` naming why.
    """
    with _lock:
        if "module" not in _state:
            module, reason, failed = None, _why_not_buildable(), False
            if reason is None:
                try:
                    module = _build(verbose)
                except Exception as e:  # build error, ABI mismatch...: never silent
                    reason, failed = f"building the extension failed: {e}", True
                    log.warning("hybridcomm: the CUDA C++ extension (csrc/) did not build: %s", e)
            _state.update(module=module, reason=reason, failed=failed)
        module = _state["module"]
    if module is None and required:
        raise CsrcBuildError(f"the CUDA C++ extension is required: {_state['reason']}")
    return module


def why_not() -> str | None:
    """Why :func:`load` returned None (None if it has not been tried or it worked)."""
    return _state.get("reason")


def build_failed() -> bool:
    """Whether a build was tried (CUDA, sources and toolkit there) and failed."""
    return bool(_state.get("failed"))


def available() -> bool:
    return load() is not None
