"""What the three launchers share: the Triton import, the implementation choice, the
launch geometry, the argument checks, the launch itself (Triton's path for a
specialization's first launch, its compiled launcher directly after that), the
multi-tensor launch and its prepared form, and the simulator's launch seam (so
each rule lives in one place)."""

import collections
import itertools
import math
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
_SUPPORTED = frozenset(SUPPORTED_DTYPES)

# Elements (BLOCK) and warps per program on a GPU. Up to _GPU_LARGE_FROM elements:
# 1024 over 4 warps (8 per thread, two 16-byte accesses of fp32 each); from there
# on 4096 over 8 warps (16 per thread): more bytes in flight per SM, which an HBM3
# GPU needs to come near its copy bandwidth (the usual settings for large
# element-wise kernels, Triton's tutorials' and torch inductor's; not tuned here),
# while small launches keep 4 warps and enough programs to spread over the SMs.
_GPU_SMALL = (1024, 4)
_GPU_LARGE = (4096, 8)
_GPU_LARGE_FROM = 1 << 18  # elements: 64 programs of 4096 and more
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
    if impl is None:
        return triton_available and tensor.is_cuda
    if impl not in IMPLS:
        raise ValueError(f"impl must be None, 'triton' or 'torch', got {impl!r}")
    if impl == "torch":
        return False
    if not triton_available:
        raise RuntimeError("impl='triton' but triton is not importable (pip install triton)")
    if not tensor.is_cuda and not interpreting():
        raise RuntimeError(
            "impl='triton' on a CPU tensor needs TRITON_INTERPRET=1, set before "
            "hybridcomm.kernels is imported"
        )
    return True


def geometry(numel: int, on_gpu: bool, block=None):
    """(BLOCK, num_warps) for a launch whose largest piece has ``numel`` elements, on
    a GPU or (``on_gpu`` False) in the interpreter; ``block`` overrides BLOCK (tests).

    >>> geometry(1000, True), geometry(1 << 20, True), geometry(1000, False)[0]
    ((1024, 4), (4096, 8), 1024)
    """
    if block is None:
        if on_gpu:
            return _GPU_LARGE if numel >= _GPU_LARGE_FROM else _GPU_SMALL
        block = max(16, min(_INTERPRET_MAX_BLOCK, triton.next_power_of_2(max(numel, 1))))
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block must be a positive power of two, got {block}")
    return block, (_GPU_LARGE if block >= _GPU_LARGE[0] else _GPU_SMALL)[1]


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


# The checks above name the culprit; a valid call (the common one) costs only the
# cheap tests below, and anything they reject goes through the full checks for
# the message. Every launch pays them, so they are kept to a few attribute reads.
def fine(t) -> bool:
    """True if ``check_tensor`` would pass ``t`` (a tensor of a supported dtype,
    contiguous), tested cheaply."""
    return isinstance(t, torch.Tensor) and t.dtype in _SUPPORTED and t.is_contiguous()


def checked_sizes(tensors: list) -> list:
    """Each tensor's numel, after ``check_tensor(tensors[i], "tensors[i]")`` on each."""
    sizes = [
        t.numel()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.dtype in _SUPPORTED and t.is_contiguous()
    ]
    if len(sizes) != len(tensors):
        for i, t in enumerate(tensors):
            check_tensor(t, f"tensors[{i}]")
    return sizes


def check_devices(tensors: list, flat: torch.Tensor, flat_name: str) -> None:
    """``check_same_device(tensors[i], flat, "tensors[i]", flat_name)`` on each."""
    device = flat.device
    for i, t in enumerate(tensors):
        if t.device != device:
            check_same_device(t, flat, f"tensors[{i}]", flat_name)


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


