"""hierarchical and torus2d as pure schedules: exact and bitwise identical through
the simulator for every world size 1..17 and many node sizes and grids (short
last groups, primes), and their structure (step counts, matched sends, which
ranks talk across groups)."""

import math
import random

import pytest

from hybridcomm.algorithms import ScheduleError, Topology, get_schedule, simulate
from hybridcomm.algorithms.grouped import runs
from hybridcomm.algorithms.schedule import Recv, Schedule, Send, Step
from hybridcomm.algorithms.topology import most_square
from hybridcomm.plan.cost_model import coefficients

pytestmark = pytest.mark.fast  # in this process alone (tests/tiers.py)

WORLD_SIZES = range(1, 18)


def lengths(p):
    return sorted({0, 1, 2, p - 1, p, p + 1, 2 * p + 1, 13, 97})


def topologies(p):
    """Node sizes incl. non-divisors and 1 and P; grids incl. short last rows and (1, P)."""
    nodes = {1, 2, 3, 4, p - 1, p, p + 3}
    grids = {most_square(p), (1, p), (p, 1)}
    for cols in {2, 3, math.isqrt(p - 1) + 1, p - 1}:
        if 2 <= cols < p:
            grids.add((-(-p // cols), cols))  # the last row short unless cols divides p
    return [("hierarchical", Topology(node_size=n)) for n in sorted(nodes) if n >= 1] + [
        ("torus2d", Topology(grid=g)) for g in sorted(grids)
    ]


def run(algo, p, n, topo, inputs):
    return simulate([get_schedule(algo, r, p, n, topo) for r in range(p)], inputs)


@pytest.mark.parametrize("p", WORLD_SIZES)
def test_exact_and_bitwise_identical_for_every_node_size_and_grid(p):
    rng = random.Random(p)
    for algo, topo in topologies(p):
        for n in lengths(p):
            ints = [[rng.randint(-1000, 1000) for _ in range(n)] for _ in range(p)]
            want = [[sum(c) for c in zip(*ints)]] * p
            assert run(algo, p, n, topo, ints) == want, (algo, topo, n)
        # Floats of mixed magnitude: a sum's rounding depends on its order, so
        # identical results mean each element was summed once, then copied.
        n = 2 * p + 3
        floats = [
            [rng.uniform(-1, 1) * 10 ** rng.randint(-8, 8) for _ in range(n)] for _ in range(p)
        ]
        out = run(algo, p, n, topo, floats)
        assert all(o == out[0] for o in out), (algo, topo)


def test_identical_check_catches_rank_dependent_order():
    # The check above must be able to fail: here every rank adds the others'
    # buffers in its own order (left neighbour first), so the ranks differ.
    p, n = 3, 64
    scheds = [
        Schedule(
            "x",
            r,
            p,
            n,
            (
                Step(tuple(Send(q, 0, n) for q in range(p) if q != r), ()),
                Step((), (Recv((r - 1) % p, 0, n, reduce=True),)),
                Step((), (Recv((r + 1) % p, 0, n, reduce=True, final=True),)),
            ),
        )
        for r in range(p)
    ]
    rng = random.Random(0)
    floats = [[rng.uniform(-1, 1) * 10 ** rng.randint(-8, 8) for _ in range(n)] for _ in range(p)]
    out = simulate(scheds, floats)
    assert any(o != out[0] for o in out)


@pytest.mark.parametrize("p,node", [(4, 2), (6, 2), (6, 3), (8, 4), (9, 3), (12, 4), (16, 4)])
def test_step_counts_follow_the_formula(p, node):
    m = p // node
    n = 1000 * p
    for algo, topo in (
        ("hierarchical", Topology(node_size=node)),
        ("torus2d", Topology(grid=(m, node))),
    ):
        want = coefficients(algo, n, p, topo)[0]
        assert want == 2 * (node - 1) + 2 * (m - 1)
        assert all(len(get_schedule(algo, r, p, n, topo).steps) == want for r in range(p))
    assert len(get_schedule("torus2d", 0, 16, n).steps) == 12  # 4x4 by default: 4 sqrt(P) - 4
    assert len(get_schedule("ring", 0, 16, n).steps) == 30


def test_one_node_or_one_rank_per_node_is_the_ring():
    for p in (3, 5, 8):
        ring = [len(get_schedule("ring", r, p, 100).steps) for r in range(p)]
        for topo in (Topology(node_size=1), Topology(node_size=p), Topology(node_size=10 * p)):
            assert [
                len(get_schedule("hierarchical", r, p, 100, topo).steps) for r in range(p)
            ] == ring
        assert [
            len(get_schedule("torus2d", r, p, 100, Topology(grid=(1, p))).steps) for r in range(p)
        ] == ring


@pytest.mark.parametrize("p,node", [(3, 2), (6, 2), (7, 2), (7, 3), (11, 4), (13, 5)])
def test_every_send_matched_and_only_chunk_owners_talk_across_nodes(p, node):
    n = 7 * p + 3
    sends, recvs = {}, {}
    for r in range(p):
        s = get_schedule("hierarchical", r, p, n, Topology(node_size=node))
        assert s.topology == Topology(node_size=node).resolve(p)
        for st in s.steps:
            assert len({x.peer for x in st.sends}) == len(st.sends)  # one message per peer
            for x in st.sends:
                sends.setdefault((r, x.peer), []).append((x.stop - x.start))
                if x.peer // node != r // node:  # across nodes: the chunk it owns
                    g, local = node, r % node
                    size = min(node, p - r // node * node)
                    b = runs(g, size)
                    lo, hi = b[local] * n // g, b[local + 1] * n // g
                    assert lo <= x.start and x.stop <= hi, (r, x)
            for v in st.recvs:
                recvs.setdefault((v.peer, r), []).append(v.stop - v.start)
    assert sends == recvs  # same pairs, same sizes, same order: FIFO without tags


def test_final_once_per_element_is_checked():
    # Dropping the cross-node phase's `final` flags must be caught (the executor
    # applies avg's scale there).
    p, n, topo = 4, 16, Topology(node_size=2)
    bad = []
    for r in range(p):
        s = get_schedule("hierarchical", r, p, n, topo)
        steps = tuple(
            Step(st.sends, tuple(Recv(v.peer, v.start, v.stop, v.reduce, False) for v in st.recvs))
            for st in s.steps
        )
        bad.append(Schedule(s.algorithm, r, p, n, steps))
    with pytest.raises(ScheduleError, match="final"):
        simulate(bad, [[1] * n] * p)


def test_topology_defaults_and_errors(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert Topology().resolve(6) == Topology(6, (2, 3))
    assert Topology().resolve(13) == Topology(13, (1, 13))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Topology().resolve(7).node_size == 2
    assert get_schedule("hierarchical", 0, 7, 50).topology.node_size == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # read on every call: no stale cache
    assert get_schedule("hierarchical", 0, 7, 50).topology.node_size == 3
    assert Topology(node_size=4).resolve(7).node_size == 4  # the argument wins
    assert get_schedule("ring", 0, 7, 50).topology is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        Topology().resolve(4)
    for bad in ((2, 2), (4, 3), (0, 5), (1, 9), (2,)):
        with pytest.raises(ValueError, match="grid"):
            Topology(node_size=1, grid=bad).resolve(7)
    with pytest.raises(ValueError, match="node_size"):
        Topology(node_size=0).resolve(4)
