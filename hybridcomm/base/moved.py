"""The module paths of the flat layout (before docs/ARCHITECTURE.md's) keep importing.

``import hybridcomm.planner`` or ``from hybridcomm.ps import split_world`` find
the module where it lives now (``hybridcomm.plan.planner``,
``hybridcomm.comm.servers``): the same module object, under both names. The
library's own code imports the new paths only (tests/test_package_structure.py).

Example::

    >>> import hybridcomm.planner, hybridcomm.plan.planner
    >>> hybridcomm.planner is hybridcomm.plan.planner
    True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# old path under hybridcomm -> new path under hybridcomm (a prefix: subpackages follow)
MOVED = {
    "errors": "base.errors",
    "units": "base.units",
    "tensor_access": "base.tensor_access",
    "dtensor": "base.dtensor",
    "timeline": "base.timeline",
    "trace": "base.trace",
    "env": "config.env",
    "logs": "config.logs",
    "runtime": "gpu.runtime",
    "clock": "gpu.clock",
    "cuda_ext": "gpu.cuda_ext",
    "cost_model": "plan.cost_model",
    "auto_model": "plan.auto_model",
    "planner": "plan.planner",
    "verdict": "plan.verdict",
    "compression": "comm.compression",
    "backend": "comm.backend",
    "control": "comm.control",
    "transport": "comm.transport",
    "issuer": "comm.channel",
    "executor": "comm.executor",
    "channel": "comm.channel",
    "engine": "comm.engine",
    "calibration": "comm.calibration",
    "ps": "comm.servers",
    "sparse": "comm.sparse",
    "registry": "sync.registry",
    "buckets": "sync.buckets",
    "pending": "sync.pending",
    "measure": "sync.measure",
    "stall": "sync.stall",
    "synchronizer": "sync.synchronizer",
    "bench": "tools.bench",
    "launch": "tools.launch",
    "netns": "tools.netns",
    "strategies.downpour_pipeline": "strategies.downpour.pipeline",
    "strategies.ps_link": "strategies.downpour.link",
    "strategies.ps_server": "strategies.downpour.server",
    "strategies.ps_wire": "strategies.downpour.wire",
}


def new_path(fullname: str):
    """``hybridcomm.<old>[.<sub>]`` -> its module's path now, or None if it did not move."""
    if not fullname.startswith("hybridcomm."):
        return None
    rest = fullname[len("hybridcomm.") :]
    for old in sorted(MOVED, key=len, reverse=True):
        if rest == old or rest.startswith(old + "."):
            return "hybridcomm." + MOVED[old] + rest[len(old) :]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.spec = module.__spec__  # importlib overwrites it with the alias's: put it back
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec

    # ``python -m hybridcomm.<old path>`` (runpy) asks the loader for these: it says
    # where the module moved and runs it there, as ``python -m <new path>`` would
    # (its relative imports resolve from the new package, not the old name's)
    def is_package(self, fullname) -> bool:
        spec = importlib.util.find_spec(self.target)
        return spec is not None and spec.submodule_search_locations is not None

    def get_code(self, fullname):
        old, new = (name.removesuffix(".__main__") for name in (fullname, self.target))
        source = (
            "import runpy, sys\n"
            f"print('hybridcomm: {old} is now {new}', file=sys.stderr)\n"
            f"runpy.run_module({self.target!r}, run_name='__main__', alter_sys=True)\n"
        )
        return compile(source, f"<{old}: moved to {new}>", "exec")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = new_path(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())  # before the path finder: it would load a second copy
