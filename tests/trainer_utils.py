"""Shared helpers of the trainer tests: a tiny config, deterministic synthetic rollouts."""

from __future__ import annotations

import random

import torch

from molt_core.config import RunConfig
from molt_core.types import SampledSpan, Segment, Trajectory


def tiny_cfg(**sections) -> RunConfig:
    """A RunConfig on builtin:tiny-qwen3 with section overrides, e.g. ``trainer={"lr": 1e-3}``.

    Rollouts built by hand in tests carry no engine record of their ids, so unless the test
    sets ``trainer.refuse_unverified`` itself it is false here (the product default is true:
    tests/test_identity.py covers it)."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in sections.items()}
    data.setdefault("trainer", {}).setdefault("refuse_unverified", False)
    return RunConfig.model_validate(data)


def synthetic_rollouts(seed: int, n_groups: int = 3, n_per_group: int = 4, vocab: int = 500,
                       version: int = 0, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                       two_segments_every: int = 0, shared_prompt: bool = False) -> list[Trajectory]:
    """Deterministic rollouts with varied prompt/completion lengths and 0/1 rewards.

    Behaviour logprobs are placeholders (-1.0); use :func:`set_behaviour` to make them the
    trainer's own (on-policy). With ``two_segments_every = k`` every k-th rollout has two
    segments (a rewritten context). With ``shared_prompt`` the rollouts of a group share one
    prompt (as a GRPO group's samples do; prompt lengths still vary across groups), else every
    rollout draws its own.
    """
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        # (drawn only when shared, so the other rollouts' draws stay those of earlier releases)
        group_prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(3, 9) - 1)] if shared_prompt else []
        for k in range(n_per_group):
            segs = []
            n_segs = 2 if two_segments_every and (g * n_per_group + k) % two_segments_every == 0 else 1
            for _ in range(n_segs):
                p = rng.randint(3, 9)
                c = rng.randint(2, 8)
                ids = [1] + [rng.randrange(3, vocab) for _ in range(p - 1 + c)]
                if shared_prompt:
                    p = len(group_prompt)
                    ids = group_prompt + ids[len(ids) - c:]
                n = len(ids)
                segs.append(Segment(
                    token_ids=ids,
                    loss_mask=[i >= p for i in range(n)],
                    logprobs=[-1.0 if i >= p else None for i in range(n)],
                    versions=[version if i >= p else None for i in range(n)],
                    spans=[SampledSpan(start=p, end=n, temperature=temperature, top_k=top_k, top_p=top_p)],
                ))
            out.append(Trajectory(rollout_id=f"r{seed}-{g}-{k}", group_id=f"g{seed}-{g}", segments=segs,
                                  reward=float(rng.random() < 0.5)))
    return out


def record_engine_ids(trajectories: list[Trajectory]) -> None:
    """Attach to every span the engine's record of its ids (``sampled_ids`` and their
    ``digest``), as if an engine had sampled exactly the current ``token_ids`` there."""
    from molt_core.identity import digest_ids

    for t in trajectories:
        for seg in t.segments:
            for sp in seg.spans:
                sp.sampled_ids = list(seg.token_ids[sp.start:sp.end])
                sp.digest = digest_ids(sp.sampled_ids)


def set_behaviour(trainer, trajectories: list[Trajectory], version: int | None = None) -> None:
    """Overwrite behaviour logprobs (and versions) with the trainer's own recompute."""
    from molt_core.train import build_batch

    batch = build_batch(trajectories, trainer.pad_id, trainer.vocab_size)
    lp, _ = trainer.recompute_logprobs(batch)
    v = trainer.version if version is None else version
    b = 0
    for t in trajectories:
        for seg in t.segments:
            seg.logprobs = [float(lp[b, i]) if m else None for i, m in enumerate(seg.loss_mask)]
            seg.versions = [v if m else None for m in seg.loss_mask]
            b += 1


def clone_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of every parameter."""
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@torch.no_grad()
def resample_completions(model: torch.nn.Module, trajectories: list[Trajectory], seed: int = 0) -> None:
    """Replace every sampled token by one drawn from ``model`` under its span's transform
    (so no sampled token lies outside a top-k / top-p filter), token by token."""
    from molt_core.sampling import processed_logprobs

    g = torch.Generator().manual_seed(seed)
    for t in trajectories:
        for seg in t.segments:
            ids = list(seg.token_ids)
            for sp in seg.span_params():
                for i in range(sp.start, sp.end):
                    if not seg.loss_mask[i]:
                        continue
                    logits = model(input_ids=torch.tensor([ids[:i]])).logits[0, -1]
                    probs = processed_logprobs(logits, sp.temperature, sp.top_k, sp.top_p).exp()
                    ids[i] = int(torch.multinomial(probs, 1, generator=g))
            seg.token_ids = ids


class BiasLM(torch.nn.Module):
    """A stand-in causal LM for exact-value trainer tests: logits ``[B, T, V]`` float32 are a
    learnable bias ``[V]``, the same at every position (so each token's logprob is known by hand)."""

    def __init__(self, logits):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.tensor(logits, dtype=torch.float32))

    def forward(self, input_ids, use_cache=False):
        from types import SimpleNamespace

        B, T = input_ids.shape
        return SimpleNamespace(logits=self.bias.expand(B, T, -1))


class PoisonLM(BiasLM):
    """:class:`BiasLM` whose logits are NaN at every position whose input id is ``poison``
    while its persistent buffer ``nan_gate`` is 1 (0: exactly :class:`BiasLM`): the token
    after a ``poison`` id gets a NaN logprob. The gate is in the state dict, so a version
    history's copy (or the check process's ring slot) can be poisoned alone."""

    def __init__(self, logits, poison: int):
        super().__init__(logits)
        self.poison = poison
        self.register_buffer("nan_gate", torch.zeros(()))

    def forward(self, input_ids, use_cache=False):
        from types import SimpleNamespace

        B, T = input_ids.shape
        hit = (input_ids == self.poison) & (self.nan_gate > 0)
        return SimpleNamespace(logits=torch.where(hit[..., None], torch.nan, self.bias.expand(B, T, -1)))
