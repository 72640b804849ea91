"""Supervised fine-tuning (SFT) on the trainer's model: the warm start before RL.

Examples ``(messages, completion)`` are rendered with the engine's chat template and only the
completion tokens (the reply and its end-of-turn token) enter a token-mean cross-entropy; images
in a prompt are rendered and fed as the engine and the RL trainer do (docs/architecture.md).
"""

from __future__ import annotations

import math
import random
import time
import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch

from molt_core.agents import Env, load_agent
from molt_core.ledger.messages import image_shas, normalize_messages
from molt_core.plugins import modality, use_run_plugins
from molt_core.rollout.datafiles import load_rows
from molt_core.train.forward import image_inputs
from molt_core.train.progress import step_progress
from molt_core.train.trainer import Trainer
from molt_core.train.update import lr_factor

__all__ = ["Example", "render_example", "render_with_images", "collate", "sft", "iter_sft", "examples_from_agent", "examples_from_rows",
           "noisy_answer", "warm_start_steps", "run_sft"]

#: ``(messages, completion)``: OpenAI-format chat messages (the prompt) and the reply text.
Example = tuple[list[dict[str, Any]], str]


def _end_of_turn_ids(tokenizer: Any) -> set[int]:
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if hasattr(tokenizer, "convert_tokens_to_ids") else None
    unk = getattr(tokenizer, "unk_token_id", None)
    if isinstance(im_end, int) and im_end != unk:
        ids.add(im_end)
    return ids


def render_example(tokenizer: Any, messages: list[dict[str, Any]], completion: str,
                   chat_template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of one example: ``(prompt_ids, completion_ids)``.

    ``prompt_ids``: the chat template of ``messages`` with the generation prompt (what the engine
    is given); ``completion_ids``: the rest of the rendering of ``messages + [assistant: completion]``
    up to and including the end-of-turn token (``eos_token`` / ``<|im_end|>``).

    Raises:
        ValueError: the full rendering does not start with the prompt's (a template that rewrites
            earlier turns), or the completion renders to no token.
    """
    kw = dict(chat_template_kwargs or {})
    prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    full_text = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": completion}], tokenize=False, **kw)
    if not full_text.startswith(prompt_text):
        raise ValueError(
            "chat template: rendering the prompt plus the reply does not start with the rendered prompt; "
            "SFT cannot tell which tokens are the completion"
        )
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    full_ids = tokenizer.encode(full_text, add_special_tokens=False)
    if full_ids[: len(prompt_ids)] != prompt_ids:  # a BPE merge across the boundary
        full_ids = prompt_ids + tokenizer.encode(full_text[len(prompt_text):], add_special_tokens=False)
    comp = full_ids[len(prompt_ids):]
    stops = _end_of_turn_ids(tokenizer)
    cut = next((i for i, t in enumerate(comp) if t in stops), None)
    if cut is not None:
        comp = comp[: cut + 1]
    if not comp:
        raise ValueError(f"completion {completion!r} renders to no token")
    return prompt_ids, comp


def _vision_processor(trainer: Any) -> Any:
    """``trainer.vision_processor``, else a VL model's processor from ``cfg.model.path``, else None."""
    vp = getattr(trainer, "vision_processor", None)
    mod = modality()
    if vp is None and mod is not None:
        vp = mod.processor_for(trainer.model, trainer.cfg.model.path, trainer.tokenizer)
    return vp


def render_with_images(tokenizer: Any, vp: Any, messages: list[dict[str, Any]], completion: str,
                       chat_template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], list[int], list[bytes]]:
    """:func:`render_example` for prompts that may hold images: ``(prompt_ids, completion_ids,
    images)``, each placeholder expanded into its image's run, ``images`` the bytes in token order.

    Raises:
        ValueError: as :func:`render_example`; images for a model without a vision processor;
            the modality's error for a refused image (naming its field).
    """
    if not any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") == "image_url"
                                                          for p in m["content"]) for m in messages):
        return (*render_example(tokenizer, messages, completion, chat_template_kwargs), [])
    pool: dict[str, bytes] = {}
    msgs = normalize_messages(messages, pool, decode=getattr(modality() or vp, "decode_part", None))
    if vp is None:
        raise ValueError(f"sft: an example carries {len(pool)} image(s) but the model is not a vision-language model")
    prompt, comp = render_example(tokenizer, msgs, completion, chat_template_kwargs)
    images = [pool[h] for h in image_shas(msgs)]
    return vp.expand_placeholders(prompt, images)[0], comp, images


