"""Framework cost per phase of a quickstart step, in one process (no Ray, no driver): molt's
rollout path vs HF ``generate``, and molt's trainer step vs a plain PyTorch update, interleaved
step by step on the same data.

Where ``benchmarks/bench_quickstart.py`` times whole runs (Ray hops, driver, weight publish
included), this isolates the two phases the framework wraps:

* **rollout**: :meth:`molt_core.runtime.workers.RolloutWorker.rollout` on the step's 8 tasks x 8
  samples -- ledger (chat template, prompt ids), the embedded continuous-batching engine on
  its own thread, the env's scoring, trajectories -- vs the plain loop of
  ``bench_quickstart.py``: chat-template prompt ids, one left-padded HF ``generate`` (T = 1),
  exact-match reward.
* **train**: :meth:`molt_core.train.Trainer.train_step` on the ok trajectories of that rollout
  (ingress and its identity checks, gate, advantages, loss forward with the fused recompute,
  backward, clip, AdamW, metrics) vs the plain REINFORCE update of ``bench_quickstart.py`` on
  the same sequences (its own model copy, same optimizer settings). The engine gets the
  trainer's weights after each step, so the rollouts stay on-policy.

Prints the median of each phase (steps before ``--warmup`` excluded) and the per-step ratio
molt / plain (median and range). Absolute times drift on a shared machine; the ratios are
interleaved so drift hits both sides alike.

Usage: ``python benchmarks/bench_step_phases.py --model runs/bench_quickstart/sft-1200steps/model
[--steps 25] [--warmup 3] [--threads 1]`` (a warm-started model makes completions end as in a
real run; ``builtin:tiny-qwen3`` works but samples every token to ``max_tokens``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quickstart as bq  # noqa: E402  (the plain loop's pieces: prompt ids, generate, reward, GRPO)

from molt_core.cli.recipe import load_config  # noqa: E402


def plain_update(model, opt, params, trajs, group: int, grad_clip: float) -> None:
    """The plain loop's update (:func:`bench_quickstart.reinforce_step`) on the first segment of
    each trajectory (one per rollout here), GRPO advantages per consecutive ``group``."""
    seqs = [t.segments[0] for t in trajs]
    r = torch.tensor([float(t.reward) for t in trajs])
    adv = bq.grpo_advantages(r, group) if len(trajs) % group == 0 else r - r.mean()
    L = max(len(s.token_ids) for s in seqs)
    ids = torch.zeros((len(seqs), L), dtype=torch.long)
    att = torch.zeros_like(ids)
    mask = torch.zeros((len(seqs), L), dtype=torch.bool)
    for i, s in enumerate(seqs):
        k = len(s.token_ids)
        ids[i, :k] = torch.tensor(s.token_ids)
        att[i, :k] = 1
        mask[i, :k] = torch.tensor(s.loss_mask)
    bq.reinforce_step(model, opt, params, ids, att, mask, adv, grad_clip)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:tiny-qwen3", help="model path (a warm start: see the usage line)")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from molt_core.models import load_model, load_tokenizer
    from molt_core.runtime.workers import RolloutWorker
    from molt_core.train import Trainer

    model_path = args.model if args.model.startswith("builtin:") else str(Path(args.model).resolve())
    cfg = load_config(bq.RECIPE, [f"model.path={json.dumps(model_path)}", "sft.steps=0",
                                  f"run.seed={args.seed}", f"run.threads={args.threads}"])
    P, n, max_tokens = cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_tokens
    worker = RolloutWorker(cfg, 0)
    trainer = Trainer(cfg)
    tok = load_tokenizer(model_path)
    if model_path.startswith("builtin:"):
        model = load_model(model_path, dtype="float32", seed=args.seed)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32).eval()
    params = [p for p in model.parameters() if p.requires_grad]
    t = cfg.trainer
    opt = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay)
    tasks = bq.train_tasks(bq.make_env(bq.load_recipe()), args.seed, args.steps * P)
    loop = asyncio.new_event_loop()
    rows: list[dict[str, float]] = []
    try:
        for s in range(args.steps):
            batch = tasks[s * P:(s + 1) * P]
            t0 = time.perf_counter()
            groups = loop.run_until_complete(worker.rollout(batch, n))
            t1 = time.perf_counter()
            prompts = [bq.prompt_ids(tok, x["question"]) for x in batch for _ in range(n)]
            comps = bq.generate(model, tok, prompts, max_tokens, sample=True)
            _ = [bq.reward_of(tok, c, batch[i // n]["answer"]) for i, c in enumerate(comps)]
            t2 = time.perf_counter()
            trajs = [x for g in groups for x in g.trajectories if x.status == "ok"]
            trainer.train_step(trajs)
            t3 = time.perf_counter()
            plain_update(model, opt, params, trajs, n, t.grad_clip)
            t4 = time.perf_counter()
            worker.engine.load_weights(trainer.weights(), trainer.version)  # on-policy next step (not timed)
            rows.append({"rollout": t1 - t0, "generate": t2 - t1, "train_step": t3 - t2, "update": t4 - t3})
    finally:
        worker.engine.close()
        loop.close()
    rows = rows[args.warmup:]

    def med(k: str) -> float:
        return statistics.median(r[k] for r in rows)

    print(f"{len(rows)} steps (after {args.warmup} warm-up), {P}x{n} per step, {args.threads} thread(s), model {args.model}")
    for a, b in (("rollout", "generate"), ("train_step", "update")):
        rs = [r[a] / r[b] for r in rows]
        print(f"  molt {a:10s} {1e3 * med(a):7.1f} ms   plain {b:8s} {1e3 * med(b):7.1f} ms   "
              f"ratio median {statistics.median(rs):.3f} [{min(rs):.2f}-{max(rs):.2f}]")
    tot = [(r["rollout"] + r["train_step"]) / (r["generate"] + r["update"]) for r in rows]
    print(f"  both phases: ratio median {statistics.median(tot):.3f} [{min(tot):.2f}-{max(tot):.2f}]")


if __name__ == "__main__":
    main()
