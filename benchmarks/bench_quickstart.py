"""Time to target reward on the CPU quickstart: ``molt run`` vs TRL ``GRPOTrainer`` vs a plain
PyTorch loop, and ``molt run`` async (``max_staleness=1``) vs sync -- ratios from one run.

Setup (``recipes/quickstart.toml``): the builtin tiny Qwen3
(~0.85M parameters, ChatML byte-level tokenizer), 2-digit addition "What is A + B?" from the
built-in ``arithmetic`` env (reasoning-gym's ``basic_arithmetic`` problems) with a binary exact-match reward, 8 prompts x 8 completions per step, at
most 8 new tokens at T = 1 (no top-k / top-p), no KL / reference, AdamW with the recipe's
``[trainer]`` settings for every arm (lr 1.5e-4 constant, betas (0.9, 0.98), eps 1e-8, no weight
decay, grad-norm clip 1.0), GRPO advantages
``(r - mean_group) / (std_group + 1e-6)``, one policy update per batch.

Every arm starts from the SAME warm-start weights, written once by ``molt sft
recipes/quickstart.toml --out OUT/sft-<steps>`` (the recipe's ``[sft]``: 1200 steps on 30%-noisy labels; reused on
later runs), and sees the SAME prompts in the same order: for seed ``s`` the first ``steps x 8``
tasks of the env's ``train`` stream (``ArithmeticEnv.tasks("train", s)``, as ``molt run``
draws them with ``run.seed = s``), and is evaluated on the env's held-out ``eval`` split of
that seed (excluded from the train stream).

Each arm runs in its own process. By default (``--interleave 5``) the arms of a seed take
turns of 5 s on the machine: the running arm's whole process tree (Ray's processes included)
is stopped with SIGSTOP and the next continued with SIGCONT, so a change in the load from
other jobs on a shared machine falls on every arm alike instead of on whichever arm ran
when it came. Each step's wall-clock bounds are logged (``time/step_end_unix`` for molt); the
time an arm was stopped inside a step is taken out of that step, and steps that were
stopped at all stay out of the medians (a resumed process starts on cold caches).
``--interleave 0`` runs the arms one after another, in an order rotated per seed.

Arms:

* ``molt`` -- ``molt run quickstart --set model.path=<sft>/model --set sft.steps=0
  --set async.max_staleness=0 ...`` as a subprocess (Ray, rollout worker with the embedded
  engine, ledger, gate, trainer actor, weight sync). In-run eval and intermediate checkpoints
  are off (``eval.n_problems=0``, ``checkpoint.every=0``) so they do not enter the wall time.
  From its ``metrics.jsonl``: the step time is the wall between consecutive step ends
  (``time/step_end_unix``; it includes the run's per-step logging and the share of the machine its
  ``reward.png`` redraw takes -- on a background thread, at most every 30 s), the phases are ``time/rollout``, ``time/train_step`` (of which the trainer's
  ``time/train``), ``time/sync`` and their sum ``time/step``. The final checkpoint is evaluated
  like the other arms; ``process wall`` adds Ray start-up and shutdown.
* ``molt_async`` -- the same with ``async.max_staleness=1`` (rollout one step ahead).
* ``trl`` -- TRL ``GRPOTrainer`` set up fairly as in ``benchmarks/bench_trainer.py``:
  ``loss_type="grpo"``, ``beta=0``, bf16 off, gradient checkpointing off, ``adamw_torch``,
  same betas, constant LR, ``shuffle_dataset=False`` (so its prompts are the same stream). A
  callback times each optimizer step (``on_step_begin`` -> ``on_step_end``) and a wrapper
  times its generation (``_generate``).
* ``plain`` -- a minimal loop in this file, no framework: HF ``generate`` (T = 1), exact-match
  reward, GRPO advantages, REINFORCE loss (the PPO-clip gradient at importance ratio 1, which
  holds exactly with one update per batch) averaged over all completion tokens of the batch
  (molt's aggregation), grad clip, AdamW.

Rewards of all arms use the env's rule: the completion up to its end-of-turn token, decoded,
whitespace-stripped, ``<|im_end|>`` / ``<|endoftext|>`` suffixes removed, must equal the answer.

Reported per arm: median step time and its phases, steps and seconds (summed step times) until
the ``--window``-step moving average of the per-step mean reward first reaches ``--target``
(a full window is required), the final held-out greedy and sampled (T = 1, one sample each)
accuracy, total loop time and (for ``molt``) the process wall time including Ray start-up.
Ratios (molt / TRL, molt / plain, TRL / plain, async / sync) are computed per seed from arms of
that seed and summarised by their median and range. Writes ``OUT/bench_quickstart.json`` and
``OUT/bench_quickstart.png``.

Usage::

    python benchmarks/bench_quickstart.py                 # 300 steps x 3 seeds, target 0.8
    python benchmarks/bench_quickstart.py --quick         # smoke configuration (~2-4 min)
    python benchmarks/bench_quickstart.py --steps 300 --seeds 5 --target 0.8 [--skip-trl] [--skip-async]

Needs ``pip install -e .[dev,bench]`` (``bench`` brings ``trl``). Absolute times on a shared machine drift;
quote the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import tomllib
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' gradient_checkpointing rename

import torch

from molt_core.cli.recipe import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "quickstart.toml"
ARMS = ("molt", "molt_async", "trl", "plain")
END_MARKERS = ("<|im_end|>", "<|endoftext|>")


# --------------------------------------------------------------------------- task and reward


def load_recipe() -> dict[str, Any]:
    """The quickstart recipe as a dict (read with ``tomllib``; only data settings are used)."""
    return tomllib.loads(RECIPE.read_text())


def make_env(recipe: dict[str, Any]) -> Any:
    """The recipe's env (``arithmetic``, or ``reasoning_gym`` with the same options: the same
    tasks) -- used only as the task stream and held-out split."""
    from molt_plugins.envs.arithmetic import ArithmeticEnv
    from molt_plugins.envs.reasoning_gym import ReasoningGymEnv

    return {"arithmetic": ArithmeticEnv, "reasoning_gym": ReasoningGymEnv}[recipe["agent"]["name"]](
        **recipe["agent"]["options"])


def train_tasks(env: Any, seed: int, n: int) -> list[dict[str, Any]]:
    """The first ``n`` tasks of the env's train stream for ``seed`` (what ``molt run`` draws)."""
    it = env.tasks("train", seed)
    return [next(it) for _ in range(n)]


