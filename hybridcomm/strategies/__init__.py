"""Data-parallel training schemes beside synchronous hybrid all-reduce: each
trades synchronization for progress differently. :class:`ParallelSGD`
(Zinkevich et al. 2010), :class:`LocalSGD`, :class:`DiLoCo` (Douillard et al.
2023, 2025, Streaming DiLoCo's options included), :class:`ADMM` (Boyd et al.
2011), :class:`DownpourSGD` (Dean et al. 2012, a sharded parameter server) and
:class:`DownpourStage` (its model-parallel replicas). Each reports
``bytes_sent`` and raises ``HybridCommError`` / ``HybridCommTimeout`` within
its timeout. docs/STRATEGIES.md describes each.

May import: the fronts (``averager``, ``broadcast``), ``sync``, ``comm``
and everything below them; not ``integrations`` or ``tools``.
"""

from .admm import ADMM
from .diloco import DiLoCo
from .downpour.client import DownpourSGD, init_downpour, serve
from .downpour.pipeline import DownpourStage
from .local_sgd import LocalSGD
from .parallel_sgd import ParallelSGD

__all__ = [
    "ADMM",
    "DiLoCo",
    "DownpourSGD",
    "DownpourStage",
    "LocalSGD",
    "ParallelSGD",
    "init_downpour",
    "serve",
]
