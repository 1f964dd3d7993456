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

The fronts users call sit here, one subpackage per concept under them
(docs/ARCHITECTURE.md); old module paths (``hybridcomm.ps``, ...) still import
through ``base.moved``.
"""

from .config import logs
from .algorithms import ALGORITHMS
from .collectives import all_reduce
from .base.errors import HybridCommError, HybridCommTimeout
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .comm import servers as ps  # noqa: F401  (hybridcomm.ps: the summation servers)
from .base import moved

moved.install()

from ._version import __version__  # noqa: E402
from .gpu import runtime as _runtime


def _simulated_runtime():  # the runtime for HYBRIDCOMM_SIMULATE_GPU=1, made on first use
    from .testing import simgpu

    return simgpu.runtime()


_runtime.set_simulator(_simulated_runtime)
logs.setup()
__all__ = [
    "ALGORITHMS",
    "all_reduce",
    "DistributedOptimizer",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "HybridCommError",
    "HybridCommTimeout",
    "__version__",
]
