"""The session ledger: the single place where trajectories are assembled, token-exactly.

One job a module: :mod:`~molt_core.ledger.session` (the :class:`Ledger` of one rollout and its
read-out), :mod:`~molt_core.ledger.prepare` (planning a request: start, extend, rewrite,
retry), :mod:`~molt_core.ledger.commit` (recording a generation and parsing it),
:mod:`~molt_core.ledger.turn` (the one turn: prepare -> engine -> commit),
:mod:`~molt_core.ledger.template` (the chat template's facts), :mod:`~molt_core.ledger.compare`
(message comparison), :mod:`~molt_core.ledger.records` (plans, turns, errors), besides
messages, the tool-call protocol (:mod:`~molt_core.ledger.toolcall`) and render.
"""

from __future__ import annotations

from molt_core.ledger.messages import normalize_messages
from molt_core.ledger.prepare import max_token_bytes
from molt_core.ledger.records import LEDGER_INFO_KEYS, REWRITE_CAUSES, AssistantTurn, LedgerConflict, Prepared, PromptTooLong
from molt_core.ledger.session import Ledger
from molt_core.ledger.turn import take_turn

__all__ = ["LEDGER_INFO_KEYS", "REWRITE_CAUSES", "Ledger", "Prepared", "AssistantTurn", "LedgerConflict", "PromptTooLong",
           "normalize_messages", "max_token_bytes", "take_turn"]
