"""The README's training snippet, as written, on 2 CPU ranks (gloo): it runs, and it
trains what one process on the whole batch would.

The snippet is the text between ``<!-- snippet:start -->`` and ``<!-- snippet:end -->``
in README.md. It uses three names a user's script has: ``MyNet``, ``loader`` and
``loss_fn``; the prelude below defines them (a tiny fp64 model, each rank's share of
fixed global batches) and seeds each rank differently, as an unseeded script would
be. The epilogue, after the snippet's loop, gathers every rank's parameters and
compares them with each other and with one process trained on the whole batches
from rank 0's initial weights (fp64: the summation order moves the last bits only).
"""

import json
import os
import re

import pytest

from launch_script import ROOT, run_script

STEPS = 4

PRELUDE = f"""
import torch as _torch
_torch.set_default_dtype(_torch.float64)  # summation order then costs ~1e-16, not 1e-7
_RANK, _WORLD = int(__import__("os").environ["RANK"]), int(__import__("os").environ["WORLD_SIZE"])
_torch.manual_seed(1000 + _RANK)  # every rank initializes its model differently


class MyNet(_torch.nn.Module):
    made = []

    def __init__(self):
        super().__init__()
        self.conv = _torch.nn.Conv2d(2, 3, 3, padding=1)
        self.fc = _torch.nn.Linear(3 * 4 * 4, 5)
        MyNet.made.append({{k: v.detach().clone() for k, v in self.state_dict().items()}})

    def forward(self, x):
        return self.fc(_torch.relu(self.conv(x)).flatten(1))


_g = _torch.Generator().manual_seed(7)
_BATCHES = [(_torch.randn(8, 2, 4, 4, generator=_g), _torch.randn(8, 5, generator=_g))
            for _ in range({STEPS})]
loader = [(x.chunk(_WORLD)[_RANK], y.chunk(_WORLD)[_RANK]) for x, y in _BATCHES]
loss_fn = _torch.nn.functional.mse_loss
"""

EPILOGUE = """
import json as _json
import torch.distributed as _dist

_flat = _torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
_all = [_torch.empty_like(_flat) for _ in range(_WORLD)]
_dist.all_gather(_all, _flat)
_initial = [None] * _WORLD
_dist.all_gather_object(_initial, MyNet.made[0])
_report = {"rank": _RANK, "identical": all(_torch.equal(a, _all[0]) for a in _all)}
if _RANK == 0:  # one process on the whole batches, from rank 0's initial weights
    _ref = MyNet()
    _ref.load_state_dict(_initial[0])
    _cls = next(c for c in type(opt).__mro__  # the wrapped class: torch's own SGD
                if c.__module__.startswith("torch.optim.") and not hasattr(c, "_hc_init"))
    _ref_opt = _cls(_ref.parameters(), **{k: v for k, v in opt.param_groups[0].items()
                                           if k != "params"})
    for _x, _y in _BATCHES:
        _ref_opt.zero_grad()
        loss_fn(_ref(_x), _y).backward()
        _ref_opt.step()
    _want = _torch.cat([p.detach().reshape(-1) for p in _ref.parameters()])
    _report["max_diff_vs_one_process"] = float((_flat - _want).abs().max())
    _report["max_abs"] = float(_want.abs().max())
    _report["moved"] = float((_want - _torch.cat([v.reshape(-1) for k, v in
                                                  _initial[0].items()])).abs().max())
print("SNIPPET-RESULT " + _json.dumps(_report), flush=True)
if hasattr(opt, "close"):
    opt.close()
_dist.destroy_process_group()
"""


def snippet() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    m = re.search(
        r"<!-- snippet:start -->\s*```python\n(.*?)```\s*<!-- snippet:end -->", text, re.S
    )
    assert m, "README.md has no ```python block between <!-- snippet:start/end --> markers"
    return m.group(1)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    code = snippet()
    script = tmp_path_factory.mktemp("readme") / "snippet.py"
    script.write_text(
        PRELUDE
        + "\n# --- README.md's snippet, as written ---\n"
        + code
        + "\n# --- the test's epilogue ---\n"
        + EPILOGUE
    )
    outs = run_script(str(script), [], nprocs=2, timeout=180)
    results = []
    for out in outs:
        line = next((ln for ln in out.splitlines() if ln.startswith("SNIPPET-RESULT ")), None)
        assert line, out[-3000:]
        results.append(json.loads(line.split(" ", 1)[1]))
    return code, outs, results


def test_the_snippet_is_the_one_line_change_and_runs_on_two_cpu_ranks(ran):
    code, outs, results = ran
    assert "hybridcomm.DistributedOptimizer(opt, model=model)" in code
    assert ".cuda()" not in code  # runs on a CPU machine as written
    assert [r["rank"] for r in results] == [0, 1]
    assert "hybridcomm plan:" in outs[0]  # print(opt.plan)


def test_the_snippet_trains_what_one_process_would(ran):
    """Fails without construction's broadcast of rank 0's parameters (the ranks
    start apart) or without reads after the loop seeing the last deferred update."""
    _, _, results = ran
    assert all(r["identical"] for r in results), results  # construction made the ranks agree
    r0 = results[0]
    assert r0["moved"] > 1e-3  # the training did change the parameters
    # fp64: only the summation order differs from one process (about 1e-16 relative)
    assert r0["max_diff_vs_one_process"] <= 1e-12 * max(1.0, r0["max_abs"]), r0
