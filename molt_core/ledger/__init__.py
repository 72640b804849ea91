"""The session ledger: the single place where trajectories are assembled, token-exactly.

:mod:`~molt_core.ledger.session` holds the :class:`Ledger`; ``prepare`` plans a request, ``commit``
records a generation, ``turn`` runs one turn; ``template``, ``compare``, ``messages``, ``toolcall``,
``render`` and ``records`` serve them.
"""

from __future__ import annotations

from molt_core.ledger.messages import normalize_messages
from molt_core.ledger.prepare import max_token_bytes
from molt_core.ledger.records import LEDGER_INFO_KEYS, REWRITE_CAUSES, AssistantTurn, LedgerConflict, Prepared, PromptTooLong
from molt_core.ledger.session import Ledger
from molt_core.ledger.turn import take_turn

__all__ = ["LEDGER_INFO_KEYS", "REWRITE_CAUSES", "Ledger", "Prepared", "AssistantTurn", "LedgerConflict", "PromptTooLong",
           "normalize_messages", "max_token_bytes", "take_turn"]
