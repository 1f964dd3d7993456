"""The device runtime: the one layer under the GPU path that is swapped for a simulator.

Everything the stream-ordered code needs from CUDA (streams, events, device
memory, ``record_stream``, binding a thread to the device, the NCCL module)
goes through a runtime: :class:`CudaRuntime` (``torch.cuda``, ``cupy.cuda.nccl``)
or ``hybridcomm.testing.simgpu.SimRuntime`` (``HYBRIDCOMM_SIMULATE_GPU=1``).
:func:`runtime_for` picks one for a device, or None for the host path. Code
above this layer never calls ``torch.cuda``, so the simulator runs exactly the
production code.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Dict, Optional

import torch

from ..config import env
from ..base.errors import HybridCommError


class CudaRuntime:
    """``torch.cuda`` streams/events/memory for one device, and CuPy's NCCL.

    Usage (on a GPU)::

        rt = CudaRuntime(torch.device("cuda", 0))
        s = rt.new_stream(priority=-1)
        with rt.use(s):
            scratch = rt.empty(1024, torch.float32)   # allocated on s
    """

    simulated = False
    reports_writes = False  # expect_write is a no-op: the gradient hooks may stay off

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
        return import_nccl()

    def stream_of(self, handle: int):
        """The stream behind a raw handle (what NCCL-style calls are given)."""
        return torch.cuda.ExternalStream(handle, device=self.device)

    def at(self, ptr: int, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` of device memory at ``ptr`` as a uint8 tensor (no copy)."""
        return torch.as_tensor(_DeviceBytes(ptr, nbytes), device=self.device)

    @staticmethod
    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        """A device-to-device copy queued on the current stream."""
        dst.copy_(src, non_blocking=True)

    def ipc(self):
        """Memory and events shared with other processes on this device."""
        from .ipc import CudaIpc

        return CudaIpc(self.device)

    def communicator_device(self):
        """CuPy's device context for making a communicator (NCCL binds it to the device)."""
        import cupy

        return cupy.cuda.Device(self.device.index)


class _DeviceBytes:
    """Raw device memory, seen by torch through the CUDA array interface."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def import_nccl():  # needs the real CuPy: tests/test_cupy_nccl_api.py, tests/gpu
    """``cupy.cuda.nccl`` if CuPy imports and finds libnccl, else HybridCommError saying why."""
    try:
        from cupy.cuda import nccl
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        raise HybridCommError(
            f"the 'cupy' transport needs CuPy with NCCL: `import cupy.cuda.nccl` failed ({e}); "
            "install the extra matching your torch's CUDA: pip install 'hybridcomm[cuda12]' "
            "or 'hybridcomm[cuda13]'"
        ) from e
    if not getattr(nccl, "available", False):
        raise HybridCommError(
            "the 'cupy' transport needs NCCL: CuPy imports but did not find libnccl; "
            "pip install nvidia-nccl-cu12 (or -cu13, matching cupy-cuda12x/13x)"
        )
    return nccl


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


_simulator: Optional[Callable[[], object]] = None


def set_simulator(make: Callable[[], object]) -> None:
    """Where the simulated runtime comes from (``hybridcomm/__init__`` hands it
    hybridcomm.testing.simgpu's, made on first use): the runtime does not import
    the simulator that tests it."""
    global _simulator
    _simulator = make
    _sim_runtime.cache_clear()


@functools.lru_cache(maxsize=1)
def _sim_runtime():
    if _simulator is None:
        raise HybridCommError(
            "HYBRIDCOMM_SIMULATE_GPU=1 but no simulated runtime is set (import hybridcomm first)"
        )
    return _simulator()
