"""Interleaved A/B of train.py configs built side by side in one launch (run from the
repository root: python benchmarks/results/compile/blocks_ab.py CONFIGS BACKEND NPROCS
[MODEL] [BATCH]): R rounds of K steps each, per-rank medians; dynamo's graph-break
count and compile stats over each config's warm-up steps."""

import os, statistics, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

sys.path.insert(0, "benchmarks")
import train as T

CONFIGS = sys.argv[1].split(",")
BACKEND = sys.argv[2]
NPROCS = int(sys.argv[3])
MODEL = sys.argv[4] if len(sys.argv) > 4 else "transformer"
BATCH = int(sys.argv[5]) if len(sys.argv) > 5 else 8
WARM, ROUNDS, K = 6, 6, 3


def run(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29733")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    data = T._shard(rank, BATCH, MODEL)
    from torch._dynamo.utils import counters

    trainers, breaks = {}, {}
    for cfg in CONFIGS:
        counters.clear()
        tr = trainers[cfg] = T._Trainer(cfg, world, model=MODEL, compile_backend=BACKEND)
        for i in range(WARM):
            tr.step(*data[i % len(data)])
        breaks[cfg] = (sum(counters["graph_break"].values()), dict(counters["stats"]))
    times = {c: [] for c in CONFIGS}
    for r in range(ROUNDS):
        for cfg in CONFIGS:
            dist.barrier()
            for i in range(K):
                t0 = time.perf_counter()
                trainers[cfg].step(*data[i % len(data)])
                times[cfg].append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(times[c]) for c in CONFIGS])
    allm = [torch.zeros_like(med) for _ in range(world)]
    dist.all_gather(allm, med)
    if rank == 0:
        print(
            f"# {NPROCS} ranks, {MODEL} batch {BATCH}, backend {BACKEND}, {ROUNDS} rounds x {K} steps interleaved after {WARM} warm-up; load {os.getloadavg()}"
        )
        for j, c in enumerate(CONFIGS):
            per = [float(m[j]) * 1e3 for m in allm]
            print(
                f"{c:26s} mean of rank medians {sum(per) / len(per):7.1f} ms  per rank {['%.0f' % p for p in per]}  graph breaks in warm-up {breaks[c][0]} stats {breaks[c][1]}"
            )
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    mp.spawn(run, args=(NPROCS,), nprocs=NPROCS)
