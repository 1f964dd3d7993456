"""The package's modules import one another with no cycle.

Every import counts, wherever it is written: at module level, inside a
function or method, under ``try`` or ``if``. A function-level (lazy) import
breaks no initialization today, but it still makes the two modules depend on
each other, and it turns into an import-time failure as soon as either side
moves it to the top; so the graph holds them all. A literal
``__import__("hybridcomm.x")`` / ``importlib.import_module("hybridcomm.x")``
counts as well.
"""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.fast  # in this process alone (tests/tiers.py)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _modules():
    """Dotted name -> source file, for hybridcomm and its kernels."""
    mods = {}
    for path in (ROOT / "hybridcomm").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    for path in (ROOT / "kernels").glob("*.py"):
        name = "hybridcomm.kernels" + ("" if path.stem == "__init__" else f".{path.stem}")
        mods[name] = path
    return mods


def _resolve(module: str, is_package: bool, node: ast.ImportFrom):
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[: len(base) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return prefix, [a.name for a in node.names]


def _dynamic_import(node):
    """The module a literal ``__import__("m")`` / ``import_module("m")`` names."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    func = node.func
    name = (
        func.id
        if isinstance(func, ast.Name)
        else func.attr
        if isinstance(func, ast.Attribute)
        else None
    )
    arg = node.args[0]
    if (
        name in ("__import__", "import_module")
        and isinstance(arg, ast.Constant)
        and isinstance(arg.value, str)
        and not arg.value.startswith(".")
    ):
        return arg.value
    return None


def _edges(name: str, is_package: bool, source: str, mods):
    """The package modules ``name`` imports -> line of the first import that does.

    Walks the whole tree (``ast.walk``), so an import in a function, a method,
    a ``try`` or an ``if`` block counts like one at module level.
    """
    edges = {}
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix, names = _resolve(name, is_package, node)
            targets = [f"{prefix}.{n}" if f"{prefix}.{n}" in mods else prefix for n in names]
        else:
            dynamic = _dynamic_import(node)
            targets = [dynamic] if dynamic else []
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("hybridcomm"):
                edges[t] = min(edges.get(t, node.lineno), node.lineno)
    return edges


def _graph():
    """Module -> {imported module: line number of the import}."""
    mods = _modules()
    return {
        name: _edges(name, path.name == "__init__.py", path.read_text(), mods)
        for name, path in mods.items()
    }


def _cycle(graph):
    """One cycle as [a, b, ..., a] (each module imports the next), or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if nxt not in graph:
                continue
            if state.get(nxt) == "open":
                loop = path + [node]
                return loop[loop.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def _describe(graph, cycle):
    mods = _modules()
    lines = ["import cycle:"]
    for a, b in zip(cycle, cycle[1:]):
        path = mods[a].relative_to(ROOT) if a in mods else a
        lines.append(f"  {a} -> {b}   ({path}:{graph[a][b]})")
    return "\n".join(lines)


def test_no_import_cycle():
    graph = _graph()
    assert "hybridcomm.optimizer" in graph and graph["hybridcomm.optimizer"]
    cycle = _cycle(graph)
    assert cycle is None, _describe(graph, cycle)


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert _cycle({"a": {"b"}, "b": set()}) is None
    # the report is the loop itself, not the path that led into it
    assert _cycle({"x": {"a"}, "a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_the_checker_sees_imports_anywhere():
    mods = {
        "hybridcomm",
        "hybridcomm.pkg",
        "hybridcomm.pkg.mod",
        "hybridcomm.a",
        "hybridcomm.b",
        "hybridcomm.c",
        "hybridcomm.d",
        "hybridcomm.e",
        "hybridcomm.f",
    }
    source = (
        "import os\n"  # 1: not the package
        "def f():\n"
        "    from ..a import thing\n"  # 3: function level, relative
        "class K:\n"
        "    def m(self):\n"
        "        import hybridcomm.b\n"  # 6: method level, absolute
        "try:\n"
        "    from .. import c\n"  # 8: try block
        "except ImportError:\n"
        "    pass\n"
        "if os.environ.get('X'):\n"
        "    from hybridcomm.d import y\n"  # 12: if block
        "def g():\n"
        "    def inner():\n"
        "        return __import__('hybridcomm.e', fromlist=['z'])\n"  # 15: dynamic
        "from . import mod\n"  # 16: sibling submodule
        "from hybridcomm.a import other\n"  # 17: a second import of a
    )
    edges = _edges("hybridcomm.pkg.me", False, source, mods)
    assert edges == {
        "hybridcomm.a": 3,
        "hybridcomm.b": 6,
        "hybridcomm.c": 8,
        "hybridcomm.d": 12,
        "hybridcomm.e": 15,
        "hybridcomm.pkg.mod": 16,
    }
    # and a cycle made only of lazy imports is found, with its lines
    graph = {
        "hybridcomm.a": _edges("hybridcomm.a", False, "def f():\n    from . import b\n", mods),
        "hybridcomm.b": _edges("hybridcomm.b", False, "\n\ndef g():\n    from .a import x\n", mods),
    }
    cycle = _cycle(graph)
    assert cycle == ["hybridcomm.a", "hybridcomm.b", "hybridcomm.a"]
    text = _describe(graph, cycle)
    assert "hybridcomm.a -> hybridcomm.b" in text and ":2)" in text
    assert "hybridcomm.b -> hybridcomm.a" in text and ":4)" in text


# ---- the layer rule (docs/ARCHITECTURE.md) -----------------------------------------------
# Each unit may import itself and the units listed for it, nothing else. Read
# bottom-up: base is the ground floor; the fronts (the modules at the top of
# hybridcomm/) wire sync, comm and plan together; strategies and integrations
# use the fronts; tools and testing may use anything.
BELOW_COMM = {"base", "algorithms", "config", "gpu", "plan", "kernels"}
LAYERS = {
    "base": set(),
    "kernels": set(),
    "algorithms": {"base"},
    "config": {"base", "algorithms"},
    "gpu": {"base", "config"},
    "plan": {"base", "config", "algorithms"},
    "comm": BELOW_COMM,
    "sync": BELOW_COMM | {"comm"},
    "fronts": BELOW_COMM | {"comm", "sync"},
    "strategies": BELOW_COMM | {"comm", "sync", "fronts"},
    "integrations": BELOW_COMM | {"comm", "sync", "fronts"},
    "testing": BELOW_COMM | {"comm", "sync", "fronts"},
    "tools": BELOW_COMM | {"comm", "sync", "fronts", "strategies", "integrations", "testing"},
    # hybridcomm/__init__: the public names, and the simulated runtime handed to gpu/
    # (the runtime must not import the simulator that tests it); nothing imports it
    "package": BELOW_COMM | {"comm", "sync", "fronts", "strategies", "integrations", "testing"},
}
TOP_LEVEL_UNIT = {
    "hybridcomm": "package",
    "hybridcomm.__main__": "tools",
    "hybridcomm._version": "base",
}


def _unit(module: str) -> str:
    """The unit a module belongs to: its subpackage under hybridcomm, or "fronts"
    for the modules at the top (the package itself included)."""
    parts = module.split(".")
    if module in TOP_LEVEL_UNIT:
        return TOP_LEVEL_UNIT[module]
    if len(parts) >= 2 and parts[1] in LAYERS:
        return parts[1]
    return "fronts"


def _violations(graph):
    bad = []
    for module, edges in sorted(graph.items()):
        mine = _unit(module)
        for target, line in sorted(edges.items()):
            theirs = _unit(target)
            if theirs != mine and theirs not in LAYERS[mine]:
                bad.append(f"{module} ({mine}) imports {target} ({theirs}) at line {line}")
    return bad


def test_every_import_follows_the_layer_rule():
    graph = _graph()
    units = {_unit(m) for m in graph}
    assert units == set(LAYERS), (
        f"units without a rule, or rules without a unit: {units ^ set(LAYERS)}"
    )
    bad = _violations(graph)
    assert not bad, "imports against the layer rule (docs/ARCHITECTURE.md):\n  " + "\n  ".join(bad)


def test_the_layer_rule_has_no_cycle_between_units():
    assert _cycle({u: {v: 0 for v in allowed} for u, allowed in LAYERS.items()}) is None


def test_the_layer_checker_catches_a_back_edge():
    graph = {
        "hybridcomm.comm.engine": {"hybridcomm.sync.buckets": 7},
        "hybridcomm.sync.buckets": {"hybridcomm.plan.planner": 3},
        "hybridcomm.gpu.runtime": {"hybridcomm.testing.simgpu": 9},
    }
    assert _violations(graph) == [
        "hybridcomm.comm.engine (comm) imports hybridcomm.sync.buckets (sync) at line 7",
        "hybridcomm.gpu.runtime (gpu) imports hybridcomm.testing.simgpu (testing) at line 9",
    ]


def test_the_package_top_holds_few_modules_and_each_unit_says_its_job():
    top = sorted(p.name for p in (ROOT / "hybridcomm").glob("*.py"))
    assert len(top) <= 8, f"{len(top)} modules at hybridcomm/'s top: {top}"
    for unit in set(LAYERS) - {"fronts", "kernels", "package"}:
        doc = ast.get_docstring(ast.parse((ROOT / "hybridcomm" / unit / "__init__.py").read_text()))
        assert doc and "May import" in doc, (
            f"hybridcomm/{unit}/__init__.py: say its job and what it may import"
        )


@pytest.mark.slow  # (a fresh interpreter: a process, not in the fast tier)
def test_importing_the_package_leaves_dtensor_unimported_and_finds_it_once_it_is():
    """torch.distributed.tensor costs about a second of a process's start; a DTensor
    can exist only once it is imported, and is then recognized."""
    import subprocess
    import sys

    code = (
        "import sys, torch, hybridcomm\n"
        "from hybridcomm.base import dtensor\n"
        "assert 'torch.distributed.tensor' not in sys.modules\n"
        "assert not dtensor.is_dtensor(torch.zeros(2))\n"
        "import torch.distributed.tensor as dt\n"
        "assert dtensor._dtensor() is dt.DTensor\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
