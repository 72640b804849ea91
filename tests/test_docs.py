"""The docs (issue 13 item 13): relative links in README, CONTRIBUTING and docs/ resolve (files
and #anchors), README and CONTRIBUTING agree on the test time, CONTRIBUTING names only tools
the project ships or installs, and the own-model tokenizer check runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces -> '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    out, fence = set(), False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def broken_links(md: Path) -> list[str]:
    """Relative links of ``md`` whose file or ``#anchor`` does not exist (code blocks skipped)."""
    bad, text = [], re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{md.relative_to(ROOT) if md.is_relative_to(ROOT) else md}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{md.name}: {target} (no heading #{anchor})")
    return bad


def test_relative_links_resolve():
    assert [b for md in DOCS for b in broken_links(md)] == []


def test_a_broken_link_is_flagged(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    md = tmp_path / "page.md"
    md.write_text("[ok](there.md) [ok](there.md#a-heading) [x](missing.md) [y](there.md#nope) [web](https://x.y)\n"
                  "```\n[in code](ignored.md)\n```\n")
    assert broken_links(md) == [f"{md}: missing.md (no such file)", "page.md: there.md#nope (no heading #nope)"]


def test_readme_and_contributing_agree_on_test_time():
    readme, contributing = (ROOT / "README.md").read_text(), (ROOT / "CONTRIBUTING.md").read_text()
    assert "7–9 minutes on 2 cores" in readme and "7–9 minutes on 2 cores" in contributing


SHIPPED_OR_INSTALLED = {"pip", "pytest", "python", "molt", "mypy"}  # molt ships; [dev] installs pytest, mypy


def commands(text: str) -> set[str]:
    """The first word of every line of a ```bash block and of every inline `cmd args` span."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    firsts = {ln.split()[0] for b in blocks for ln in b.splitlines() if ln.strip()}
    return firsts | {m.split()[0] for m in re.findall(r"`([a-z][\w.-]* [^`]*)`", text)}


def test_contributing_names_only_shipped_or_installed_tools():
    assert commands((ROOT / "CONTRIBUTING.md").read_text()) - SHIPPED_OR_INSTALLED == set()
    # the line it used to have named a tool the project neither ships nor installs
    assert commands("Before committing: `duplicates --change` shows code your change wrote twice.") == {"duplicates"}


def test_own_model_tokenizer_check_runs():
    """The snippet of docs/own_model.md, as written, on the shipped tiny tokenizer."""
    text = (ROOT / "docs" / "own_model.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "apply_chat_template" in b)
    exec(compile(code, "own_model.md", "exec"), {})


@pytest.mark.parametrize("page", ["own_model.md", "gpu.md", "cluster.md"])
def test_new_pages_are_linked_from_the_docs_index(page):
    assert f"({page})" in (ROOT / "docs" / "README.md").read_text()
