"""Incremental render for the ledger's extend check: a window proof for chat templates.

The ledger extends a segment only when the chat template keeps the committed history verbatim
(:meth:`molt_core.ledger.Ledger.prepare`). Checked naively, that renders the whole conversation
each turn (cost linear in the turn count). This module proves, once per template, that the
template's text for a conversation is determined *locally* enough that rendering a short
**window** -- the conversation's first ``head`` messages followed by its last few -- gives the
same verdict and the same tail as the full render. Templates the proof does not cover (and any
window whose runtime conditions fail) take the full render; nothing is guessed.

The proof (:func:`prove_window`) is a conservative static analysis of the template's Jinja AST.
It accepts a template when:

* ``messages`` is read only as ``messages[k]`` (constant ``k >= 0``: part of the head),
  ``messages | length`` compared with ``0``, ``for m in messages`` loops and, inside such a
  loop, ``messages[loop.index0 +- k]`` (a neighbour at distance ``k <= radius``);
* at most one ``for m in messages`` loop writes output (the *main loop*); every other one is a
  *last-index scan* ``{% for m in messages %}{% if P(m) %}{% set ns.x = loop.index0 %}{% endif
  %}{% endfor %}`` with ``P`` reading only ``m`` (``ns.x`` = index of the last message
  satisfying ``P``, or its constant initial value ``<= 0``), or its reversed form, Qwen3's
  last-query scan (:meth:`~molt_core.ledger.window_analysis._Analysis.reverse_scan`); such an
  index is only compared with a loop index (``<``, ``>``, ``==``, ...);
* a loop index (``loop.index0`` / ``loop.index``) is only compared with another index or an
  integer constant ``k`` (the head then holds messages ``0..k``), or used as a neighbour
  subscript; ``loop.first`` and ``loop.last`` are free,
  other ``loop`` attributes (``length``, ``revindex``, ``cycle``, ``previtem`` ...) are refused;
* nothing inside a messages loop or a macro assigns a namespace attribute (state that would
  flow from message to message), reads ``add_generation_prompt`` (it is read only at top level
  after the main loop), calls ``raise_exception`` (allowed at top level) or an impure global
  (``strftime_now``...),
  breaks or continues, and the template uses no ``include``/``import``/``call``/``filter``
  blocks or extensions.

Why a window then gives the full-render verdict: the main loop's output is one *chunk* per
message; a chunk depends only on its message, its neighbours within ``radius``, ``loop.first`` /
``loop.last``, comparisons of its index with scanned indices and constants below ``head``, and values
computed from the head messages, ``tools`` and template variables. Rendering ``W = M[:head] +
M[j:]`` maps index ``i < head`` to itself and ``i >= j`` to ``i - j + head``: order-preserving,
so every allowed comparison agrees, and chunks of messages from ``j + radius`` on are the same
text in ``W`` as in ``M``. Everything before them (the head's chunks, the first ``radius``
chunks after the gap, the text before the loop) is the *same* text in the three renders the
extend check compares -- previous prompt, held history, new prompt -- once the runtime
conditions of :func:`window_start` hold (the boundary's neighbours exist and are not last, each
scanned index stays put or lies past the boundary). A common prefix cancels from
``startswith`` and from the tail, so the window's three renders give the full renders'
verdict and tail exactly. A reverse scan's index (Qwen3's last user query) must lie inside the
window (its found-flag is a value the text may use), so after one user turn an agent's tool
chain is rendered from that turn on: the window's cost then grows with the chain, not with the
conversation; a forward scan's index may stay before the gap. A negative subscript during a
window render (``messages[-1]`` via ``loop.index0 - 1`` at index 0) aborts the window
(:class:`WindowMessages`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from molt_core.ledger.window_analysis import _Analysis, _NotProven

__all__ = ["WindowProof", "Scan", "WindowMessages", "NegativeIndex", "prove_window", "window_start"]


class NegativeIndex(Exception):
    """A window render subscripted the messages with a negative index (the window is refused).

    Not a ``LookupError``: the Jinja sandbox turns those into undefined values."""


class WindowMessages(list):  # type: ignore[type-arg]
    """The message list handed to a window render: a plain list whose subscript refuses a
    negative integer index (:class:`NegativeIndex`), which would wrap to the conversation's end
    and make the head's chunks depend on the last message."""

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, int) and i < 0:
            raise NegativeIndex(i)
        return list.__getitem__(self, i)


