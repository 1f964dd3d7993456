"""Run an example script as P ranks, as torchrun would start them (the env
variables each framework reads), on 127.0.0.1 and a free port; no launcher's
own start-up delay. Every rank in its own session: on a timeout all are killed."""
import os
import signal
import socket
import subprocess
import sys
from typing import List, Sequence

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(script: str, args: Sequence[str], nprocs: int, timeout: float = 240,
               env: dict = None) -> List[str]:
    """Each rank's output (stdout and stderr); fails with them if a rank fails."""
    port, procs = free_port(), []
    for rank in range(nprocs):
        rank_env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        WORLD_SIZE=str(nprocs), RANK=str(rank), LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(nprocs), NODE_RANK="0", GLOO_SOCKET_IFNAME="lo",
                        **(env or {}))
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, script), *args],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      cwd=ROOT, env=rank_env, start_new_session=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        outs = [p.communicate()[0] for p in procs]
        raise AssertionError(f"{script} did not finish within {timeout} s:\n"
                             + "\n".join(o[-2000:] for o in outs))
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"{script} {' '.join(args)}: ranks {failed} failed:\n" + \
        "\n".join(outs[r][-3000:] for r in failed)
    return outs
