"""What the kernel tests share: awkward sizes, dtypes, and the ulp check.

bf16 outputs may be 1 bf16 ulp off under the interpreter (its casts to bf16
truncate where torch and the GPU round to nearest even), and from fp64 sources
anywhere (the kernels round fp64 -> bf16 through fp32). Everything else must
match the reference bitwise.
"""
import os

import torch

SIZES = [0, 1, 2, 7, 127, 1000, 4099]
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

