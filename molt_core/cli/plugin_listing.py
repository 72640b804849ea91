"""The compact view of ``molt plugins``: one header line per plugin kind, one line per
registered name with a one-line summary cut to the terminal width, then the plugins
themselves. ``molt plugins --verbose`` keeps the full table (options and hooks) and
``--json`` everything.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

from molt_core.plugins.extras import install_command, missing_modules
from molt_core.hookspecs import REGISTRATION_HOOKS
from molt_core.plugins import FIRST_PARTY, PluginHost, _norm

__all__ = ["summary", "compact_lines"]

_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")  # :class:`a.b.C` -> a.b.C; :class:`~a.b.C` -> C

#: kinds listed as one wrapped line of names: a name is the model family it serves, which a
#: summary would only repeat (``molt plugins --verbose`` / ``--json`` still show each)
NAMES_ONLY = ("tool_parsers", "render_windows", "builtin_models")


def summary(obj: Any) -> str:
    """A one-line summary of a registered object: its ``describe()`` when it describes itself
    (sandbox backends), else the first sentence of its docstring with reST markup removed
    (``code`` quotes and ``:role:`` wrappers); ``""`` when it has neither."""
    fn = getattr(obj, "describe", None)
    if callable(fn) and not isinstance(obj, type):
        try:
            return " ".join(str(fn()).split())
        except Exception as e:  # a plugin's describe() must not break the listing
            return f"describe() failed: {type(e).__name__}: {e}"
    doc = (getattr(obj, "__doc__", None) or "").strip()
    para = " ".join(doc.split("\n\n", 1)[0].split())
    para = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), para).replace("``", "")
    m = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", para)
    return para[: m.start() + 1] if m else para


def _cut(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, ending in ``...`` when cut."""
    return text if len(text) <= width else text[: max(width - 3, 0)].rstrip() + "..."


def compact_lines(host: PluginHost, width: int = 80) -> list[str]:
    """The lines of the compact ``molt plugins`` view, none longer than ``width``.

    Per kind with at least one name: ``kind (N)``, then ``  name  summary`` per name (for a
    kind of :data:`NAMES_ONLY`, ``kind (N): name, name, ...`` wrapped instead; a name
    from a third-party distribution is followed by ``[distribution]``; a name whose optional
    module is missing gets a line ``unusable here: pip install 'molt-sdk[EXTRA]' (...)``,
    :mod:`molt_core.plugins.extras`); then the plugins with
    their distribution and version, wrapped to ``width``; then a pointer to ``--verbose`` and
    ``--json``.
    """
    width = max(width, 40)
    lines: list[str] = []
    listed = host.plugin_registries()
    regs = [(k, listed[k]) for k in REGISTRATION_HOOKS if listed[k]]
    label_w = min(max((len(n) for k, r in regs if k not in NAMES_ONLY for n in r), default=0), 24)
    for kind, reg in regs:
        if kind in NAMES_ONLY:
            lines += textwrap.wrap(f"{kind.replace('_', ' ')} ({len(reg)}): {', '.join(sorted(reg))}", width,
                                   subsequent_indent="  ", break_on_hyphens=False)
            continue
        lines.append(f"{kind.replace('_', ' ')} ({len(reg)})")
        for name in sorted(reg):
            r = reg[name]
            tag = "" if _norm(r.distribution) == FIRST_PARTY else f" [{r.distribution}]"
            head = f"  {name:<{label_w}}  "
            lines.append(_cut(head + (summary(r.obj) + tag).strip(), width).rstrip())
            for mod in missing_modules(r.obj):  # the install command first, so a narrow terminal keeps it
                cmd = install_command(mod)
                note = f"unusable here: {cmd} (module {mod!r} is missing)" if cmd else f"unusable here: module {mod!r} is missing"
                lines += textwrap.wrap(note, width, initial_indent=" " * len(head), subsequent_indent=" " * len(head),
                                       break_on_hyphens=False)
    groups: dict[tuple[str, str], list[str]] = {}
    for info in host.plugin_infos():
        groups.setdefault((info.distribution, info.version), []).append(info.name)
    text = "; ".join(f"{', '.join(names)} ({dist}{'' if ver in ('', '-', '?') else ' ' + ver})"
                     for (dist, ver), names in groups.items())
    lines += textwrap.wrap(f"plugins: {text}", width, subsequent_indent="  ", break_on_hyphens=False)
    lines += textwrap.wrap("molt plugins --verbose: options and hooks; --json: everything; --check: "
                           "conformance", width, subsequent_indent="  ")
    return lines
