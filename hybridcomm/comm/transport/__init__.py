"""Point-to-point transports (see base.py for the contract)."""

from .base import Pending, Transfer, Transport
from .cupy_nccl import CupyNcclTransport  # imports no CuPy until one is made
from .torch_dist import TorchDistTransport

__all__ = ["Pending", "Transfer", "Transport", "TorchDistTransport", "CupyNcclTransport"]
