"""World 2, interleaved in one launch: hybridcomm's backward and none modes with the
step's last reduction in the trainer's thread (``HYBRIDCOMM_HOST_HERE=1``, the
default) and on the channel's thread (``-thread``: ``HYBRIDCOMM_HOST_HERE=0``, as
before), beside plain and the best DDP; sync_overhead.py's figures and table.

    python benchmarks/results/synchronizer/host_here/here_ab.py --models conv,linear
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import sync_overhead as so  # noqa: E402

for _mode in ("backward", "none"):
    so.CONFIGS[f"{_mode}-thread"] = ("hybrid", dict(so.HYBRID, overlap=_mode), {})
for _gone in ("ddp", "ddp-view", "forward"):  # (the best DDP at world 2 is ddp-batch here)
    del so.CONFIGS[_gone]
so.DDPS[:] = [c for c in so.DDPS if c in so.CONFIGS]
so.MODES[:] = ["backward", "none"]  # (the verdict: the defaults; -thread rows for comparison)
_made = so._Run.__init__


def _run_init(self, config, model_name, args, cost_model=None):
    """A ``-thread`` config's channel is made with HYBRIDCOMM_HOST_HERE=0 (read then)."""
    if config.endswith("-thread"):
        os.environ["HYBRIDCOMM_HOST_HERE"] = "0"
    try:
        _made(self, config, model_name, args, cost_model)
    finally:
        os.environ.pop("HYBRIDCOMM_HOST_HERE", None)


so._Run.__init__ = _run_init


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="conv,linear")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=20)
    so.add_model_arguments(parser)
    args = parser.parse_args()
    args.models, args.worlds, args.warmup, args.timeout = args.models.split(","), [2], 10, 600
    os.environ.setdefault("HYBRIDCOMM_LOG_LEVEL", "WARNING")
    nparams = {m: sum(1 for _ in so.build_model(m, args)[0].parameters()) for m in args.models}
    for res in so.figures([so.one_launch(args)], nparams):
        so.print_table(res, so.describe(res["model"], args))


if __name__ == "__main__":
    main()
