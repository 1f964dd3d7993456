"""The host time of posting one butterfly step's send and receive on gloo (2 ranks,
loopback), four ways, rotated so that none always goes first: torch's
``batch_isend_irecv``, ``dist.isend``/``dist.irecv``, the process group's own
``send``/``recv``, and ``TorchDistTransport.exchange``. Median us per posting (the
wait is outside the timed part), for a 1-element and a 0.71 MB message (the conv
net's one bucket).

    python benchmarks/results/synchronizer/host_here/posting.py
"""

import statistics
import time

import torch
import torch.distributed as dist


def _rank(rank, world, numel):  # launch()'s function: module level
    from hybridcomm.comm.channel import open_channel

    torch.set_num_threads(1)
    a, b = torch.randn(numel), torch.empty(numel)
    transport, _ = open_channel(torch.device("cpu"), None, 60)  # its own gloo group
    pg, peer = transport.group, 1 - rank
    ways = {
        "batch_isend_irecv": lambda: dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, a, peer, pg), dist.P2POp(dist.irecv, b, peer, pg)]
        ),
        "isend/irecv": lambda: [dist.isend(a, peer, pg), dist.irecv(b, peer, pg)],
        "group send/recv": lambda: [pg.send([a], peer, 0), pg.recv([b], peer, 0)],
        "exchange": lambda: transport.exchange([(peer, a)], [(peer, b)]).works,
    }
    names, times = list(ways), {k: [] for k in ways}
    for i in range(300):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            t0 = time.perf_counter()
            works = ways[name]()
            times[name].append(time.perf_counter() - t0)
            for w in works:
                w.wait()
    return {k: statistics.median(v[10:]) * 1e6 for k, v in times.items()}


def main() -> None:
    from hybridcomm.tools.launch import launch

    for numel in (1, 705608 // 4):
        ranks = launch(_rank, 2, numel, backend="gloo", timeout=300)
        print(
            f"{numel * 4} bytes: "
            + ", ".join(f"{k} {max(r[k] for r in ranks):.1f}" for k in ranks[0])
            + " us (the larger rank's)"
        )


if __name__ == "__main__":
    main()
