"""The window of the ledger's extend check: the records a window prover returns and the rule
that places a window in a conversation.

The ledger extends a segment only when the chat template keeps the committed history verbatim
(:meth:`molt_core.ledger.Ledger.prepare`). Checked naively, that renders the whole conversation
each turn. A *window prover* (``molt_register_render_windows``; first party:
:mod:`molt_plugins.render_window`, which documents the proof) establishes, once per template,
that rendering a short window -- the conversation's first ``head`` messages followed by its
last few -- gives the same verdict and the same tail as the full render. Without a prover, and
for any window whose runtime conditions (:func:`window_start`) fail, the ledger renders the
whole conversation; nothing is guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from molt_core import _moved

__all__ = ["WindowProof", "Scan", "WindowMessages", "NegativeIndex", "Prover", "window_start"]


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
    """What a window prover established for one template.

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


Prover = Callable[[Any, Any], "tuple[WindowProof | None, str]"]
"""A window prover, ``prove(source, environment) -> (proof, reason)``: ``source`` the chat
template text, ``environment`` the Jinja ``ImmutableSandboxedEnvironment`` it is compiled in;
``(None, reason)`` when the template is outside what the prover covers."""


def window_start(proof: WindowProof, n_prev: int, last_prev: list[int], last_full: list[int]) -> int | None:
    """The first message after the window's gap, or None when no useful window exists.

    Args:
        proof: the template's :class:`WindowProof`.
        n_prev: messages of the previous prompt (the committed history minus its last
            assistant message).
        last_prev / last_full: per scan, the index of the last message satisfying it in the
            previous prompt's messages / in the new prompt's messages (-1 when none).

    The window ``M[:head] + M[j:]`` is valid when (:mod:`molt_plugins.render_window`) the boundary -- the head and
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


def __getattr__(name: str) -> object:
    """``prove_window`` moved to :mod:`molt_plugins.render_window` (deprecated here)."""
    return _moved.moved_attr(__name__, name)
