"""World 2: what the start-up probe picks between the butterfly and ``native``, launch after launch.

Each launch starts two fresh ranks (gloo on loopback), runs
``calibration.probe`` once, and prints, for a 0.71 MB bucket (the conv net's),
a 1.66 MB one (the linear stack's) and a 4 MiB one, the planner's pick at
P = 2 (``b``: butterfly, ``n``: native) and the fit's error
(``CostModel.uncertainty``; ``None`` before it was recorded). Run it at two
commits to compare probes:

    python benchmarks/results/synchronizer/probe_rounds/probe_choice.py --launches 15
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))

SIZES = (705608, 1664000, 4 << 20)


def _rank(rank, world, _):  # launch()'s function: module level
    from hybridcomm.comm import calibration

    torch.set_num_threads(1)
    model = calibration.probe(timeout=60)
    picks = "".join(model.choose(n, 2, candidates=("butterfly", "native"))[0] for n in SIZES)
    return picks, getattr(model, "uncertainty", None)


def main() -> None:
    from hybridcomm.tools.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launches", type=int, default=15)
    args = parser.parse_args()
    os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")
    rows = [launch(_rank, 2, None, backend="gloo", timeout=120)[0] for _ in range(args.launches)]
    for picks, error in rows:
        print(picks, error)
    some_native = sum("n" in picks for picks, _ in rows)
    print(
        f"# {some_native} of {len(rows)} launches picked native for at least one of "
        f"{', '.join(map(str, SIZES))} B"
    )


if __name__ == "__main__":
    main()