@dataclass
class WindowProof:
    """What :func:`prove_window` established for one template.

    ``radius``: the largest neighbour distance ``k`` of a ``messages[loop.index0 +- k]``.
    ``head``: messages kept at the window's start (``max(1, radius, k + 1)`` for the largest
    constant ``k`` a loop index is compared with or the messages are subscripted by).
    ``scans``: one :class:`Scan` per last-index scan.
    """

    radius: int
    head: int
    scans: list[Scan] = field(default_factory=list)


@dataclass
class Scan:
    """One last-index scan of the template: ``pred(message) -> bool`` (evaluated with the
    template's own environment) and its form: ``reverse`` for the Qwen3 idiom (a reversed loop
    that stops at the first hit behind a found-flag, starting from ``messages | length - 1``;
    its flag is a value, so the window needs the hit inside it or no hit at all), else the
    forward loop (starting from a constant <= 0)."""

    pred: Callable[[dict[str, Any]], bool]
    reverse: bool = False


def prove_window(source: Any, environment: Any) -> tuple[WindowProof | None, str]:
    """Prove that ``source`` (a Jinja chat template) can be checked through a window.

    Args:
        source: the template text (anything else, e.g. a dict of named templates, is refused).
        environment: the Jinja environment the template is compiled in; it must be an
            ``ImmutableSandboxedEnvironment`` (as transformers uses) so that no expression can
            mutate a list or dict behind the analysis.

    Returns:
        ``(proof, "")`` when the template is in the class described in the module doc, else
        ``(None, reason)``: the ledger then renders the whole conversation.
    """
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(source, str) or not isinstance(environment, ImmutableSandboxedEnvironment):
        return None, "not a string template in an immutable sandbox"
    try:
        tree = environment.parse(source)
        an = _Analysis(nodes)
        an.ns_names = {a.target.name for a in tree.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)
                       and isinstance(a.node, nodes.Call) and isinstance(a.node.node, nodes.Name)
                       and a.node.node.name == "namespace"}
        an.stmts(tree.body, {}, {"loop": None, "msg_loop": False, "macro": False, "depth": 0})
    except _NotProven as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - a template the parser refuses: never a proof
        return None, f"{type(e).__name__}: {e}"
    scans = [Scan(_compile_scan(environment, nodes, name, test), rev) for name, test, rev in an.scans]
    return WindowProof(radius=an.radius, head=max(1, an.radius, an.const_max + 1), scans=scans), ""


def _compile_scan(environment: Any, nodes: Any, name: str, test: Any) -> Callable[[dict[str, Any]], bool]:
    """``pred(message)``: the scan's condition ``test`` evaluated with ``name`` bound to the
    message, through the template's own environment (same tests, filters and sandbox)."""
    tree = nodes.Template([nodes.If(test, [nodes.Output([nodes.TemplateData("1")])], [], [])], lineno=1)
    tree.set_environment(environment)
    code = environment.compile(tree)
    tmpl = environment.template_class.from_code(environment, code, environment.make_globals(None), None)

    def pred(message: dict[str, Any]) -> bool:
        return tmpl.render({name: message}) == "1"

    return pred


def window_start(proof: WindowProof, n_prev: int, last_prev: list[int], last_full: list[int]) -> int | None:
    """The first message after the window's gap, or None when no useful window exists.

    Args:
        proof: the template's :class:`WindowProof`.
        n_prev: messages of the previous prompt (the committed history minus its last
            assistant message).
        last_prev / last_full: per scan, the index of the last message satisfying it in the
            previous prompt's messages / in the new prompt's messages (-1 when none).

    The window ``M[:head] + M[j:]`` is valid when (module doc) the boundary -- the head and
    the ``radius`` messages after the gap -- has its neighbours inside the previous prompt and
    none of them is last: ``j <= n_prev - max(2 * radius, 1)``; and each scan index either lies
    at or past ``j + radius`` in all three renders, or (forward scan) is the same in all three
    and before ``j``, or (reverse scan) no message satisfies it in any of them.
    """
    c, a = proof.radius, proof.head
    j = n_prev - max(2 * c, 1)
    changed = True
    while changed and j > a:
        changed = False
        for scan, lp, lf in zip(proof.scans, last_prev, last_full):
            if lp >= j + c:
                continue
            if scan.reverse:  # no hit at all: the index is the last message's, the flag true, in every render
                if lp == lf == -1:
                    continue
            elif lp == lf and lf < j:
                continue
            if lp < 0:
                return None
            j, changed = lp - c, True
            break
    return j if j > a else None
