"""2D-torus all-reduce (Mikami et al. 2018; Ying et al. 2018).

Over a grid of R rows of C ranks (rank r at row r // C, column r % C):
reduce-scatter along each row, all-reduce along each column (the ranks
holding the same chunk), all-gather along each row. 2(C-1) + 2(R-1) steps
instead of the ring's 2(P-1) (about 4 sqrt(P) on a square grid), sending the
same 2(P-1)/P of the buffer: the ring's bandwidth with far fewer messages.

The grid is the ``topology``'s (``grid=``, else the most square
factorization; a prime P gives (1, P), the ring). A grid whose last row is
short works too (grouped.py), so ``grid=(3, 3)`` serves P = 7..9. Rows are
consecutive ranks, so with C = ranks per node this is ``hierarchical``.
"""

from __future__ import annotations

from .grouped import two_level
from .schedule import Schedule
from .topology import Topology


def schedule(rank: int, world_size: int, numel: int, topology: Topology | None = None) -> Schedule:
    """2D-torus schedule for ``rank`` of ``world_size`` over ``numel`` elements.

    Example::

        >>> len(schedule(0, 16, 1000).steps)   # 4 x 4: 2*3 along the row + 2*3 down the column
        12
    """
    topo = (topology or Topology()).resolve(world_size)
    return two_level("torus2d", rank, world_size, numel, g=topo.grid[1], topology=topo)
