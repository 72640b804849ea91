"""Embedded engine throughput: continuous batching vs one request at a time (same run).

Runs ``N`` chat prompts through :class:`~molt_core.engines.transformers_engine.TransformersEngine`
on the builtin tiny Qwen3 model twice -- all at once through ``asyncio.gather``, then one after
another -- and prints sampled tokens/s of each and their ratio. Stops are disabled
(``eos_token_ids=[]``) so both runs sample exactly ``N * max_tokens`` tokens.

Usage: ``python benchmarks/bench_engine.py [--n 32] [--max-tokens 64] [--model builtin:tiny-qwen3]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from molt_core.engines.transformers_engine import TransformersEngine
from molt_core.models import load_model, load_tokenizer
from molt_core.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="builtin:tiny-qwen3")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    eng = TransformersEngine(load_model(args.model), tok, max_batch_size=max(args.n, 1), eos_token_ids=[])
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {2 * i}?"}],
                                           add_generation_prompt=True, tokenize=False)).input_ids for i in range(args.n)]
    params = [SamplingParams(max_tokens=args.max_tokens, seed=i) for i in range(args.n)]

    async def batched():
        return await asyncio.gather(*[eng.generate(p, sp) for p, sp in zip(prompts, params)])

    async def sequential():
        return [await eng.generate(p, sp) for p, sp in zip(prompts, params)]

    asyncio.run(eng.generate(prompts[0], SamplingParams(max_tokens=4)))  # warm-up
    rates = {}
    for name, fn in (("batched", batched), ("one-at-a-time", sequential)):
        t = time.perf_counter()
        outs = asyncio.run(fn())
        dt = time.perf_counter() - t
        rates[name] = sum(len(o.token_ids) for o in outs) / dt
        print(f"{name:>14}: {rates[name]:9.1f} tokens/s ({dt:.2f} s)")
    print(f"ratio batched / one-at-a-time: {rates['batched'] / rates['one-at-a-time']:.2f}x")
    eng.close()


if __name__ == "__main__":
    main()
