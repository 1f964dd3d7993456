"""hybridcomm: per-layer hybrid all-reduce for data-parallel PyTorch training.

Example::

    >>> import hybridcomm
    >>> opt = hybridcomm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...                                       model=model)        # the one-line change
    >>> for x, y in loader:
    ...     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    >>> opt.synchronize(); opt.close()
    >>> hybridcomm.all_reduce(torch.ones(3), op="avg")
    tensor([1., 1., 1.])
"""
from . import logs
from .algorithms import ALGORITHMS
from .collectives import all_reduce
from .errors import HybridCommError, HybridCommTimeout
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from . import ps  # noqa: E402,F401  (hybridcomm.ps: the summation servers)

from ._version import __version__  # noqa: E402
logs.setup()
__all__ = ["ALGORITHMS", "all_reduce", "DistributedOptimizer", "broadcast_parameters",
           "broadcast_optimizer_state", "HybridCommError", "HybridCommTimeout", "__version__"]
