"""What the three launchers share: the Triton import, the implementation choice, the
block size, the argument checks, the multi-tensor launch and the simulator's
launch seam (so each rule lives in one place)."""
import collections
import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl

    triton_available = True
except ImportError:  # CPU-only installs: the torch references still work
    triton = None
    tl = None
    triton_available = False

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# fp64 values bound for bf16 are rounded through fp32 in every kernel (the
# interpreter's direct fp64 -> bf16 cast is wrong): at most one bf16 ulp from
# rounding directly, and only for an fp64 model reduced over a bf16 wire.

IMPLS = (None, "triton", "torch")  # automatic, the Triton kernel, the torch reference
_GPU_BLOCK = 1024
# The interpreter costs ~1 ms per program instance whatever its size, so there
# a few big programs beat many small ones.
_INTERPRET_MAX_BLOCK = 65536


def interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def use_triton(tensor: torch.Tensor, impl) -> bool:
    """Decide whether ``tensor`` is handled by a Triton kernel.

    ``impl=None`` is automatic: Triton for CUDA tensors when it imports, the
    torch reference otherwise. ``"triton"`` forces the kernel (on CPU tensors
    that needs the interpreter), ``"torch"`` forces the reference.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be None, 'triton' or 'torch', got {impl!r}")
    if impl == "torch":
        return False
    if impl is None:
        return triton_available and tensor.is_cuda
    if not triton_available:
        raise RuntimeError("impl='triton' but triton is not importable (pip install triton)")
    if not tensor.is_cuda and not interpreting():
        raise RuntimeError(
            "impl='triton' on a CPU tensor needs TRITON_INTERPRET=1, set before "
            "hybridcomm.kernels is imported"
        )
    return True


def block_size(numel: int) -> int:
    """Elements per program instance for a launch over ``numel`` elements."""
    if interpreting():
        return max(16, min(_INTERPRET_MAX_BLOCK, triton.next_power_of_2(max(numel, 1))))
    return _GPU_BLOCK


def launch_geometry(numel: int, block):
    """(grid, BLOCK) for ``numel`` elements; ``block`` overrides the size (tests)."""
    block = block_size(numel) if block is None else block
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block must be a positive power of two, got {block}")
    return (triton.cdiv(numel, block),), block


def device_guard(tensor: torch.Tensor):
    """Launch on ``tensor``'s GPU, not on whichever one happens to be current (a
    no-op when it is current: no device switch per launch in the common case)."""
    if tensor.is_cuda and tensor.device.index != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def check_tensor(t, name: str) -> None:
    """Type, dtype and contiguity of one argument (the kernels ignore strides)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} has dtype {t.dtype}; supported dtypes are {supported}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
            "pass t.contiguous()"
        )


def check_dtype(dtype, name: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} is {dtype}; supported dtypes are {supported}")