# -- launching: Triton's path once per specialization, then its launcher directly --
# JITFunction.run costs ~20 us of host time per call on top of the launch itself
# (binding and specializing the arguments, the cache key, launch metadata, hook
# chains). launch() takes that path the first time it sees a specialization and
# keeps the compiled kernel it returns; later calls with the same specialization
# call that kernel's launcher directly, with the arguments JITFunction.run would
# give it when no hook is set. What the launcher takes differs between Triton
# versions (3.0-3.2: the non-constexpr arguments; 3.3 on: all of them), so it is
# read off the compiled kernel: the names in its source's signature.
# HYBRIDCOMM_TRITON_FAST_LAUNCH=0 (read at import) keeps every launch on Triton's
# own path; so does anything that watches launches (a launch hook, e.g. a
# profiler, or a JIT pre-run hook), and the interpreter.
def fast_launch_wanted(environ) -> bool:
    """HYBRIDCOMM_TRITON_FAST_LAUNCH in ``environ``: on unless 0, false, off or no.

    >>> fast_launch_wanted({}), fast_launch_wanted({"HYBRIDCOMM_TRITON_FAST_LAUNCH": "0"})
    (True, False)
    """
    flag = environ.get("HYBRIDCOMM_TRITON_FAST_LAUNCH", "1").strip().lower()
    return flag not in ("0", "false", "off", "no")


FAST_LAUNCH = fast_launch_wanted(os.environ)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton itself calls
_current_device = getattr(torch._C, "_cuda_getDevice", None)
if triton_available:
    from triton.runtime.jit import JITFunction

    try:
        from triton.compiler.compiler import CompiledKernel
    except ImportError:  # moved: no direct launches
        CompiledKernel = None
    # Where Triton keeps its launch hooks: triton.knobs.runtime from 3.4 on (a
    # HookChain, empty when unused, from 3.5), CompiledKernel's class before.
    _HOOK_OWNERS = [
        o
        for o in (getattr(getattr(triton, "knobs", None), "runtime", None), CompiledKernel)
        if o is not None
    ]


def specialization_key(args, constexpr) -> tuple:
    """What Triton compiles a kernel for, read off ``args`` (every parameter in
    order; ``constexpr[i]`` is True where parameter i is a constexpr): constexprs
    by value; a tensor by its dtype and whether its address is a multiple of 16
    bytes; an int by whether it is 1, a multiple of 16, and 32- or 64-bit; a float
    by its type (the kernels annotate theirs, so Triton does not specialize them).
    Calls with equal keys run the same compiled kernel.

    >>> x = torch.zeros(33)
    >>> specialization_key((x, 32, 0.5, 1024), (False, False, False, True))
    ((torch.float32, True), (False, True, 'i32'), <class 'float'>, 1024)
    >>> specialization_key((x[1:], 1, 0.5, 1024), (False, False, False, True))[:2]
    ((torch.float32, False), (True, False, 'i32'))
    """
    return specialize(args, constexpr)[0]


def specialize(args, constexpr):
    """(``specialization_key(args, constexpr)``, ``args`` with each tensor replaced by
    its address), in one pass: a launcher takes an address as it is, where for a
    tensor it calls ``data_ptr()`` and asks the driver whether the GPU can reach
    it (the launchers here have checked their tensors' devices already)."""
    key, raw = [], []
    for a, c in zip(args, constexpr):
        if c:
            key.append(a)
        elif isinstance(a, torch.Tensor):
            p = a.data_ptr()
            key.append((a.dtype, p % 16 == 0))
            a = p
        else:
            key.append(_int_key(a) if type(a) is int else type(a))
        raw.append(a)
    return tuple(key), raw


def _int_key(v: int) -> tuple:
    # Triton folds a 1 into the kernel, marks multiples of 16, and passes i32, i64 or u64.
    return v == 1, v % 16 == 0, "i32" if -(2**31) <= v < 2**31 else "i64" if v < 2**63 else "u64"


class _Compiled:
    """One JIT kernel's direct launches, per (device, num_warps, specialization key):
    a function (grid, stream, args), or False where Triton's path is kept."""

    __slots__ = ("constexpr", "runs")

    def __init__(self, kernel):
        self.constexpr = tuple(p.is_constexpr for p in kernel.params)
        self.runs: dict = {}


# id(kernel) -> (kernel, its _Compiled or None: Triton's path only). By id: a
# JITFunction hashes its source's cache key.
_compiled: dict = {}