def clean(text: str) -> str:
    """The reply as the env scores it: stripped, end-of-turn markers removed from the end."""
    s = text.strip()
    changed = True
    while changed:
        changed = False
        for suf in END_MARKERS:
            if s.endswith(suf):
                s, changed = s[: -len(suf)].rstrip(), True
    return s


def reward_of(tok: Any, completion_ids: list[int], answer: str) -> float:
    """Binary exact-match reward of one completion (token ids, end-of-turn token included)."""
    return float(clean(tok.decode(completion_ids, skip_special_tokens=False)) == answer)


def prompt_ids(tok: Any, question: str) -> list[int]:
    """Chat-template token ids of one user question with the generation prompt."""
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def cut_at_eos(row: list[int], eos: int) -> list[int]:
    """A generated row up to and including its first ``eos`` (the rest is HF padding)."""
    return row[: row.index(eos) + 1] if eos in row else row


@torch.no_grad()
def generate(model: Any, tok: Any, prompts: list[list[int]], max_new_tokens: int, sample: bool) -> list[list[int]]:
    """HF ``generate`` on left-padded ``prompts``; returns each completion cut at end-of-turn.

    Sampling is pure T = 1 (``top_k=0``, ``top_p=1``); greedy otherwise.
    """
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), tok.pad_token_id, dtype=torch.long)
    att = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        att[i, P - len(p):] = 1
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)
    return [cut_at_eos(r, tok.eos_token_id) for r in out[:, P:].tolist()]


def evaluate(model: Any, tok: Any, tasks: list[dict[str, Any]], max_new_tokens: int, seed: int) -> dict[str, float]:
    """Held-out accuracy: ``greedy`` and ``sampled`` (T = 1, one sample per problem, RNG seeded)."""
    model.eval()
    prompts = [prompt_ids(tok, t["question"]) for t in tasks]
    out = {}
    for name, sample in (("greedy", False), ("sampled", True)):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(10_007 + seed)
            comps = generate(model, tok, prompts, max_new_tokens, sample)
        out[name] = sum(reward_of(tok, c, t["answer"]) for c, t in zip(comps, tasks)) / len(tasks)
    return out


def steps_to_target(rewards: list[float], target: float, window: int) -> int | None:
    """First step (1-based) whose trailing ``window``-step mean reward is >= ``target`` (a full
    window is required), or None."""
    s = 0.0
    for i, r in enumerate(rewards):
        s += r
        if i >= window:
            s -= rewards[i - window]
        if i >= window - 1 and s / window >= target - 1e-12:
            return i + 1
    return None


