"""docs/API.md against the code: every public name it documents exists, and every
signature it writes has the parameters the code has.

What is read, without hand-kept lists:

* each ```python block: a statement ``name(params)`` (``-> ...``, an assignment
  before it and comments ignored) whose callee is a hybridcomm name (``hybridcomm.``
  dotted, a name the block imported from hybridcomm, or a bare name of the
  package, e.g. ``DistributedOptimizer``), and any such call or name nested in
  another call's arguments;
* backticked ``hybridcomm.x.y`` names anywhere (they must exist), and backticked
  calls ``name(params)`` in a table row or paragraph that starts with a
  backticked ``hybridcomm.x`` (resolved in it; ``.name(...)``: a method of the
  row's last class).

A written signature whose parameters are names or ``name=literal`` is compared
with ``inspect.signature``: the same names, kinds (``*``, ``*args``,
``**kwargs``, whose own names are free) and defaults, in order; one that ends in
``...`` lists a prefix. Anything else (``register(ddp, HybridState())``,
``split_world(num_servers=K)``) is a usage: it must bind to the signature.
"""

import ast
import importlib
import inspect
import os
import re
from dataclasses import dataclass, field
from typing import List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API = os.path.join(ROOT, "docs", "API.md")
TOKEN = re.compile(r"`([^`\n]+)`")
CALL = re.compile(r"^(\.?[A-Za-z_][\w.]*)\((.*)\)$", re.S)
DOTTED = re.compile(r"^hybridcomm(\.[A-Za-z_]\w*)+$")


@dataclass
class Check:
    where: str  # for the test id and messages
    target: str  # dotted path, or ".method" / "name" relative to context
    args: Optional[str]  # the written parameters (None: a name, existence only)
    context: List[str] = field(default_factory=list)  # where relative names are looked up
    owner: Optional[str] = None  # ".method": the class it belongs to
    usage: bool = False  # the arguments are values (an example), not the parameters


def _strip_comment(line: str) -> str:
    return re.sub(r"\s+#.*$", "", line) if not line.lstrip().startswith("#") else ""


def _logical_lines(block: str) -> List[str]:
    out, cur, depth = [], [], 0
    for raw in block.splitlines():
        line = _strip_comment(raw)
        if not line.strip() and not cur:
            continue
        cur.append(line.strip())
        depth += sum(line.count(c) for c in "([{") - sum(line.count(c) for c in ")]}")
        if depth <= 0:
            out.append(" ".join(cur))
            cur, depth = [], 0
    return out


def _without_return(text: str) -> str:
    """``f(...) -> X`` -> ``f(...)``."""
    depth = 0
    for i, c in enumerate(text):
        depth += (c in "([{") - (c in ")]}")
        if c == ")" and depth == 0:
            return text[: i + 1]
    return text


def _block_checks(block: str, n: int) -> List[Check]:
    aliases = {}  # name -> dotted path, from the block's imports
    checks = []
    for line in _logical_lines(block):
        m = re.match(r"from (hybridcomm[\w.]*) import (.+)$", line)
        if m:
            for name in m.group(2).split(","):
                aliases[name.strip()] = f"{m.group(1)}.{name.strip()}"
            continue
        m = re.match(r"import (hybridcomm[\w.]*)(?: as (\w+))?$", line)
        if m:
            aliases[m.group(2) or m.group(1).split(".")[0]] = m.group(1)
            continue
        stripped = re.sub(r"^\w+\s*=\s*(?!=)", "", line)
        text = _without_return(stripped)
        found = _calls_in(text, aliases, f"block {n}")
        if found and found[0].target and text.startswith("hybridcomm.") and text == stripped:
            found[0].usage = True  # code that calls the library, not a signature
        checks += found
    return checks


def _absolute(dotted: str, aliases) -> Optional[str]:
    head, _, rest = dotted.partition(".")
    if head == "hybridcomm":
        return dotted
    if head in aliases:
        return aliases[head] + ("." + rest if rest else "")
    import hybridcomm

    if not rest and head in getattr(hybridcomm, "__all__", ()):
        return f"hybridcomm.{head}"
    return None


def _calls_in(text: str, aliases, where: str) -> List[Check]:
    """The hybridcomm calls and names in one statement of a block."""
    m = CALL.match(text)
    if m and _absolute(m.group(1), aliases):
        target = _absolute(m.group(1), aliases)
        out = [Check(f"{where}: {m.group(1)}", target, m.group(2))]
        try:  # names and calls nested in its arguments
            call = ast.parse(f"_f({m.group(2)})", mode="eval").body
            out += _nested(call, aliases, where)
        except SyntaxError:
            pass
        return out
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return []
    return _nested(ast.Call(func=ast.Name("_f"), args=[tree], keywords=[]), aliases, where)


