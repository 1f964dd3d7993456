"""The package's modules import one another with no cycle (module-level imports;
an import inside a function runs later and cannot make initialization circular)."""
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


def _graph():
    mods = _modules()
    graph = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        for node in tree.body:  # module level only
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                prefix, names = _resolve(name, is_package, node)
                targets = [f"{prefix}.{n}" if f"{prefix}.{n}" in mods else prefix for n in names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("hybridcomm"):
                    graph[name].add(t)
    return graph


def _cycle(graph):
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if nxt not in graph:
                continue
            if state.get(nxt) == "open":
                return path + [node, nxt]
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


def test_no_import_cycle():
    graph = _graph()
    assert "hybridcomm.optimizer" in graph and graph["hybridcomm.optimizer"]
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert _cycle({"a": {"b"}, "b": set()}) is None
