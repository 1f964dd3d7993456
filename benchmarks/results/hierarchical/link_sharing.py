"""How well one shaped node link carries several gloo flows at once (root).

2 nodes of 2 ranks (hybridcomm.netns.ShapedNetwork, node uplinks shaped by the
tbf spec given, rank links unshaped); 4 MiB per flow, the best of 3, each
pattern measured twice:
  one-way 1 flow     0->2                     (ring's pattern: one flow per direction)
  one-way 2 flows    0->2, 1->3               (twice the bytes through one direction)
  both ways 1 pair   0<->2
  both ways 2 pairs  0<->2, 1<->3             (hierarchical's step across nodes)
Usage: python link_sharing.py "rate 100mbit"
"""

import sys, time, torch, torch.distributed as dist
from hybridcomm.launch import launch
from hybridcomm.netns import ShapedNetwork


def work(rank, world, nbytes, reps):
    n = nbytes // 4
    sbuf, rbuf = torch.ones(n), torch.empty(n)
    out = {}
    modes = {
        "one-way 1 flow": [(0, 2)],
        "one-way 2 flows": [(0, 2), (1, 3)],
        "both ways 1 pair": [(0, 2), (2, 0)],
        "both ways 2 pairs": [(0, 2), (2, 0), (1, 3), (3, 1)],
    }
    for mode, active in list(modes.items()) * 2:
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            reqs = []
            for s, d in active:
                if rank == s:
                    reqs.append(dist.isend(sbuf, d))
                if rank == d:
                    reqs.append(dist.irecv(rbuf, s))
            for r in reqs:
                r.wait()
            dist.barrier()
            ts.append(time.perf_counter() - t0)
        out.setdefault(mode, []).append(round(min(ts), 3))
    return out


spec = sys.argv[1]
with ShapedNetwork(4, None, node_size=2, inter_spec=spec) as net:
    res = launch(work, 4, 4 << 20, 3, backend="gloo", setup=net.setup, start_method="fork")
print(spec, res[0], "ideal one flow", round(4 * 2**20 * 8 / 1e8, 3))
