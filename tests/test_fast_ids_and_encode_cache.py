"""Rollout-path cuts of issue 16 item 2: ids without one ``os.urandom`` per id, and the
ledger's prompt encoding reused across the rollouts of a group."""

import multiprocessing as mp
import re

import pytest

from molt_core.ledger import template as ledger_mod
from molt_core import types
from molt_core.ledger import Ledger
from molt_core.models import load_tokenizer
from molt_core.types import new_id


def test_new_id_format_and_uniqueness():
    ids = [new_id() for _ in range(20_000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert re.fullmatch(r"r-[0-9a-f]{32}", new_id("r"))


def _child_id(q):
    q.put(new_id())


def test_forked_child_draws_its_own_ids():
    """After a fork the child reseeds: without it the child would print the parent's next id."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_id, args=(q,))
    p.start()
    child = q.get(timeout=30)
    p.join(30)
    assert child != new_id()


def test_a_source_that_is_not_reseeded_repeats_the_parents_ids():
    """The fault the fork hook prevents: two sources with one state give the same ids."""
    a = types._IdSource()
    b = types._IdSource()
    b.rng.setstate(a.rng.getstate())
    assert a.hex() == b.hex()  # same state -> same id: why a forked child must reseed
    b.reseed()
    assert a.hex() != b.hex()


class _Counting:
    """A tokenizer proxy counting ``encode`` calls (the ledger's only path to encoding text)."""

    def __init__(self, tok):
        self._tok, self.calls = tok, []

    def encode(self, text, **kw):
        self.calls.append(text)
        return self._tok.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_group_rollouts_encode_their_shared_prompt_once():
    tok = _Counting(load_tokenizer("builtin:tiny-qwen3"))
    msgs = [{"role": "user", "content": "What is 12 + 34?"}]
    preps = [Ledger(tok).prepare(msgs) for _ in range(8)]
    text = preps[0].prompt_text
    want = tok._tok.encode(text, add_special_tokens=False)
    assert all(p.prompt_ids == want for p in preps)
    assert tok.calls.count(text) == 1
    preps[0].prompt_ids.append(-1)  # a caller mutating its list does not touch the cache
    assert Ledger(tok).prepare(msgs).prompt_ids == want


def test_encode_cache_is_bounded_oldest_first(monkeypatch):
    monkeypatch.setattr(ledger_mod, "_ENCODED_MAX", 2)
    tok = _Counting(load_tokenizer("builtin:tiny-qwen3"))
    lg = Ledger(tok)
    for t in ("a", "b", "c", "a"):
        lg._encode(t)
    assert list(ledger_mod._ENCODED[tok]) == ["c", "a"]
    assert tok.calls[-4:] == ["a", "b", "c", "a"]  # "a" was dropped when "c" came, so encoded again
