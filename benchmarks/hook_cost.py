"""What autograd charges for a Python gradient hook, per parameter and backward pass.

The floor under any library that watches gradients from Python: the same
backward of ``--layers`` Linear(``--width``) layers with no hook, an empty
tensor pre-hook (``register_hook``: autograd wraps the gradient for Python
and calls it before it accumulates), an empty post-accumulate hook
(``register_post_accumulate_grad_hook``), both, or a post-accumulate hook
registered and removed again (``emptied``: autograd keeps calling into the
emptied dict, short of Python code); the configs interleaved
in ``--rounds`` rounds, each figure the median over rounds of the round's
median backward less the no-hook model's of the same round (paired, so a
change of machine load cancels), per parameter. DDP's hooks are C++ and
cost no Python call. hybridcomm arms its pre-hook only while a bucket is
launched, in flight or pending, and in a steady step keeps the
post-accumulate hook on one parameter per bucket (hybridcomm/sync/
grad_hooks.py), so a steady step pays the emptied column per parameter and
the post-accumulate column per bucket.

Example::

    python benchmarks/hook_cost.py            # ~15 s
    python benchmarks/hook_cost.py --rounds 3 --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

KINDS = ("none", "pre", "post", "both", "emptied")


def build(kind: str, layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    for p in model.parameters():
        if kind in ("pre", "both"):
            p.register_hook(lambda g: None)
        if kind in ("post", "both", "emptied"):
            handle = p.register_post_accumulate_grad_hook(lambda p: None)
            if kind == "emptied":
                handle.remove()
    return model


def measure(
    layers: int = 100, width: int = 64, batch: int = 32, rounds: int = 30, steps: int = 20
) -> dict:
    """{kind: us per parameter and pass over no hook}, and the no-hook backward (ms)."""
    torch.set_num_threads(1)
    x = torch.randn(batch, width)
    models = {k: build(k, layers, width) for k in KINDS}
    per_round = {k: [] for k in KINDS}
    for r in range(rounds + 1):  # the first round warms up
        for k, model in models.items():
            params, times = list(model.parameters()), []
            for _ in range(steps):
                for p in params:
                    p.grad = None
                loss = model(x).square().mean()
                t0 = time.perf_counter()
                loss.backward()
                times.append(time.perf_counter() - t0)
            if r:
                per_round[k].append(statistics.median(times))
    nparams = 2 * layers
    out = {
        k: statistics.median(a - b for a, b in zip(per_round[k], per_round["none"])) / nparams * 1e6
        for k in KINDS
        if k != "none"
    }
    out["backward_ms"] = statistics.median(per_round["none"]) * 1e3
    out["params"] = nparams
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    res = measure(args.layers, args.width, rounds=args.rounds, steps=args.steps)
    print(
        f"# {res['params']} parameters, backward without hooks {res['backward_ms']:.2f} ms, "
        f"torch {torch.__version__}"
    )
    for k in KINDS[1:]:
        print(f"{k:7s} hook: {res[k]:+.2f} us per parameter and pass")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
