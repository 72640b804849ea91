"""The window of the ledger's extend check: what a window prover (``molt_register_render_windows``)
returns, and :func:`window_start`, which places a window (first ``head`` messages and the last
few) whose render gives the full render's verdict and tail."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from molt_core import _moved

__all__ = ["WindowProof", "Scan", "WindowMessages", "NegativeIndex", "Prover", "window_start"]


class NegativeIndex(Exception):
    """A window render subscripted the messages with a negative index (the window is refused).
    Not a ``LookupError``, which the Jinja sandbox turns into undefined."""


class WindowMessages(list):  # type: ignore[type-arg]
    """A window render's message list: a negative index (which would wrap to the end) raises
    :class:`NegativeIndex`."""

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, int) and i < 0:
            raise NegativeIndex(i)
        return list.__getitem__(self, i)


@dataclass
class WindowProof:
    """What a window prover established for one template: ``radius``, the largest ``k`` of a
    ``messages[loop.index0 +- k]``; ``head``, messages kept at the window's start; ``scans``, one
    :class:`Scan` per last-index scan."""

    radius: int
    head: int
    scans: list[Scan] = field(default_factory=list)


@dataclass
class Scan:
    """One last-index scan of the template: ``pred(message) -> bool`` and its form, ``reverse`` for
    the Qwen3 idiom (a reversed loop with a found-flag), else a forward loop."""

    pred: Callable[[dict[str, Any]], bool]
    reverse: bool = False


Prover = Callable[[Any, Any], "tuple[WindowProof | None, str]"]
"""``prove(source, environment) -> (proof, reason)``: the chat template text and its Jinja
``ImmutableSandboxedEnvironment``; ``(None, reason)`` for a template the prover does not cover."""


def window_start(proof: WindowProof, n_prev: int, last_prev: list[int], last_full: list[int]) -> int | None:
    """``j``, the first message after the gap of the window ``M[:head] + M[j:]``, or None when no
    useful window exists (the conditions: docs/architecture.md).

    Args:
        proof: the template's :class:`WindowProof`.
        n_prev: messages of the previous prompt (the committed history less its last reply).
        last_prev / last_full: per scan, the last index satisfying it in the previous / the new
            prompt's messages (-1: none).
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
