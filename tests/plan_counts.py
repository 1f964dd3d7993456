"""What a plan's schedules cost in exact counts (the simulated-GPU tests assert them)."""


def schedule_counts(plan, rank, world):
    """(reduction kernels, NCCL calls) one round of every bucket of ``plan`` makes on
    ``rank``: a kernel per reducing receive of each schedule step (the executor's
    reduce) and nothing else (no pack, no unpack: zero-copy); an NCCL call per send
    and per receive."""
    from hybridcomm.algorithms import get_schedule

    kernels = calls = 0
    for b in plan.buckets:
        for a, z in b.segments:
            sched = get_schedule(b.algorithm, rank, world, z - a)
            kernels += sum(1 for st in sched.steps for r in st.recvs if r.reduce)
            calls += sum(len(st.sends) + len(st.recvs) for st in sched.steps)
    return kernels, calls
