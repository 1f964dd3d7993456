"""Schedules as pure data: exact sums through the simulator, and their structure."""

import math
import random

import pytest

from hybridcomm.algorithms import ALGORITHMS, ScheduleError, get_schedule, simulate
from hybridcomm.algorithms.schedule import Recv, Schedule, Send, Step

pytestmark = pytest.mark.fast  # in this process alone (tests/tiers.py)

WORLD_SIZES = range(1, 18)


def lengths(p):
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 2 * p + 1, 13, 101, 1009})


def all_schedules(algo, p, n):
    return [get_schedule(algo, r, p, n) for r in range(p)]


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("p", WORLD_SIZES)
def test_simulated_sum_is_exact_on_every_rank(algo, p):
    rng = random.Random(p)
    for n in lengths(p):
        inputs = [[rng.randint(-1000, 1000) for _ in range(n)] for _ in range(p)]
        expected = [sum(col) for col in zip(*inputs)] if n else []
        out = simulate(all_schedules(algo, p, n), inputs)
        assert out == [expected] * p, (algo, p, n)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_step_counts_at_powers_of_two(p):
    n = 10 * p
    log = int(math.log2(p))
    for r in range(p):
        assert len(get_schedule("ring", r, p, n).steps) == 2 * (p - 1)
        assert len(get_schedule("butterfly", r, p, n).steps) == log
        assert len(get_schedule("halving_doubling", r, p, n).steps) == 2 * log


@pytest.mark.parametrize("p", [3, 5, 6, 7, 12])
def test_non_power_of_two_folds_two_extra_steps(p):
    core = 1 << (p.bit_length() - 1)
    log = int(math.log2(core))
    for r in range(p):
        steps = len(get_schedule("butterfly", r, p, 100).steps)
        if r >= core:
            assert steps == 2  # hand in, get the result back
        elif r < p - core:
            assert steps == log + 2
        else:
            assert steps == log
    assert all(len(get_schedule("ring", r, p, 100).steps) == 2 * (p - 1) for r in range(p))


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 11])
def test_every_send_has_its_receive(algo, p):
    n = 3 * p + 2
    sends, recvs = {}, {}
    for r in range(p):
        for st in get_schedule(algo, r, p, n).steps:
            for s in st.sends:
                sends.setdefault((r, s.peer), []).append(s.stop - s.start)
            for v in st.recvs:
                recvs.setdefault((v.peer, r), []).append(v.stop - v.start)
    assert sends == recvs  # same pairs, same sizes, same order


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_ring_traffic_forms_a_ring(p):
    n = 10 * p
    total = 0
    for r in range(p):
        s = get_schedule("ring", r, p, n)
        for st in s.steps:
            assert [x.peer for x in st.sends] == [(r + 1) % p]
            assert [x.peer for x in st.recvs] == [(r - 1) % p]
            total += sum(x.stop - x.start for x in st.sends)
    # each rank sends 2(P-1)/P of the buffer: bandwidth-optimal
    assert total == p * 2 * (p - 1) * n // p


def test_butterfly_partners_are_xor_pairs():
    for r in range(8):
        peers = [st.sends[0].peer for st in get_schedule("butterfly", r, 8, 64).steps]
        assert peers == [r ^ 1, r ^ 2, r ^ 4]


def test_final_reduction_once_per_element():
    # each element is finalized (scaled, for avg) by exactly one reduction per
    # rank or copied from one: the simulator checks this, so a schedule that
    # forgets `final` fails here.
    p, n = 4, 8
    bad = []
    for r in range(p):
        s = get_schedule("ring", r, p, n)
        steps = tuple(
            Step(st.sends, tuple(Recv(v.peer, v.start, v.stop, v.reduce, False) for v in st.recvs))
            for st in s.steps
        )
        bad.append(Schedule(s.algorithm, r, p, n, steps))
    with pytest.raises(ScheduleError, match="final"):
        simulate(bad, [[1] * n] * p)


def test_simulator_catches_order_mismatch_without_tags():
    # rank 0 sends two differently sized messages; rank 1 posts its receives
    # in the other order: NCCL would mismatch, so must the simulator.
    s0 = Schedule("x", 0, 2, 3, (Step((Send(1, 0, 1),), ()), Step((Send(1, 1, 3),), ())))
    s1 = Schedule(
        "x",
        1,
        2,
        3,
        (Step((), (Recv(0, 1, 3, reduce=False),)), Step((), (Recv(0, 0, 1, reduce=False),))),
    )
    with pytest.raises(ScheduleError, match="expects 2 elements"):
        simulate([s0, s1], [[1, 2, 3], [0, 0, 0]])


def test_simulator_catches_deadlock_and_unmatched_sends():
    s0 = Schedule("x", 0, 2, 1, (Step((), (Recv(1, 0, 1, reduce=True),)),))
    s1 = Schedule("x", 1, 2, 1, (Step((), (Recv(0, 0, 1, reduce=True),)),))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([s0, s1], [[1], [1]])
    s0 = Schedule("x", 0, 2, 1, (Step((Send(1, 0, 1),), ()),))
    s1 = Schedule("x", 1, 2, 1, ())
    with pytest.raises(ScheduleError, match="never received"):
        simulate([s0, s1], [[1], [1]])


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown algorithm"):
        get_schedule("tree", 0, 2, 4)
    with pytest.raises(ValueError, match="rank"):
        get_schedule("ring", 2, 2, 4)
    with pytest.raises(ValueError, match="numel"):
        get_schedule("butterfly", 0, 2, -1)
    with pytest.raises(ValueError, match="world_size"):
        get_schedule("halving_doubling", 0, 0, 4)


