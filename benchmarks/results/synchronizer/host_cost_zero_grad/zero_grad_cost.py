"""zero_grad()'s host time alone, on the linear stack of ``benchmarks/sync_overhead.py``.

    python zero_grad_cost.py CHECKOUT [LABEL]

Imports hybridcomm from CHECKOUT (so two checkouts can be alternated), trains
100 x Linear(64, 64) (200 parameters, SGD with momentum, one thread, world 1)
for 50 steps in forward mode (HYBRIDCOMM_DEFER=always: the update is pending
after ``step()``) and in backward mode, then times, in a steady state:

- forward: ``zero_grad()`` while the update is pending (it marks the bucket and
  reads each field; repeated calls do the same work);
- backward: ``zero_grad()`` after the bucket's views were put back in ``.grad``,
  less the time of putting them back.

Median of 7 repeats of 2000 calls, microseconds per call.
"""

import statistics
import sys
import timeit

from world1 import linear_stack, start, steps

if __name__ == "__main__":
    checkout, label = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else sys.argv[1])
    hybridcomm = start(checkout)

    def trained(mode):
        model, x, opt = linear_stack(hybridcomm, mode)
        steps(model, x, opt, 50)
        return opt

    def per_call(fn, n=2000):
        return statistics.median(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6

    fwd = trained("forward")  # its update is pending now
    print(f"{label} forward  zero_grad() while pending: {per_call(fwd.zero_grad):6.1f} us")
    bwd = trained("backward")
    state = bwd._hc_sync.group.states[0]
    pairs = list(zip(state.bucket.params, state.bucket.views))

    def rebind():
        for p, v in pairs:
            p.grad = v

    def rebind_and_zero():
        rebind()
        bwd.zero_grad()

    print(
        f"{label} backward zero_grad() of 200 views:  "
        f"{per_call(rebind_and_zero) - per_call(rebind):6.1f} us"
    )
