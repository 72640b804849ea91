"""MkDocs hook: a link from a page to a repository file outside ``docs/`` (``../recipes/x.toml``,
``../CONTRIBUTING.md``) works on a code host but is no page of the site. Such a link to a file that
exists becomes its path as code (or the page that includes it); a link to a missing file is left
alone, so ``mkdocs build --strict`` still fails on it. Registered by ``hooks:`` in ``mkdocs.yml``.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

#: repository files the site includes as a page of its own (``{% include-markdown %}``)
INCLUDED = {"README.md": "getting_started.md", "CONTRIBUTING.md": "contributing.md"}
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _rewrite(text: str, page_dir: str, root: Path) -> str:
    def one(m: re.Match[str]) -> str:
        label, target, anchor = m.group(1), m.group(2), m.group(3) or ""
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return m.group(0)
        path = posixpath.normpath(posixpath.join(page_dir, target))
        if not path.startswith("../"):
            return m.group(0)  # a page of the site: mkdocs validates it
        repo_path = path[3:]
        if not (root / repo_path).exists():
            return m.group(0)  # broken: leave it for mkdocs to report
        if repo_path in INCLUDED:
            rel = posixpath.relpath(INCLUDED[repo_path], page_dir or ".")
            return f"[{label}]({rel}{anchor})"
        code = f"`{repo_path}`"
        return code if label.strip("`") == repo_path else f"{label} ({code})"

    out, last = [], 0
    for f in FENCE.finditer(text):
        out += [LINK.sub(one, text[last:f.start()]), f.group(0)]
        last = f.end()
    out.append(LINK.sub(one, text[last:]))
    return "".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Rewrite the page's links to repository files outside ``docs/`` (see the module docstring)."""
    root = Path(config["docs_dir"]).resolve().parent
    return _rewrite(markdown, posixpath.dirname(page.file.src_uri), root)
