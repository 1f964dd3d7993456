"""Point-to-point transports (see base.py for the contract)."""
from .base import Pending, Transfer, Transport
from .torch_dist import TorchDistTransport

__all__ = ["Pending", "Transfer", "Transport", "TorchDistTransport"]
