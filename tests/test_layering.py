"""The layering contracts of pyproject.toml (``[tool.importlinter]``, docs/architecture.md) hold on
this checkout, and each kind of break is caught: a kernel module importing a plugin, the ledger
importing an engine, an import up the layers, and a cycle."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` over the packages under ``root`` with ``root/pyproject.toml``."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.argv = ['lint-imports', 'pyproject.toml', '--no-cache']; lint_imports_command()"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_every_contract_is_kept_on_this_checkout():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 5 kept, 0 broken." in r.stdout


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the two packages' sources and pyproject.toml, to break."""
    t = tmp_path_factory.mktemp("layering")
    for pkg in ("molt_core", "molt_plugins"):
        shutil.copytree(ROOT / pkg, t / pkg, ignore=shutil.ignore_patterns("__pycache__", "assets", "templates"))
    shutil.copy(ROOT / "pyproject.toml", t / "pyproject.toml")
    return t


LAYERS = "no import up"


@pytest.mark.parametrize("module,line,broken", [
    ("molt_core/train/update.py", "import molt_plugins.lora", ["the kernel never imports molt_plugins"]),
    ("molt_core/ledger/commit.py", "import molt_core.engines.base", ["the ledger imports only the records", LAYERS]),
    ("molt_core/algo/losses.py", "import molt_core.hookspecs", ["algo/ imports nothing of molt but the records"]),
    ("molt_core/engines/base.py", "import molt_core.runtime.weightpack", [LAYERS]),
    ("molt_core/ledger/records.py", "import molt_core.ledger.session", ["no import cycle"]),
])
def test_each_kind_of_break_is_reported_by_its_contract(tree, module, line, broken):
    path = tree / module
    clean = path.read_text()
    path.write_text(clean + f"\n{line}  # injected\n")
    try:
        r = lint(tree)
    finally:
        path.write_text(clean)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"Contracts: {5 - len(broken)} kept, {len(broken)} broken." in r.stdout, r.stdout
    status = {ln.rsplit(" ", 1)[0]: ln.rsplit(" ", 1)[1] for ln in r.stdout.splitlines() if ln.endswith((" KEPT", " BROKEN"))}
    assert sorted(name for name, st in status.items() if st == "BROKEN") == sorted(
        next(name for name in status if name.startswith(b)) for b in broken)


def test_the_kernel_contract_names_every_kernel_module():
    """Review of issue 26: the forbidden contract lists its sources by hand, so a new top-level
    module (or the package's own ``__init__``) escaped it. Every module and package directly under
    molt_core/ but cli/, testing/ and data must be a source, and molt_core/__init__.py may import
    only the deprecation face."""
    import ast
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    sources = set(next(c for c in contracts if c["name"].startswith("the kernel never imports"))["source_modules"])
    pkg = ROOT / "molt_core"
    kernel = {f"molt_core.{p.stem}" for p in pkg.glob("*.py") if p.stem not in ("__init__", "__main__")}
    kernel |= {f"molt_core.{p.name}" for p in pkg.iterdir() if (p / "__init__.py").is_file()
               and p.name not in ("cli", "testing")}
    assert kernel - sources == set()
    tree = ast.parse((pkg / "__init__.py").read_text())
    imported = {(n.module if isinstance(n, ast.ImportFrom) else a.name) for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert {m for m in imported if m and m.startswith("molt")} == {"molt_core"}  # from molt_core import _moved


def _spine_rows(text: str) -> list[tuple[list[str], int]]:
    """(files, lines) of each spine row of docs/architecture.md; a cell ``a/b.py``, ``c.py``
    names ``a/b.py`` and ``a/c.py``."""
    rows = []
    for line in text.splitlines():
        cells = line.split("|")
        if not re.match(r"^\| \d+ \| `molt_core/", line):
            continue
        base, files = "", []
        for name in re.findall(r"`([^`]+)`", cells[2]):
            base = name.rsplit("/", 1)[0] if "/" in name else base
            files.append(name if "/" in name else f"{base}/{name}")
        rows.append((files, int(cells[3])))
    return rows


def test_the_spine_table_gives_each_files_size_as_of_this_tree():
    """docs/architecture.md's spine lists the files a token crosses with their ``wc -l`` sizes:
    a file that grows or shrinks without the table fails here (a stale size is injected too)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = _spine_rows(text)
    assert len(rows) == 18
    for files, n in rows:
        assert n == sum(len((ROOT / f).read_text().splitlines()) for f in files), files
    stale = text.replace(f"| {rows[0][1]} |", f"| {rows[0][1] + 1} |", 1)
    files, n = _spine_rows(stale)[0]
    assert n != sum(len((ROOT / f).read_text().splitlines()) for f in files)
