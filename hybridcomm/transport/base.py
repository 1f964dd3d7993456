"""The transport contract: move bytes between ranks, nothing else.

A transport posts one schedule step's sends and receives together and hands
back a :class:`Pending` to wait on. Tensors are 1-D contiguous views into the
caller's buffers: a transport never copies or allocates on the data path.
"""
from __future__ import annotations

from typing import Protocol, Sequence, Tuple

import torch

Transfer = Tuple[int, torch.Tensor]  # (peer rank in the group, 1-D contiguous tensor)


class Pending(Protocol):
    def wait(self, timeout: float | None = None) -> None:
        """Block until every posted transfer is done, or raise HybridCommTimeout."""


class Transport(Protocol):
    rank: int
    world_size: int

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> Pending:
        """Post all sends and receives of one step as a group."""
