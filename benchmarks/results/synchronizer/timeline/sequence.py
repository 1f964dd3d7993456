"""World 2: three steps of one reduction, event by event on both ranks (timeline.py's recorder).

For none mode's reduction in steps 50-52 of a ``timeline.py`` run, each rank's
posting (``post>``/``post<``), waiting and add, in us from that rank's entry,
and when it entered against rank 0. With ``HYBRIDCOMM_ALGO=ring`` (two
exchanges at P = 2) it shows where this machine's multi-ms stalls sit in a
training step: in the second exchange's post (``TorchDistTransport.exchange``,
gloo's send), 1-3 ms now and then, while the peer waits. The same ring timed
alone, between barriers, took 0.56-0.61 ms at the median with one process
group or with each direction on a group of its own (``duplex.py``; p90
0.7-3.9 ms), so the stall comes with the training step's load on 2 cores, not
with the pattern.

    HYBRIDCOMM_ALGO=ring python benchmarks/results/synchronizer/timeline/sequence.py
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timeline as tl  # noqa: E402

_install = tl._Recorder.install


def _install_marks(self):
    """timeline.py's recorder, each post, wait and add also marked where it starts and ends."""
    from hybridcomm.comm import executor
    from hybridcomm.comm.transport import torch_dist

    rec = self

    def mark(fn, name):
        def inner(*a, **k):
            if rec.ops:
                rec.ops[-1].setdefault("events", []).append((name + ">", time.perf_counter()))
            try:
                return fn(*a, **k)
            finally:
                if rec.ops:
                    rec.ops[-1]["events"].append((name + "<", time.perf_counter()))

        return inner

    torch_dist.TorchDistTransport.exchange = mark(torch_dist.TorchDistTransport.exchange, "post")
    torch_dist.TorchDistPending.wait = mark(torch_dist.TorchDistPending.wait, "wait")
    executor.reduce = mark(executor.reduce, "add")
    _install(self)


def _print_sequences(ranks):
    for i in (50, 51, 52):
        first = ranks[0]["steps"]["none"][i]["ops"][0]["enter"]
        for r, rank in enumerate(ranks):
            op = rank["steps"]["none"][i]["ops"][0]
            t0 = op["enter"]
            events = " ".join(f"{n}{(t - t0) * 1e6:.0f}" for n, t in op.get("events", []))
            print(
                f"step {i} rank {r}: {events} leave {(op['leave'] - t0) * 1e6:.0f} "
                f"(entered {(t0 - first) * 1e6:+.0f} after rank 0)"
            )
    return {}


tl._Recorder.install = _install_marks  # (module level: the spawned ranks import this too)
tl.summarize = _print_sequences

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "--model", "conv", "--rounds", "6"]
    tl.main()
