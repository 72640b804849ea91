"""The server over the real embedded engine (builtin tiny Qwen3 models) and ``molt serve``.

The strongest token-identity check runs a random tiny model over the real Qwen2/3 BPE
vocabulary: its samples mostly do not survive decode -> re-encode, so only a token-exact
path yields a trajectory equal to the concatenation of wire ids and template deltas."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest
import torch

from molt_core.identity import TokenCheck, check_tokens
from molt_core.engines.transformers_engine import TransformersEngine
from molt_core.models import load_model, load_tokenizer
from molt_core.server import start_server

torch.set_num_threads(1)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def render(tok, msgs, gen=True):
    return tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)


def run_conversation(tok, h, turns, max_tokens):
    """Alternate wires over ``turns`` user turns; return the expected ledger segments built
    from the wire's token_ids and the template, the wire ids, and the trajectory."""
    info = h.create_session()
    oc = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0, timeout=120)
    ac = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0, timeout=120)
    msgs, segments, wire_ids, wire_lps, last = [], [], [], [], None
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Turn {t}: what is {t} + {t}?"})
        if t % 2 == 0:
            r = oc.chat.completions.create(model="m", messages=msgs, max_tokens=max_tokens, temperature=1.0, seed=t)
            ch = r.choices[0]
            ids, reply = ch.token_ids, {"role": "assistant", "content": ch.message.content or "",
                                        **({"reasoning_content": ch.message.reasoning_content}
                                           if getattr(ch.message, "reasoning_content", None) is not None else {})}
            wire_lps.append([x.logprob for x in ch.logprobs.content])
        else:
            r = ac.messages.create(model="m", max_tokens=max_tokens, messages=msgs)
            ids = r.token_ids
            reply = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]}
            wire_lps.append(None)
        wire_ids.append(ids)
        full = render(tok, _oa(msgs))
        held = render(tok, _oa(last), gen=False) if last is not None else None
        if held is not None and full.startswith(held) and segments:
            closed = wire_ids[-2][-1] == tok.convert_tokens_to_ids("<|im_end|>")
            segments[-1] += enc(tok, ("\n" if closed else "<|im_end|>\n") + full[len(held):]) + ids
        else:
            segments.append(enc(tok, full) + ids)
        msgs.append(reply)
        last = list(msgs)
    traj = h.trajectory(info.session_id)
    # the behaviour logprobs stored are the ones the engine reported on the wire
    stored = [lp for seg in traj.segments for lp, m in zip(seg.logprobs, seg.loss_mask) if m]
    i = 0
    for ids, lps in zip(wire_ids, wire_lps):
        if lps is not None:
            assert stored[i:i + len(ids)] == pytest.approx(lps, abs=1e-6)
        i += len(ids)
    return segments, wire_ids, traj


def _oa(msgs):
    """The conversation as the ledger renders it (Anthropic blocks -> OpenAI messages)."""
    out = []
    for m in msgs:
        if isinstance(m["content"], list):
            text = "".join(b.get("text", "") for b in m["content"] if b["type"] == "text")
            think = [b["thinking"] for b in m["content"] if b["type"] == "thinking"]
            out.append({"role": m["role"], "content": text, **({"reasoning_content": think[0]} if think else {})})
        else:
            out.append(m)
    return out


@pytest.fixture(scope="module")
def tiny():
    tok = load_tokenizer("builtin:tiny-qwen3")
    eng = TransformersEngine(load_model("builtin:tiny-qwen3"), tok, max_batch_size=8, seed=0)
    h = start_server(eng, tok)
    yield tok, eng, h
    h.stop()
    eng.close()