def test_scratch_is_bounded_by_the_buffer():
    for algo in ALGORITHMS:
        for p in (2, 3, 8):
            for r in range(p):
                s = get_schedule(algo, r, p, 1000)
                folded_out = r >= 1 << (p.bit_length() - 1) and algo in (
                    "butterfly",
                    "halving_doubling",
                )
                assert s.scratch_numel == 0 if folded_out else 0 < s.scratch_numel <= 1000
    # the largest chunk: 1000 split at multiples of 8 elements is 248, 248, 248, 256
    assert get_schedule("ring", 0, 4, 1000).scratch_numel == 256


@pytest.mark.parametrize("algo", ["ring", "halving_doubling"])
def test_chunks_start_at_aligned_offsets(algo):
    """Every transfer of a chunked schedule starts at a multiple of 8 elements, so
    NCCL and the reduction kernels get aligned (vectorisable) addresses."""
    from hybridcomm.algorithms.schedule import ALIGN_ELEMENTS

    for p in (2, 3, 4, 8):
        for n in (1, 7, 100, 1000, 4099):
            for r in range(p):
                for st in get_schedule(algo, r, p, n).steps:
                    for t in st.sends + st.recvs:
                        assert t.start % ALIGN_ELEMENTS == 0, (algo, p, n, r, t)


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling"])
def test_a_phased_segments_tail_gives_each_rank_its_whole_block(algorithm):
    """A sharded bucket's usage flags ride in its last segment's tail: one block a
    rank, in rank order, after the gradients. After the reduce-scatter each rank
    holds the exact sum of its own block (and of its part of the rest), with the
    same steps as without the tail; the all-gather gives every rank all of it."""
    from hybridcomm.algorithms import SHARD_BOUNDS, get_phase_schedule, tail_block, tail_body

    rng = random.Random(4)
    worlds = (1, 2, 3, 4, 5, 8) if algorithm == "ring" else (1, 2, 4, 8)
    for world in worlds:
        for body in (0, 1, 7, 100, 1001):
            for tail in (8, 16):
                numel = body + world * tail
                assert tail_body(world, numel, tail) == body
                inputs = [[rng.randint(-9, 9) for _ in range(numel)] for _ in range(world)]
                total = [sum(col) for col in zip(*inputs)]
                owned = [
                    [SHARD_BOUNDS[algorithm](r, world, body), tail_block(r, world, numel, tail)]
                    for r in range(world)
                ]
                rs = [
                    get_phase_schedule("reduce_scatter", algorithm, r, world, numel, tail)
                    for r in range(world)
                ]
                plain = [
                    get_phase_schedule("reduce_scatter", algorithm, r, world, body)
                    for r in range(world)
                ]
                if body >= 8 * world:  # no part empty: the tail adds no step of its own
                    assert [len(s.steps) for s in rs] == [len(s.steps) for s in plain]
                scattered = simulate(rs, inputs, owned, "reduce_scatter")
                for r in range(world):
                    for lo, hi in owned[r]:
                        assert scattered[r][lo:hi] == total[lo:hi], (world, body, tail, r)
                gathered = simulate(
                    [
                        get_phase_schedule("all_gather", algorithm, r, world, numel, tail)
                        for r in range(world)
                    ],
                    scattered,
                    owned,
                    "all_gather",
                )
                assert all(g == total for g in gathered), (world, body, tail)
    with pytest.raises(ValueError, match="multiple of 8"):
        get_phase_schedule("reduce_scatter", algorithm, 0, 2, 100, 5)
    with pytest.raises(ValueError, match="does not fit"):
        get_phase_schedule("reduce_scatter", algorithm, 0, 2, 10, 8)


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling"])
def test_a_reduce_scatter_then_an_all_gather_is_the_all_reduce(algorithm):
    """Sharded state's two phases on their own (issue 40): after the reduce-scatter
    each rank's part (``SHARD_BOUNDS``) is the exact sum, finalized once; the
    all-gather from those parts gives every rank the whole sum. Awkward sizes."""
    from hybridcomm.algorithms import SHARD_BOUNDS, get_phase_schedule

    rng = random.Random(3)
    worlds = (1, 2, 3, 4, 5, 8) if algorithm == "ring" else (1, 2, 4, 8)
    for world in worlds:
        for numel in (0, 1, 7, 9, 100, 1001):
            inputs = [[rng.randint(-9, 9) for _ in range(numel)] for _ in range(world)]
            total = [sum(col) for col in zip(*inputs)]
            owned = [SHARD_BOUNDS[algorithm](r, world, numel) for r in range(world)]
            assert owned[0][0] == 0 and owned[-1][1] == numel
            assert all(owned[r][1] == owned[r + 1][0] for r in range(world - 1))
            scattered = simulate(
                [
                    get_phase_schedule("reduce_scatter", algorithm, r, world, numel)
                    for r in range(world)
                ],
                inputs,
                owned,
                "reduce_scatter",
            )
            for r, (lo, hi) in enumerate(owned):
                assert scattered[r][lo:hi] == total[lo:hi], (world, numel, r)
            gathered = simulate(
                [
                    get_phase_schedule("all_gather", algorithm, r, world, numel)
                    for r in range(world)
                ],
                scattered,
                owned,
                "all_gather",
            )
            assert all(g == total for g in gathered), (world, numel)
    if algorithm == "halving_doubling":
        with pytest.raises(ValueError, match="power-of-two"):
            get_phase_schedule("reduce_scatter", algorithm, 0, 3, 10)
