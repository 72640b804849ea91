"""The ``molt_core`` import graph has no cycle (issue 14).

Every module under ``molt_core/`` is parsed with :mod:`ast`; every import in it -- at module
level *and* inside functions (a lazy import still ties the two modules together) -- becomes an
edge to the ``molt_core`` module it names. ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``; relative imports are resolved against the
importing module. A package's ``__init__`` counts like any module: ``from pkg import f`` runs
``pkg/__init__.py``, and with it every submodule that ``__init__`` imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "molt_core"

#: known cycles left in on purpose, as sorted tuples of module names (none today)
ALLOWED_CYCLES: set[tuple[str, ...]] = set()


def module_names(root: Path, package: str) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` under ``root / package`` (a package is
    named by its ``__init__.py``)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The ``molt_core`` modules that module ``name`` (file ``path``) imports anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # ``import a.b.c`` of a non-module attribute -> nearest module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the package."""
    mods = module_names(root, package)
    return {m: imports_of(m, p, set(mods)) for m, p in mods.items()}


def find_cycle(graph: dict[str, set[str]], allowed: set[tuple[str, ...]] = frozenset()) -> list[str] | None:
    """One cycle ``[a, b, ..., a]`` of ``graph`` not in ``allowed`` (depth-first search), or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                cyc = stack[stack.index(v):] + [v]
                if tuple(sorted(set(cyc))) not in allowed:
                    return cyc
            elif v not in state:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


def test_finder_sees_a_lazy_function_level_cycle(tmp_path):
    pkg = tmp_path / "pk"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pk.a import f\n")
    (pkg / "a.py").write_text("def f():\n    from pk.sub import b\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def g():\n    from ..a import f\n    return f\n")
    graph = import_graph(tmp_path, "pk")
    assert graph == {"pk": {"pk.a"}, "pk.a": {"pk.sub.b"}, "pk.sub": set(), "pk.sub.b": {"pk.a"}}
    assert find_cycle(graph) == ["pk.a", "pk.sub.b", "pk.a"]
    assert find_cycle(graph, {("pk.a", "pk.sub.b")}) is None
    (pkg / "sub" / "b.py").write_text("import pk.sub.nope\n")  # a missing name -> its nearest module
    assert import_graph(tmp_path, "pk")["pk.sub.b"] == {"pk.sub"}
    assert find_cycle(import_graph(tmp_path, "pk")) is None


def test_molt_core_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "molt_core.train.trainer" in graph  # the walk found the package
    cycle = find_cycle(graph, ALLOWED_CYCLES)
    if cycle:
        pytest.fail("import cycle in molt_core: " + " -> ".join(cycle))