def _compiled_for(kernel):
    held = _compiled.get(id(kernel))
    if held is None or held[0] is not kernel:
        usable = (
            FAST_LAUNCH
            and isinstance(kernel, JITFunction)
            and CompiledKernel is not None
            and _raw_stream is not None
            and not interpreting()
        )
        held = _compiled[id(kernel)] = (kernel, _Compiled(kernel) if usable else None)
    return held[1]


def _watched(kernel) -> bool:
    """True while something watches launches; those take Triton's path, which calls it."""
    if getattr(kernel, "pre_run_hooks", None):
        return True
    for owner in _HOOK_OWNERS:
        for hook in (
            getattr(owner, "launch_enter_hook", None),
            getattr(owner, "launch_exit_hook", None),
        ):
            if hook is not None and getattr(hook, "calls", True):  # a HookChain: if not empty
                return True
    return False


def direct_run(kernel, compiled):
    """A function ``(grid, stream, args)`` that launches ``compiled`` (what
    ``kernel[grid](...)`` returned for one specialization) as JITFunction.run does
    when no hook is set: ``compiled.run(grid, 1, 1, stream, function, packed
    metadata, None, None, None, *arguments)``, the arguments being those of
    ``args`` (every parameter, tensors as addresses) that its source's signature
    names, in order (Triton 3.0-3.2: no constexprs; 3.3 on: all). None where
    ``compiled`` does not have that shape."""
    try:
        if not isinstance(compiled, CompiledKernel):  # None (a cache hook), a future (async)
            return None
        takes = compiled.src.signature
        keep = tuple(i for i, p in enumerate(kernel.params) if p.name in takes)
        if len(keep) != len(takes) or any(
            not p.is_constexpr and i not in keep for i, p in enumerate(kernel.params)
        ):
            return None
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        if function is None:
            return None
    except Exception:  # an attribute Triton renamed: its own path then
        return None
    if len(keep) == len(kernel.params):

        def go(grid, stream, args):
            run(grid, 1, 1, stream, function, packed, None, None, None, *args)
    else:

        def go(grid, stream, args):
            run(grid, 1, 1, stream, function, packed, None, None, None, *[args[i] for i in keep])

    return go


def launch_key(kernel, args):
    """``specialize(args, ...)`` for ``kernel``, to hand to :func:`launch` when the
    same arguments launch again (None where launches take Triton's path)."""
    state = _compiled_for(kernel)
    return None if state is None else specialize(args, state.constexpr)


def launch(kernel, grid: int, num_warps: int, device: int, args: tuple, key=None) -> None:
    """``kernel[(grid,)](*args, num_warps=num_warps)`` on CUDA device ``device`` (an
    index; -1 for CPU tensors under the interpreter), whichever device is current.
    ``args`` is every parameter of the kernel, in order, constexprs included;
    ``key`` their :func:`launch_key`, where the caller kept it."""
    if device >= 0 and _current_device() != device:
        with torch.cuda.device(device):
            _launch(kernel, grid, num_warps, device, args, key)
    else:
        _launch(kernel, grid, num_warps, device, args, key)


def _launch(kernel, grid, num_warps, device, args, key):
    state = _compiled_for(kernel) if device >= 0 else None
    if state is None or _watched(kernel):
        kernel[(grid,)](*args, num_warps=num_warps)
        return
    spec, raw = specialize(args, state.constexpr) if key is None else key
    key = (device, num_warps, spec)
    run = state.runs.get(key)
    if run:
        try:
            run(grid, _raw_stream(device), raw)
            return
        except Exception:  # the launcher refused before launching: Triton's path from now on
            state.runs[key] = run = False
    compiled = kernel[(grid,)](*args, num_warps=num_warps)
    if run is None:
        state.runs[key] = direct_run(kernel, compiled) or False


# -- one launch for many tensors ---------------------------------------------------
if triton_available:
    _TL_DTYPES = {
        torch.float32: tl.float32,
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
        torch.float64: tl.float64,
    }
