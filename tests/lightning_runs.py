"""Several runs of examples/lightning_train.py in the same rank processes, one
after another (the tests' 2-process runs: one launch, so Lightning and torch
are imported once per rank instead of once per run).

    python tests/lightning_runs.py '[["name", ["--route", "hook", "--out", "p.pt"]], ...]'

Lightning initializes the process group once and reuses it for each later
Trainer; every run seeds itself (``pl.seed_everything(0)``).
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import lightning_train  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for name, argv in json.loads(sys.argv[1]):
        print(f"[lightning_runs] {name}", flush=True)
        lightning_train.main(argv)
    lightning_train.close()
