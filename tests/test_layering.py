"""The layering rules of docs/ARCHITECTURE.md and the source rules of STYLE.md, checked on the source: no import circle,
torch only in runtime/model/ (and kernels/); in the product, benchmarks/ and tests/: no file over 400 lines, no
`# fmt: skip` (ruff format is the formatter), no inline `-(-x // b)` (a named cdiv), no packed assignment to
attributes (`self.a, self.b = ...`). Each failure names the files and lines to fix."""

from __future__ import annotations

import ast
import functools
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from tests.paths import ROOT

PACKAGES = ("radix", "kernels", "runtime", "router")
CHECKED = (*PACKAGES, "benchmarks", "tests")  # the line and style rules: the product and the code beside it
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    """Every project module by dotted name (a package by its own name, for its __init__.py)."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imported(name: str, tree: ast.Module) -> set[str]:
    """The project modules `name` imports anywhere in its file (module level, functions, TYPE_CHECKING blocks).

    `import a.b` is an edge to a.b; `from a import b` to a.b when that is a module, else to a. Parent packages that
    Python runs on the way are not edges (a package's __init__ importing its own submodules is no circle).
    """
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if _is_package(name) else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import a.b.func`-like names: the deepest module named
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    return {name: _imported(name, ast.parse(path.read_text(), str(path))) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> ... -> a) per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle_in(graph, comp) for comp in components]


def _circle_in(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest circle through comp[0] inside the component (breadth first)."""
    members, start = set(comp), comp[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle in component {comp}")


def test_cycle_finder_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    circles = _cycles(_graph())
    assert not circles, "import circles (counting imports in functions and under TYPE_CHECKING):\n" + "\n".join(
        " -> ".join(c) for c in circles
    )


def _module_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of the imports that run when the module is imported: top-level statements and the blocks of
    top-level if/try/with, except `if TYPE_CHECKING:` bodies; not function or class bodies."""
    found: list[tuple[int, str]] = []

    def scan(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.extend((node.lineno, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found.append((node.lineno, node.module or ""))
            elif isinstance(node, ast.If):
                test = node.test
                is_tc = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
                )
                if not is_tc:
                    scan(node.body)
                scan(node.orelse)
            elif isinstance(node, ast.Try):
                scan(node.body)
                for handler in node.handlers:
                    scan(handler.body)
                scan(node.orelse)
                scan(node.finalbody)
            elif isinstance(node, ast.With):
                scan(node.body)

    scan(tree.body)
    return found


def test_runtime_imports_torch_only_in_model():
    offenders = []
    for name, path in MODULES.items():
        if not name.startswith("runtime") or name == "runtime.model" or name.startswith("runtime.model."):
            continue
        for line, module in _module_level_imports(ast.parse(path.read_text(), str(path))):
            if module.split(".")[0] in ("torch", "triton"):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: import {module}")
    assert not offenders, "module-level torch/triton imports outside runtime/model/:\n" + "\n".join(offenders)


# Run in a fresh interpreter: a meta path hook records who asked for torch, then refuses nothing.
_PROBE = """
import sys, traceback
class Spy:
    who = None
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and Spy.who is None:
            Spy.who = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()
                       if "/importlib/" not in f.filename and "<frozen" not in f.filename][:-1]
        return None
sys.meta_path.insert(0, Spy())
import importlib
importlib.import_module(sys.argv[1])
print("torch imported via: " + " <- ".join(reversed(Spy.who)) if "torch" in sys.modules else "no torch")
"""


@pytest.mark.parametrize(
    "module",
    [
        "runtime.scheduler.scheduler",
        "runtime.engine",
        "runtime.client",
        "runtime.serve.tokenizer.process",
        "runtime.serve.scheduler_process",
        "router.router",
    ],
)
def test_module_starts_without_torch(module):
    proc = subprocess.run([sys.executable, "-c", _PROBE, module], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "no torch", f"importing {module}: {proc.stdout.strip()}"


def _sources() -> dict[str, Path]:
    """Every Python file the line and style rules cover, by its path from the repository root."""
    return {str(path.relative_to(ROOT)): path for top in CHECKED for path in sorted((ROOT / top).rglob("*.py"))}


SOURCES = _sources()


def test_no_file_over_400_lines():
    long = {}
    for name, path in SOURCES.items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long[name] = lines
    assert not long, f"files over {MAX_LINES} lines (STYLE.md: split them at a seam between concepts): {long}"


FMT_PRAGMA = re.compile(r"#\s*fmt:\s*(skip|off|on)\b")


def _fmt_pragmas(source: str) -> list[int]:
    """Lines of the comments that switch ruff format off (`# fmt: skip`, `# fmt: off` / `on`); strings do not count."""
    if "fmt:" not in source:  # tokenizing is the slow part: only files that may hold one
        return []
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT and FMT_PRAGMA.search(tok.string)]


def _is_negated_floor_div(node: ast.AST) -> bool:
    """-(-a // b): the inline ceiling division."""
    if not (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)):
        return False
    inner = node.operand
    if not (isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.FloorDiv)):
        return False
    return isinstance(inner.left, ast.UnaryOp) and isinstance(inner.left.op, ast.USub)


