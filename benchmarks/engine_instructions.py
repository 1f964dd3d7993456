"""Instructions per round of the engine's host path alone, counted by callgrind.

``host_instructions.py`` counts a whole training step (~40M instructions at
world 1), where a change of a few thousand instructions in the engine is lost
in the heap's layout (~50K a step). This counts only the path from a bucket's
launch to its reduced result, the one a gradient takes after the hook: four
buckets launched and waited for, ``--rounds`` times, through ``CommEngine``,
the host channel (inline, as at world 1), the operation ``reduce_operation``
built, ``execute`` and the reductions, over a loopback transport at world 2
(rank 0: each receive gets the bytes of the send beside it, at once), so every
step of the schedule runs and nothing waits on a peer. Collection is on only
around the counted rounds (``torch._C._valgrind_toggle``), with a fixed
``PYTHONHASHSEED``.

Compare two commits by running this script of one with the other's package
first on the path (``PYTHONPATH=<a checkout of the other commit>``)::

    python benchmarks/engine_instructions.py --algo ring
    PYTHONPATH=/tmp/base python benchmarks/engine_instructions.py --algo butterfly --seed 1

Needs valgrind; ``--no-valgrind`` runs the rounds once without it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

SIZES = (4096, 256, 1024, 64)  # the buckets' gradients (elements)


class _Done:
    def wait(self, timeout=None) -> None:
        pass


class Loopback:
    """Rank 0 of 2: each receive gets the matching send's bytes, done at once."""

    rank, world_size, stream_ordered = 0, 2, False
    _done = _Done()

    def exchange(self, sends, recvs, *, label=None):
        for (_, s), (_, r) in zip(sends, recvs):
            n = min(r.numel(), s.numel())
            r[:n].copy_(s[:n])
        return self._done


def make_engine(algo: str):
    from hybridcomm.comm.channel import HostChannel
    from hybridcomm.comm.engine import CommEngine
    from hybridcomm.plan.planner import Bucket, Plan
    from hybridcomm.sync.buckets import GradBucket

    def alloc(n, dt):
        return torch.zeros(n, dtype=dt)

    params = [torch.nn.Parameter(torch.ones(n)) for n in SIZES]
    specs = []
    for i, n in enumerate(SIZES):
        probe = Bucket(i, [f"l{i}"], [i], n, 4 * n, algo, 0.0)
        total = GradBucket(probe, [params[i]], torch.float32, None, alloc).comm.numel()
        specs.append(Bucket(i, [f"l{i}"], [i], n, 4 * n, algo, 0.0, segments=[(0, total)]))
    plan = Plan(2, "hybrid", specs, [(i, 0) for i in range(len(SIZES))])
    buckets = [GradBucket(b, [params[b.index]], torch.float32, None, alloc) for b in specs]
    channel = HostChannel(timeout=60, inline=True)
    return CommEngine(plan, buckets, channel, Loopback(), scale=0.5, timeout=60)


def count(args) -> None:
    """The rounds, collection on around the counted ones (the child under callgrind)."""
    torch.set_num_threads(1)
    engine = make_engine(args.algo)

    def one_round() -> None:
        for i in range(len(SIZES)):
            engine.launch(i)
        for i in range(len(SIZES)):
            engine.wait(i)

    for _ in range(args.warmup):
        one_round()
    if engine.channel.failure is not None:
        raise engine.channel.failure
    if not args.no_valgrind:
        torch._C._valgrind_toggle()
    for _ in range(args.rounds):
        one_round()
    if not args.no_valgrind:
        torch._C._valgrind_toggle_and_dump_stats()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algo", default="ring", help="the buckets' algorithm")
    parser.add_argument("--rounds", type=int, default=200, help="counted rounds")
    parser.add_argument("--warmup", type=int, default=20, help="uncounted rounds first")
    parser.add_argument("--seed", type=int, default=0, help="PYTHONHASHSEED of the counted run")
    parser.add_argument("--no-valgrind", action="store_true", help="run once, count nothing")
    parser.add_argument("--_inside", dest="inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside or args.no_valgrind:
        count(args)
        return 0
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("valgrind is not installed (or run with --no-valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = [valgrind, "--tool=callgrind", "--collect-atstart=no"]
        cmd += [f"--callgrind-out-file={out}", sys.executable, os.path.abspath(__file__)]
        cmd += [f"--algo={args.algo}", f"--rounds={args.rounds}", f"--warmup={args.warmup}"]
        env = dict(os.environ, PYTHONHASHSEED=str(args.seed))
        proc = subprocess.run(cmd + ["--_inside"], capture_output=True, text=True, env=env)
        found = re.search(r"Collected : (\d+)", proc.stderr)
        if proc.returncode != 0 or found is None:
            raise SystemExit(f"the run under callgrind failed:\n{proc.stderr[-4000:]}")
    import hybridcomm

    total = int(found.group(1))
    print(
        f"{args.algo}: {total / args.rounds / 1e3:.1f}K instructions per round of "
        f"{len(SIZES)} buckets ({total} over {args.rounds} rounds; seed {args.seed}; "
        f"hybridcomm from {os.path.dirname(hybridcomm.__file__)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
