"""Example scripts run as real processes for the integration tests: each in a
session of its own (on a timeout it and every process it started are killed),
on 127.0.0.1 and free ports, offline."""

import os
import signal
import socket
import subprocess
import sys
from typing import List, Sequence

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ENV = dict(
    OMP_NUM_THREADS="1",
    GLOO_SOCKET_IFNAME="lo",
    CUDA_VISIBLE_DEVICES="",
    HF_HUB_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: Sequence[str], env: dict = None) -> subprocess.Popen:
    return subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, **ENV, **(env or {})),
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{proc.args} did not finish within {timeout} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{proc.args} failed:\n{out[-4000:]}"
    return out


def finish_all(*procs: subprocess.Popen, timeout: float = 240) -> List[str]:
    """Each process's output; none is left running, whatever fails."""
    try:
        return [_finish(p, timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()


def run_script(script: str, args: Sequence[str], nprocs: int, timeout: float = 240) -> List[str]:
    """``script`` as ``nprocs`` ranks, with the variables torchrun sets (no
    launcher, no launcher's start-up delay); each rank's output."""
    port = str(free_port())
    return finish_all(
        *(
            start(
                [sys.executable, os.path.join(ROOT, script), *args],
                env=dict(
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                    WORLD_SIZE=str(nprocs),
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(nprocs),
                    NODE_RANK="0",
                ),
            )
            for rank in range(nprocs)
        ),
        timeout=timeout,
    )
