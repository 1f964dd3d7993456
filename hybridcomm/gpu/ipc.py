"""Device memory and events that other processes on the same GPU can use (CUDA IPC).

What the one-device transport (``hybridcomm.comm.transport.one_device``) needs
to run several rank processes on one GPU: a buffer a peer process maps
(``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``, through torch's own
sharing of CUDA tensors), and an event a peer process's streams wait on
(``cudaEventInterprocess``). Handles are bytes, to pass through a store.

Usage (on a GPU, two processes)::

    ipc = CudaIpc(torch.device("cuda", 0))
    box, handle = ipc.buffer(1 << 20)        # process A; handle goes through the store
    theirs = ipc.open_buffer(handle)         # process B: A's memory, mapped
"""

from __future__ import annotations

import pickle
from typing import Tuple

import torch


class CudaIpc:
    """CUDA IPC for one device (the simulator's is ``hybridcomm.testing.simgpu.SimIpc``)."""

    def __init__(self, device: torch.device):
        self.device = device

    def buffer(self, nbytes: int) -> Tuple[torch.Tensor, bytes]:
        """``nbytes`` of device memory and the handle a peer opens it with. The
        memory must stay alive (held by the caller) while any peer uses it."""
        from torch.multiprocessing.reductions import reduce_tensor

        t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        _rebuild, args = reduce_tensor(t)
        return t, pickle.dumps(args)

    @staticmethod
    def open_buffer(handle: bytes) -> torch.Tensor:
        """A peer's :meth:`buffer`, mapped into this process."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(*pickle.loads(handle))

    def event(self):
        """An event peers can wait on, and its handle (made on this device)."""
        ev = torch.cuda.Event(interprocess=True)  # timing off: CUDA requires it for IPC
        with torch.cuda.device(self.device):
            return ev, bytes(ev.ipc_handle())

    def open_event(self, handle: bytes):
        """A peer's :meth:`event`: ``stream.wait_event`` waits for its latest record."""
        return torch.cuda.Event.from_ipc_handle(self.device, handle)

    @staticmethod
    def forget(handle: bytes) -> None:
        """Every peer has opened ``handle``: nothing to clean up on CUDA (the
        simulator removes its shared-memory file here)."""