def moving_average(xs: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (partial at the start; for plots)."""
    return [sum(xs[max(0, i - window + 1): i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(xs))]


# --------------------------------------------------------------------------- arms


def molt_command(args: Any, sft_model: Path, seed: int, staleness: int, out: Path) -> list[str]:
    """The ``molt run quickstart`` command line of a molt arm (run directory ``out/run``)."""
    return [sys.executable, "-m", "molt_core.cli", "run", str(RECIPE), "--out", str(out / "run"),
            "--set", f"model.path={json.dumps(str(sft_model))}", "--set", "sft.steps=0",
            "--set", f"run.steps={args.steps}", "--set", f"run.seed={seed}", "--set", f"run.threads={args.threads}",
            "--set", f"async.max_staleness={staleness}", "--set", "eval.n_problems=0", "--set", "checkpoint.every=0",
            # a rollout's deadline is wall clock, which runs on while the arm is stopped (--interleave):
            # a stop longer than the recipe's 60 s (another arm's Ray start-up turn) would fail the
            # rollouts in flight -- an arm computing something else, which TRL and plain never face
            "--set", f"rollout.timeout_s={max(60.0, args.arm_timeout)}"]


def collect_molt(out: Path) -> dict[str, Any]:
    """A finished molt arm's figures from its ``metrics.jsonl`` and final checkpoint.

    A step's bounds are the wall clock (``time/step_end_unix``, seconds since the epoch) at
    the previous step's end and at its own end (the first step starts ``time/step`` before
    its end), so the run's per-step extras (metrics line, trajectory sample, the background
    ``reward.png`` redraw's share of the machine) count too. Raises ``RuntimeError`` when the run left no checkpoint.
    """
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("step", 0) >= 1]
    from molt_core.train import latest_checkpoint

    ck = latest_checkpoint(out / "run")
    if ck is None:
        raise RuntimeError(f"molt run left no checkpoint in {out / 'run'}")
    stale = max((r.get("invariants/staleness_max") or 0.0) for r in rows)
    retok = max((r.get("invariants/tokens_retokenized") or 0.0) for r in rows)
    failed = sum((r.get("rollout/failed") or 0.0) for r in rows)  # e.g. a rollout past its deadline
    ends = [r["time/step_end_unix"] for r in rows]
    return {
        "rewards": [float(r["reward/mean"]) if r.get("reward/mean") is not None else 0.0 for r in rows],
        "bounds": [[ends[0] - rows[0]["time/step"], ends[0]]] + [[a, b] for a, b in zip(ends, ends[1:])],
        "phases_s": {k.split("/", 1)[1]: [r.get(k) or 0.0 for r in rows]
                     for k in ("time/rollout", "time/train_step", "time/sync", "time/train", "time/step")},
        "model_dir": str(ck / "model"),
        "invariants": {"staleness_max": stale, "tokens_retokenized": retok, "rollouts_failed": failed},
    }


def grpo_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-6, tol: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024, arXiv 2402.03300): ``(r - mean) / (std + eps)`` per group of
    ``group`` consecutive rewards, sample std; 0 where the group's std < ``tol``.
    ``rewards`` [N] float -> advantages [N] float32."""
    r = rewards.view(-1, group).double()
    std = r.std(dim=1, keepdim=True)
    adv = (r - r.mean(dim=1, keepdim=True)) / (std + eps)
    return torch.where(std < tol, torch.zeros_like(adv), adv).view(-1).float()


def reinforce_step(model: Any, opt: Any, params: list, ids: torch.Tensor, att: torch.Tensor, mask: torch.Tensor,
                   adv: torch.Tensor, grad_clip: float) -> None:
    """One plain update: REINFORCE loss ``-sum(adv * logp * mask) / sum(mask)`` over the sampled
    tokens of the batch (``ids`` / ``att`` / ``mask`` ``[B, L]`` right-padded, ``mask`` True on
    sampled tokens, ``adv`` ``[B]``), backward, global grad-norm clip (0 disables, as in molt), AdamW."""
    logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:]
    loss = -(adv[:, None] * logp * m).sum() / m.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()


def run_plain(args: Any, sft_model: Path, seed: int, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """The no-framework loop: generate -> reward -> GRPO advantages -> REINFORCE -> AdamW."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(sft_model), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(sft_model), local_files_only=True, dtype=torch.float32).eval()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=args.betas, eps=args.eps, weight_decay=args.weight_decay)
    P, n = args.prompts, args.samples
    rewards, bounds, gen_s, rew_s, upd_s = [], [], [], [], []
    for step in range(args.steps):
        batch = tasks[step * P:(step + 1) * P]
        w0, t0 = time.time(), time.perf_counter()
        prompts = [prompt_ids(tok, t["question"]) for t in batch for _ in range(n)]
        comps = generate(model, tok, prompts, args.max_tokens, sample=True)
        t1 = time.perf_counter()
        r = torch.tensor([reward_of(tok, c, batch[i // n]["answer"]) for i, c in enumerate(comps)])
        adv = grpo_advantages(r, n)
        t2 = time.perf_counter()
        L = max(len(p) + len(c) for p, c in zip(prompts, comps))
        ids = torch.full((len(comps), L), tok.pad_token_id, dtype=torch.long)
        att = torch.zeros((len(comps), L), dtype=torch.long)
        mask = torch.zeros((len(comps), L), dtype=torch.bool)
        for i, (p, c) in enumerate(zip(prompts, comps)):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            att[i, : len(p) + len(c)] = 1
            mask[i, len(p): len(p) + len(c)] = True
        reinforce_step(model, opt, params, ids, att, mask, adv, args.grad_clip)
        t3 = time.perf_counter()
        rewards.append(float(r.mean()))
        bounds.append([w0, w0 + (t3 - t0)])
        gen_s.append(t1 - t0)
        rew_s.append(t2 - t1)
        upd_s.append(t3 - t2)
    return {"rewards": rewards, "bounds": bounds,
            "phases_s": {"generate": gen_s, "reward+adv": rew_s, "update": upd_s}, "model": model, "tok": tok}


def run_trl(args: Any, sft_model: Path, seed: int, tasks: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """TRL ``GRPOTrainer`` with the fair settings of ``benchmarks/bench_trainer.py``."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(str(sft_model), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(sft_model), local_files_only=True, dtype=torch.float32)
    batch = args.prompts * args.samples
    out.mkdir(parents=True, exist_ok=True)
    targs = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=batch, num_generations=args.samples,
        max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=args.betas[0],
        adam_beta2=args.betas[1], adam_epsilon=args.eps, weight_decay=args.weight_decay, max_grad_norm=args.grad_clip,
        optim="adamw_torch",
        loss_type="grpo", beta=0.0, num_iterations=1, bf16=False, fp16=False, gradient_checkpointing=False,
        use_cpu=True, max_steps=args.steps, logging_steps=10_000, save_strategy="no", report_to=[],
        seed=seed, disable_tqdm=True, dataloader_num_workers=0, log_completions=False, shuffle_dataset=False,
    )
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": t["question"]}], "answer": t["answer"]}
                            for t in tasks])
    rewards: list[float] = []
    P, n = args.prompts, args.samples

    def exact_match(completions, answer, completion_ids, **_):
        k = len(rewards)  # the step: TRL must see the same prompts, in the same order, as the other arms
        want = [t["answer"] for t in tasks[k * P:(k + 1) * P] for _ in range(n)]
        if list(answer) != want:
            raise RuntimeError(f"TRL step {k + 1}: its batch is not the shared task stream (answers {list(answer)[:4]}..)")
        rs = [reward_of(tok, list(c), a) for c, a in zip(completion_ids, answer)]
        rewards.append(sum(rs) / len(rs))
        return rs

    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=targs, train_dataset=ds, processing_class=tok)
    rec: dict[str, float] = {"gen": 0.0, "t0": 0.0, "w0": 0.0}
    bounds: list[list[float]] = []
    gen_s: list[float] = []
    orig_generate = trainer._generate

    def timed_generate(prompts):
        t = time.perf_counter()
        res = orig_generate(prompts)
        rec["gen"] += time.perf_counter() - t
        return res

    trainer._generate = timed_generate

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            rec["gen"] = 0.0
            rec["w0"], rec["t0"] = time.time(), time.perf_counter()

        def on_step_end(self, *a, **k):
            bounds.append([rec["w0"], rec["w0"] + time.perf_counter() - rec["t0"]])
            gen_s.append(rec["gen"])

    trainer.add_callback(Clock())
    trainer.remove_callback(PrinterCallback)  # its end-of-training metrics dict would clutter the output
    trainer.train()
    if len(rewards) != len(bounds):
        raise RuntimeError(f"TRL: {len(rewards)} reward batches for {len(bounds)} steps (expected one per step)")
    return {"rewards": rewards, "bounds": bounds,
            "phases_s": {"generate": gen_s, "rest": [b - a - g for (a, b), g in zip(bounds, gen_s)]},
            "model": trainer.accelerator.unwrap_model(trainer.model), "tok": tok}


