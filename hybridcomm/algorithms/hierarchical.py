"""Hierarchical all-reduce (Jia et al. 2018; Horovod's hierarchical all-reduce).

Reduce-scatter inside each node, all-reduce among the ranks that hold the
same chunk (one per node: the same local rank), all-gather inside the node.
Only 1/node_size of the buffer crosses between nodes, in 2(nodes-1)
messages, so it wins where the links between nodes are the slow ones. With
node size L and m = P/L nodes: 2(L-1) steps inside the nodes plus 2(m-1)
between them, sending 2(P-1)/P of the buffer like the ring.

The node size is the ``topology``'s (``node_size=``, else ``LOCAL_WORLD_SIZE``,
else one node: then this is the ring); a world size that is not a multiple
of it leaves the last node short (grouped.py).
"""

from __future__ import annotations

from .grouped import two_level
from .schedule import Schedule
from .topology import Topology


def schedule(rank: int, world_size: int, numel: int, topology: Topology | None = None) -> Schedule:
    """Hierarchical schedule for ``rank`` of ``world_size`` over ``numel`` elements.

    Example::

        >>> len(schedule(0, 8, 1000, Topology(node_size=4)).steps)   # 2*3 inside + 2*1 across
        8
    """
    topo = (topology or Topology()).resolve(world_size)
    return two_level("hierarchical", rank, world_size, numel, g=topo.node_size, topology=topo)
