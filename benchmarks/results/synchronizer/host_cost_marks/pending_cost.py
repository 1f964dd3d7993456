"""Forward mode's marks, per parameter and step, in one checkout: a bucket of 200
parameters marked pending at step() and released at its first read, as
sync/deferred.py does it (``pending.defer`` then ``release`` per parameter, or
``release_all`` where the checkout has it). The best of 5 repeats of 500.

    python benchmarks/results/synchronizer/host_cost_marks/pending_cost.py <checkout>
"""

import os
import sys
import timeit

ROOT = os.path.abspath(
    sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), *[".."] * 4)
)
sys.path.insert(0, ROOT)
import torch  # noqa: E402
from hybridcomm.sync import pending  # noqa: E402

params = [torch.nn.Parameter(torch.randn(4)) for _ in range(200)]


class Owner:  # the applier is one bound method, registered once (deferred.py's on_read)
    def read(self, p):
        pending.release(p)


read = Owner().read
release_all = getattr(pending, "release_all", None)


def step():
    pending.defer(params, read)
    if release_all is not None:
        release_all(params)
    else:
        for p in params:
            pending.release(p)


best = min(timeit.repeat(step, number=500, repeat=5)) / 500
print(f"{ROOT}: defer + release {best / len(params) * 1e6:.3f} us per parameter and step")