def check_same_device(t: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_scale(scale):
    """None, or the scale as a Python float (a 0-dim CUDA tensor would sync). The
    kernels declare it ``tl.float64``: a plain float parameter would be compiled
    as fp32 (``.param .f32``), rounding 1/P for fp64 data on a GPU."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        raise TypeError("scale must be a Python number, not a tensor")
    return float(scale)


# -- the simulated GPU's seam ----------------------------------------------------
# hybridcomm.testing.simgpu registers a hook here: a launch on CPU tensors then
# enqueues the op's reference on the current simulated stream (declaring what it
# reads and writes), exactly where a CUDA launch would enqueue the kernel.
_launch_hook = None


def set_launch_hook(hook) -> None:
    global _launch_hook
    _launch_hook = hook


def simulated(name: str, tensor: torch.Tensor, impl, ref, args: tuple, *, reads, writes) -> bool:
    """True if the simulator took this launch (it then runs ``ref(*args)`` later)."""
    if _launch_hook is None or impl is not None or tensor.is_cuda:
        return False
    return _launch_hook(name, ref, args, {}, list(reads), list(writes))


# -- one launch for many tensors ---------------------------------------------------
if triton_available:
    _TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
                  torch.bfloat16: tl.bfloat16, torch.float64: tl.float64}
# Per (device, stream, dtype, block, layout): the device copy of a table and its
# row count. The layout is each tensor's (address, numel, offset), so a launch
# of a seen bucket costs a per-tensor key and one lookup, never per-block work
# (a 100 MiB bucket at block 1024 is 25,600 rows). Least recently used first
# out, so a model with many buckets keeps every one's table (clearing the
# whole cache at a limit would rebuild them all each step).
_tables: "collections.OrderedDict" = collections.OrderedDict()
_TABLES_MAX = 4096
_table_stats = {"built": 0, "reused": 0}


def table_stats() -> dict:
    """How many launch tables were built and how many reused (since start).

    >>> sorted(table_stats())
    ['built', 'reused']
    """
    return dict(_table_stats)


def tensor_table(members, block: int, device: torch.device):
    """(table, rows): the launch table of ``members`` ((tensor, flat offset) pairs,
    one dtype) as int64 on ``device``, built by ``block_rows`` only the first time
    this layout is seen on this stream.

    On CUDA the rows go through pinned memory with a non-blocking copy on the
    current stream (the pinned allocator keeps the staging buffer until the
    copy is done), so building a table never blocks the host.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (device, stream, members[0][0].dtype, block,
           tuple([(t.data_ptr(), t.numel(), offset) for t, offset in members]))
    hit = _tables.get(key)
    if hit is not None:
        _tables.move_to_end(key)
        _table_stats["reused"] += 1
        return hit
    rows = block_rows(members, block)
    if device.type == "cuda":
        host = torch.tensor(rows, dtype=torch.int64, pin_memory=True).view(-1)
        table = host.to(device, non_blocking=True)
    else:
        table = torch.tensor(rows, dtype=torch.int64).view(-1)
    _tables[key] = hit = (table, len(rows))
    if len(_tables) > _TABLES_MAX:
        _tables.popitem(last=False)
    _table_stats["built"] += 1
    return hit


def block_rows(members, block: int) -> list:
    """One table row per block of BLOCK elements: (its address, its element count,
    its offset in the flat buffer). A launch then runs exactly one program per
    block, none empty: a bucket of one large and many small tensors launches
    sum(ceil(numel / BLOCK)) programs, not (largest's blocks x tensors).

    >>> t = torch.zeros(5)
    >>> [(a - t.data_ptr(), n, o) for a, n, o in block_rows([(t, 10)], 4)]
    [(0, 4, 10), (16, 1, 14)]
    """
    rows = []
    for t, offset in members:
        addr, size, n = t.data_ptr(), t.element_size(), t.numel()
        for start in range(0, n, block):
            rows.append((addr + start * size, min(block, n - start), offset + start))
    return rows


def flat_offsets(tensors, offsets, flat_numel: int, flat_name: str):
    """Where each tensor starts in the flat buffer: consecutive when ``offsets`` is
    None (the buffer then holds exactly the tensors), else the given element
    offsets, checked: in order, not overlapping, inside the buffer (the gaps,
    e.g. a bucket's alignment padding, are left untouched)."""
    sizes = [t.numel() for t in tensors]
    if offsets is None:
        if flat_numel != sum(sizes):
            raise ValueError(f"{flat_name} has {flat_numel} elements but the tensors hold "
                             f"{sum(sizes)}")
        out, at = [], 0
        for n in sizes:
            out.append(at)
            at += n
        return out
    offsets = [int(o) for o in offsets]
    if len(offsets) != len(sizes):
        raise ValueError(f"{len(offsets)} offsets for {len(sizes)} tensors")
    end = 0
    for i, (o, n) in enumerate(zip(offsets, sizes)):
        if o < end:
            raise ValueError(f"offsets[{i}]={o} overlaps the tensor before it (which ends at "
                             f"{end}); offsets must be increasing")
        end = o + n
    if end > flat_numel:
        raise ValueError(f"the tensors end at element {end} but {flat_name} has {flat_numel}")
    return offsets


def launch_table(kernel, flat: torch.Tensor, tensors, offsets, scale, block) -> None:
    """Move every tensor to or from its slice of ``flat`` (starting at its offset)
    with ONE launch per dtype (one in practice: a bucket holds one dtype). The
    kernel reads each block's address, size and offset from a device table
    (``block_rows``, built once per layout): one program per block."""
    groups: dict = {}
    for t, offset in zip(tensors, offsets):
        if t.numel():
            groups.setdefault(t.dtype, []).append((t, offset))
    with device_guard(flat):
        for dtype, members in groups.items():
            blk = block_size(max(t.numel() for t, _ in members)) if block is None else block
            if blk <= 0 or blk & (blk - 1):
                raise ValueError(f"block must be a positive power of two, got {blk}")
            table, programs = tensor_table(members, blk, flat.device)
            kernel[(programs,)](table, flat, 1.0 if scale is None else scale,
                                 TENSOR=_TL_DTYPES[dtype], HAS_SCALE=scale is not None, BLOCK=blk)
