"""Loopback server overhead and ledger cost per turn (ratios against a peer measured in the same run).

1. Server overhead: ``--requests`` sequential chat requests (median) through the OpenAI SDK and the
   loopback server (ledger + HTTP + JSON) vs the same prompts sent straight to
   ``engine.generate``; on the builtin tiny Qwen3 engine (stops disabled, ``--max-tokens``
   tokens per request) and on a zero-cost scripted engine (pure server cost per request).
2. Ledger cost per turn over a ``--turns``-turn session (prepare + commit, zero-cost engine):
   mean time of the first and the last 20 turns and their ratio, split into the chat-template
   render (a window of the conversation for a proven template, see benchmarks/bench_ledger.py),
   message normalization (reading the request's messages; the unchanged prefix is compared, not
   re-read) and the ledger's token bookkeeping (tokenizing only the tail, appending the sampled
   ids: this part must not grow with the turn count).

Usage: ``python benchmarks/bench_server.py [--requests 30] [--max-tokens 16] [--turns 200]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fake_engine import ScriptedEngine  # noqa: E402

from molt_core.engines.transformers_engine import TransformersEngine  # noqa: E402
from molt_core.ledger import Ledger  # noqa: E402
from molt_core.models import load_model, load_tokenizer  # noqa: E402
from molt_core.server import start_server  # noqa: E402
from molt_core.types import SamplingParams  # noqa: E402


def server_vs_direct(engine, tok, n: int, max_tokens: int) -> tuple[float, float]:
    """Median seconds per request through the server (OpenAI SDK, one fresh session per
    request) and straight to ``engine.generate`` with the same prompt ids; the two are
    interleaved request by request so machine load hits both alike."""
    import openai

    h = start_server(engine, tok)
    prompts = [[{"role": "user", "content": f"What is {i} + {2 * i}?"}] for i in range(n)]
    ids = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
           for m in prompts]
    loop = asyncio.new_event_loop()
    t_server, t_direct = [], []
    try:
        info = h.create_session()
        client = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
        client.chat.completions.create(model="m", messages=prompts[0], max_tokens=2)  # warm-up
        # sessions and clients are made before the clock starts; one connection pool
        clients = [client.with_options(base_url=i.openai_base_url, api_key=i.api_key)
                   for i in (h.create_session() for _ in prompts)]
        for i, (c, msgs) in enumerate(zip(clients, prompts)):
            t0 = time.perf_counter()
            c.chat.completions.create(model="m", messages=msgs, max_tokens=max_tokens, seed=i)
            t1 = time.perf_counter()
            loop.run_until_complete(engine.generate(ids[i], SamplingParams(max_tokens=max_tokens, seed=i)))
            t2 = time.perf_counter()
            t_server.append(t1 - t0)
            t_direct.append(t2 - t1)
    finally:
        h.stop()
        loop.close()
    return statistics.median(t_server), statistics.median(t_direct)


def ledger_turns(tok, turns: int) -> list[tuple[float, float, float]]:
    """(total, template render, message normalization) seconds of prepare + commit for each
    turn of one session."""
    led = Ledger(tok)
    eng = ScriptedEngine(tok)
    spent = {"render": 0.0, "normalize": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
        return wrapper

    led.render = timed("render", led.render)  # type: ignore[method-assign]
    led._render_window = timed("render", led._render_window)  # type: ignore[method-assign]
    led._normalize = timed("normalize", led._normalize)  # type: ignore[method-assign]
    msgs: list[dict] = []
    out = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Step {t}: the tool said {t * 7}."})
        gen = eng.output(f"Noted step {t}.", SamplingParams(), 0)
        spent.update(render=0.0, normalize=0.0)
        t0 = time.perf_counter()
        p = led.prepare(msgs)
        turn = led.commit(p, gen)
        out.append((time.perf_counter() - t0, spent["render"], spent["normalize"]))
        assert p.mode in ("start", "extend")
        msgs.append({"role": "assistant", "content": turn.content})
    from molt_core.identity import check_tokens

    assert check_tokens(led.trajectory()).retokenized == 0 and len(led.segments()) == 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--model", default="builtin:tiny-qwen3")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer(args.model)

    eng = TransformersEngine(load_model(args.model), tok, max_batch_size=4, eos_token_ids=[])
    s, d = server_vs_direct(eng, tok, args.requests, args.max_tokens)
    eng.close()
    print(f"[{args.model}, {args.max_tokens} tokens/request] server {s * 1e3:.1f} ms/request, direct engine "
          f"{d * 1e3:.1f} ms/request: ratio {s / d:.2f}x, overhead {(s - d) * 1e3:.1f} ms/request")
    s0, d0 = server_vs_direct(ScriptedEngine(tok, ["x" * 8] * (args.requests + 1)), tok, args.requests, args.max_tokens)
    print(f"[zero-cost engine] server {s0 * 1e3:.2f} ms/request, direct {d0 * 1e3:.3f} ms/request: "
          f"pure server cost {(s0 - d0) * 1e3:.2f} ms/request")

    per = ledger_turns(tok, args.turns)
    k = min(20, args.turns // 2)

    def mean(xs):
        return statistics.median(xs) * 1e3

    rows = {"total (prepare + commit)": [a for a, _, _ in per],
            "chat-template render": [b for _, b, _ in per],
            "message normalization": [c for _, _, c in per],
            "ledger token bookkeeping": [a - b - c for a, b, c in per]}
    print(f"[ledger, {args.turns}-turn session] median ms per turn, first {k} vs last {k} turns:")
    for name, xs in rows.items():
        f, last = mean(xs[:k]), mean(xs[-k:])
        print(f"  {name:<26} {f:8.3f} vs {last:8.3f}  ratio {last / f:6.2f}x")


if __name__ == "__main__":
    main()