def _nested(call: ast.Call, aliases, where: str) -> List[Check]:
    out = []
    for node in list(call.args) + [k.value for k in call.keywords]:
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            target = _absolute(name, aliases)
            args = ", ".join(
                [ast.unparse(a) for a in node.args]
                + [
                    f"**{ast.unparse(k.value)}"
                    if k.arg is None
                    else f"{k.arg}={ast.unparse(k.value)}"
                    for k in node.keywords
                ]
            )
            if target:
                out.append(Check(f"{where}: {name}", target, args, usage=True))
            out += _nested(node, aliases, where)
        elif isinstance(node, (ast.Attribute, ast.Name)):
            target = _absolute(ast.unparse(node), aliases)
            if target and "." in target:
                out.append(Check(f"{where}: {ast.unparse(node)}", target, None))
    return out


FIRST_CELL = re.compile(r"^\|((?:[^|`]|`[^`]*`)*)\|")


def _prose_checks(text: str) -> List[Check]:
    """Backticked names and calls outside the code blocks."""
    checks = []
    outside = re.sub(r"```.*?```", "", text, flags=re.S)
    units = [ln.strip() for ln in outside.splitlines() if ln.strip().startswith("|")]
    units += [
        p.replace("\n", " ").strip()
        for p in re.split(r"\n\s*\n", outside)
        if not p.lstrip().startswith("|")
    ]  # paragraphs
    for unit in units:
        tokens = TOKEN.findall(unit)
        for tok in tokens:  # hybridcomm.x.y anywhere: it exists (and fits, if called)
            name = _without_return(tok.strip())
            m = CALL.match(name)
            if DOTTED.match(name):
                checks.append(Check(f"`{tok}`", name, None))
            elif m and DOTTED.match(m.group(1)):  # a signature in a table's first cell
                signature = bool(FIRST_CELL.match(unit)) and tok in TOKEN.findall(
                    FIRST_CELL.match(unit).group(1)
                )
                checks.append(Check(f"`{tok}`", m.group(1), m.group(2), usage=not signature))
        # a row or paragraph about hybridcomm.x: its calls are x's (or its class's)
        if not re.match(r"^\|?\s*`hybridcomm\.", unit):
            continue
        cell = FIRST_CELL.match(unit)
        first = TOKEN.findall(cell.group(1)) if cell else tokens[:1]
        context, owner = [], None
        for tok in tokens:
            in_first = tok in first
            for piece in (p.strip() for p in tok.split(" / ")):
                name = _without_return(piece)
                m = CALL.match(name)
                base = m.group(1) if m else name
                if not re.match(r"^\.?[A-Za-z][\w.]*$", base):
                    continue  # not a name: a value, an expression, `x=`
                if base.startswith("hybridcomm."):
                    parts = base.split(".")  # the name, then each package above it
                    context = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
                    if base.rsplit(".", 1)[1][:1].isupper():
                        owner = base
                    continue
                if not (m or in_first):
                    continue  # a bare word in the text: too loose to check
                checks.append(
                    Check(
                        f"`{tok}` (in {context[0] if context else '?'})",
                        base,
                        m.group(2) if m else None,
                        list(context),
                        owner,
                    )
                )
                if base.split(".")[-1][:1].isupper() and not base.startswith(".") and context:
                    owner = f"{context[0]}.{base}"
    return checks


def collect() -> List[Check]:
    with open(API) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    checks = [c for i, b in enumerate(blocks) for c in _block_checks(b, i + 1)]
    return checks + _prose_checks(text)


CHECKS = collect()


# --- resolving and comparing ------------------------------------------------------------


class Missing(Exception):
    pass


def _resolve(dotted: str):
    """(object, whether it was reached as a class attribute) for ``hybridcomm.x.y``:
    an attribute where there is one (a function beside its module's name), else the
    submodule."""
    parts = dotted.split(".")
    obj, from_class = importlib.import_module(parts[0]), False
    for i, part in enumerate(parts[1:], start=2):
        if hasattr(obj, part):
            from_class = inspect.isclass(obj)
            obj = getattr(obj, part)
            continue
        if not inspect.ismodule(obj):
            raise Missing(dotted)
        try:
            obj, from_class = importlib.import_module(".".join(parts[:i])), False
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("hybridcomm"):
                pytest.skip(f"{dotted} needs {e.name} (an optional extra)")
            raise Missing(dotted) from None
        except ImportError as e:  # a framework that is not installed
            pytest.skip(f"{dotted}: {e}")
    return obj, from_class


def _target(check: Check):
    if check.target.startswith("hybridcomm"):
        return _resolve(check.target)
    if check.target.startswith("."):
        if not check.owner:
            raise Missing(f"{check.target} (no class before it)")
        return _resolve(check.owner + check.target)
    for ctx in check.context:
        try:
            return _resolve(f"{ctx}.{check.target}")
        except Missing:
            continue
    raise Missing(f"{check.target} in {check.context}")


