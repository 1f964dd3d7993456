"""Run a function on P real processes joined by a gloo process group.

Rendezvous goes through a FileStore in a fresh temporary folder (no ports to
pick), and gloo is pinned to the loopback interface. Processes are forked so
each test pays no re-import of torch. A rank that raises, or a run that
passes its deadline, fails the test with that rank's traceback; nothing is
left running.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def _entry(rank, world_size, store_path, fn, args, results, pg_timeout):
    status, payload = "error", None
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=pg_timeout))
        status, payload = "ok", fn(rank, world_size, *args)
    except BaseException:
        payload = traceback.format_exc()
    results.put((rank, status, payload))
    # Leave without tearing down gloo: a peer may have died on purpose.
    results.close()
    results.join_thread()
    os._exit(0)


def run_ranks(world_size: int, fn, *args, timeout: float = 180, pg_timeout: float = 60,
              allow_errors: bool = False):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes.

    Returns the list of per-rank return values (picklable). With
    ``allow_errors`` a rank's traceback string is returned in its place
    instead of failing.
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(r, world_size, store, fn, args, results, pg_timeout),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        out, dead_once, deadline = {}, set(), time.monotonic() + timeout
        try:
            while len(out) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise AssertionError(f"ranks {missing} did not finish within {timeout}s")
                try:
                    rank, status, payload = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    # A rank dead for two polls in a row has nothing left in the pipe.
                    for r in [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]:
                        if r in dead_once:
                            out[r] = ("error", f"exited with code {procs[r].exitcode} "
                                               "without reporting")
                        dead_once.add(r)
                    continue
                out[rank] = (status, payload)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    errors = {r: v for r, (s, v) in out.items() if s != "ok"}
    if errors and not allow_errors:
        r = min(errors)
        raise AssertionError(f"rank {r} failed:\n{errors[r]}")
    return [out[r][1] for r in range(world_size)]
