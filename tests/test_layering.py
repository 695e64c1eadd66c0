"""The package layering (issue 54): ``edge_agent -> specdec <- deploy``, with one documented edge from
the server-side drafter (``deploy.router.server_draft``) to the edge's drafting code; no import cycle
between files; modules and functions of a readable size; docstrings that state contracts, not essays
(issue 62: at most 10 % of a package's lines; explanations live in ``docs/``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "deploy", "edge_agent")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_DOCSTRING_SHARE = 0.10
SERVER_DRAFTER = "deploy.router.server_draft"  # the one edge from the cloud to the edge's drafting code


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (REPO / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Every project module ``name`` imports, at module level or inside a function."""
    out = set()
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and MODULES[t].name != "__init__.py":
                out.add(t)
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _top(name: str) -> str:
    return name.split(".")[0]


def test_specdec_imports_neither_side():
    bad = {m: sorted(d for d in deps if _top(d) != "specdec") for m, deps in GRAPH.items() if _top(m) == "specdec"}
    assert not {m: d for m, d in bad.items() if d}


def test_edge_agent_never_imports_deploy():
    bad = {m: sorted(d for d in deps if _top(d) == "deploy") for m, deps in GRAPH.items() if _top(m) == "edge_agent"}
    assert not {m: d for m, d in bad.items() if d}


def test_only_the_server_drafter_imports_edge_agent():
    users = {m for m, deps in GRAPH.items() if _top(m) == "deploy" and any(_top(d) == "edge_agent" for d in deps)}
    assert users <= {SERVER_DRAFTER}


def test_no_import_cycle_between_files():
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    sys.setrecursionlimit(10_000)
    for v in GRAPH:
        if v not in index:
            visit(v)
    assert cycles == []


@pytest.mark.parametrize("package,banned", [("edge_agent", ("ray", "fastapi", "deploy")),
                                            ("specdec", ("ray", "fastapi", "deploy", "edge_agent"))])
def test_fresh_interpreter_imports(package, banned):
    """Importing every module of ``package`` in a new interpreter loads none of ``banned``."""
    names = sorted(m for m in MODULES if _top(m) == package and not m.endswith("__main__"))
    code = (f"import importlib, sys\nfor m in {names!r}:\n    importlib.import_module(m)\n"
            f"print(sorted({{m for m in sys.modules if m.split('.')[0] in {banned!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


def test_module_sizes():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_function_sizes():
    long = {}
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{m}.{node.name}"] = n
    assert long == {}


def _docstring_lines(path: Path) -> int:
    """Lines of the module's, its classes' and its functions' docstrings."""
    n = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                n += first.end_lineno - first.lineno + 1
    return n


@pytest.mark.parametrize("package", PACKAGES)
def test_docstrings_are_at_most_a_tenth_of_a_package(package):
    paths = [p for name, p in MODULES.items() if _top(name) == package]
    doc = sum(_docstring_lines(p) for p in paths)
    total = sum(len(p.read_text().splitlines()) for p in paths)
    assert doc <= MAX_DOCSTRING_SHARE * total, (
        f"{package}: docstrings are {doc} of {total} lines ({100 * doc / total:.1f} %); keep contracts, shapes, "
        f"units and paper sections, move explanations to docs/")
