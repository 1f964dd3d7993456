"""What the kernel tests share: awkward sizes, dtypes, the ulp check, and the
launch a launcher makes, compiled for a GPU.

bf16 outputs may be 1 bf16 ulp off under the interpreter (its casts to bf16
truncate where torch and the GPU round to nearest even), and from fp64 sources
anywhere (the kernels round fp64 -> bf16 through fp32). Everything else must
match the reference bitwise.

The interpreter passes scalar arguments as Python floats (fp64), where a GPU
compiles them to the parameter type Triton's binder picks (fp32 for a plain
float). ``launched_ptx`` runs that binder on the arguments a launcher really
passes and compiles for sm_90 on CPU, so a test can read the GPU's parameter
types and arithmetic.
"""

import importlib
import os

import pytest
import torch

# The two large sizes are left out of the fast tier (tests/tiers.py: ``slow``): the
# interpreter runs each program instance in Python, ~1 ms each.
SIZES = [0, 1, 2, 7, 127] + [pytest.param(n, marks=pytest.mark.slow) for n in (1000, 4099)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# None: the launcher's block (one program per tensor in the interpreter);
# 128: many programs plus a masked tail (4099 = 32 * 128 + 3).
BLOCKS = [None, 128]
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def allowed_ulps(dtype, src=None):
    """Allowed distance from the reference, in ulps of ``dtype`` (see module doc).
    fp64 -> bf16 rounds through fp32 in the kernels: one ulp, on a GPU too."""
    if dtype == torch.bfloat16 and (INTERPRETED or src == torch.float64):
        return 1
    return 0


def _ulp(x, dtype):
    # ulp(x) = eps * 2**floor(log2|x|); frexp gives |x| = m * 2**exp, m in [0.5, 1).
    _, exp = torch.frexp(x)
    return torch.finfo(dtype).eps * torch.ldexp(torch.ones_like(x), exp - 1)


def assert_within_ulps(actual, expected, ulps):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if ulps == 0:
        assert torch.equal(actual, expected), f"{(actual != expected).sum()} elements differ"
        return
    a, e = actual.float(), expected.float()
    # The smaller ulp of the two, so a step across a power of two counts as one.
    ulp = torch.minimum(_ulp(a, expected.dtype), _ulp(e, expected.dtype))
    bad = (a - e).abs() > ulps * ulp
    assert not bad.any(), (
        f"{bad.sum()} elements more than {ulps} ulp off, "
        f"e.g. {actual[bad][:4]} vs {expected[bad][:4]}"
    )


class _Captured:
    """Stands in for a Triton kernel: records the arguments of ``kernel[grid](...)``."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def launched_ptx(monkeypatch, op: str, launch):
    """(signature, ptx, scale's parameter index) of the one launch ``launch()`` makes
    of ``hybridcomm.kernels.<op>``'s kernel, as Triton would compile it for sm_90."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.jit import JITFunction, create_function_from_signature
    except ImportError as e:  # a Triton without the NVIDIA backend
        pytest.skip(f"cannot compile for CUDA here: {e}")
    module = importlib.import_module(f"hybridcomm.kernels.{op}")
    kernel = getattr(module, f"_{op}_kernel")
    captured = _Captured()
    monkeypatch.setattr(module, f"_{op}_kernel", captured)
    launch()
    assert len(captured.calls) == 1
    args, kwargs = captured.calls[0]
    fn = JITFunction(getattr(kernel, "fn", kernel))  # the interpreter wraps the Python function
    for name, helper in list(vars(module).items()):  # the @triton.jit helpers it calls, likewise
        if name.startswith("_") and type(helper).__name__ == "InterpretedFunction":
            monkeypatch.setattr(module, name, JITFunction(helper.fn))
    target = GPUTarget("cuda", 90, 32)
    binder = create_function_from_signature(fn.signature, fn.params, CUDABackend(target))
    bound, spec, _ = binder(*args, **kwargs)
    signature = {p.name: s[0] for p, s in zip(fn.params, spec)}
    constexprs = {(i,): bound[p.name] for i, p in enumerate(fn.params) if spec[i][0] == "constexpr"}
    compiled = triton.compile(triton.compiler.ASTSource(fn, signature, constexprs), target=target)
    runtime_params = [p.name for p, s in zip(fn.params, spec) if s[0] != "constexpr"]
    return signature, compiled.asm["ptx"], runtime_params.index("scale")


def assert_scale_is_fp64(signature, ptx: str, index: int, op: str, dtype) -> None:
    """The launched ``op`` kernel takes its scale as an fp64 parameter and multiplies
    fp64 data in fp64, other data by the scale's fp32 rounding in fp32."""
    import re

    assert signature["scale"] == "fp64"
    assert re.search(rf"\.param \.f64 _{op}_kernel_param_{index}\b", ptx)
    mul64 = re.search(r"\bmul(\.rn)?\.f64\b", ptx)
    if dtype == torch.float64:
        assert mul64 and "cvt.rn.f32.f64" not in ptx
    else:
        assert "cvt.rn.f32.f64" in ptx and re.search(r"\bmul(\.rn)?\.f32\b", ptx)
        assert not mul64
