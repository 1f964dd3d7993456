"""hybridcomm: per-layer hybrid all-reduce for data-parallel PyTorch training.

Example::

    >>> import hybridcomm
    >>> hybridcomm.all_reduce(grad, op="avg", algorithm="auto")
"""
from .algorithms import ALGORITHMS
from .collectives import all_reduce
from .errors import HybridCommError, HybridCommTimeout

__version__ = "0.1.0"
__all__ = ["ALGORITHMS", "all_reduce", "HybridCommError", "HybridCommTimeout", "__version__"]
from .optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters

__all__ += ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state"]
