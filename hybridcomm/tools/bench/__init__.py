"""The microbenchmark: ``hybridcomm-bench`` / ``python -m hybridcomm.tools.bench``.

cli.py parses flags and starts the ranks; harness.py is what every rank runs
(buffers, timing, data check); report.py is the output format (table, summary,
JSON, plot). See docs/PERFORMANCE.md for how to read the numbers.
"""

from ...base.units import parse_size, parse_time
from .cli import main

__all__ = ["main", "parse_size", "parse_time"]