# --------------------------------------------------------------------------- orchestration


def warm_start(args: Any) -> Path:
    """``molt sft recipes/quickstart.toml --out DIR`` once (reused when ``DIR/model`` exists)."""
    d = Path(args.sft_dir) if args.sft_dir else Path(args.cache) / f"sft-{args.sft_steps}steps"
    model = d / "model"
    if (model / "config.json").is_file() and (model / "tokenizer.json").is_file():
        print(f"warm start: reusing {model}")
        return model
    cmd = [sys.executable, "-m", "molt_core.cli", "sft", str(RECIPE), "--out", str(d),
           "--set", f"sft.steps={args.sft_steps}"]
    print(f"warm start: {' '.join(cmd[2:])}", flush=True)
    t = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
                   stdout=subprocess.DEVNULL)
    print(f"warm start: {time.perf_counter() - t:.0f} s -> {model}")
    return model


def tree_signal(root: Any, sig: int) -> None:
    """Send ``sig`` to ``root`` (a ``psutil.Process``) and every descendant -- for SIGSTOP the
    parent first and the tree re-listed until no new process appears (a stopped process
    cannot start more); processes that exited meanwhile are skipped."""
    import psutil

    seen: set[int] = set()
    while True:
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        new = [p for p in procs if p.pid not in seen]
        if not new:
            return
        for p in new:
            seen.add(p.pid)
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        if sig != signal.SIGSTOP:
            return


