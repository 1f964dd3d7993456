"""gloo's own reduce_scatter / all_gather (``native``) against the ring's phases and
the whole all-reduce, one flat fp32 buffer, 4 ranks on loopback, ms per call
(mean of 10 after one warm-up; rank 0's). Why ``native`` is not a sharded
candidate on the host path (sync/shard.py ``settle_options``).

    python benchmarks/results/shard_native/gloo_phases.py [MiB]
"""
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank, world, port, mib):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    from hybridcomm.algorithms import ALL_GATHER, REDUCE_SCATTER
    from hybridcomm.comm.executor import reduce_now
    from hybridcomm.comm.transport.torch_dist import TorchDistTransport

    transport = TorchDistTransport()
    buf = torch.ones(mib << 18)

    def ms(fn, k=10):
        fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        return (time.perf_counter() - t0) / k * 1e3

    def ours(algorithm, phase):
        return lambda: reduce_now(buf, transport, algorithm, scale=None, timeout=60, phase=phase)

    rows = {"gloo all_reduce": ms(lambda: dist.all_reduce(buf)),
            "gloo reduce_scatter (native)": ms(ours("native", REDUCE_SCATTER)),
            "gloo all_gather (native)": ms(ours("native", ALL_GATHER)),
            "ring reduce-scatter": ms(ours("ring", REDUCE_SCATTER)),
            "ring all-gather": ms(ours("ring", ALL_GATHER)),
            "ring all-reduce": ms(ours("ring", "all_reduce"))}
    if rank == 0:
        print(f"{mib} MiB fp32, {world} ranks, gloo on loopback, torch {torch.__version__}")
        for name, value in rows.items():
            print(f"  {name:30s} {value:8.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(_run, args=(4, free, int(sys.argv[1]) if len(sys.argv) > 1 else 16), nprocs=4)