def test_tiny_qwen3_both_wires_token_exact(tiny):
    tok, eng, h = tiny
    # a random model rarely emits <|im_end|>: max_tokens ends most turns by length, and rarely
    # a think block appears; both wires' trajectories must equal the stitched expectation
    segments, wire_ids, traj = run_conversation(tok, h, 4, 12)
    assert [s.token_ids for s in traj.segments] == segments
    sampled = [t for s in traj.segments for t, m in zip(s.token_ids, s.loss_mask) if m]
    assert sampled == [t for ids in wire_ids for t in ids]
    assert check_tokens(traj) == TokenCheck(0, 0)  # every action token is what the engine sampled


def test_bigvocab_random_samples_token_exact():
    tok = load_tokenizer("builtin:tiny-qwen3-bigvocab")
    eng = TransformersEngine(load_model("builtin:tiny-qwen3-bigvocab"), tok, max_batch_size=4, seed=1)
    h = start_server(eng, tok)
    try:
        segments, wire_ids, traj = run_conversation(tok, h, 4, 16)
    finally:
        h.stop()
        eng.close()
    # the premise: random samples do not survive decode -> re-encode
    changed = sum(enc(tok, tok.decode(ids)) != ids for ids in wire_ids)
    assert changed >= 3, f"only {changed} of 4 samples change under re-encoding"
    assert [s.token_ids for s in traj.segments] == segments
    sampled = [t for s in traj.segments for t, m in zip(s.token_ids, s.loss_mask) if m]
    assert sampled == [t for ids in wire_ids for t in ids]
    # logprobs stored are the engine's, one per sampled id
    assert sum(lp is not None for s in traj.segments for lp in s.logprobs) == len(sampled)


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN])
def test_molt_serve_cli(inherited):
    """`molt serve` answers and stops on SIGINT -- also when started with SIGINT ignored (a
    background job of a non-interactive shell; a parent process that ignores it)."""
    env = {**os.environ, "MOLT_ADMIN_KEY": "adm-test", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "molt_core.cli", "serve", "--model", "builtin:tiny-qwen3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, inherited))
    try:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        ready = json.loads(line)
        assert ready["admin_key"] == "adm-test" and ready["base_url"].startswith("http://127.0.0.1:")
        s = ready["session"]
        r = openai.OpenAI(base_url=s["openai_base_url"], api_key=s["api_key"], max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5, seed=0)
        ids = r.choices[0].token_ids
        assert 1 <= len(ids) <= 5
        t = httpx.get(f"{ready['base_url']}/sessions/{s['session_id']}/trajectory", headers={"x-api-key": "adm-test"}).json()
        assert [x for x, m in zip(t["segments"][0]["token_ids"], t["segments"][0]["loss_mask"]) if m] == ids
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=120)  # a loaded 2-core CI machine can take tens of seconds to shut down


def test_molt_serve_bad_model(capsys):
    from click.testing import CliRunner

    from molt_core.cli import main

    r = CliRunner().invoke(main, ["serve", "--model", "builtin:nope"])
    assert r.exit_code == 2
    assert "--model builtin:nope" in capsys.readouterr().err + r.output


def test_molt_serve_prefix_cache_mb_reaches_every_engine(monkeypatch, capsys):
    """--prefix-cache-mb sizes each engine's prefix cache (default 256 MiB); a negative value is refused."""
    from click.testing import CliRunner

    import molt_core.engines.transformers_engine as te
    from molt_core.cli import main

    seen = []

    def fake(model, **kw):
        seen.append(kw["prefix_cache_mb"])
        raise ValueError("stop here")

    monkeypatch.setattr(te, "TransformersEngine", fake)
    assert CliRunner().invoke(main, ["serve", "--model", "m", "--prefix-cache-mb", "32"]).exit_code == 2
    assert CliRunner().invoke(main, ["serve", "--model", "m"]).exit_code == 2
    assert seen == [32.0, 256.0]
    r = CliRunner().invoke(main, ["serve", "--model", "m", "--prefix-cache-mb", "-1"])
    assert r.exit_code == 2 and "--prefix-cache-mb" in r.output and seen == [32.0, 256.0]
