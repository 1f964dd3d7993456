"""The ground floor: what every other unit may use and that uses nothing of hybridcomm.

Errors (``HybridCommError``, ``HybridCommTimeout``), byte units, tensor access
helpers, DTensor local shards, the step timeline recorder, the profiler
ranges (NVTX / ``record_function``) and what compiled code calls eagerly
(``compile_boundary``).

May import: nothing of hybridcomm outside ``base``.
"""
