"""First-party window prover: the incremental render of the ledger's extend check, registered
as ``jinja`` through ``molt_register_render_windows``.

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
  last-query scan (:meth:`~molt_plugins.render_window.analysis._Analysis.reverse_scan`); such an
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
conditions of :func:`molt_core.ledger.render.window_start` hold (the boundary's neighbours exist and are not last, each
scanned index stays put or lies past the boundary). A common prefix cancels from
``startswith`` and from the tail, so the window's three renders give the full renders'
verdict and tail exactly. A reverse scan's index (Qwen3's last user query) must lie inside the
window (its found-flag is a value the text may use), so after one user turn an agent's tool
chain is rendered from that turn on: the window's cost then grows with the chain, not with the
conversation; a forward scan's index may stay before the gap. A negative subscript during a
window render (``messages[-1]`` via ``loop.index0 - 1`` at index 0) aborts the window
(:class:`molt_core.ledger.render.WindowMessages`).

Without this plugin (``MOLT_DISABLE_PLUGINS=molt_render_window``) every extend check renders the
whole conversation: the same verdicts, at a cost linear in the turn count.
"""

from __future__ import annotations

from typing import Any, Callable

from molt_core.hookspecs import Register, hookimpl
from molt_core.ledger.render import Scan, WindowProof
from molt_plugins.render_window.analysis import _Analysis, _NotProven

__all__ = ["prove_window", "molt_register_render_windows"]

@hookimpl
def molt_register_render_windows(register: Register) -> None:
    """Register :func:`prove_window` as the ``jinja`` window prover."""
    register("jinja", prove_window)


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
