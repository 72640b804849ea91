"""Trainer step time: molt-sdk's :class:`~molt_core.train.Trainer` vs TRL's ``GRPOTrainer``
on the same tiny model, batch and data, interleaved step by step in one run.

Setup (the reference benchmark setting, ``recipes/quickstart.toml``): builtin tiny Qwen3 (~0.85M parameters), 2-digit
addition "What is A + B?" with exact-match reward, 8 prompts x 8 completions per step, at
most 8 new tokens at T = 1, no KL / reference, AdamW lr 3e-4 constant, betas (0.9, 0.98),
grad-norm clip 1.0, GRPO advantages. TRL is configured fairly: ``loss_type="grpo"``,
bf16 off, gradient checkpointing off, ``optim="adamw_torch"``, constant LR.

How the comparison is kept to the *training* part on *the same data*:

* TRL runs its own loop (``trainer.train()``); a callback times each optimizer step
  (``on_step_begin`` -> ``on_step_end``: generation, rewards, advantages, forward, backward,
  clip, AdamW) and a wrapper times TRL's generation (``_generate``: prompt templating,
  ``model.generate``, decoding). TRL's train time = step time - generation time.
* The batch TRL generated (prompt ids, completion ids up to and including EOS, rewards) is
  captured; right after TRL's step, molt's trainer trains on exactly those sequences. The
  behaviour logprobs an engine would report are computed by molt's model *outside* the timed
  region (on-policy, version-stamped); only ``Trainer.train_step`` is timed (ingress,
  logprob recompute, correction + gate, advantages, loss, backward, clip, AdamW).

Both start from identical weights, warm-started by ``--sft-steps`` (default 800) of molt's
SFT on 30%-noisy labels as in the quickstart recipe, so completions end and rewards vary as in a
real run (``--sft-steps 0``: a random model, every reward 0). Steps before ``--warmup`` are excluded; the medians and
the ratio molt / TRL are printed (< 1 means molt's trainer step is faster).

Usage: ``python benchmarks/bench_trainer.py [--steps 30] [--warmup 3] [--threads 1]``
(needs ``pip install -e .[dev,bench]``; ``bench`` brings ``trl``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def make_dataset(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)})
    return rows


def exact_match(completions, answer, **_):
    """Reward: 1.0 when the completion text (stripped) equals the answer."""
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="builtin:tiny-qwen3")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=800,
                    help="warm start both models (same weights) so rewards vary, as the quickstart does")
    ap.add_argument("--label-noise", type=float, default=0.3, help="fraction of wrong SFT targets")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from molt_core.config import RunConfig
    from molt_core.models import load_model, load_tokenizer
    from molt_core.train import Trainer, build_batch
    from molt_core.types import SampledSpan, Segment, Trajectory

    tok = load_tokenizer(args.model)
    trl_model = load_model(args.model, seed=0)
    molt_model = load_model(args.model, seed=0)
    batch = args.prompts * args.samples

    cfg = RunConfig.model_validate({
        "run": {"steps": args.steps, "seed": 0},
        "trainer": {"lr": 3e-4, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.0, "grad_clip": 1.0,
                    "lr_schedule": "constant", "micro_batch_size": batch, "ppo_epochs": 1},
        "algo": {"advantage": "grpo", "loss": "ppo", "kl_coef": 0.0},
    })
    molt = Trainer(cfg, model=molt_model, tokenizer=tok)
    if args.sft_steps:
        from molt_core.train.sft import noisy_answer, sft

        rng = random.Random(1)
        ex = [(r["prompt"], noisy_answer(r["answer"], rng) if rng.random() < args.label_noise else r["answer"])
              for r in make_dataset(4000, seed=1)]
        losses = sft(molt, ex, steps=args.sft_steps, batch_size=32, lr=1e-3, seed=0)
        trl_model.load_state_dict(molt_model.state_dict())
        print(f"warm start: {args.sft_steps} SFT steps, loss {losses[0]:.2f} -> {losses[-1]:.2f}")

    out_dir = tempfile.mkdtemp(prefix="bench-trl-")
    targs = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=batch, num_generations=args.samples,
        max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=3e-4, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.98,
        adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        loss_type="grpo", beta=0.0, num_iterations=1, bf16=False, fp16=False, gradient_checkpointing=False,
        use_cpu=True, max_steps=args.steps, logging_steps=10_000, save_strategy="no", report_to=[],
        seed=0, disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    ds = Dataset.from_list(make_dataset(args.prompts * (args.steps + 2), seed=0))
    trl = GRPOTrainer(model=trl_model, reward_funcs=exact_match, args=targs, train_dataset=ds,
                      processing_class=tok)

    rec: dict = {"gen": 0.0, "batch": None}
    trl_step, trl_gen, molt_step, molt_recompute, rewards = [], [], [], [], []

    orig_generate = trl._generate

    def timed_generate(prompts):
        t = time.perf_counter()
        out = orig_generate(prompts)
        rec["gen"] += time.perf_counter() - t
        return out

    trl._generate = timed_generate
    orig_gas = trl._generate_and_score_completions

    def capture(inputs):
        out = orig_gas(inputs)
        rec["batch"] = (out, [x["answer"] for x in inputs])
        return out

    trl._generate_and_score_completions = capture

    def molt_trajectories() -> list[Trajectory]:
        out, answers = rec["batch"]
        trajs = []
        for i in range(out["completion_ids"].shape[0]):
            p = out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist()
            c = out["completion_ids"][i][out["completion_mask"][i].bool()].tolist()
            text = tok.decode([t for t in c if t != tok.eos_token_id], skip_special_tokens=True)
            P, N = len(p), len(c)
            trajs.append(Trajectory(
                rollout_id=f"r{i}", group_id=f"g{i // args.samples}", reward=float(text.strip() == answers[i]),
                segments=[Segment(token_ids=p + c, loss_mask=[False] * P + [True] * N,
                                  logprobs=[None] * P + [-1.0] * N, versions=[None] * P + [molt.version] * N,
                                  spans=[SampledSpan(start=P, end=P + N)])]))
        # what the engine would report: behaviour logprobs under molt's current weights (untimed)
        b = build_batch(trajs, molt.pad_id, molt.vocab_size)
        lp, _ = molt.recompute_logprobs(b)
        for r, t in enumerate(trajs):
            seg = t.segments[0]
            seg.logprobs = [float(lp[r, j]) if m else None for j, m in enumerate(seg.loss_mask)]
        return trajs

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            rec["gen"] = 0.0
            rec["t0"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            trl_step.append(time.perf_counter() - rec["t0"])
            trl_gen.append(rec["gen"])
            trajs = molt_trajectories()
            t = time.perf_counter()
            m = molt.train_step(trajs)
            molt_step.append(time.perf_counter() - t)
            molt_recompute.append(m["time/recompute"])
            rewards.append(m["reward/batch_mean"])
            assert m["invariants/logprob_absdiff_max"] == 0.0 and m["train/action_tokens"] > 0

    trl.add_callback(Clock())
    trl.train()

    w = args.warmup
    trl_train = [s - g for s, g in zip(trl_step[w:], trl_gen[w:])]
    med = statistics.median
    n_tok = sum(t.num_sampled for t in molt_trajectories())
    print(f"steps timed: {len(trl_train)} (after {w} warm-up), batch {args.prompts}x{args.samples}, "
          f"<= {args.max_tokens} new tokens ({n_tok} action tokens in the last batch), threads {args.threads}, "
          f"mean reward {statistics.mean(rewards):.3f}")
    print(f"TRL GRPOTrainer  full step      median {1e3 * med(trl_step[w:]):7.1f} ms "
          f"(generation {1e3 * med(trl_gen[w:]):.1f} ms)")
    print(f"TRL GRPOTrainer  train part     median {1e3 * med(trl_train):7.1f} ms")
    print(f"molt Trainer     train_step     median {1e3 * med(molt_step[w:]):7.1f} ms "
          f"(of which recompute {1e3 * med(molt_recompute[w:]):.1f} ms)")
    ratios = [m / t for m, t in zip(molt_step[w:], trl_train)]
    print(f"ratio molt / TRL (train part): median of per-step ratios {med(ratios):.3f} "
          f"[IQR {statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f}], "
          f"ratio of medians {med(molt_step[w:]) / med(trl_train):.3f}")


if __name__ == "__main__":
    main()
