"""The dependencies of ``minipar/`` in sight: read from the source with ``ast``, no import.

The graph has an edge A -> B when module A imports B at import time (its top level and
class bodies, not inside a function), and A -> P for each package P above B that does
not hold A (importing ``minipar.theory.clusters`` from outside runs
``minipar/theory/__init__.py`` first, and with it every module that file imports). A
cycle there is a module that can be half-initialised when another reads it: the test
fails on any. Imports inside functions are kept for optional packages only, so no
dependency hides there; the reference model and the counted collectives stay at the
bottom of the graph.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minipar"
# third-party packages a function may import, to keep them optional (the GPU machines
# run without them; plotly, ipywidgets and IPython are the notebooks')
OPTIONAL = {"plotly", "ipywidgets", "IPython", "jupyterlab", "jupyterlab_widgets",
            "tokenizers", "safetensors", "transformers", "datasets", "pyarrow"}
# parts of torch that take seconds to import, imported where a run that uses them needs
# them (every command line would pay them otherwise), with a comment saying so
HEAVY = {"torch._dynamo.utils"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _imports(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The modules of ``minipar`` an import statement names (with the package a
    ``from P import name`` reads ``name`` from, when ``name`` is not a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: from the package that holds ``module``
        here = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
            for a in node.names]


def _import_nodes(tree: ast.Module, at_import_time: bool) -> list[ast.AST]:
    """Import statements run when the module is imported, or those inside functions."""
    found: list[ast.AST] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef,
                                                       ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and inside != at_import_time:
                found.append(child)
            visit(child, inside)

    visit(tree, False)
    return found


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        edges = set()
        for node in _import_nodes(_tree(path), at_import_time=True):
            for target in _imports(node, module, path.name == "__init__.py"):
                while target and target not in MODULES:  # a name inside a module
                    target = target.rpartition(".")[0]
                parts = target.split(".")
                for i in range(1, len(parts) + 1):  # the target and the packages above it
                    up = ".".join(parts[:i])
                    if up in MODULES and up != module and not module.startswith(up + "."):
                        edges.add(up)
        graph[module] = edges
    return graph


GRAPH = _graph()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan 1972)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _reach(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for w in GRAPH[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_graph_is_read() -> None:
    """The reader sees the edges it must (a check that could not fail otherwise)."""
    assert "minipar.comm" in GRAPH["minipar.mesh"]
    assert "minipar.theory" in GRAPH["minipar.config"]  # the package's __init__ runs
    assert "minipar.theory" not in GRAPH["minipar.theory.planner"]  # its own package
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_minipar() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_model_and_the_collectives_stand_alone() -> None:
    """``model.py`` is the plain reference: nothing of minipar's beyond its config;
    ``comm.py`` counts collectives for anyone: the launcher installs its hooks into it,
    never the other way."""
    assert GRAPH["minipar.model"] <= {"minipar.config"}
    assert not {"minipar.launch", "minipar.rank"} & _reach("minipar.comm")


def test_functions_import_only_optional_packages() -> None:
    """An import inside a function hides a dependency: kept only for a package the
    engine must run without, and said so in a comment on it or the line before."""
    wrong = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node in _import_nodes(_tree(path), at_import_time=False):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) \
                else [node.module or ""]
            said = " ".join(lines[node.lineno - 2:node.end_lineno])
            lazy = all(n in HEAVY for n in names) and "seconds to import" in said
            if not lazy and (any(n.split(".")[0] not in OPTIONAL for n in names)
                             or "optional" not in said):
                wrong.append(f"{module}:{node.lineno} {', '.join(names)}")
    assert not wrong, "function-level imports: " + "; ".join(wrong)


def test_the_command_line_imports_no_compiler() -> None:
    """``python -m minipar`` (and every rank it spawns) imports the engine without
    ``torch._dynamo``, a second of import on this machine, so ``plan``, ``memory`` and
    the lessons' theory never pay for it: the layers that stay eager inside a compiled
    block are marked with ``torch._disable_dynamo``, which applies
    ``torch.compiler.disable`` at their first call, and ``compile_stats`` imports the
    compiler's counters only in a run that compiles. (A training run imports it once,
    before its ranks fork: their optimizers need it.)"""
    import subprocess
    import sys

    code = ("import sys, minipar.__main__, minipar.engine, minipar.theory.planner; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.strip() == "False"
