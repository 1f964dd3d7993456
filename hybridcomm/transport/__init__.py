"""Point-to-point transports (see base.py for the contract)."""
from .base import Pending, Transfer, Transport
from .torch_dist import TorchDistTransport

__all__ = ["Pending", "Transfer", "Transport", "TorchDistTransport"]
from .cupy_nccl import CupyNcclTransport  # noqa: F401,E402  (imports no CuPy until used)
