"""Scripted engines for ledger/server tests; they now live in :mod:`molt_core.testing`
(public, shipped) and are re-exported here so existing tests keep importing them."""

from molt_core.testing import EchoEngine, FailingEngine, ScriptedEngine

__all__ = ["ScriptedEngine", "EchoEngine", "FailingEngine"]
