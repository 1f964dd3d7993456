"""Tracing hooks for profilers.

Each bucket's all-reduce and each schedule step is a named range: an NVTX
range for Nsight Systems (when enabled, below) and a ``record_function`` range
while torch.profiler records, so its trace shows them beside the kernels. The
Chrome-trace timeline lives in timeline.py.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------
# NVTX ranges
#
# Through the ``nvtx`` pip package (the ``cuda12``/``cuda13`` extras), never
# ``torch.cuda.nvtx`` (which raises on CPU builds of torch). Ranges are pushed
# in the "hybridcomm" domain when:
#   HYBRIDCOMM_NVTX=1                              always (the profile scripts set it)
#   HYBRIDCOMM_NVTX unset and nsys is attached     (it sets NVTX_INJECTION64_PATH)
#   HYBRIDCOMM_NVTX=0                              never
# Otherwise, or without the package, every range is a shared no-op object:
# no string is formatted, nothing is called.
# ---------------------------------------------------------------------------
import functools
import os

import torch

from .units import format_bytes

NVTX_DOMAIN = "hybridcomm"
_COLORS = {"bucket": "green", "ring": "blue", "butterfly": "orange", "halving_doubling": "purple"}


def _nvtx_wanted(env=os.environ) -> bool:
    flag = env.get("HYBRIDCOMM_NVTX")
    if flag is not None and flag.strip():
        return flag.strip().lower() not in ("0", "false", "no", "off")
    return bool(env.get("NVTX_INJECTION64_PATH") or env.get("NVTX_INJECTION32_PATH"))


def _load_domain():
    if not _nvtx_wanted():
        return None
    try:
        import nvtx
    except ImportError:
        return None
    return nvtx.get_domain(NVTX_DOMAIN)


_domain = _load_domain()


def nvtx_enabled() -> bool:
    """Whether ranges are pushed (decided at import; see :func:`set_nvtx`)."""
    return _domain is not None


def set_nvtx(enabled: bool | None = None) -> bool:
    """Turn ranges on or off at run time (None: decide from the environment again).

    Returns whether they are on (False when the ``nvtx`` package is missing).
    """
    global _domain
    if enabled is None:
        _domain = _load_domain()
    elif enabled:
        try:
            import nvtx
        except ImportError:
            _domain = None
        else:
            _domain = nvtx.get_domain(NVTX_DOMAIN)
    else:
        _domain = None
    return _domain is not None


class _NullRange:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _NullRange()


class _Range:
    __slots__ = ("domain", "attributes")

    def __init__(self, domain, attributes):
        self.domain, self.attributes = domain, attributes

    def __enter__(self):
        self.domain.push_range(self.attributes)
        return self

    def __exit__(self, *exc):
        self.domain.pop_range()
        return False


@functools.lru_cache(maxsize=8192)
def _attributes(domain, message: str, color: str | None):
    # NVTX registers each message string once; names repeat every iteration.
    return domain.get_event_attributes(message=message, color=color)


def nvtx_range(message: str, color: str | None = None):
    """A ``with`` range named ``message`` (a no-op when NVTX is off)."""
    domain = _domain
    if domain is None:
        return _NULL
    return _Range(domain, _attributes(domain, message, color))


def bucket_range_name(bucket: int | str, algorithm: str, nbytes: int, world_size: int) -> str:
    return f"bucket {bucket} {algorithm} {format_bytes(nbytes)} P={world_size}"


def step_range_name(algorithm: str, index: int, nsteps: int, step, itemsize: int) -> str:
    """E.g. 'ring step 3/6 send 1.0KiB->2 recv 1.0KiB<-0' for a schedule ``Step``."""
    parts = [f"{algorithm} step {index + 1}/{nsteps}"]
    parts += [f"send {format_bytes((s.stop - s.start) * itemsize)}->{s.peer}" for s in step.sends]
    parts += [f"recv {format_bytes((r.stop - r.start) * itemsize)}<-{r.peer}" for r in step.recvs]
    return " ".join(parts)


def _profiling() -> bool:
    """Whether a torch.profiler (or autograd profiler) is recording now."""
    return torch._C._autograd._profiler_enabled()


class _Both:
    """An NVTX range and a torch.profiler ``record_function`` range at once."""

    __slots__ = ("ranges",)

    def __init__(self, ranges):
        self.ranges = ranges

    def __enter__(self):
        for r in self.ranges:
            r.__enter__()
        return self

    def __exit__(self, *exc):
        for r in reversed(self.ranges):
            r.__exit__(*exc)
        return False


def _ranges(name_of, color):
    """The ranges wanted now for a name made by ``name_of()`` (made only if some are)."""
    profiling = _profiling()
    if _domain is None and not profiling:
        return _NULL
    name = name_of()
    ranges = [nvtx_range(name, color)] if _domain is not None else []
    if profiling:
        ranges.append(torch.profiler.record_function(f"hybridcomm: {name}"))
    return ranges[0] if len(ranges) == 1 else _Both(ranges)


def bucket_range(bucket: int | str, algorithm: str, nbytes: int, world_size: int):
    """The range around one bucket's all-reduce (name: bucket, algorithm, bytes, P):
    NVTX for Nsight Systems, ``record_function`` while torch.profiler records."""
    return _ranges(
        lambda: bucket_range_name(bucket, algorithm, nbytes, world_size), _COLORS["bucket"]
    )


def step_range(algorithm: str, index: int, nsteps: int, step, itemsize: int):
    """The range around one schedule step (name: algorithm, step, bytes and peers)."""
    return _ranges(
        lambda: step_range_name(algorithm, index, nsteps, step, itemsize=itemsize),
        _COLORS.get(algorithm),
    )
