"""Sizes and times, parsed and printed in one way everywhere (bench, env, traces).

Example::

    >>> parse_size("4K"), format_bytes(16 << 20), format_seconds(2.5e-4)
    (4096, '16M', '250 us')
"""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``4K``, ``4k``, ``4KB``, ``4KiB``, ``16M``, ``1G``, ``1.5M``
    (K, M, G, T are powers of 1024, as in nccl-tests).

    Example::

        >>> parse_size("4K"), parse_size("16M"), parse_size("1G"), parse_size("100")
        (4096, 16777216, 1073741824, 100)
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (try 4096, 4K, 16M, 1G)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def parse_time(text: str) -> float:
    """Seconds from ``200us``, ``0.5ms``, ``1s``, ``50ns`` (a bare number is microseconds).

    Example::

        >>> parse_time("0.5ms"), parse_time("250"), round(parse_time("200us") * 1e6)
        (0.0005, 0.00025, 200)
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ns|us|µs|ms|s)?\s*", str(text))
    if not m:
        raise ValueError(f"not a time: {text!r} (try 200us, 0.5ms)")
    return float(m.group(1)) * _TIME_UNITS[m.group(2) or "us"]


def format_bytes(nbytes: float) -> str:
    """4096 -> '4K', 16 << 20 -> '16M', 100 -> '100B' (powers of 1024, as the
    sizes nccl-tests takes)."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{int(nbytes) >> shift}{unit}"
    if nbytes >= 1 << 10:
        for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
            if nbytes >= 1 << shift:
                return f"{nbytes / (1 << shift):.3g}{unit}"
    return f"{int(nbytes)}B"


def format_seconds(s: float) -> str:
    """2.5e-4 -> '250 us' (4 significant digits)."""
    if s == 0:
        return "0"
    exp = math.floor(math.log10(abs(s)))
    for unit, k in (("s", 0), ("ms", -3), ("us", -6), ("ns", -9), ("ps", -12)):
        if exp >= k:
            return f"{s / 10**k:.4g} {unit}"
    return f"{s:.3g} s"
