"""World 2: hybridcomm's ring at P = 2 timed alone, both directions on one process group or each on a group of its own.

A test of one guess about the ring's stalls in a training step
(``sequence.py``): that a send waits for gloo's pair, busy with the receive
coming the other way. The reduce-scatter and all-gather of a 0.71 MB buffer
(the conv net's), as the ring does them, between barriers, 300 times each
way, twice. Printed: p10, p50, p75 and p90 in us. If the guess held,
"by direction" would be faster.

    python benchmarks/results/synchronizer/timeline/duplex.py
"""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))

NUMEL = 705608 // 4
RUNS = 300


def _rank(rank, world, _):  # launch()'s function: module level
    torch.set_num_threads(1)
    peer, half = 1 - rank, NUMEL // 2
    other = dist.new_group([0, 1], backend="gloo")
    buf, scratch = torch.randn(NUMEL), torch.empty(half)
    mine, theirs = slice(rank * half, (rank + 1) * half), slice(peer * half, (peer + 1) * half)

    def ring(send_pg, recv_pg):
        for work in (send_pg.send([buf[theirs]], peer, 0), recv_pg.recv([scratch], peer, 0)):
            work.wait()
        buf[mine].add_(scratch)
        for work in (send_pg.send([buf[mine]], peer, 1), recv_pg.recv([buf[theirs]], peer, 1)):
            work.wait()

    world_pg = dist.group.WORLD
    ways = {
        "one group": (world_pg, world_pg),
        "by direction": (world_pg, other) if rank == 0 else (other, world_pg),
    }
    out = {}
    for name, (send_pg, recv_pg) in ways.items():
        for _ in range(20):
            ring(send_pg, recv_pg)
        times = []
        for _ in range(RUNS):
            dist.barrier()
            t0 = time.perf_counter()
            ring(send_pg, recv_pg)
            times.append((time.perf_counter() - t0) * 1e6)
        times.sort()
        out[name] = [times[int(q * (len(times) - 1))] for q in (0.1, 0.5, 0.75, 0.9)]
    return out


def main() -> None:
    from hybridcomm.tools.launch import launch

    for _ in range(2):
        for name, qs in launch(_rank, 2, None, backend="gloo", timeout=120)[0].items():
            print(f"{name:<13} p10 p50 p75 p90 us: " + " ".join(f"{q:.0f}" for q in qs))


if __name__ == "__main__":
    main()
