"""Host time per pack/unpack table launch for one bucket (issue 29, defect 5).

The table kernels read each block's (address, count, offset) from a device
table (``kernels/_triton.py``). What matters on a GPU is the host's Python
work per launch once the bucket's layout was seen. On CPU (the default) the
kernel is replaced by a no-op, so only that host work is timed: the launcher,
its checks and the table lookup, not the interpreter running the kernel.
With ``--device cuda`` the real kernel is launched and the host time until
the launch returns is timed (no synchronize inside the loop).

    python benchmarks/launch_cost.py                 # 100 MiB fp32 bucket, 25 tensors
    python benchmarks/launch_cost.py --mib 100 --tensors 25 --block 1024 --op unpack
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # impl="triton" on CPU tensors needs it
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records the grid only."""

    def __init__(self):
        self.programs = 0

    def __getitem__(self, grid):
        self.programs = grid[0]
        return lambda *args, **kwargs: None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=100.0, help="bucket size in MiB (fp32)")
    ap.add_argument("--tensors", type=int, default=25, help="tensors in the bucket")
    ap.add_argument("--block", type=int, default=1024, help="elements per program (the GPU's)")
    ap.add_argument("--op", choices=["pack", "unpack"], default="pack")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cpu", help="cpu (kernel stubbed) or cuda (real launch)")
    args = ap.parse_args(argv)

    from hybridcomm import kernels as K

    module = importlib.import_module(f"hybridcomm.kernels.{args.op}")
    device = torch.device(args.device)
    stub = None
    if device.type != "cuda":
        stub = _NoLaunch()
        setattr(module, f"_{args.op}_kernel", stub)
    numel = int(args.mib * 2**20) // 4
    sizes = [numel // args.tensors + (i < numel % args.tensors) for i in range(args.tensors)]
    tensors = [torch.zeros(n, device=device) for n in sizes]
    flat = torch.zeros(numel, device=device)

    def launch():
        if args.op == "pack":
            K.pack(tensors, flat, impl="triton", _block=args.block)
        else:
            K.unpack(flat, tensors, impl="triton", _block=args.block)

    t0 = time.perf_counter()
    launch()  # the first launch of this layout (and, on CUDA, the compile)
    first = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        launch()
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    programs = stub.programs if stub else -(-numel // args.block)
    result = {
        "op": args.op,
        "device": str(device),
        "bucket_mib": args.mib,
        "tensors": args.tensors,
        "block": args.block,
        "programs": programs,
        "first_launch_ms": first * 1e3,
        "host_ms_per_launch_median": statistics.median(times) * 1e3,
        "host_ms_per_launch_min": min(times) * 1e3,
    }
    for k, v in result.items():
        print(f"{k:28s} {v:.4f}" if isinstance(v, float) else f"{k:28s} {v}")
    return result


if __name__ == "__main__":
    main()