# Per (device, stream, dtype, block, layout): the device copy of a table, its
# row count and its rows' alignment. The layout is each tensor's (address, numel,
# offset), so a launch of a seen bucket costs a per-tensor key and one lookup,
# never per-block work (a 100 MiB bucket at block 1024 is 25,600 rows); a plan
# (table_plan) costs not even that. Least recently used first out, so a model
# with many buckets keeps every one's table (clearing the whole cache at a limit
# would rebuild them all each step).
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
    """(table, rows, alignment): the launch table of ``members`` ((tensor, flat
    offset) pairs, one dtype) as int64 on ``device``, built by ``block_rows`` only
    the first time this layout is seen on this stream, and its ``row_alignment``.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (
        device,
        stream,
        members[0][0].dtype,
        block,
        tuple([(t.data_ptr(), t.numel(), offset) for t, offset in members]),
    )
    hit = _tables.get(key)
    if hit is not None:
        _tables.move_to_end(key)
        _table_stats["reused"] += 1
        return hit
    rows = block_rows(members, block)
    _tables[key] = hit = (device_table(rows, device), len(rows), row_alignment(members, block))
    if len(_tables) > _TABLES_MAX:
        _tables.popitem(last=False)
    _table_stats["built"] += 1
    return hit


def device_table(rows: list, device: torch.device) -> torch.Tensor:
    """``rows`` as one int64 tensor on ``device``. On CUDA they go through pinned
    memory with a non-blocking copy on the current stream (the pinned allocator
    keeps the staging buffer until the copy is done), so building a table never
    blocks the host; the table is then for launches on that stream."""
    if device.type == "cuda":
        host = torch.tensor(rows, dtype=torch.int64, pin_memory=True).view(-1)
        return host.to(device, non_blocking=True)
    return torch.tensor(rows, dtype=torch.int64).view(-1)


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


def row_alignment(members, block: int) -> int:
    """What every table row of ``members`` has in common: the gcd of the rows' flat
    offsets (elements), or 0 if some row's address is not a multiple of 16 bytes.

    >>> t = torch.zeros(64)
    >>> row_alignment([(t, 0), (t, 24)], 16), row_alignment([(t[1:], 0)], 16)
    (8, 0)
    """
    if any([t.data_ptr() % 16 or block * t.element_size() % 16 for t, _ in members]):
        return 0
    return math.gcd(block, *[offset for _, offset in members])


def flat_vec(alignment: int, flat: torch.Tensor) -> int:
    """The table kernels' ALIGN: how many of ``flat``'s elements make 16 bytes if
    every row's tensor address is a multiple of 16 bytes and its flat offset a
    multiple of that many elements (the kernel then tells the compiler so, and a
    full block moves 16 bytes per access on both sides), else 0.

    >>> flat_vec(8, torch.zeros(1)), flat_vec(8, torch.zeros(1, dtype=torch.bfloat16))
    (4, 8)
    >>> flat_vec(2, torch.zeros(1)), flat_vec(0, torch.zeros(1))
    (0, 0)
    """
    vec = 16 // flat.element_size()
    return vec if alignment and alignment % vec == 0 else 0


def flat_offsets(tensors, offsets, flat_numel: int, flat_name: str, sizes=None):
    """Where each tensor starts in the flat buffer: consecutive when ``offsets`` is
    None (the buffer then holds exactly the tensors), else the given element
    offsets, checked: in order, not overlapping, inside the buffer (the gaps,
    e.g. a bucket's alignment padding, are left untouched). ``sizes``: the
    tensors' numels, where the caller has them."""
    if sizes is None:
        sizes = [t.numel() for t in tensors]
    if offsets is None:
        total = sum(sizes)
        if flat_numel != total:
            raise ValueError(f"{flat_name} has {flat_numel} elements but the tensors hold {total}")
        return list(itertools.accumulate(sizes, initial=0))[:-1]
    offsets = [int(o) for o in offsets]
    if len(offsets) != len(sizes):
        raise ValueError(f"{len(offsets)} offsets for {len(sizes)} tensors")
    end = 0
    for i, (o, n) in enumerate(zip(offsets, sizes)):
        if o < end:
            raise ValueError(
                f"offsets[{i}]={o} overlaps the tensor before it (which ends at "
                f"{end}); offsets must be increasing"
            )
        end = o + n
    if end > flat_numel:
        raise ValueError(f"the tensors end at element {end} but {flat_name} has {flat_numel}")
    return offsets


def dtype_groups(tensors, offsets) -> dict:
    """dtype -> [(tensor, offset)] of the non-empty tensors: one launch each."""
    groups: dict = {}
    for t, offset in zip(tensors, offsets):
        if t.numel():
            groups.setdefault(t.dtype, []).append((t, offset))
    return groups


def table_args(table, flat, scale, dtype, alignment, block) -> tuple:
    """The table kernels' arguments, in order: (table_ptr, flat, scale, TENSOR,
    HAS_SCALE, ALIGN, BLOCK)."""
    return (
        table,
        flat,
        1.0 if scale is None else scale,
        _TL_DTYPES[dtype],
        scale is not None,
        flat_vec(alignment, flat),
        block,
    )


def launch_table(kernel, flat: torch.Tensor, tensors, offsets, scale, block) -> None:
    """Move every tensor to or from its slice of ``flat`` (starting at its offset)
    with ONE launch per dtype (one in practice: a bucket holds one dtype). The
    kernel reads each block's address, size and offset from a device table
    (``block_rows``, built once per layout): one program per block."""
    groups = dtype_groups(tensors, offsets)
    if groups:
        device, on_gpu = flat.get_device(), flat.is_cuda
        for dtype, members in groups.items():
            blk, warps = geometry(max([t.numel() for t, _ in members]), on_gpu, block)
            table, programs, alignment = tensor_table(members, blk, flat.device)
            launch(
                kernel,
                programs,
                warps,
                device,
                table_args(table, flat, scale, dtype, alignment, blk),
            )


def copy_plan(kernel, flat: torch.Tensor, tensors, offsets, scale, block, impl, elsewhere, result):
    """The function ``pack_plan`` / ``unpack_plan`` return: on a Triton device the
    prepared table launch (:func:`table_plan`), else ``elsewhere()`` (the simulated
    GPU or the torch reference) every call; either returns ``result``."""
    if use_triton(flat, impl):
        launch = table_plan(kernel, flat, tensors, offsets, scale, block)

        def copied():
            launch()
            return result
    else:

        def copied():
            elsewhere()
            return result

    return copied


def table_plan(kernel, flat: torch.Tensor, tensors, offsets, scale, block):
    """``launch_table(kernel, flat, tensors, offsets, scale, block)`` prepared: the
    groups, rows and geometry worked out once; returns a function that launches
    them again with no per-tensor work. The table of each stream it runs on is
    built there on its first run (as ``tensor_table`` does). The tensors' and
    ``flat``'s memory must stay where it was."""
    device, on_gpu = flat.get_device(), flat.is_cuda
    flat = flat.detach()
    groups = []
    for dtype, members in dtype_groups(tensors, offsets).items():
        blk, warps = geometry(max([t.numel() for t, _ in members]), on_gpu, block)
        groups.append((block_rows(members, blk), warps, dtype, row_alignment(members, blk), blk))
    per_stream: dict = {}  # stream -> [(programs, warps, args, key)]

    def run() -> None:
        stream = (
            (
                _raw_stream(device)
                if _raw_stream is not None
                else torch.cuda.current_stream(device).cuda_stream
            )
            if on_gpu
            else None
        )
        ready = per_stream.get(stream)
        if ready is None:
            ready = per_stream[stream] = []
            for rows, warps, dtype, alignment, blk in groups:
                args = table_args(
                    device_table(rows, flat.device), flat, scale, dtype, alignment, blk
                )
                ready.append((len(rows), warps, args, launch_key(kernel, args)))
                _table_stats["built"] += 1
        for programs, warps, args, key in ready:
            launch(kernel, programs, warps, device, args, key)

    # The memory the rows point at lives as long as the plan: a tensor given new
    # memory (p.data = ...) leaves the plan writing into its old memory, never
    # into memory freed and handed to someone else.
    run.memory = [t.detach() for t in tensors]
    return run
