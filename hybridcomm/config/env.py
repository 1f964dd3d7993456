"""Every ``HYBRIDCOMM_*`` environment variable: one table, one lazy parser.

Each variable is read when it is used (so tests and users may set it after
import) and parsed by the rule in :data:`VARIABLES`; a bad value raises
:class:`HybridCommError` naming the variable and what it accepts.

Example::

    >>> import os
    >>> os.environ["HYBRIDCOMM_PIPELINE_BYTES"] = "4M"
    >>> get("HYBRIDCOMM_PIPELINE_BYTES")
    4194304
    >>> del os.environ["HYBRIDCOMM_PIPELINE_BYTES"]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..base.errors import HybridCommError
from ..base.units import parse_size

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError("expected one of " + ", ".join(_TRUE + _FALSE))


def parse_positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be a number > 0")
    return value


def parse_nonnegative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("must be a number >= 0")
    return value


def parse_nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be an integer >= 0")
    return value


def _choices(values: Callable[[], Sequence[str]]):
    def parse(text: str) -> str:
        t = text.strip()
        allowed = tuple(values())
        if t not in allowed:
            raise ValueError("expected one of " + ", ".join(allowed))
        return t

    return parse


def _algorithms() -> Sequence[str]:
    from ..algorithms import ALGORITHMS

    return ALGORITHMS + ("native", "ps")  # ps: DistributedOptimizer(servers=...) only


@dataclass(frozen=True)
class Variable:
    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str


VARIABLES = {
    v.name: v
    for v in (
        Variable(
            "HYBRIDCOMM_ALGO",
            _choices(_algorithms),
            None,
            "force one algorithm for `auto` and for every bucket",
        ),
        Variable(
            "HYBRIDCOMM_DEFER",
            _choices(lambda: ("measured", "always")),
            "measured",
            "forward mode: keep deferring updates to their first read after the measured "
            "steps even where the plan finds nothing left to overlap (always; tests, "
            "debugging) or only where it pays (measured)",
        ),
        Variable(
            "HYBRIDCOMM_PROBE_CACHE",
            parse_bool,
            True,
            "keep the start-up probe's cost model for the next run of the same job "
            "(world size, backend, device, rendezvous address and interface) beside the "
            "calibration file, so plans repeat; removed when the measured steps contradict it",
        ),
        Variable(
            "HYBRIDCOMM_TIMEOUT",
            parse_positive_float,
            300.0,
            "seconds any blocking call waits for a peer",
        ),
        Variable(
            "HYBRIDCOMM_STALL_WARN",
            parse_nonnegative_float,
            None,
            "seconds a bucket waits before the stall inspector names the ranks behind "
            "(unset: timeout/5, at most 60; 0: off)",
        ),
        Variable(
            "HYBRIDCOMM_CHECK",
            _choices(lambda: ("always", "first", "off", *_TRUE, *_FALSE)),
            "first",
            "all_reduce's cross-rank agreement check: always, first (once per call signature), off",
        ),
        Variable("HYBRIDCOMM_COST_MODEL", str, None, "path of a calibrated cost model (JSON)"),
        Variable(
            "HYBRIDCOMM_TRANSPORT",
            _choices(lambda: ("auto", "cupy", "torch", "one-device")),
            "auto",
            "point-to-point transport for CUDA tensors (one-device: every rank "
            "process on one GPU, exchanging by device-to-device copies; tests)",
        ),
        Variable(
            "HYBRIDCOMM_ONE_DEVICE_MAILBOX",
            parse_size,
            4 << 20,
            "one-device transport: bytes of each rank pair's mailbox (a message moves in "
            "pieces of this size)",
        ),
        Variable(
            "HYBRIDCOMM_ISSUE_THREAD",
            parse_bool,
            True,
            "GPU path: the optimizer's buckets are issued by the transport's communicator "
            "thread, whole (off: by the gradient hook, on autograd's thread)",
        ),
        Variable(
            "HYBRIDCOMM_HOST_HERE",
            parse_bool,
            True,
            "host path (gloo): an operation the trainer waits for at once (the step's "
            "last launch where nothing is left to overlap it with) runs in the trainer's "
            "thread, after what came before it, and so does one the channel's thread has "
            "not started when the trainer waits for it (off: every operation on the "
            "channel's thread)",
        ),
        Variable(
            "HYBRIDCOMM_LEAN_HOOKS",
            parse_bool,
            True,
            "in a steady step, the post-accumulate hook only on the parameter that completes "
            "each bucket (off: on every parameter in every step)",
        ),
        Variable(
            "HYBRIDCOMM_TRITON_FAST_LAUNCH",
            parse_bool,
            True,
            "kernels: launch a seen specialization through its compiled kernel's launcher "
            "directly (off: Triton's own path every call); read by hybridcomm.kernels at "
            "import",
        ),
        Variable(
            "HYBRIDCOMM_RESHARD_BYTES",
            parse_size,
            64 << 20,
            "shard=: a re-plan moves the optimizer state whose slicing changed in runs of "
            "parameters of at most this many bytes, one all-to-all a run",
        ),
        Variable(
            "HYBRIDCOMM_RELEASE_IN_BACKWARD",
            parse_bool,
            True,
            "shard='gradients' on the host path: a bucket keeps only this rank's part of "
            "its gradient from its reduce-scatter's end in backward (off: from the step)",
        ),
        Variable(
            "HYBRIDCOMM_PIPELINE_BYTES",
            parse_size,
            32 << 20,
            "pipeline parts of large host-path buffers (0: off)",
        ),
        Variable(
            "HYBRIDCOMM_NVTX", parse_bool, None, "NVTX ranges on/off (default: when nsys attaches)"
        ),
        Variable(
            "HYBRIDCOMM_HOST_EXT",
            parse_bool,
            True,
            "per-bucket loops over the parameters' .grad fields in C++ (csrc/host_ops.cpp, "
            "built once per machine and torch with the system compiler; off: the same "
            "loops in Python)",
        ),
        Variable(
            "HYBRIDCOMM_CSRC", str, None, "where the CUDA C++ sources are (hybridcomm.gpu.cuda_ext)"
        ),
        Variable(
            "HYBRIDCOMM_LOG_LEVEL",
            _choices(lambda: ("DEBUG", "INFO", "WARNING", "ERROR")),
            "INFO",
            "level of the `hybridcomm` logger (the plan logs at INFO)",
        ),
        Variable(
            "HYBRIDCOMM_SIMULATE_GPU",
            parse_bool,
            False,
            "CPU tensors take the GPU path over a simulated CUDA runtime (tests)",
        ),
        Variable(
            "HYBRIDCOMM_SIM_DELAY_US",
            parse_nonnegative_float,
            200.0,
            "simulator: largest random delay per stream operation (microseconds)",
        ),
        Variable("HYBRIDCOMM_SIM_SEED", parse_nonnegative_int, 0, "simulator: seed of the delays"),
        Variable(
            "HYBRIDCOMM_SIM_NCCL_KERNELS",
            parse_nonnegative_int,
            1,
            "simulator: NCCL kernels that may run at once per device (0: unlimited)",
        ),
        Variable(
            "HYBRIDCOMM_SIM_CUPY_UID",
            _choices(lambda: ("bytes", "tuple")),
            "bytes",
            "simulator: unique-id style of the CuPy it imitates (14: bytes, 13: tuple)",
        ),
        Variable(
            "HYBRIDCOMM_SIM_DEADLOCK_S",
            parse_positive_float,
            20.0,
            "simulator: seconds an NCCL kernel may wait before a deadlock is reported",
        ),
    )
}


def get(name: str) -> Any:
    """The parsed value of ``name`` (its default when unset or empty)."""
    var = VARIABLES[name]
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return var.default
    try:
        return var.parse(raw)
    except (ValueError, TypeError) as e:
        raise HybridCommError(f"{name}={raw!r} is invalid: {e}") from None


def describe() -> str:
    """A table of every variable, its default and what it does (for docs and --help)."""
    rows = [f"{v.name:<28} default {v.default!s:<10} {v.help}" for v in VARIABLES.values()]
    return "\n".join(rows)


def timeout(value: Optional[float]) -> float:
    """``value`` as seconds, else ``HYBRIDCOMM_TIMEOUT``."""
    if value is None:
        return get("HYBRIDCOMM_TIMEOUT")
    value = float(value)
    if not value > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {value}")
    return value
