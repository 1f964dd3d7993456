"""Run a function on N local processes joined by a torch.distributed group.

Used by the benchmark CLI (``--nprocs``), the demo, the training benchmark and
the tests. Rendezvous goes through a FileStore in a fresh temporary folder: no
port to pick, and it works across network namespaces too. Gloo is pinned to
the loopback interface unless the caller says otherwise. A rank that raises,
dies, or outlives the deadline fails the launch with that rank's traceback;
nothing is left running, Ctrl-C included.

Example::

    >>> import operator
    >>> launch(operator.add, 2, backend="gloo")    # each rank: fn(rank, world_size)
    [2, 3]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Callable, Optional

from ..base.errors import HybridCommError


def _worker(
    fn, rank, world_size, store_path, backend, setup, args, results, pg_timeout, one_device=False
):
    status, payload, store = "error", None, None
    try:
        import torch
        import torch.distributed as dist

        if setup is not None:
            setup(rank, world_size)  # e.g. enter this rank's network namespace
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)  # ranks share the machine's cores
        if one_device:  # every rank on GPU 0, the one-device transport between them
            os.environ["HYBRIDCOMM_TRANSPORT"] = "one-device"
            torch.cuda.set_device(0)
        elif backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        store.add(_UP, 1)
        status, payload = "ok", fn(rank, world_size, *args)
    except BaseException:
        payload = traceback.format_exc()
    if store is not None:
        _wait_for_peers_up(store, world_size)
    try:
        # Plain pickle: torch's queue pickler would share tensors through file
        # descriptors that die with this process.
        blob = pickle.dumps(payload)
    except Exception:
        status, blob = (
            "error",
            pickle.dumps(f"rank {rank}: result not picklable:\n" + traceback.format_exc()),
        )
    results.put((rank, status, blob))
    # Leave without tearing gloo down: a peer may have died on purpose, and a
    # teardown would wait for it. os._exit skips atexit, so a coverage run
    # (make coverage) saves this rank's data first.
    results.close()
    results.join_thread()
    _save_coverage()
    os._exit(0)


def _worker_from_server(environ, rank, payload, results):
    """A rank forked from the forkserver: the server's environment is the one it had
    when it started, so the caller's, as it was at the launch, is put back first (as
    spawn would give it), and only then are ``fn`` and its arguments unpickled (their
    modules may read it on import)."""
    os.environ.clear()
    os.environ.update(environ)
    fn, world_size, store_path, backend, setup, args, pg_timeout, one_device = pickle.loads(payload)
    _worker(
        fn,
        rank,
        world_size,
        store_path,
        backend=backend,
        setup=setup,
        args=args,
        results=results,
        pg_timeout=pg_timeout,
        one_device=one_device,
    )


_UP = "hybridcomm/launch/up"  # ranks whose process group is made


def _wait_for_peers_up(store, world_size: int, limit: float = 10.0) -> None:
    """Before this rank exits: every peer's gloo group is made (a quick rank that
    exits while a peer still connects closes the peer's socket mid-handshake:
    "Connection closed by peer"). Bounded: a peer that died on purpose is not
    waited for long."""
    deadline = time.monotonic() + limit
    try:
        while store.add(_UP, 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - a store gone: nothing to wait for
        pass


def _save_coverage() -> None:
    import sys

    coverage = sys.modules.get("coverage")
    cov = coverage.Coverage.current() if coverage is not None else None
    if cov is not None:
        cov.stop()
        cov.save()


def _rank_starts(
    start_method, results, fn, nprocs, store, backend, setup, args, pg_timeout, one_device
):
    """(target, args) of each rank's Process."""
    if start_method != "forkserver":
        return [
            (_worker, (fn, r, nprocs, store, backend, setup, args, results, pg_timeout, one_device))
            for r in range(nprocs)
        ]
    try:  # once for all the ranks, and before any starts
        payload = pickle.dumps((fn, nprocs, store, backend, setup, args, pg_timeout, one_device))
    except Exception as e:  # a lambda, a local function, a lock or queue in args
        raise ValueError(
            "launch(start_method='forkserver'): fn, setup and args must be "
            f"picklable (module-level functions, no locks or queues): {e}"
        ) from e
    environ = dict(os.environ)
    return [(_worker_from_server, (environ, r, payload, results)) for r in range(nprocs)]


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def launch(
    fn: Callable,
    nprocs: int,
    *args,
    backend: Optional[str] = None,
    setup: Optional[Callable[[int, int], None]] = None,
    timeout: float = 600,
    pg_timeout: float = 120,
    start_method: str = "spawn",
    allow_errors: bool = False,
    one_device: bool = False,
):
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` processes; return their results.

    ``one_device``: every rank on GPU 0 over a gloo group, the GPU path between
    them over the one-device transport (``HYBRIDCOMM_TRANSPORT=one-device``):
    a single GPU runs the multi-rank path (NCCL refuses two ranks on a GPU).

    ``start_method``: ``"spawn"`` (the default) starts each rank as a fresh
    interpreter, which imports torch again (about 3.7 s of CPU per rank on a 2-core
    machine; a launch of 4 ranks there took 7.6 s). ``"forkserver"`` forks the ranks
    from one server process that imported torch (and ``torch._dynamo``, which a
    rank's first optimizer imports) once for the caller's whole process
    (the same launch: 1.5 s after the first); the ranks get the caller's
    ``os.environ`` as it is at the launch, as with spawn. Use it when one process
    launches many times. ``"fork"`` copies the caller, threads' state included.

    ``fn``, ``setup`` and ``args`` must be picklable with ``start_method="spawn"``
    or ``"forkserver"`` (module-level functions). ``setup(rank, nprocs)`` runs in the child before
    the process group is made. With ``allow_errors`` a failed rank's traceback
    (a string) stands in its place instead of raising.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if one_device and backend not in (None, "gloo"):
        raise ValueError(f"one_device ranks share one GPU over gloo, not {backend!r}")
    backend = "gloo" if one_device else backend or default_backend()
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # No effect once this process's server runs. torch._dynamo is what a rank's first
        # torch.optim.Optimizer imports (1.7 CPU-s a rank on a 2-core machine).
        ctx.set_forkserver_preload(["torch", "torch._dynamo"])
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hybridcomm-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=target, daemon=True, args=worker_args)
            for target, worker_args in _rank_starts(
                start_method,
                results,
                fn,
                nprocs,
                store=store,
                backend=backend,
                setup=setup,
                args=args,
                pg_timeout=pg_timeout,
                one_device=one_device,
            )
        ]
        for p in procs:
            p.start()
        out, dead_once, deadline = {}, set(), time.monotonic() + timeout
        try:
            while len(out) < nprocs:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(nprocs)) - set(out))
                    raise HybridCommError(f"ranks {missing} did not finish within {timeout:.0f}s")
                try:
                    rank, status, payload = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    # A rank dead for two polls in a row has nothing left in the pipe.
                    for r in [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]:
                        if r in dead_once:
                            out[r] = (
                                "error",
                                f"rank {r} exited with code {procs[r].exitcode} without reporting",
                            )
                        dead_once.add(r)
                    continue
                out[rank] = (status, pickle.loads(payload))
        finally:  # also on Ctrl-C: no orphans
            for p in procs:
                p.join(timeout=5 if len(out) == nprocs else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    errors = {r: v for r, (s, v) in out.items() if s != "ok"}
    if errors and not allow_errors:
        r = min(errors)
        raise HybridCommError(f"rank {r} failed:\n{errors[r]}")
    return [out[r][1] for r in range(nprocs)]
