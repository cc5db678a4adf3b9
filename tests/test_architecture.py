"""The package's layering, checked statically: no import cycles, kernels below the model.

Every `import` statement counts, also those inside functions or under TYPE_CHECKING: a
function-level import that dodges a cycle at import time still ties two modules into one
idea. Importing `a.b.c` from outside package `a.b` also runs `a/b/__init__.py`, so that
counts as an import of the package too (the top-level `jaxinfer` facade excepted: it
re-exports the public API and nothing inside imports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxinfer", "pallas_kernels")
FACADES = frozenset(PACKAGES)  # top-level __init__ files: public re-exports only


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of our packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that `name` imports (resolved to the deepest existing module)."""
    is_package = path.name == "__init__.py"
    base = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                module = ".".join(anchor + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{module}.{alias.name}"
                targets.add(sub if sub in modules else module)
    edges = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if not target or target == name:
            continue
        edges.add(target)
        # running a submodule first runs its packages' __init__ (unless we are inside them)
        parent = target.rpartition(".")[0]
        while parent and parent not in FACADES:
            if not (name == parent or name.startswith(parent + ".")):
                edges.add(parent)
            parent = parent.rpartition(".")[0]
    return edges


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_checker_finds_a_planted_cycle_and_package_edges():
    graph = {"a.x": {"b.y"}, "b.y": {"a.x"}, "c": set()}
    assert cycles(graph) == [["a.x", "b.y"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    g = import_graph()
    assert "jaxinfer.config" in g["jaxinfer.engine.engine"] or any(
        m.startswith("jaxinfer.") for m in g["jaxinfer.engine.engine"])


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("forbidden", ["jaxinfer.model", "jaxinfer.engine", "jaxinfer.attention",
                                       "jaxinfer.speculative", "jaxinfer.server"])
def test_kernels_never_import_the_model_or_anything_above_it(forbidden):
    graph = import_graph()
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("pallas_kernels")
                 for t in ts if t == forbidden or t.startswith(forbidden + "."))
    assert not bad, bad


def test_training_code_is_not_on_the_inference_import_path():
    """Serving (engine, server) never reaches optax training code, directly or not."""
    graph = import_graph()
    seen, todo = set(), ["jaxinfer.engine", "jaxinfer.server"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    assert "jaxinfer.speculative.train" not in seen
    assert not any("training" in m for m in seen), sorted(m for m in seen if "training" in m)


@pytest.mark.parametrize("lower,upper", [
    ("jaxinfer.kv", ("jaxinfer.model", "jaxinfer.attention", "jaxinfer.engine", "jaxinfer.calibration",
                     "jaxinfer.speculative", "jaxinfer.sharding", "pallas_kernels")),
    ("jaxinfer.attention", ("jaxinfer.model", "jaxinfer.engine", "jaxinfer.speculative", "jaxinfer.sharding")),
    ("jaxinfer.model", ("jaxinfer.engine", "jaxinfer.speculative", "jaxinfer.server", "jaxinfer.sharding")),
])
def test_data_flows_down(lower, upper):
    """Cache formats know nothing of attention or models; attention nothing of the model."""
    graph = import_graph()
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() if m == lower or m.startswith(lower + ".")
                 for t in ts for u in upper if t == u or t.startswith(u + "."))
    assert not bad, bad