def run_arm_processes(cmds: dict[str, tuple[list[str], dict[str, str] | None, Path]], slice_s: float,
                      timeout_s: float, ready: dict[str, Path] | None = None) -> dict[str, dict[str, Any]]:
    """Run each arm's command (``arm -> (argv, env, log path)``) to its end.

    ``slice_s = 0``: one arm after another. ``slice_s > 0``: the arms take turns of
    ``slice_s`` seconds on the machine -- the running arm's whole process tree (Ray's
    processes included) is stopped with SIGSTOP and the next one continued with SIGCONT --
    so load from other jobs on a shared machine falls on every arm alike instead of on
    whichever arm ran when it came; an arm left alone (the others ended) is not stopped. An arm with a ``ready`` file keeps its first turn until
    that file is non-empty (Ray's start-up has wall-clock timeouts that a stop would
    trip; a molt arm is ready once its first metrics row is written). Returns per arm ``rc``, ``run_s`` (seconds it was
    running, pauses excluded) and ``pauses`` (``[start, end]`` wall-clock intervals,
    seconds since the epoch, during which it was stopped). An arm running longer than
    ``timeout_s`` is killed (``rc`` -9).
    """
    import psutil

    queue = list(cmds)
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Any] = {}
    stopped: set[str] = set()
    out = {a: {"rc": None, "run_s": 0.0, "pauses": []} for a in cmds}
    try:
        while queue:
            arm = queue.pop(0)
            argv, env, log = cmds[arm]
            if arm not in procs:
                logs[arm] = open(log, "w")
                procs[arm] = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=logs[arm], stderr=subprocess.STDOUT)
            elif arm in stopped:
                stopped.discard(arm)
                out[arm]["pauses"][-1][1] = time.time()
                tree_signal(psutil.Process(procs[arm].pid), signal.SIGCONT)
            t0 = time.perf_counter()
            left = timeout_s - out[arm]["run_s"]
            turn = min(slice_s, left) if slice_s > 0 else left
            flag = (ready or {}).get(arm)
            starting = flag is not None and not out[arm]["pauses"]
            while procs[arm].poll() is None and time.perf_counter() - t0 < left and (
                    time.perf_counter() - t0 < turn or (starting and not (flag.is_file() and flag.stat().st_size))):
                time.sleep(0.02)
            out[arm]["run_s"] += time.perf_counter() - t0
            if procs[arm].poll() is not None:
                out[arm]["rc"] = procs[arm].returncode
                logs[arm].close()
            elif out[arm]["run_s"] >= timeout_s:
                tree_signal(psutil.Process(procs[arm].pid), signal.SIGKILL)
                procs[arm].wait()
                out[arm]["rc"] = -9
                logs[arm].close()
            elif not queue:  # no other arm waits for the machine: keep running, unstopped
                queue.append(arm)
            else:
                tree_signal(psutil.Process(procs[arm].pid), signal.SIGSTOP)
                out[arm]["pauses"].append([time.time(), None])
                stopped.add(arm)
                queue.append(arm)
    finally:  # interrupted: no stopped process tree may outlive the benchmark
        for arm, p in procs.items():
            if p.poll() is None:
                try:
                    root = psutil.Process(p.pid)
                    tree_signal(root, signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass
    return out


def unpause(bounds: list[list[float]], pauses: list[list[float]]) -> tuple[list[float], list[bool]]:
    """Step times with the arm's stopped time taken out.

    ``bounds``: per step ``[start, end]``; ``pauses``: ``[start, end]`` intervals the arm was
    stopped (both wall clock, seconds since the epoch). Returns per step its duration less
    its overlap with the pauses, and whether it overlapped one at all (such steps stay out
    of the medians: a resumed process starts on cold caches).
    """
    secs, paused = [], []
    for a, b in bounds:
        ov = sum(max(0.0, min(b, pe) - max(a, ps)) for ps, pe in pauses)
        secs.append(max(0.0, (b - a) - ov))
        paused.append(ov > 0.0 or any(a <= ps <= b for ps, _ in pauses))
    return secs, paused


def child_main(d: Path) -> None:
    """``--child DIR``: run the TRL or plain arm described by ``DIR/child.json`` and write
    ``DIR/result.json`` (rewards, step bounds, phases) and ``DIR/model`` (weights + tokenizer)."""
    spec = json.loads((d / "child.json").read_text())
    args = argparse.Namespace(**spec["args"])
    torch.set_num_threads(args.threads)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    seed, sft_model = spec["seed"], Path(spec["sft_model"])
    tasks = train_tasks(make_env(load_recipe()), seed, args.steps * args.prompts)
    if spec["arm"] == "trl":
        res = run_trl(args, sft_model, seed, tasks, d / "trl")
    else:
        res = run_plain(args, sft_model, seed, tasks)
    res.pop("model").save_pretrained(d / "model")
    res.pop("tok").save_pretrained(d / "model")
    (d / "result.json").write_text(json.dumps(res))


def arm_command(arm: str, args: Any, sft_model: Path, seed: int, d: Path) -> list[str]:
    """The command line of one arm, writing into ``d`` (made empty first)."""
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    if arm in ("molt", "molt_async"):
        return molt_command(args, sft_model, seed, 1 if arm == "molt_async" else 0, d)
    (d / "child.json").write_text(json.dumps({"arm": arm, "seed": seed, "sft_model": str(sft_model),
                                              "args": {k: v for k, v in vars(args).items() if k != "child"}}))
    return [sys.executable, str(Path(__file__).resolve()), "--child", str(d)]


def summarise_arm(res: dict[str, Any], args: Any) -> dict[str, Any]:
    """Per-arm summary of one seed: medians over the steps after the first ``--warmup`` that
    were not paused by ``--interleave``; totals over every step's unpaused time."""
    w = min(args.warmup, max(0, len(res["step_s"]) - 1))
    keep = [i for i in range(w, len(res["step_s"])) if not res["paused"][i]] or list(range(w, len(res["step_s"])))
    k = steps_to_target(res["rewards"], args.target, args.window)
    return {
        "median_step_s": statistics.median(res["step_s"][i] for i in keep),
        "phases_median_s": {p: statistics.median(v[i] for i in keep) for p, v in res["phases_s"].items()},
        "steps_in_medians": len(keep),
        "steps_to_target": k,
        "seconds_to_target": sum(res["step_s"][:k]) if k else None,
        "loop_s": sum(res["step_s"]),
        "reward_first_window": statistics.mean(res["rewards"][: args.window]),
        "reward_last_window": statistics.mean(res["rewards"][-args.window:]),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Time to a target reward on the CPU quickstart: molt run (sync and async) vs TRL GRPOTrainer vs a "
                    "plain PyTorch loop, every arm from one warm start on the same prompts, ratios from one run. The "
                    "defaults (3 seeds x 300 steps x 4 arms, after a 1,200-step warm start written once) take about "
                    "16 minutes on 2 CPU cores once the warm start is cached; --quick is a 2-4 minute smoke run. "
                    "See the module docstring.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="RL steps per arm")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (each runs every arm)")
    ap.add_argument("--target", type=float, default=0.8, help="moving-average reward to reach")
    ap.add_argument("--window", type=int, default=20, help="moving-average window (steps)")
    ap.add_argument("--warmup", type=int, default=3, help="steps excluded from median step times")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (the recipe's run.threads)")
    ap.add_argument("--skip-trl", action="store_true", help="skip the TRL GRPOTrainer arm")
    ap.add_argument("--skip-async", action="store_true", help="skip the molt max_staleness=1 arm")
    ap.add_argument("--quick", action="store_true",
                    help="smoke configuration: 30 steps, 1 seed, window 10, target 0.5, 64 eval problems; the recipe's "
                         "warm start when it is cached, else a 200-step one (which barely earns reward)")
    ap.add_argument("--sft-steps", type=int, default=None, help="warm-start SFT steps (None: the recipe's)")
    ap.add_argument("--sft-dir", default=None, help="warm-start output dir to reuse or create (holds model/)")
    ap.add_argument("--eval-problems", type=int, default=256, help="held-out problems for the start and final evals")
    ap.add_argument("--out", default=None, help="output dir (None: runs/bench_quickstart/<time>)")
    ap.add_argument("--cache", default=str(ROOT / "runs" / "bench_quickstart"), help="where warm starts are cached")
    ap.add_argument("--arm-timeout", type=float, default=3600.0, help="running seconds before an arm is killed")
    ap.add_argument("--interleave", type=float, default=5.0,
                    help="seconds per turn when the arms of a seed take turns (SIGSTOP/SIGCONT), so drift of a "
                         "shared machine falls on every arm alike; 0 runs them one after another")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-plot", action="store_true", help="do not write bench_quickstart.png")
    args = ap.parse_args()
    if args.child:
        child_main(Path(args.child))
        return
    recipe = load_recipe()
    if args.quick:
        args.steps, args.seeds, args.window, args.target, args.eval_problems = 30, 1, 10, 0.5, 64
        full = Path(args.cache) / f"sft-{recipe['sft']['steps']}steps" / "model" / "config.json"
        args.sft_steps = args.sft_steps or (recipe["sft"]["steps"] if full.is_file() and not args.sft_dir else 200)
    args.sft_steps = args.sft_steps or recipe["sft"]["steps"]
    args.prompts = recipe["rollout"]["prompts_per_step"]
    args.samples = recipe["rollout"]["n_samples_per_prompt"]
    args.max_tokens = recipe["rollout"]["max_tokens"]
    optim = load_config(RECIPE).trainer  # the recipe's optimizer, for the TRL and plain arms too
    if optim.lr_schedule != "constant" or optim.warmup_steps:
        ap.error(f"{RECIPE}: the TRL and plain arms use a constant LR without warm-up; the recipe has "
                 f"lr_schedule = {optim.lr_schedule!r}, warmup_steps = {optim.warmup_steps}")
    args.lr, args.betas, args.eps = optim.lr, tuple(optim.betas), optim.eps
    args.weight_decay, args.grad_clip = optim.weight_decay, optim.grad_clip
    if args.window > args.steps:
        ap.error(f"--window {args.window} is longer than --steps {args.steps}")
    torch.set_num_threads(args.threads)
    out = Path(args.out or Path(args.cache) / datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass

    t_all = time.perf_counter()
    sft_model = warm_start(args)
    env = make_env(recipe)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(sft_model), local_files_only=True)
    arms = [a for a in ARMS if not (a == "trl" and args.skip_trl) and not (a == "molt_async" and args.skip_async)]
    results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()}, "sft_model": str(sft_model),
                               "start_eval": {}, "seeds": {}}
    for si, seed in enumerate(range(args.seeds)):
        tasks = train_tasks(env, seed, args.steps * args.prompts)
        eval_tasks = env.eval_tasks(seed)[: args.eval_problems]
        start_model = AutoModelForCausalLM.from_pretrained(str(sft_model), local_files_only=True, dtype=torch.float32)
        results["start_eval"][str(seed)] = evaluate(start_model, tok, eval_tasks, args.max_tokens, seed)
        del start_model
        print(f"seed {seed}: start held-out greedy {results['start_eval'][str(seed)]['greedy']:.3f} "
              f"sampled {results['start_eval'][str(seed)]['sampled']:.3f}", flush=True)
        order = arms[si % len(arms):] + arms[: si % len(arms)]
        env_vars = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "RAY_USAGE_STATS_ENABLED": "0"}
        dirs = {arm: out / f"seed{seed}" / arm for arm in order}
        cmds = {arm: (arm_command(arm, args, sft_model, seed, dirs[arm]), env_vars, dirs[arm] / "arm.log")
                for arm in order}
        print(f"seed {seed}: arms {', '.join(order)}"
              + (f", taking turns of {args.interleave:g} s" if args.interleave > 0 else ", one after another"), flush=True)
        runs = run_arm_processes(cmds, args.interleave, args.arm_timeout,
                                 ready={a: dirs[a] / "run" / "metrics.jsonl" for a in order if a.startswith("molt")})
        per: dict[str, Any] = {}
        for arm in order:
            try:
                if runs[arm]["rc"] != 0:
                    tail = (dirs[arm] / "arm.log").read_text()[-3000:]
                    raise RuntimeError(f"exited {runs[arm]['rc']}; log {dirs[arm] / 'arm.log'}:\n{tail}")
                if arm in ("molt", "molt_async"):
                    res = collect_molt(dirs[arm])
                    model_dir = res.pop("model_dir")
                    res["process_wall_s"] = runs[arm]["run_s"]
                else:
                    res = json.loads((dirs[arm] / "result.json").read_text())
                    model_dir = str(dirs[arm] / "model")
                model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
            except Exception as e:  # one broken arm should not lose the others
                print(f"seed {seed} {arm}: FAILED {type(e).__name__}: {e}", flush=True)
                per[arm] = {"error": f"{type(e).__name__}: {e}"}
                continue
            res["step_s"], res["paused"] = unpause(res["bounds"], runs[arm]["pauses"])
            res["arm_wall_s"] = runs[arm]["run_s"]
            res["final_eval"] = evaluate(model, tok, eval_tasks, args.max_tokens, seed)
            del model
            res["summary"] = summarise_arm(res, args)
            s = res["summary"]
            print(f"seed {seed} {arm:10s} median step {1e3 * s['median_step_s']:7.1f} ms "
                  f"({s['steps_in_medians']} steps)  to {args.target}: {s['steps_to_target'] or '-'} steps / "
                  f"{format(s['seconds_to_target'], '.1f') if s['seconds_to_target'] else '-'} s  reward {s['reward_first_window']:.2f} -> "
                  f"{s['reward_last_window']:.2f}  final greedy {res['final_eval']['greedy']:.3f} "
                  f"sampled {res['final_eval']['sampled']:.3f}  ({res['arm_wall_s']:.0f} s running)", flush=True)
            per[arm] = res
        results["seeds"][str(seed)] = per
        results["ratios"] = seed_ratios(results, args)
        (out / "bench_quickstart.json").write_text(json.dumps(results, indent=1))
    results["summary"] = overall(results, arms)
    results["total_wall_s"] = time.perf_counter() - t_all
    (out / "bench_quickstart.json").write_text(json.dumps(results, indent=1))
    print_tables(results, arms, args)
    if not args.no_plot:
        plot(results, arms, args, out / "bench_quickstart.png")
    print(f"results: {out / 'bench_quickstart.json'}  ({results['total_wall_s']:.0f} s in all)")


