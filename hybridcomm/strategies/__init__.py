"""Data-parallel training schemes beside synchronous hybrid all-reduce
(docs/STRATEGIES.md): each trades synchronization for progress differently.

- :class:`ParallelSGD` (Zinkevich et al. 2010): local SGD on each shard, the
  models averaged every epoch or once at the end.
- :class:`LocalSGD`: H local steps, then the parameters (and optionally the
  optimizer state) averaged; H = 1 is synchronous SGD; a synchronous warm-up.
- :class:`DiLoCo` (Douillard et al. 2023, 2025): H inner steps, then the averaged
  pseudo-gradient through an outer optimizer; Streaming DiLoCo's fragments,
  delayed merges and quantized syncs.
- :class:`ADMM`: consensus ADMM (Boyd et al. 2011): local steps on the loss plus
  the augmented Lagrangian, the consensus as an all-reduced average.
- :class:`DownpourSGD` (Dean et al. 2012): asynchronous, a parameter server
  sharded over server processes (a small TCP protocol, no pickle); a killed
  server restarts from its checkpoint and the workers replay what it missed.
- :class:`DownpourStage`: Downpour with model-parallel replicas: each replica
  a pipeline of stage processes, each stage fetching and pushing only its own
  parameters (``stage{k}.*``) to the same shards.

Every strategy reports ``bytes_sent`` (by this rank) and raises
``HybridCommError`` / ``HybridCommTimeout`` on failure, within its timeout.

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
