"""The device runtime: the one layer under the GPU path that is swapped for a simulator.

Everything the stream-ordered code needs from CUDA goes through a runtime:
streams, events, the current stream, device memory and ``record_stream``,
binding a thread to the rank's device, and the NCCL module. Two exist:

* :class:`CudaRuntime`: ``torch.cuda`` and ``cupy.cuda.nccl`` (production);
* ``hybridcomm.testing.simgpu.SimRuntime``: a simulated CUDA runtime on CPU
  tensors, selected with ``HYBRIDCOMM_SIMULATE_GPU=1`` (streams that run late,
  events, a stream-tracking allocator, a race detector, NCCL over gloo).

:func:`runtime_for` picks one for a tensor's device, or None for the host
path (CPU tensors over gloo, no streams). Code above this layer never calls
``torch.cuda`` directly, so the simulator runs exactly the production code.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Dict, Optional

import torch

from . import env
from .errors import HybridCommError


class CudaRuntime:
    """``torch.cuda`` streams/events/memory for one device, and CuPy's NCCL.

    Usage (on a GPU)::

        rt = CudaRuntime(torch.device("cuda", 0))
        s = rt.new_stream(priority=-1)
        with rt.use(s):
            scratch = rt.empty(1024, torch.float32)   # allocated on s
    """

    simulated = False

    def __init__(self, device: torch.device):
        if not torch.cuda.is_available():
            raise HybridCommError("no CUDA device is available")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)

    def new_stream(self, priority: int = 0):
        return torch.cuda.Stream(device=self.device, priority=priority)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def new_event(self, timing: bool = False):
        """An event; ``timing`` allows ``elapsed_time`` (off: cheapest to record and query)."""
        return torch.cuda.Event(enable_timing=timing)

    def use(self, stream):
        """``with rt.use(s):`` makes ``s`` current (kernels launch on it)."""
        return torch.cuda.stream(stream)

    @staticmethod
    def handle(stream) -> int:
        """The raw ``cudaStream_t`` NCCL takes."""
        return stream.cuda_stream

    @staticmethod
    def record_stream(tensor: torch.Tensor, stream) -> None:
        # The caching allocator must not hand this memory out again until the
        # work queued on ``stream`` so far is done.
        tensor.record_stream(stream)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Device memory, allocated on the current stream (torch's allocator rule)."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    def bind_thread(self) -> None:
        """Make this thread's current device the rank's: a helper thread that
        touches the runtime on device 0 would create a context there (~0.5 GB)."""
        torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    @staticmethod
    def host_region():
        """Code inside runs on the host in production too (a no-op here)."""
        return contextlib.nullcontext()

    @staticmethod
    def watched():
        """Torch calls inside are device work on the current stream (a no-op here; the
        simulator watches them: it must see the library's gradient hooks too)."""
        return contextlib.nullcontext()

    @staticmethod
    def expect_write(tensor: torch.Tensor) -> None:
        """Autograd is about to write ``tensor`` in place on the current stream (its
        AccumulateGrad, which no torch-function mode sees): a no-op here; the
        simulator checks it against the comm stream's work and orders it."""

    @staticmethod
    def nccl():
        from .transport.cupy_nccl import import_nccl

        return import_nccl()

    def communicator_device(self):
        """CuPy's device context for making a communicator (NCCL binds it to the device)."""
        import cupy

        return cupy.cuda.Device(self.device.index)


_cuda: Dict[int, CudaRuntime] = {}
_lock = threading.Lock()


def simulating() -> bool:
    """True when ``HYBRIDCOMM_SIMULATE_GPU=1``: CPU tensors take the GPU path."""
    return env.get("HYBRIDCOMM_SIMULATE_GPU")


def runtime_for(device) -> Optional[object]:
    """The runtime for tensors on ``device`` (a tensor, torch.device or str), or
    None for the host path (CPU tensors, unless simulating a GPU).

    Example::

        >>> runtime_for(torch.device("cpu")) is None      # without HYBRIDCOMM_SIMULATE_GPU
        True
    """
    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with _lock:
            rt = _cuda.get(index)
            if rt is None:
                rt = _cuda[index] = CudaRuntime(torch.device("cuda", index))
        return rt
    if device.type == "cpu" and simulating():
        return _sim_runtime()
    return None


@functools.lru_cache(maxsize=1)
def _sim_runtime():
    from .testing import simgpu

    return simgpu.runtime()
