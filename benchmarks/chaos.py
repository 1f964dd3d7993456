"""Chaos: kill a random rank at a random step, N times, and check each run resumes exactly.

    python benchmarks/chaos.py                 # 20 kills, 2 ranks on CPU (gloo), ~8 minutes
    python benchmarks/chaos.py --kills 5 --seed 3

Each kill is one `torchrun --max-restarts 2` run of examples/train.py (one
epoch, a checkpoint every 5 steps) in which rank R SIGKILLs itself at step K
of the first attempt (R and K random). torchrun restarts the group, the
script resumes from its last checkpoint, and the run must end with the same
parameters, bitwise, as an uninterrupted run of the same mode. The modes
rotate: forward, backward and none overlap, top-k compression (forward mode),
local SGD. A run that does not end within its limit counts as hung (its
process group is killed). After each run, a process still running with that
run's checkpoint directory counts as stray. The last line reads
`N of N resumed with bitwise-equal final parameters, 0 hung, 0 stray`.
"""

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TRAIN = os.path.join(ROOT, "examples", "train.py")
MODES = {
    "forward": ["--overlap", "forward"],
    "backward": ["--overlap", "backward"],
    "none": ["--overlap", "none"],
    "topk": ["--overlap", "forward", "--compression", "topk:0.1"],
    "local_sgd": ["--local-sgd", "4"],
}
STEPS = 32  # one epoch: 4096 samples / 2 ranks / batch 64
EVERY = 5


def run(ckpt_dir, mode_args, crash=None, limit=300.0):
    """(digest or None, output, seconds, hung)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        TRAIN,
        "--epochs",
        "1",
        "--checkpoint-dir",
        ckpt_dir,
        "--checkpoint-every",
        str(EVERY),
        *mode_args,
    ]
    if crash is not None:
        cmd += ["--crash-rank", str(crash[0]), "--crash-at-step", str(crash[1])]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    hung = False
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, hung = proc.communicate()[0], True
    found = set(re.findall(r"parameters sha256 (\w+)", out))
    digest = found.pop() if proc.returncode == 0 and len(found) == 1 else None
    return digest, out, time.perf_counter() - t0, hung


def stray(ckpt_dir) -> int:
    left = subprocess.run(["pgrep", "-f", ckpt_dir], capture_output=True, text=True).stdout.split()
    return len(left)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=float, default=300.0, help="seconds a run may take")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    names = list(MODES)
    ok = hung = strays = 0
    with tempfile.TemporaryDirectory(prefix="hybridcomm-chaos-") as tmp:
        reference = {}
        for name in names[: min(args.kills, len(names))]:
            digest, out, secs, _ = run(os.path.join(tmp, f"ref-{name}"), MODES[name])
            if digest is None:
                print(out[-3000:])
                raise SystemExit(f"the uninterrupted {name} run failed")
            reference[name] = digest
            print(f"reference {name:9s} {digest}  ({secs:.0f} s)", flush=True)
        print(
            f"{'kill':>4} {'mode':9s} {'rank':>4} {'step':>4} {'resumed from':>12} "
            f"{'digest':16s} {'equal':>5} {'s':>4} {'stray':>5}"
        )
        for i in range(args.kills):
            name = names[i % len(names)]
            rank, step = rng.randrange(2), rng.randrange(1, STEPS)
            ckpt = os.path.join(tmp, f"kill{i}")
            digest, out, secs, was_hung = run(ckpt, MODES[name], (rank, step), args.limit)
            killed = "exitcode: -9" in out
            resumed = re.search(r"resumed from step (\d+)", out)
            left = stray(ckpt)
            equal = digest is not None and digest == reference[name] and killed
            ok += equal
            hung += was_hung
            strays += left > 0
            print(
                f"{i:>4} {name:9s} {rank:>4} {step:>4} "
                f"{resumed.group(1) if resumed else '-':>12} {digest or '-':16s} "
                f"{'yes' if equal else 'NO':>5} {secs:>4.0f} {left:>5}",
                flush=True,
            )
            if not equal:
                print(out[-2000:])
    print(
        f"{ok} of {args.kills} resumed with bitwise-equal final parameters, {hung} hung, "
        f"{strays} stray"
    )
    return 0 if ok == args.kills and not hung and not strays else 1


if __name__ == "__main__":
    raise SystemExit(main())
