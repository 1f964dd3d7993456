"""The used-parameter agreement under shard at world 2 (a timing probe, not a fix):
shard="optimizer", backward mode, the linear stack (one bucket), against DDP with
the batched copy, in the same launch (benchmarks/sync_overhead.py's loop and
figures: added ms over plain, the larger rank's). ``how``:

- ``post``: as shipped (``UsedAgreement.post`` posts a HostMax per bucket at issue);
- ``chan``: the HostMax made on the channel's thread instead of the trainer's;
- ``skip``: none posted: timing only, wrong where a rank lacks a gradient.

    python benchmarks/results/synchronizer/host_cost_marks/agreement_world2.py post

Since the usage flags ride in the reduce-scatter (benchmarks/results/shard/
flags_in_reduce_scatter/), the host path posts no HostMax under shard: ``post``
is the shipped code, and ``chan`` and ``skip`` change nothing there.
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[".."] * 4))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]
os.environ["HYBRIDCOMM_LOG_LEVEL"] = "WARNING"
import torch  # noqa: E402
import sync_overhead as so  # noqa: E402
from hybridcomm.tools.launch import launch  # noqa: E402


class A:
    layers, width, batch, channels, image, conv_batch = 100, 64, 32, 8, 16, 8


class _OnChannel:
    """A HostMax made on the channel's thread, waited for through its ticket."""

    def __init__(self, channel, make):
        self.box, self.channel = {}, channel
        self.ticket = channel.submit(lambda: self.box.setdefault("agreed", make()), "agree")

    def wait(self):
        self.channel.wait(self.ticket, "agree")
        self.box["agreed"].wait()

    def positions(self):
        self.channel.wait(self.ticket, "agree")
        return self.box["agreed"].positions()


def rank(r, w, how):
    from hybridcomm.comm import control
    from hybridcomm.sync import used

    channel = []
    if how == "skip":
        used.UsedAgreement.post = lambda self, state: None
    elif how == "chan":

        def post(self, state):
            state.agreed = _OnChannel(
                channel[0],
                lambda: control.HostMax(
                    len(state.bucket.params),
                    state.marked,
                    group=self.group,
                    timeout=self.timeout,
                    what="agreement",
                ),
            )

        used.UsedAgreement.post = post
    torch.set_num_threads(1)
    kind, options, zero = so.CONFIGS["backward"]
    so.CONFIGS["shard"] = (kind, dict(options, shard="optimizer"), zero)
    runs = {c: so._Run(c, "linear", A) for c in ("plain", "ddp-batch", "shard")}
    channel.append(runs["shard"].opt._hc_sync.channel)
    for x in runs.values():
        x.steps(10, keep=False)
    for _ in range(8):
        for x in runs.values():
            x.steps(25, keep=True)
    out = {c: x.medians(runs["plain"])["added"] for c, x in runs.items()}
    for x in runs.values():
        x.close()
    return out


if __name__ == "__main__":
    how = sys.argv[1] if len(sys.argv) > 1 else "post"
    res = launch(rank, 2, how, backend="gloo", timeout=300)
    print(how, " ".join(f"{c} {max(o[c] for o in res):+.2f}" for c in ("ddp-batch", "shard")))
