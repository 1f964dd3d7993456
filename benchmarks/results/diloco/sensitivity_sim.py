"""(Streaming) DiLoCo on benchmarks/diloco.py's charlm workload, re-enacted in one
process without a network: the steps to the target for each setting.

Each of the 4 ranks' models trains on its quarter of the seeded global batch (the
harness's order); fragment k starts its sync after inner step t when
``t % H == floor((k + 1) H / K) % H`` and is merged tau steps later, with mixing
(tests/test_diloco.py's re-enactment rule, fragments cut by
hybridcomm.strategies.fragments). The global copy is evaluated every 20 steps, as
the harness evaluates it. Steps are what the network cannot change; seconds are
not measured here.

    python benchmarks/results/diloco/sensitivity_sim.py out.jsonl '{"seed": 0, "H": 5}' ...

Each argument is one setting (JSON): seed, H, and optionally K, tau, mix (a weight, or
"carry": the global parameters plus the rank's own progress since the sync
started), ilr, olr, om.
"""

import copy
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

import charlm  # noqa: E402

from hybridcomm.strategies import fragments as fr  # noqa: E402

WORLD, STEPS, TARGET, PER_RANK = 4, 280, 1.6, 16


def run(seed, H, K=1, tau=0, mix=0.5, ilr=0.006, olr=1.0, om=0.0):
    """(steps to the target or None, the final loss, the curve) of one setting."""
    train, valid, _ = charlm.corpus()
    torch.manual_seed(seed)
    base = charlm.CharLM()
    models = [copy.deepcopy(base) for _ in range(WORLD)]
    inners = [torch.optim.AdamW(m.parameters(), lr=ilr, weight_decay=0.01) for m in models]
    glob = copy.deepcopy(base)
    g = list(glob.parameters())
    outer = torch.optim.SGD(g, lr=olr, momentum=om, nesterov=om > 0)
    frags = [f.params for f in fr.split(fr.layers_of(base, list(base.parameters())), K, H)]
    offsets = [(k + 1) * H // K for k in range(K)]
    gen = torch.Generator().manual_seed(seed + 1)
    in_flight, hit, curve = {}, None, []
    for t in range(1, STEPS + 1):
        starts = torch.randint(
            0, len(train) - charlm.CONTEXT - 1, (PER_RANK * WORLD,), generator=gen
        )
        for r, (m, o) in enumerate(zip(models, inners)):
            o.zero_grad()
            charlm.loss(m, *charlm.batches(train, starts[r::WORLD])).backward()
            o.step()
        for k in range(K):
            if t % H == offsets[k] % H:  # Δ against the global copy, averaged
                deltas = []
                for i in frags[k]:
                    mine = [g[i].detach() - list(m.parameters())[i].detach() for m in models]
                    deltas.append(sum(mine[1:], mine[0]) * (1.0 / WORLD))
                # (mix="carry": each model's θ at the start, to carry its progress over)
                starts_at = [
                    [list(m.parameters())[i].detach().clone() for i in frags[k]] for m in models
                ]
                in_flight[k] = (t + tau, deltas, starts_at)
        for k in [k for k, (at, _, _) in in_flight.items() if at == t]:
            _, deltas, starts_at = in_flight.pop(k)
            for p in g:
                p.grad = None
            for i, d in zip(frags[k], deltas):
                g[i].grad = d
            outer.step()
            with torch.no_grad():
                for m, started in zip(models, starts_at):
                    mp = list(m.parameters())
                    for i, s0 in zip(frags[k], started):
                        if tau and mix == "carry":
                            mp[i].copy_(g[i] + (mp[i] - s0))
                        else:
                            mp[i].copy_(torch.lerp(g[i], mp[i], mix) if tau else g[i])
        if t % 20 == 0 or t == STEPS:
            v = charlm.validation_loss(glob, valid)
            curve.append((t, round(v, 4)))
            if hit is None and v <= TARGET:
                hit = t
    return hit, curve[-1][1], curve


def main(argv):
    torch.set_num_threads(1)
    for setting in (json.loads(a) for a in argv[1:]):
        t0 = time.time()
        hit, final, curve = run(**setting)
        rec = dict(
            cfg=setting, steps_to_target=hit, final=final, curve=curve, wall=round(time.time() - t0)
        )
        print(json.dumps(rec), flush=True)
        with open(argv[0], "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