def _inline_ceil_divs(tree: ast.Module) -> list[int]:
    """Lines of `-(-a // b)` outside the body of a function named cdiv or _cdiv (the arithmetic with a name:
    radix.blocks.cdiv, and kernels/reference.py's own, as kernels/ imports nothing of the project)."""
    named: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") == "cdiv":
            named.update(id(inner) for inner in ast.walk(node))
    return [node.lineno for node in ast.walk(tree) if _is_negated_floor_div(node) and id(node) not in named]


def _attribute_packing(tree: ast.Module) -> list[int]:
    """Lines of assignments to a tuple or list of targets with an attribute among them (`self.a, self.b = x, y`)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Tuple | ast.List) and any(isinstance(e, ast.Attribute) for e in target.elts):
                found.append(node.lineno)
    return found


def test_the_source_checks_see_each_pattern():
    source = (
        "def cdiv(n, d):\n"
        "    return -(-n // d)\n"
        "x = -(-7 // 2)  # fmt: skip\n"
        "s = '# fmt: skip'\n"
        "self.a, self.b = 1, 2\n"
        "a, b = 1, 2\n"
        "[o.x, y] = f()\n"
    )
    tree = ast.parse(source)
    assert _fmt_pragmas(source) == [3]
    assert _inline_ceil_divs(tree) == [3]
    assert sorted(_attribute_packing(tree)) == [5, 7]


@functools.cache
def _parsed() -> list[tuple[str, str, ast.Module]]:
    """(path, source, syntax tree) of every file of SOURCES, parsed once for the three source checks."""
    out = []
    for name, path in SOURCES.items():
        source = path.read_text()
        out.append((name, source, ast.parse(source, name)))
    return out


def _offenders(check) -> list[str]:
    """path:line of every hit of check(source, tree) over SOURCES."""
    out = []
    for name, source, tree in _parsed():
        out.extend(f"{name}:{line}" for line in sorted(check(source, tree)))
    return out


def test_no_fmt_skip():
    offenders = _offenders(lambda source, tree: _fmt_pragmas(source))
    assert not offenders, "ruff format is the formatter (STYLE.md): remove the fmt pragmas at\n" + "\n".join(offenders)


def test_no_inline_ceiling_division():
    offenders = _offenders(lambda source, tree: _inline_ceil_divs(tree))
    assert not offenders, "-(-x // b) inline: call radix.blocks.cdiv (STYLE.md) at\n" + "\n".join(offenders)


def test_no_attribute_packing():
    offenders = _offenders(lambda source, tree: _attribute_packing(tree))
    assert not offenders, "packed assignments to attributes: one statement per line (STYLE.md) at\n" + "\n".join(
        offenders
    )