def _real(obj, from_class: bool) -> inspect.Signature:
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())
    if from_class and inspect.isfunction(obj) and params and params[0].name == "self":
        sig = sig.replace(parameters=params[1:])
    return sig


def _written(args: str):
    """[(name, kind, default)] from ``a, b=1, *c, d=None, **e``; None if these are not
    parameters but values (a usage); partial: it ended in ``...``."""
    partial = bool(re.search(r"(^|,)\s*\.\.\.\s*$", args))
    if partial:
        args = re.sub(r"(^|,)\s*\.\.\.\s*$", "", args)
    try:
        fn = ast.parse(f"def _f({args}): pass").body[0].args
        pos = fn.posonlyargs + fn.args
        if any(
            isinstance(d, ast.Constant) and d.value is Ellipsis
            for d in fn.defaults + [d for d in fn.kw_defaults if d is not None]
        ):
            return None, partial  # `name=...`: a value left out, not a default
        defaults = [inspect.Parameter.empty] * (len(pos) - len(fn.defaults)) + [
            ast.literal_eval(d) for d in fn.defaults
        ]
        out = [(a.arg, "positional", d) for a, d in zip(pos, defaults)]
        if fn.vararg:
            out.append(("*", "*", inspect.Parameter.empty))
        elif fn.kwonlyargs:
            out.append(("*", "bare *", inspect.Parameter.empty))
        out += [
            (a.arg, "keyword", inspect.Parameter.empty if d is None else ast.literal_eval(d))
            for a, d in zip(fn.kwonlyargs, fn.kw_defaults)
        ]
        if fn.kwarg:
            out.append(("**", "**", inspect.Parameter.empty))
    except (SyntaxError, ValueError):
        return None, partial
    return out, partial


def _as_written(sig: inspect.Signature, bare_star: bool):
    kinds = inspect.Parameter
    out, star = [], False
    for p in sig.parameters.values():
        if p.kind is kinds.VAR_POSITIONAL:
            out.append(("*", "*", kinds.empty))
            star = True
        elif p.kind is kinds.VAR_KEYWORD:
            out.append(("**", "**", kinds.empty))
        elif p.kind is kinds.KEYWORD_ONLY:
            if not star:
                out.append(("*", "bare *", kinds.empty))
                star = True
            out.append((p.name, "keyword", p.default))
        else:
            out.append((p.name, "positional", p.default))
    return out


def _fmt(params):
    def one(name, kind, default):
        text = {"*": "*args", "bare *": "*", "**": "**kwargs"}.get(kind, name)
        return text if default is inspect.Parameter.empty else f"{text}={default!r}"

    return "(" + ", ".join(one(*p) for p in params) + ")"


@pytest.mark.parametrize("check", CHECKS, ids=[c.where for c in CHECKS])
def test_documented_name_exists_with_its_documented_parameters(check):
    try:
        obj, from_class = _target(check)
    except Missing as e:
        pytest.fail(f"docs/API.md documents {check.where}, but hybridcomm has no {e}")
    if check.args is None:
        return
    sig = _real(obj, from_class)
    written, partial = _written(check.args)
    if check.usage or written is None or not written and not partial:  # values: they must fit
        call = ast.parse(f"_f({check.args})", mode="eval").body
        if any(isinstance(a, ast.Starred) for a in call.args) or any(
            k.arg is None for k in call.keywords
        ):
            return
        try:
            sig.bind_partial(*call.args, **{k.arg: k.value for k in call.keywords})
        except TypeError as e:
            pytest.fail(
                f"docs/API.md's {check.where}: ({check.args}) does not fit {check.target}{sig}: {e}"
            )
        return
    real = _as_written(sig, any(k == "bare *" for _, k, _ in written))
    got = real[: len(written)] if partial else real
    assert written == got, (
        f"docs/API.md writes {check.where} as {_fmt(written)}"
        f"{' ...' if partial else ''}; the code has {check.target}{_fmt(real)}"
    )


def test_the_reader_finds_the_signatures():
    """The parser still sees the documented fronts (a format change must not make
    this test check nothing)."""
    targets = {c.target for c in CHECKS if c.args is not None}
    for name in (
        "hybridcomm.DistributedOptimizer",
        "hybridcomm.all_reduce",
        "hybridcomm.broadcast_parameters",
        "hybridcomm.broadcast_optimizer_state",
        "hybridcomm.ddp.HybridState",
        "hybridcomm.integrations.accelerate.prepare",
        "hybridcomm.averager.TensorAverager",
        "fit",
    ):
        assert name in targets, sorted(targets)
    assert len(CHECKS) > 40
