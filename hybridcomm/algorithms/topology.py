"""Where the ranks sit: ranks per node (``hierarchical``) and the grid (``torus2d``).

Ranks are placed consecutively, as torchrun places them (node k holds ranks
``[k * node_size, (k + 1) * node_size)``; a grid ``(rows, cols)`` puts rank r at
``(r // cols, r % cols)``; the last node or row may be short). The defaults
come from here alone: ``LOCAL_WORLD_SIZE`` else one node; the most square grid
(a prime P: ``(1, P)``, the ring).

Example::

    >>> Topology(node_size=2).resolve(7)
    Topology(node_size=2, grid=(1, 7))
    >>> Topology(grid=(3, 3)).resolve(7).grid
    (3, 3)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple

NODE_SIZE_ENV = "LOCAL_WORLD_SIZE"


@dataclass(frozen=True)
class Topology:
    """``node_size``: ranks per node; ``grid``: (rows, cols). None: the default."""

    node_size: Optional[int] = None
    grid: Optional[Tuple[int, int]] = None

    def resolve(self, world_size: int) -> "Topology":
        """Both fields concrete and checked for ``world_size`` ranks (hashable:
        a resolved topology is part of a schedule's cache key)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        size = self.node_size
        if size is None:
            env = os.environ.get(NODE_SIZE_ENV, "").strip()
            if env and not env.isdigit():
                raise ValueError(f"{NODE_SIZE_ENV}={env!r} is not a whole number")
            size = int(env) if env else world_size
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"node_size must be a positive integer, got {size!r}")
        grid = most_square(world_size) if self.grid is None else tuple(self.grid)
        if (
            len(grid) != 2
            or not all(isinstance(x, int) and x >= 1 for x in grid)
            or not (grid[0] - 1) * grid[1] < world_size <= grid[0] * grid[1]
            or grid[1] > world_size
        ):
            raise ValueError(
                f"grid {self.grid!r} does not fit {world_size} ranks: need "
                "(rows, cols) with (rows - 1) * cols < world_size <= rows * cols "
                "and cols <= world_size"
            )
        return Topology(min(size, world_size), grid)

    def nodes(self, world_size: int) -> int:
        """How many nodes ``world_size`` ranks take (resolved topology)."""
        return -(-world_size // self.node_size)


def most_square(p: int) -> Tuple[int, int]:
    """(rows, cols) with rows * cols == p, rows <= cols, rows as large as possible.

    Example::

        >>> most_square(12), most_square(16), most_square(7)
        ((3, 4), (4, 4), (1, 7))
    """
    rows = next(r for r in range(math.isqrt(p), 0, -1) if p % r == 0)
    return rows, p // rows
