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
        base = base[:len(base) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return prefix, [a.name for a in node.names]


def _dynamic_import(node):
    """The module a literal ``__import__("m")`` / ``import_module("m")`` names."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    arg = node.args[0]
    if name in ("__import__", "import_module") and isinstance(arg, ast.Constant) \
            and isinstance(arg.value, str) and not arg.value.startswith("."):
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
    return {name: _edges(name, path.name == "__init__.py", path.read_text(), mods)
            for name, path in mods.items()}


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
                return loop[loop.index(nxt):] + [nxt]
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
    mods = {"hybridcomm", "hybridcomm.pkg", "hybridcomm.pkg.mod", "hybridcomm.a",
            "hybridcomm.b", "hybridcomm.c", "hybridcomm.d", "hybridcomm.e", "hybridcomm.f"}
    source = (
        "import os\n"                                   # 1: not the package
        "def f():\n"
        "    from ..a import thing\n"                   # 3: function level, relative
        "class K:\n"
        "    def m(self):\n"
        "        import hybridcomm.b\n"                 # 6: method level, absolute
        "try:\n"
        "    from .. import c\n"                        # 8: try block
        "except ImportError:\n"
        "    pass\n"
        "if os.environ.get('X'):\n"
        "    from hybridcomm.d import y\n"              # 12: if block
        "def g():\n"
        "    def inner():\n"
        "        return __import__('hybridcomm.e', fromlist=['z'])\n"  # 15: dynamic
        "from . import mod\n"                           # 16: sibling submodule
        "from hybridcomm.a import other\n"              # 17: a second import of a
    )
    edges = _edges("hybridcomm.pkg.me", False, source, mods)
    assert edges == {"hybridcomm.a": 3, "hybridcomm.b": 6, "hybridcomm.c": 8,
                     "hybridcomm.d": 12, "hybridcomm.e": 15, "hybridcomm.pkg.mod": 16}
    # and a cycle made only of lazy imports is found, with its lines
    graph = {"hybridcomm.a": _edges("hybridcomm.a", False, "def f():\n    from . import b\n", mods),
             "hybridcomm.b": _edges("hybridcomm.b", False, "\n\ndef g():\n    from .a import x\n", mods)}
    cycle = _cycle(graph)
    assert cycle == ["hybridcomm.a", "hybridcomm.b", "hybridcomm.a"]
    text = _describe(graph, cycle)
    assert "hybridcomm.a -> hybridcomm.b" in text and ":2)" in text
    assert "hybridcomm.b -> hybridcomm.a" in text and ":4)" in text