def _image_kwargs(model: Any, vp: Any, seqs: Sequence[tuple[list[int], list[int]]], imgs: Sequence[list[bytes]],
                  width: int, device: Any) -> dict[str, Any]:
    """:func:`molt_core.train.forward.image_inputs` of a micro-batch (``{}`` when no row has images)."""
    if not any(imgs):
        return {}
    return image_inputs(model, vp, [(p + c, im) for (p, c), im in zip(seqs, imgs)], width, device)


def collate(seqs: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of rendered examples as ``(input_ids, labels)``, both ``[B, T]`` int64:
    ``input_ids`` right-padded with ``pad_id``; ``labels`` the completion ids at the completion
    positions and -100 elsewhere, so only completion tokens enter the loss."""
    T = max(len(p) + len(c) for p, c in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), T), -100, dtype=torch.long)
    for b, (p, c) in enumerate(seqs):
        ids[b, : len(p) + len(c)] = torch.tensor(p + c)
        labels[b, len(p): len(p) + len(c)] = torch.tensor(c)
    return ids, labels


def sft(trainer: Any, examples: Sequence[Example], *, steps: int, batch_size: int, lr: float, seed: int = 0,
        log: Callable[[int, dict[str, float]], None] | None = None, warmup_steps: int = 0,
        lr_schedule: str = "constant") -> list[float]:
    """Fine-tune ``trainer.model`` on ``examples``: all of :func:`iter_sft` at once.
    Returns the loss of each step (floats, nats per completion token).

    Args:
        log: called as ``log(step, metrics)`` after each step (0-based). Others: as :func:`iter_sft`.

    Raises:
        ValueError: as :func:`iter_sft`.
    """
    losses: list[float] = []
    for step, m in enumerate(iter_sft(trainer, examples, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                                      warmup_steps=warmup_steps, lr_schedule=lr_schedule)):
        losses.append(m["sft/loss"])
        if log is not None:
            log(step, m)
    return losses


def iter_sft(trainer: Any, examples: Sequence[Example], *, steps: int, batch_size: int, lr: float, seed: int = 0,
             warmup_steps: int = 0, lr_schedule: str = "constant", start: int = 0,
             opt_state: dict[str, Any] | None = None) -> Iterator[dict[str, float]]:
    """Fine-tune ``trainer.model`` on ``examples``, one optimizer step per item drawn: yields
    each step's metrics (so a caller can show progress or stop between steps).

    Batches of ``batch_size`` examples are drawn without replacement from a seeded shuffle
    (reshuffled each pass), cut into micro-batches of ``trainer.cfg.trainer.micro_batch_size`` rows.
    Loss: ``-(1/N) sum log p(y_t | y_<t, prompt)`` over the batch's ``N`` completion tokens (T = 1).

    Args:
        trainer: a :class:`molt_core.train.Trainer` (its ``model``, ``tokenizer``, ``cfg``).
        examples: ``(messages, completion)`` pairs. steps: optimizer steps (0 yields nothing).
        batch_size: examples per step. seed: shuffle seed.
        lr, warmup_steps, lr_schedule: step ``i`` uses ``lr * lr_factor(i, warmup_steps, steps,
            lr_schedule)`` (:func:`molt_core.train.lr_factor`; ``constant``, ``linear`` or ``cosine``).
        start, opt_state: resume at step ``start`` (0-based) with the AdamW ``state_dict`` saved there
            (``trainer.sft_optimizer`` at that step): the batches of the steps before it are drawn again
            without compute, so the run continues bit-exact with an uninterrupted one.

    Yields:
        Per step ``{"sft/loss", "sft/tokens", "sft/grad_norm", "sft/lr", "time/step"}`` (nats/token; s).

    Side effects: ``trainer.sft_optimizer`` is the AdamW while steps remain (None after the last: what
    a checkpoint saves, :mod:`molt_core.train.checkpoint`); before the last step's metrics are yielded,
    the frozen reference (if any) is re-snapshotted to the fine-tuned weights; ``trainer.version`` is unchanged.

    Raises:
        ValueError: no examples, the trainer has no tokenizer, an unknown ``lr_schedule``, or a
            ``start`` past ``steps`` / without ``opt_state`` (raised when the first step is drawn, before any compute).
    """
    lr_factor(0, warmup_steps, steps, lr_schedule)  # unknown schedule: fail before any compute
    if start and not (start < steps and opt_state):
        raise ValueError(f"sft: resuming at step {start} needs sft.steps > {start} (it is {steps}) and the warm "
                         "start's optimizer state (a checkpoint written during it)")
    if steps <= 0:
        return
    if not examples:
        raise ValueError("sft: no examples; sft.steps > 0 needs (messages, completion) pairs")
    tok = trainer.tokenizer
    if tok is None:
        raise ValueError("sft: the trainer has no tokenizer to render examples with")
    vp = _vision_processor(trainer)
    rendered = [render_with_images(tok, vp, m, c, trainer.cfg.model.chat_template_kwargs) for m, c in examples]
    model = trainer.model  # LoRA: its base, with the adapter disabled
    scope = (trainer.adapter.base_training(model) if trainer.adapter is not None
             else contextlib.nullcontext((model, [p for p in model.parameters() if p.requires_grad])))
    model, params = scope.__enter__()
    tc = trainer.cfg.trainer
    opt = torch.optim.AdamW(params, lr=lr, betas=(tc.betas[0], tc.betas[1]), eps=tc.eps, weight_decay=tc.weight_decay)
    if start:
        opt.load_state_dict(opt_state)
    trainer.sft_optimizer = opt
    rng = random.Random(seed)
    order: list[int] = []
    mb, dev, pad = tc.micro_batch_size, trainer.device, trainer.pad_id
    for step in range(steps):
        t0 = time.perf_counter()
        idx = []
        while len(idx) < batch_size:
            if not order:
                order = list(range(len(rendered)))
                rng.shuffle(order)
            idx.append(order.pop())
        if step < start:  # a resume: the steps before it only advance the shuffle
            continue
        seqs = [rendered[i][:2] for i in idx]
        imgs = [rendered[i][2] for i in idx]
        n_tok = sum(len(c) for _, c in seqs)
        step_lr = lr * lr_factor(step, warmup_steps, steps, lr_schedule)
        for g in opt.param_groups:
            g["lr"] = step_lr
        opt.zero_grad(set_to_none=True)
        total = 0.0
        # a sharded trainer runs its share of the rows (plus stand-ins, real False: zero loss)
        work = (trainer.row_work(len(seqs), 0) if hasattr(trainer, "row_work")
                else [(slice(s, s + mb), True) for s in range(0, len(seqs), mb)])
        for rows, real in work:
            ids, labels = (t.to(dev) for t in collate(seqs[rows], pad))
            vision = _image_kwargs(model, vp, seqs[rows], imgs[rows], ids.shape[1], dev)
            with trainer.autocast():
                logits = model(input_ids=ids, use_cache=False, **vision).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                ignore_index=-100, reduction="sum") / n_tok * float(real)
            loss.backward()
            total += float(loss.detach())
        total = trainer._reduce_losses({"sft/loss": total})["sft/loss"]  # summed over ranks
        gn = trainer._clip_grads(params, tc.grad_clip)
        opt.step()
        m = {"sft/loss": total, "sft/tokens": float(n_tok), "sft/grad_norm": float(gn), "sft/lr": step_lr,
             "time/step": time.perf_counter() - t0}
        if step == steps - 1:
            trainer.sft_optimizer = None
            scope.__exit__(None, None, None)
            model.zero_grad(set_to_none=True)
            if trainer.ref_model is not None:
                trainer.reset_reference()
        yield m


def noisy_answer(answer: str, rng: random.Random, pool: Sequence[str] = ()) -> str:
    """A deliberately wrong version of ``answer``.

    An integer answer moves by a random non-zero offset in [-10, 10] (so it stays plausible);
    any other answer is replaced by a different one drawn from ``pool``, or gets a ``" x"``
    suffix when the pool has no different answer.
    """
    a = answer.strip()
    try:
        v = int(a)
    except ValueError:
        others = [p for p in pool if p.strip() != a]
        return rng.choice(others) if others else a + " x"
    off = 0
    while off == 0:
        off = rng.randint(-10, 10)
    return str(v + off)


def examples_from_agent(agent: Any, n: int, seed: int, label_noise: float = 0.0) -> list[Example]:
    """Draw ``n`` SFT examples from ``agent.tasks("train", seed)``.

    Each task dict needs ``answer`` (the completion, ``str()``-ed). The prompt is what the agent
    would be shown: its ``first_messages(task)`` (an :class:`~molt_core.agents.Env`, or a
    :class:`~molt_core.agents.ChatAgent` that defines it), else ``task["question"]`` as the user
    message. A ``label_noise`` fraction of the completions (seeded) is replaced by :func:`noisy_answer`.

    Raises:
        ValueError: a task without ``answer`` (or, for a non-Env agent, ``question``); fewer than ``n`` tasks.
    """
    rng = random.Random(seed + 7919)
    out: list[tuple[list[dict[str, Any]], str]] = []
    answers: list[str] = []
    it = iter(agent.tasks("train", seed))
    for i in range(n):
        try:
            task = next(it)
        except StopIteration:
            raise ValueError(f"sft: the agent's train split has only {i} tasks, sft.n_examples asks for {n}") from None
        if "answer" not in task:
            raise ValueError(f"sft: task {i} has no 'answer' field (keys: {sorted(task)}); SFT needs a target")
        if isinstance(agent, Env) or callable(getattr(agent, "first_messages", None)):
            msgs = agent.first_messages(task)  # as the Env runner (or the ChatAgent itself) sends the first turn
        else:
            if "question" not in task:
                raise ValueError(f"sft: task {i} has no 'question' field (keys: {sorted(task)})")
            msgs = [{"role": "user", "content": str(task["question"])}]
        answers.append(str(task["answer"]))
        out.append((msgs, answers[-1]))
    if label_noise > 0:
        k = int(math.floor(label_noise * n + 0.5))
        for i in rng.sample(range(n), k):
            out[i] = (out[i][0], noisy_answer(out[i][1], rng, answers))
    return out


def examples_from_rows(rows: Sequence[dict[str, Any]], what: str = "sft.data") -> list[Example]:
    """SFT examples from data rows, in order. A row is either

    * ``{"prompt", "completion"}`` -- ``prompt`` a string (the user message) or chat messages,
      ``completion`` a string or ``[{"role": "assistant", "content": ...}]`` (TRL's formats); or
    * ``{"messages": [...]}`` -- a chat; each assistant message becomes one example whose prompt
      is the messages before it.

    A ``content`` is a string or (VL models) a list of ``text`` and ``image_url`` parts.

    Raises:
        ValueError: a row of neither form, malformed messages, or no example at all (names
            ``what`` and the 1-based row number).
    """
    def parts(c: Any) -> bool:  # a content list of text and image parts (images: vision-language models)
        return isinstance(c, list) and all(isinstance(p, dict) and (p.get("type") == "text" and isinstance(
            p.get("text"), str) or p.get("type") == "image_url") for p in c)

    def chat(msgs: Any, where: str) -> list[dict[str, Any]]:
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and (isinstance(m.get("content"), str) or parts(m.get("content")))
                                                 for m in msgs):
            raise ValueError(f"{what}: {where} must be a list of {{\"role\": str, \"content\": str}} messages "
                             "(a user message's content may also be a list of text and image_url parts)")
        if any(m["role"] == "assistant" and not isinstance(m["content"], str) for m in msgs):
            raise ValueError(f"{what}: {where}: an assistant message's content must be a string")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]

    out: list[Example] = []
    for n, row in enumerate(rows, 1):
        if "messages" in row:
            msgs = chat(row["messages"], f"row {n} 'messages'")
            turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > 0]
            if not turns:
                raise ValueError(f"{what}: row {n} has no assistant message after a prompt; nothing to learn")
            out += [(msgs[:i], msgs[i]["content"]) for i in turns]
        elif "prompt" in row and "completion" in row:
            p, c = row["prompt"], row["completion"]
            prompt = [{"role": "user", "content": p}] if isinstance(p, str) else chat(p, f"row {n} 'prompt'")
            if isinstance(c, list):
                comp = chat(c, f"row {n} 'completion'")
                if len(comp) != 1 or comp[0]["role"] != "assistant":
                    raise ValueError(f"{what}: row {n} 'completion' must be one assistant message")
                c = comp[0]["content"]
            if not isinstance(c, str) or not prompt:
                raise ValueError(f"{what}: row {n}: 'completion' must be a string and 'prompt' non-empty")
            out.append((prompt, c))
        else:
            raise ValueError(f"{what}: row {n} has fields {sorted(row)}; an SFT row needs 'prompt' and "
                             f"'completion', or 'messages'")
    if not out:
        raise ValueError(f"{what}: no rows")
    return out


#: Offset of the example-drawing seed from ``run.seed`` (examples differ from RL's task stream).
EXAMPLE_SEED_OFFSET = 17


def warm_start_steps(trainer: Any, agent: Any, start: int = 0) -> Iterator[dict[str, float]]:
    """The recipe's SFT warm start on ``trainer``, one step per item: :func:`iter_sft` (``sft.steps``
    steps of ``sft.batch_size`` at ``sft.lr``, shuffle seed ``run.seed``) on the rows of ``sft.data``
    when set (``agent`` may then be None), else on ``sft.n_examples`` examples from ``agent`` (seed
    ``run.seed + 17``). The examples are drawn at once, so errors surface before any step. ``start``
    > 0 resumes at that step with ``trainer.sft_resume_state`` (the AdamW state a checkpoint restored).
    Returns an iterator of per-step metrics (empty when ``sft.steps == 0``).

    Raises:
        ValueError: as :func:`examples_from_agent` / :func:`examples_from_rows`, or ``sft.data``
            cannot be read (:func:`molt_core.rollout.datafiles.load_rows`).
    """
    cfg = trainer.cfg
    s = cfg.sft
    if s.steps <= 0:
        return iter(())
    if s.data:
        examples = examples_from_rows(load_rows(s.data, what="sft.data"))
    else:
        examples = examples_from_agent(agent, s.n_examples, seed=cfg.run.seed + EXAMPLE_SEED_OFFSET,
                                       label_noise=s.label_noise)
    return iter_sft(trainer, examples, steps=s.steps, batch_size=s.batch_size, lr=s.lr, seed=cfg.run.seed,
                    warmup_steps=s.warmup_steps, lr_schedule=s.lr_schedule, start=start,
                    opt_state=getattr(trainer, "sft_resume_state", None))


def run_sft(cfg: Any, host: Any, out_dir: str | None = None, recipe_name: str = "run") -> Any:
    """``molt sft``: warm-start the recipe's model (on ``sft.data`` rows when set, else on the
    agent's train tasks) and write it as a Hugging Face directory.

    Writes ``OUT/config.toml`` (the resolved recipe), ``OUT/sft_metrics.jsonl`` (one line per step:
    ``step`` and the metrics of :func:`iter_sft`) and ``OUT/model/`` (``save_pretrained``, tokenizer,
    a VL model's image processor; use it as ``model.path``). ``OUT`` defaults to
    ``runs/<recipe>-sft-<YYYYmmdd-HHMMSS>``; returns the ``OUT/model`` path.

    Raises:
        ValueError: ``sft.steps`` is 0, the agent cannot be built / has no answers, or
            ``sft.data`` cannot be read or has a bad row.
    """
    use_run_plugins(cfg.plugins)  # the modality SFT reads before the trainer exists
    import json
    from datetime import datetime
    from pathlib import Path

    from rich.console import Console

    if cfg.sft.steps <= 0:
        raise ValueError("sft.steps is 0: nothing to do; set it in the recipe's [sft] table or --set sft.steps=N")
    torch.set_num_threads(cfg.run.threads)
    out = Path(out_dir) if out_dir else Path("runs") / f"{recipe_name}-sft-{datetime.now():%Y%m%d-%H%M%S}"
    agent = None if cfg.sft.data else load_agent(cfg, host)  # a bad --agent fails before OUT exists
    out.mkdir(parents=True, exist_ok=True)
    cfg.write(out / "config.toml")
    trainer = Trainer(cfg)
    with open(out / "sft_metrics.jsonl", "w") as f, \
            step_progress(Console(stderr=True), "molt sft", cfg.sft.steps) as update:
        for step, m in enumerate(warm_start_steps(trainer, agent)):
            f.write(json.dumps({"step": step, **m}) + "\n")
            f.flush()
            update(step + 1, f"loss {m['sft/loss']:.3f}")
    trainer.model.save_pretrained(out / "model", safe_serialization=True)
    if trainer.tokenizer is not None:
        trainer.tokenizer.save_pretrained(out / "model")
    if trainer.vision_processor is not None:  # a vision-language model: its preprocessor_config.json
        trainer.vision_processor.image_processor.save_pretrained(out / "model")
    return out / "model"