RATIOS = {  # name -> (numerator arm, denominator arm); "molt" is the sync arm, "molt_async" max_staleness = 1
    "molt/trl": ("molt", "trl"), "molt/plain": ("molt", "plain"), "trl/plain": ("trl", "plain"),
    "molt_async/molt": ("molt_async", "molt"), "molt_async/trl": ("molt_async", "trl"),
    "molt_async/plain": ("molt_async", "plain"),
}


def seed_ratios(results: dict[str, Any], args: Any) -> dict[str, dict[str, list[float]]]:
    """Per-seed ratios of median step time, seconds to target and loop time, per arm pair."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, (a, b) in RATIOS.items():
        acc: dict[str, list[float]] = {"step_time": [], "seconds_to_target": [], "steps_to_target": [], "loop_time": []}
        for per in results["seeds"].values():
            if "summary" not in per.get(a, {}) or "summary" not in per.get(b, {}):
                continue
            sa, sb = per[a]["summary"], per[b]["summary"]
            for key, fa, fb in (("step_time", sa["median_step_s"], sb["median_step_s"]),
                                ("seconds_to_target", sa["seconds_to_target"], sb["seconds_to_target"]),
                                ("steps_to_target", sa["steps_to_target"], sb["steps_to_target"]),
                                ("loop_time", sa["loop_s"], sb["loop_s"])):
                r = ratio(fa, fb)
                if r is not None:
                    acc[key].append(r)
        if any(acc.values()):
            out[name] = acc
    return out


def _stats(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "mean": statistics.mean(xs),
            "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def overall(results: dict[str, Any], arms: list[str]) -> dict[str, Any]:
    """Across seeds: per-arm statistics and ratio statistics."""
    summ: dict[str, Any] = {"arms": {}, "ratios": {}}
    for arm in arms:
        rs = [p[arm] for p in results["seeds"].values() if "summary" in p.get(arm, {})]
        if not rs:
            continue
        ss = [r["summary"] for r in rs]
        phases = {k: _stats([s["phases_median_s"][k] for s in ss]) for k in ss[0]["phases_median_s"]}
        summ["arms"][arm] = {
            "seeds_ok": len(rs),
            "median_step_s": _stats([s["median_step_s"] for s in ss]),
            "phases_s": phases,
            "steps_to_target": _stats([s["steps_to_target"] for s in ss if s["steps_to_target"]]),
            "seconds_to_target": _stats([s["seconds_to_target"] for s in ss if s["seconds_to_target"]]),
            "reached": sum(s["steps_to_target"] is not None for s in ss),
            "loop_s": _stats([s["loop_s"] for s in ss]),
            "final_greedy": _stats([r["final_eval"]["greedy"] for r in rs]),
            "final_sampled": _stats([r["final_eval"]["sampled"] for r in rs]),
            "process_wall_s": _stats([r["process_wall_s"] for r in rs if "process_wall_s" in r]),
            "invariants": {k: max(r.get("invariants", {}).get(k, 0.0) for r in rs)
                           for k in ("staleness_max", "tokens_retokenized", "rollouts_failed")}
            if arm.startswith("molt") else None,
        }
    for name, acc in results.get("ratios", {}).items():
        summ["ratios"][name] = {k: _stats(v) for k, v in acc.items()}
    return summ


def print_tables(results: dict[str, Any], arms: list[str], args: Any) -> None:
    """Rich tables: per-arm figures and the same-run ratios."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 200)
    summ = results["summary"]
    starts = list(results["start_eval"].values())
    n = len(results["seeds"])

    def ms(st: dict | None) -> str:
        return "-" if not st else f"{1e3 * st['median']:.1f}" + (f" ({1e3 * st['min']:.0f}-{1e3 * st['max']:.0f})" if st["n"] > 1 else "")

    def pm(st: dict | None, fmt: str = "{:.0f}") -> str:
        return "-" if not st else fmt.format(st["mean"]) + (f" ± {fmt.format(st['std'])}" if st["n"] > 1 else "")

    t = Table(title=f"quickstart: {args.steps} steps x {n} seed(s), {args.prompts}x{args.samples} per step, "
                    f"target {args.window}-step avg reward >= {args.target}, {args.threads} thread(s); start held-out "
                    f"greedy {statistics.mean(s['greedy'] for s in starts):.3f} / sampled "
                    f"{statistics.mean(s['sampled'] for s in starts):.3f}")
    for col in ("arm", "median step ms", "phases (median ms)", "steps to target", "s to target", "reached",
                "loop s", "final greedy / sampled", "process wall s"):
        t.add_column(col)
    for arm in arms:
        a = summ["arms"].get(arm)
        if a is None:
            t.add_row(arm, "failed", "", "", "", "", "", "", "")
            continue
        phases = ", ".join(f"{k} {1e3 * v['median']:.0f}" for k, v in a["phases_s"].items())
        t.add_row(arm, ms(a["median_step_s"]), phases, pm(a["steps_to_target"]), pm(a["seconds_to_target"], "{:.1f}"),
                  f"{a['reached']}/{a['seeds_ok']}", pm(a["loop_s"], "{:.1f}"),
                  f"{a['final_greedy']['mean']:.3f} / {a['final_sampled']['mean']:.3f}",
                  pm(a["process_wall_s"], "{:.1f}"))
    con.print(t)
    r = Table(title=escape("ratios, same seed and run (median [min-max] over seeds; < 1: numerator faster)"))
    for col in ("ratio", "median step time", "seconds to target", "steps to target", f"loop time ({args.steps} steps)"):
        r.add_column(col)

    def fr(st: dict | None) -> str:
        return "-" if not st else escape(f"{st['median']:.3f}" + (f" [{st['min']:.2f}-{st['max']:.2f}]" if st["n"] > 1 else ""))

    for name, v in summ["ratios"].items():
        r.add_row(name, fr(v["step_time"]), fr(v["seconds_to_target"]), fr(v["steps_to_target"]), fr(v["loop_time"]))
    con.print(r)
    for arm in arms:
        inv = (summ["arms"].get(arm) or {}).get("invariants")
        if inv:
            con.print(f"{arm}: invariants/staleness_max {inv['staleness_max']:.0f}, "
                      f"invariants/tokens_retokenized {inv['tokens_retokenized']:.0f} (max over steps), "
                      f"failed rollouts {inv['rollouts_failed']:.0f} (most in one seed)")


def plot(results: dict[str, Any], arms: list[str], args: Any, path: Path) -> None:
    """Moving-average reward against step and against seconds (summed step times), per arm."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    colors = {"molt": "tab:blue", "molt_async": "tab:cyan", "trl": "tab:orange", "plain": "tab:green"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for arm in arms:
        for i, per in enumerate(results["seeds"].values()):
            res = per.get(arm, {})
            if "rewards" not in res:
                continue
            ma = moving_average(res["rewards"], args.window)
            secs = [sum(res["step_s"][: k + 1]) for k in range(len(ma))]
            kw = {"color": colors[arm], "alpha": 0.8, "label": arm if i == 0 else None}
            ax1.plot(range(1, len(ma) + 1), ma, **kw)
            ax2.plot(secs, ma, **kw)
    for ax, xl in ((ax1, "step"), (ax2, "seconds (summed step times)")):
        ax.axhline(args.target, color="gray", ls="--", lw=0.8)
        ax.set_xlabel(xl)
        ax.set_ylabel(f"reward ({args.window}-step avg)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle("quickstart: molt run vs TRL GRPOTrainer vs plain PyTorch")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
