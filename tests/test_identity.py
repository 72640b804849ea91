"""Token identity measured against the engine's own record (issue 10 item 1): the digest,
the record carried from engine through ledger into each span, the per-token check at ingress,
old data without a record, and JSON round trips."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from fake_engine import ScriptedEngine
from molt_core.engines.base import GenerationOutput
from molt_core.identity import IdDigest, TokenCheck, check_tokens, digest_ids, screen
from molt_core.ledger import Ledger
from molt_core.models import load_tokenizer
from molt_core.types import SampledSpan, SamplingParams, Segment, Trajectory

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen3")


def test_digest_is_blake2b_128_over_int64_le():
    raw = (1).to_bytes(8, "little") + (258).to_bytes(8, "little")  # 01 00.. | 02 01 00..
    assert raw == b"\x01" + b"\x00" * 7 + b"\x02\x01" + b"\x00" * 6
    want = hashlib.blake2b(raw, digest_size=16).hexdigest()
    assert digest_ids([1, 258]) == want and len(want) == 32
    assert IdDigest().update([1]).update([258]).hexdigest() == want  # incremental == at once
    assert digest_ids([]) == "cae66941d9efbd404e4d88758ea67670"  # BLAKE2b-128 of the empty string
    assert digest_ids([258, 1]) != want


def _session(tok):
    """Two turns through a ledger with an engine that records its ids (the clean case)."""
    eng = ScriptedEngine(tok, ["Hello there.", "Bye now."])
    led = Ledger(tok)
    msgs = [{"role": "user", "content": "hi"}]
    p1 = led.prepare(msgs)
    o1 = asyncio.run(eng.generate(p1.prompt_ids, SamplingParams()))
    led.commit(p1, o1)
    msgs = led.history + [{"role": "user", "content": "bye"}]
    p2 = led.prepare(msgs)
    o2 = asyncio.run(eng.generate(p2.prompt_ids, SamplingParams()))
    led.commit(p2, o2)
    return led.trajectory(reward=1.0), o1, o2


def test_ledger_carries_the_engine_record_and_a_clean_rollout_reads_zero(tok):
    traj, o1, o2 = _session(tok)
    (seg,) = traj.segments
    assert [(sp.sampled_ids, sp.digest) for sp in seg.spans] == [(o1.token_ids, digest_ids(o1.token_ids)),
                                                                  (o2.token_ids, digest_ids(o2.token_ids))]
    assert check_tokens(traj) == TokenCheck(0, 0, None)
    kept, m = screen([traj])
    assert kept == [traj] and m["invariants/tokens_retokenized"] == 0.0 and m["ingress/refused_rollouts"] == 0.0


def test_ledger_keeps_the_engines_digest_not_one_of_its_own(tok):
    """An engine whose record disagrees with the ids it returned (its sampler emitted 11, 12;
    11, 13 came back): the ledger stores the engine's digest verbatim -- one recomputed from
    the returned ids would hide the fault -- so ingress counts the whole span."""
    led = Ledger(tok)
    p = led.prepare([{"role": "user", "content": "hi"}])
    sampled = hashlib.blake2b(b"".join(i.to_bytes(8, "little") for i in (11, 12)), digest_size=16).hexdigest()
    led.commit(p, GenerationOutput(token_ids=[11, 13], logprobs=[-1.0] * 2, versions=[0] * 2, finish_reason="length",
                                   sampled_digest=sampled))
    traj = led.trajectory(reward=0.0)
    n = len(p.prompt_ids)
    assert traj.segments[0].spans[0].digest == sampled
    assert check_tokens(traj) == TokenCheck(2, 0, f"segment 0, span 0 (tokens {n}..{n + 2})")
    kept, m = screen([traj])
    assert kept == [] and m["invariants/tokens_retokenized"] == 2.0


def test_altered_ids_are_counted_per_token(tok):
    traj, o1, o2 = _session(tok)
    sp0, sp1 = traj.segments[0].spans
    bad = traj.model_copy(deep=True)
    bad.segments[0].token_ids[sp0.start] += 1  # one id altered after the ledger built the segment
    assert check_tokens(bad) == TokenCheck(1, 0, f"segment 0, span 0 (tokens {sp0.start}..{sp0.end})")
    bad.segments[0].token_ids[sp1.start + 1] += 1
    bad.segments[0].token_ids[sp1.start + 2] += 1
    assert check_tokens(bad).retokenized == 3
    kept, m = screen([bad, traj.model_copy(update={"rollout_id": "other"})])
    assert [t.rollout_id for t in kept] == ["other"]
    assert m["invariants/tokens_retokenized"] == 3.0 and m["ingress/refused_rollouts"] == 1.0


def test_altered_record_counts_the_whole_span(tok):
    """If the stored ids were altered as well, they are not the engine's (their digest
    differs): which tokens differ is unknown, so every token of the span counts."""
    traj, o1, _ = _session(tok)
    sp0 = traj.segments[0].spans[0]
    bad = traj.model_copy(deep=True)
    bad.segments[0].token_ids[sp0.start] += 1
    bad.segments[0].spans[0].sampled_ids[0] += 1
    assert check_tokens(bad).retokenized == len(o1.token_ids)
    # a record altered while the segment is intact: the segment still matches the digest
    ok = traj.model_copy(deep=True)
    ok.segments[0].spans[0].sampled_ids[0] += 1
    assert check_tokens(ok) == TokenCheck(0, 0)


def test_engine_without_record_is_unverified_and_refused_when_asked(tok):
    led = Ledger(tok)
    p = led.prepare([{"role": "user", "content": "hi"}])
    led.commit(p, GenerationOutput(token_ids=[11, 12, 13], logprobs=[-1.0] * 3, versions=[0] * 3, finish_reason="length"))
    traj = led.trajectory(reward=0.0)
    assert traj.segments[0].spans[0].digest is None and traj.segments[0].spans[0].sampled_ids is None
    assert check_tokens(traj) == TokenCheck(0, 3)
    kept, m = screen([traj])
    assert kept == [traj] and m["invariants/tokens_unverified"] == 3.0 and m["ingress/refused_rollouts"] == 0.0
    # trainer.refuse_unverified (the default) refuses it
    kept, m = screen([traj], refuse_unverified=True)
    assert kept == [] and m["invariants/tokens_unverified"] == 3.0
    assert m["ingress/refused_unverified"] == 1.0 and m["ingress/refused_rollouts"] == 1.0
    # a rollout whose ids were altered AND whose record was stripped: unverified, so refused
    clean, _, _ = _session(tok)
    forged = clean.model_copy(deep=True)
    sp = forged.segments[0].spans[0]
    forged.segments[0].token_ids[sp.start] += 1
    sp.digest = sp.sampled_ids = None
    kept, m = screen([forged, clean.model_copy(update={"rollout_id": "c"})], refuse_unverified=True)
    assert [t.rollout_id for t in kept] == ["c"] and m["ingress/refused_unverified"] == 1.0
    assert m["invariants/tokens_unverified"] == float(sp.end - sp.start)


def test_record_round_trips_json_and_old_data_loads(tok):
    traj, _, _ = _session(tok)
    back = Trajectory.model_validate_json(traj.model_dump_json())
    assert back == traj and check_tokens(back) == TokenCheck(0, 0)
    old = traj.model_dump(mode="json")
    for sp in old["segments"][0]["spans"]:  # data written before the record existed
        del sp["sampled_ids"], sp["digest"]
    loaded = Trajectory.model_validate(old)
    assert check_tokens(loaded) == TokenCheck(0, loaded.num_sampled)


def test_span_record_length_is_validated():
    with pytest.raises(ValueError, match=r"sampled_ids has 1 ids but the span \[2, 4\) holds 2 tokens"):
        SampledSpan(start=2, end=4, sampled_ids=[5], digest=digest_ids([5]))
    seg = Segment(token_ids=[1, 2, 3], loss_mask=[False, True, True], logprobs=[None, -1.0, -1.0], versions=[None, 0, 0],
                  spans=[SampledSpan(start=1, end=3, sampled_ids=[2, 3], digest=digest_ids([2, 3]))])
    assert check_tokens(Trajectory(segments=[seg], reward=0.0)) == TokenCheck(0, 0)


def test_transformers_engine_digest_is_of_the_ids_it_sampled(tok):
    """The engine's record against an expectation built without the engine: greedy ids from a
    plain full forward of the same weights (argmax, no KV cache), hashed by the module-doc
    formula with hashlib; then through a ledger, one tampered id is flagged against that record."""
    from molt_core.engines.transformers_engine import TransformersEngine

    led = Ledger(tok)
    p = led.prepare([{"role": "user", "content": "hi"}])
    eng = TransformersEngine("builtin:tiny-qwen3", max_batch_size=2, seed=0)
    try:  # the builtin init repeats one id greedily; noise on the weights makes the ids vary
        g = torch.Generator().manual_seed(0)
        eng.load_weights({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in eng.model.state_dict().items()}, 1)
        o = asyncio.run(eng.generate(p.prompt_ids, SamplingParams(max_tokens=6, temperature=0.0)))
        ids = list(p.prompt_ids)
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(eng.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    finally:
        eng.close()
    want = ids[len(p.prompt_ids):]
    assert o.finish_reason == "length" and o.token_ids == want and len(set(want)) > 1
    raw = b"".join(i.to_bytes(8, "little", signed=True) for i in want)
    assert o.sampled_digest == hashlib.blake2b(raw, digest_size=16).hexdigest()
    led.commit(p, o)
    traj = led.trajectory(reward=0.0)
    assert check_tokens(traj) == TokenCheck(0, 0)
    sp = traj.segments[0].spans[0]
    traj.segments[0].token_ids[sp.start + 2] += 1  # the fault: one action id altered after sampling
    assert check_tokens(traj) == TokenCheck(1, 0, f"segment 0, span 0 (tokens {sp.start}..{sp.end})")
