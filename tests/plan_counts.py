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
            k, c = _counts(get_schedule(b.algorithm, rank, world, z - a))
            kernels, calls = kernels + k, calls + c
    return kernels, calls


def _counts(sched):
    """(reducing receives, sends and receives) of one schedule."""
    return (
        sum(1 for st in sched.steps for r in st.recvs if r.reduce),
        sum(len(st.sends) + len(st.recvs) for st in sched.steps),
    )


def sharded_counts(plan, rank, world):
    """The same for a sharded plan's round: every bucket reduce-scattered, then
    all-gathered (each phase's schedule; the last segment with the flags' tail
    blocks), or, ``native``, one NCCL call a phase for the body and one for the
    tail, and no kernel of ours."""
    from hybridcomm.algorithms import ALL_GATHER, REDUCE_SCATTER, get_phase_schedule

    kernels = calls = 0
    for b in plan.buckets:
        for i, (a, z) in enumerate(b.segments):
            tail = b.tail if i == len(b.segments) - 1 else 0
            if b.algorithm == "native":
                calls += 2 * (1 + bool(tail))
                continue
            for phase in (REDUCE_SCATTER, ALL_GATHER):
                k, c = _counts(get_phase_schedule(phase, b.algorithm, rank, world, z - a, tail))
                kernels, calls = kernels + k, calls + c
    return kernels, calls
