"""The single trainable actor: logprob recompute, correction, loss, optimizer, weight export.

One :class:`Trainer` owns one Hugging Face ``AutoModelForCausalLM`` (plain PyTorch, no
framework wrapper). A call to :meth:`Trainer.train_step` turns a list of finished
:class:`~molt_core.types.Trajectory` objects into one policy update:

1. **Ingress**: every action token is checked against the engine's record of what it
   sampled (:func:`molt_core.identity.screen`; a rollout with a mismatching token is refused,
   counted in ``invariants/tokens_retokenized``); then :func:`molt_core.train.ingress.build_batch`: rows are segments
   (a rollout with a rewritten context has several rows sharing one reward), right-padded;
   per-token lengths, sampled-token spans and token ids are re-checked, and each row points at
   its rollout, each rollout at its group (one reward per rollout).
2. **Recompute**: the log-probability of every sampled token under the current weights
   (the *proximal* policy), through :func:`molt_core.sampling.processed_logprobs` with the
   temperature / top-k / top-p of the span that sampled it -- the transform the engine used,
   so with identical weights the importance ratio is exactly 1 (forward consistency,
   B08/B09). A separate no-grad pass, or -- with one PPO epoch, where the proximal policy is
   the policy being differentiated -- the loss forward itself (``lp.detach()``, bit-identical;
   see :meth:`Trainer.fused_recompute_ok`).
3. **Correction** (:func:`molt_core.algo.correction.apply_correction`): the staleness gate
   and per-token importance weights -- the single policy-version site.
4. **Advantages** (:func:`molt_core.algo.advantages.compute_advantages`).
5. **Update**: micro-batches of ``trainer.micro_batch_size`` rows with gradient
   accumulation; the policy loss of each micro-batch is already normalised by the *global*
   action-token count of the optimizer step, so micro-batch losses are summed (B15);
   optional KL to a frozen reference as a loss term or a per-token reward; AdamW, global
   grad-norm clip, LR warmup + constant/linear/cosine schedule; ``ppo_epochs`` passes; then
   ``version += 1`` (the :class:`~molt_core.types.PolicyVersion` the next publish carries).
   For ``gae`` a critic (:class:`ValueModel`) gives the values and is updated alongside.

Checkpoints (:meth:`Trainer.save_checkpoint`, :mod:`molt_core.train.checkpoint`) are Hugging Face-loadable directories
(``save_pretrained``, safetensors, tokenizer) plus optimizer, scheduler, RNG states, step,
version and the caller's data cursor, written atomically (temp dir + rename) and pruned to
``checkpoint.keep``.

Dropout is disabled (the model stays in ``eval()`` mode while training): an importance ratio
is only exactly 1 on-policy if the recompute and the loss forward are the same function.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from molt_core.config import RunConfig
from molt_core.sampling import processed_logprobs
from molt_core.train.checkpoint import load_checkpoint, save_checkpoint
from molt_core.train.ingress import Batch, IngressError, build_batch, refuse_malformed
from molt_core.types import Trajectory

__all__ = ["Trainer", "ValueModel", "lr_factor", "token_logprobs"]


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    param_ids: torch.Tensor,
    params: Sequence[tuple[float, int, float]],
    with_entropy: bool = False,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each sampled token under its span's processed distribution.

    Args:
        logits: ``[B, K, V]`` model outputs for positions ``offset .. offset + K - 1``
            (logits at position ``t - 1`` predict token ``t``; ``K = T``, ``offset = 0`` for a
            full forward).
        input_ids: ``[B, T]`` int64 token ids.
        param_ids: ``[B, T]`` int64, index into ``params`` for sampled tokens, -1 elsewhere
            (position 0 must be -1).
        params: ``(temperature, top_k, top_p)`` per index, applied by
            :func:`molt_core.sampling.processed_logprobs` (temperature -> top-k -> top-p).
        with_entropy: also return the entropy (nats) of the processed distribution at each
            sampled position (computed without grad).

    Returns:
        ``(logprobs, entropy)``: ``[B, T]`` float32 (0 where not sampled; differentiable
        w.r.t. ``logits``), and ``[B, T]`` float32 or None.

    Example (B08): logits ``[2, 1, 0]``, T = 0.5 -> logprob of token 0 = -0.142932.
    """
    B, T = input_ids.shape
    out = torch.zeros((B, T), dtype=torch.float32, device=logits.device)
    ent = torch.zeros((B, T), dtype=torch.float32, device=logits.device) if with_entropy else None
    for c, (temp, top_k, top_p) in enumerate(params):
        bi, ti = (param_ids == c).nonzero(as_tuple=True)
        if bi.numel() == 0:
            continue
        lp = processed_logprobs(logits[bi, ti - 1 - offset], temp, top_k, top_p)  # [N, V]
        tok = lp.gather(-1, input_ids[bi, ti].unsqueeze(-1)).squeeze(-1)
        out = out.index_put((bi, ti), tok)
        if ent is not None:
            with torch.no_grad():
                ent[bi, ti] = torch.special.entr(lp.detach().exp()).sum(-1)
    return out, ent


# ---------------------------------------------------------------------------------------
# LR schedule
# ---------------------------------------------------------------------------------------


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier of the base LR for optimizer step ``step`` (0-based).

    Warmup is linear, ``(step + 1) / warmup_steps`` for ``step < warmup_steps`` (the first
    step is not wasted at LR 0). After it, with ``p = (step - warmup) / max(1, total - warmup)``
    clamped to [0, 1]: ``constant`` -> 1; ``linear`` -> ``1 - p``; ``cosine`` ->
    ``0.5 (1 + cos(pi p))`` (Loshchilov & Hutter 2017, SGDR, without restarts).

    Raises:
        ValueError: unknown schedule.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    p = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - p
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"trainer.lr_schedule {schedule!r} is unknown; use constant, linear or cosine")


def _accepts(model: torch.nn.Module, arg: str) -> bool:
    """Whether ``model.forward`` takes keyword ``arg`` (cached per model class; a peft model:
    its base model's ``forward``)."""
    cls = type(model)
    cache = _ACCEPTS.setdefault(cls, {})
    if arg not in cache:
        import inspect

        try:
            inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft passes kwargs on
            cache[arg] = arg in inspect.signature(inner.forward).parameters
        except (TypeError, ValueError):
            cache[arg] = False
    return cache[arg]


_ACCEPTS: dict[type, dict[str, bool]] = {}


def _model_vocab(model: torch.nn.Module) -> int | None:
    emb = getattr(model, "get_output_embeddings", lambda: None)()
    if emb is not None and hasattr(emb, "weight"):
        return int(emb.weight.shape[0])
    cfg = getattr(model, "config", None)
    return getattr(cfg, "vocab_size", None)


class ValueModel(torch.nn.Module):
    """The critic of GAE: a copy of the policy's decoder (its initial weights) with a scalar
    value head (zero-initialised, so every value starts at 0).

    ``forward(input_ids [B, T] int64) -> values [B, T] float32`` where ``values[:, t]`` is the
    value of the state *before* token ``t`` (read from the hidden state at ``t - 1``; 0 at
    ``t = 0``) -- aligned with the logprobs, so GAE reads it on sampled tokens.

    Raises:
        ValueError: the policy has no ``get_decoder()`` / ``config.hidden_size``.
    """

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        dec = policy.get_decoder() if hasattr(policy, "get_decoder") else None
        hidden = getattr(getattr(policy, "config", None), "hidden_size", None)
        if dec is None or hidden is None:
            raise ValueError(
                f"algo.advantage = 'gae' needs a critic built from the policy's decoder, but "
                f"{type(policy).__name__} has no get_decoder()/config.hidden_size; use a group estimator (grpo, rloo)"
            )
        self.backbone = copy.deepcopy(dec)
        self.head = torch.nn.Linear(int(hidden), 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.backbone(input_ids=input_ids, use_cache=False).last_hidden_state
        v = self.head(h).squeeze(-1).float()
        return torch.nn.functional.pad(v[:, :-1], (1, 0))


class Trainer:
    """The single trainable actor (policy, optional frozen reference, optimizer, schedule).

    Args:
        cfg: the run configuration (sections ``model``, ``trainer``, ``algo``,
            ``correction``, ``async``, ``checkpoint``, ``run``).
        model: a causal LM whose ``forward(input_ids=...)`` returns an object with
            ``.logits`` ``[B, T, V]``; loaded with ``molt_core.models.load_model`` from
            ``cfg.model`` when None.
        tokenizer: saved with checkpoints; loaded with ``molt_core.models.load_tokenizer``
            when None and ``model`` is None.
        ref_model: frozen reference for the KL term; when None and ``algo.kl_coef > 0`` a
            frozen copy of the initial policy is made (:meth:`reset_reference` re-snapshots
            it, e.g. after an SFT warm start).

    Attributes:
        version: the policy version of the current weights (0 = initial; +1 per
            :meth:`train_step` that updated them).
        step: optimizer steps taken (the LR schedule position).

    With ``algo.advantage = "gae"`` a critic (:class:`ValueModel`, a copy of the policy's
    decoder with a scalar head) is trained alongside, with its own AdamW at
    ``trainer.critic_lr``.

    Raises:
        ValueError: a bad option combination (KL as reward with a sequence-level estimator,
            ``trainer.betas`` not of length 2, GAE on a model without a decoder to copy).
    """

    def __init__(self, cfg: RunConfig, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 ref_model: torch.nn.Module | None = None, replay_backend: Any = None) -> None:
        self.cfg = cfg
        torch.manual_seed(cfg.run.seed)  # global torch RNG, so a run is reproducible from its seed
        if model is None:
            from molt_core.models import load_model, load_tokenizer

            model = load_model(cfg.model.path, dtype=cfg.model.dtype, gguf_file=cfg.model.gguf_file, seed=cfg.run.seed)
            if tokenizer is None:
                tokenizer = load_tokenizer(cfg.model.path, gguf_file=cfg.model.gguf_file)
        self.device = torch.device("cuda" if cfg.trainer.num_gpus > 0 and torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device)
        if cfg.trainer.lora is not None:  # a LoRA adapter (peft): molt_core.train.lora
            from molt_core.train.lora import wrap

            self.model = wrap(self.model, cfg.trainer.lora)
        self.model.eval()  # no dropout: on-policy ratios are exactly 1
        if cfg.trainer.gradient_checkpointing:
            from molt_core.train.grad_ckpt import enable_gradient_checkpointing

            enable_gradient_checkpointing(self.model)
        self.tokenizer = tokenizer
        self.kl_coef = float(cfg.algo.kl_coef)
        self.ref_model = ref_model
        if self.ref_model is None and self.kl_coef > 0:
            self.reset_reference()
        elif self.ref_model is not None:
            self.ref_model.to(self.device).eval().requires_grad_(False)
        self.kl_controller = None
        if cfg.algo.kl_target is not None and self.kl_coef > 0:
            from molt_core.algo.kl import AdaptiveKLController

            self.kl_controller = AdaptiveKLController(self.kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
        if cfg.algo.kl_as_reward and cfg.algo.advantage not in ("reinforce", "gae"):
            raise ValueError(
                f"algo.kl_as_reward = true works with algo.advantage 'reinforce' or 'gae' (per-token "
                f"rewards), not {cfg.algo.advantage!r}; set algo.kl_as_reward = false to use KL as a loss term"
            )
        tc = cfg.trainer
        if len(tc.betas) != 2:
            raise ValueError(f"trainer.betas must have 2 entries, got {tc.betas}")
        self.critic = ValueModel(self.model).to(self.device) if cfg.algo.advantage == "gae" else None
        self._shard()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=tc.lr, betas=(tc.betas[0], tc.betas[1]), eps=tc.eps,
                                           weight_decay=tc.weight_decay)
        total = max(1, cfg.run.steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, tc.warmup_steps, total, tc.lr_schedule))
        if self.critic is not None:
            self.critic_optimizer = torch.optim.AdamW(
                self.critic.parameters(), lr=tc.critic_lr or tc.lr, betas=(tc.betas[0], tc.betas[1]), eps=tc.eps,
                weight_decay=tc.weight_decay)
            self.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.critic_optimizer, lambda s: lr_factor(s, tc.warmup_steps, total, tc.lr_schedule))
        self.version = 0
        self.step = 0
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_id = int(pad) if pad is not None else 0
        self.vocab_size = _model_vocab(self.model)
        from molt_core.version_history import VersionHistory

        #: weights of the last ``max_staleness`` versions, for the on-policy consistency measure
        self.history = VersionHistory(cfg.async_.max_staleness if cfg.async_.onpolicy_rows != 0 else 0)
        self._init_routing(replay_backend)
        #: take proximal logprobs from the loss forward when :meth:`fused_recompute_ok`
        self.fuse_recompute = True

    # -- data-parallel seams, overridden by molt_core.train.distributed.ShardedTrainer ---------
    #: every process runs the same forwards/backwards (FSDP2 collectives): a micro-batch with
    #: nothing to train still runs its forward and a zero backward
    lockstep = False

    def _shard(self) -> None:
        """Shard the models across processes, before the optimizers see the parameters."""

    def _work(self, batch: Batch, model: torch.nn.Module | None = None) -> list[tuple[slice, bool]]:
        """Micro-batches this process runs, ``(rows, real)``: all rows, all real (a sharded
        trainer: its share, then stand-ins with ``real`` False)."""
        return [(rows, True) for rows in self._micro_batches(batch)]

    def _combine_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, ...]``, each process having filled the rows it ran -> every row filled."""
        return x

    def _reduce_losses(self, m: dict[str, float]) -> dict[str, float]:
        """Loss metrics of this process's micro-batches -> of the whole step."""
        return m

    @staticmethod
    def _clip_grads(params: list[torch.nn.Parameter], clip: float) -> float:
        """Clip to global grad norm ``clip`` (0: none); the norm before it (over every shard)."""
        gn = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        return float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)

    # -- reference ------------------------------------------------------------------------
    def reset_reference(self) -> None:
        """Make the frozen reference a copy of the current policy weights (no grad); with
        LoRA, the policy with its adapter disabled (:class:`molt_core.train.lora.AdapterDisabled`)."""
        if self.cfg.trainer.lora is not None:
            from molt_core.train.lora import AdapterDisabled

            self.ref_model = AdapterDisabled(self.model)
            return
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)

    # -- forward --------------------------------------------------------------------------
    def _forward(self, model: torch.nn.Module, batch: Batch, rows: slice, with_entropy: bool = False):
        """Logprobs (and entropy) ``[b, T_rows]`` of the sampled tokens of ``rows``; right
        padding needs no attention mask (a causal model never attends to later positions).
        Logits are only computed at the positions that predict a sampled token
        (``logits_to_keep`` as column indices, when the model accepts it)."""
        T = int(batch.lengths[rows].max())
        ids = batch.input_ids[rows, :T].to(self.device)
        pids = batch.param_ids[rows, :T]
        kw: dict[str, Any] = {}
        offset = 0
        if _accepts(model, "logits_to_keep"):
            cols = (pids >= 0).any(0).nonzero().flatten()
            if cols.numel():
                offset = int(cols[0]) - 1
                kw["logits_to_keep"] = torch.arange(offset, int(cols[-1]), device=self.device)
        with self._routing(model, batch, rows, T):
            logits = model(input_ids=ids, use_cache=False, **kw).logits
        lp, ent = token_logprobs(logits, ids, pids.to(self.device), batch.params, with_entropy, offset=offset)
        if self.lockstep and torch.is_grad_enabled():  # a backward reaches every parameter, even with no token
            lp = lp + 0.0 * logits[..., :1].sum()
        return lp, ent

    # -- MoE routing replay (R3, arXiv 2510.11370) ---------------------------------------------
    def _init_routing(self, backend: Any) -> None:
        """Set up routing record/replay for an MoE policy (nothing for a dense one).

        Raises:
            ValueError: ``model.routing_replay`` is on and no backend is registered for the
                model's ``config.model_type``.
        """
        from molt_core.routing import RoutingRecorder, get_replay_backend, is_moe

        self.replay_backend = None
        self._route_recorder = RoutingRecorder(self.model) if is_moe(self.model) else None
        self._routing_used: dict[int, torch.Tensor] = {}  # first row -> selection of its first forward
        self._replaying = True
        if self._route_recorder is None or not self.cfg.model.routing_replay:
            return
        self.replay_backend = backend if backend is not None else get_replay_backend(self.model, plugins=self.cfg.plugins)
        if self.replay_backend is None:
            mt = getattr(self.model.config, "model_type", "?")
            raise ValueError(
                f"model.routing_replay is true but no routing-replay backend is registered for model type "
                f"{mt!r}; register one with molt_register_replay_backends, or set model.routing_replay = false"
            )

    @contextmanager
    def _routing(self, model: torch.nn.Module, batch: Batch, rows: slice, T: int):
        """Around a policy forward over ``rows``: replay ``batch.routed_experts`` (when a
        backend is active) and record the selection actually used (first forward per row
        block in a step)."""
        rec = batch.routed_experts
        shadow = model is self.history.shadow  # an older version's weights: replay, no record
        if (model is not self.model and not shadow) or self._route_recorder is None or rec is None:
            yield
            return
        rec = rec[rows, :T]
        replay = self.replay_backend.replay(model, rec) if self.replay_backend is not None and self._replaying else nullcontext()
        if shadow:
            with replay:
                yield
            return
        with self._route_recorder, replay:
            yield
            used = self._route_recorder.take()
        self._routing_used.setdefault(int(rows.start or 0), used.view(rec.shape).cpu())

    @torch.no_grad()
    def _routing_noreplay(self, batch: Batch) -> dict[str, Any]:
        """The no-replay diagnostic (before the update): logprobs ``[B, T]`` and routing of a
        natural forward, when a replay backend is active and the batch carries routing."""
        if self.replay_backend is None or batch.routed_experts is None:
            return {}
        self._replaying, saved, self._routing_used = False, self._routing_used, {}
        try:
            lp, _ = self.recompute_logprobs(batch)
            return {"logprobs": lp, "used": self._routing_used}
        finally:
            self._replaying, self._routing_used = True, saved

    def _routing_metrics(self, batch: Batch, prox: torch.Tensor, noreplay: dict[str, Any]) -> dict[str, float]:
        """R3 metrics of a step (empty for a dense policy or a batch without routing).

        Both rates are :func:`molt_core.routing.flip_rate`: the fraction of (position, MoE
        layer) pairs whose selected top-k *set* differs from the engine's recorded one, at the
        positions whose logits score a sampled token (``t - 1`` for a sampled ``t``) that have
        a complete recorded selection. The selections are what the routers returned, captured
        by forward hooks on the router modules (:class:`molt_core.routing.RoutingRecorder`).

        * ``invariants/routing_flip_rate`` -- always the trainer's *natural* router (no
          replay) against the engine's record: the no-replay pass when a replay backend is
          active, else the loss forward itself;
        * ``invariants/routing_replay_mismatch`` (replay only) -- the selection the replayed
          forward actually used against the record: 0 when the backend replays correctly;
        * ``invariants/logprob_absdiff_mean_noreplay`` / ``_max_noreplay`` -- |behaviour -
          recomputed| without replay (``invariants/logprob_absdiff_*`` are with it);
        * ``invariants/routing_replay`` -- 1 when replay was applied, ``routing/positions``.
        """
        from molt_core.routing import flip_rate

        rec = batch.routed_experts
        if self._route_recorder is None or rec is None:
            return {}
        mask = batch.mask
        pos = torch.zeros_like(mask)
        pos[:, :-1] = mask[:, 1:]
        used, count = flip_rate(self._routing_used, rec, pos)
        natural = flip_rate(noreplay["used"], rec, pos)[0] if noreplay else used
        out = {"invariants/routing_replay": float(self.replay_backend is not None),
               "invariants/routing_flip_rate": natural, "routing/positions": float(count)}
        if noreplay:
            out["invariants/routing_replay_mismatch"] = used
        lp_nat = noreplay.get("logprobs", prox)
        diff = (batch.behaviour_logprobs - lp_nat).abs()[mask]
        diff = diff[torch.isfinite(diff)]  # a token out of the natural forward's support has no finite size
        out["invariants/logprob_absdiff_mean_noreplay"] = float(diff.mean()) if diff.numel() else 0.0
        out["invariants/logprob_absdiff_max_noreplay"] = float(diff.max()) if diff.numel() else 0.0
        return out

    # -- critic (GAE) ------------------------------------------------------------------------
    @torch.no_grad()
    def critic_values(self, batch: Batch) -> torch.Tensor:
        """The critic's values ``[B, T]`` float32 (CPU) before the update (see :class:`ValueModel`)."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for rows, real in self._work(batch, self.critic):
            Tr = int(batch.lengths[rows].max())
            v = self.critic(batch.input_ids[rows, :Tr].to(self.device)).cpu()
            if real:
                out[rows, :Tr] = v
        return self._combine_rows(out)

    def _update_critic(self, batch: Batch, old_values: torch.Tensor, returns: torch.Tensor, train_mask: torch.Tensor,
                       num_tokens: int) -> dict[str, float]:
        """``ppo_epochs`` critic steps on the clipped value loss (PPO; Schulman et al. 2017,
        arXiv 1707.06347, with value clipping as in OpenAI baselines ppo2):
        ``0.5 * max((V - G)^2, (V_old + clip(V - V_old, -c, c) - G)^2)`` summed over the
        step's action tokens / ``num_tokens`` (c = ``algo.value_clip``; None: unclipped)."""
        cfg = self.cfg
        c = cfg.algo.value_clip
        clip = cfg.trainer.grad_clip
        params = list(self.critic.parameters())
        loss_sum = gn_sum = 0.0
        for _epoch in range(cfg.trainer.ppo_epochs):
            self.critic_optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for rows, real in self._work(batch, self.critic):
                active = real and bool(train_mask[rows].any())
                if not active and not self.lockstep:
                    continue
                T = int(batch.lengths[rows].max())
                dev = self.device
                v = self.critic(batch.input_ids[rows, :T].to(dev))
                if not active:  # every process runs the same backwards (FSDP2 collectives)
                    (0.0 * v.sum()).backward()
                    continue
                g = returns[rows, :T].to(dev)
                err = (v - g) ** 2
                if c is not None:
                    v0 = old_values[rows, :T].to(dev)
                    err = torch.maximum(err, (v0 + (v - v0).clamp(-c, c) - g) ** 2)
                m = train_mask[rows, :T].to(dev)
                loss = 0.5 * torch.where(m, err, torch.zeros((), device=dev)).sum() / num_tokens
                loss.backward()
                total += float(loss.detach())
            gn = self._clip_grads(params, clip)
            self.critic_optimizer.step()
            loss_sum += self._reduce_losses({"loss/value": total})["loss/value"] / cfg.trainer.ppo_epochs
            gn_sum += gn / cfg.trainer.ppo_epochs
        m = train_mask
        g, v0 = returns[m].double(), old_values[m].double()
        var = float(g.var(unbiased=False)) if g.numel() > 1 else 0.0
        ev = 1.0 - float((g - v0).var(unbiased=False)) / var if var > 0 else 0.0
        return {"loss/value": loss_sum, "critic/grad_norm": gn_sum, "critic/value_mean": float(v0.mean()),
                "critic/return_mean": float(g.mean()), "critic/explained_variance": ev}

    def _micro_batches(self, batch: Batch) -> list[slice]:
        mb = self.cfg.trainer.micro_batch_size
        return [slice(i, min(i + mb, batch.size)) for i in range(0, batch.size, mb)]

    @torch.no_grad()
    def recompute_logprobs(self, batch: Batch, model: torch.nn.Module | None = None,
                           with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs ``[B, T]`` float32 (CPU) of the batch's sampled tokens under ``model``
        (default: the policy), in the same micro-batches the update uses; 0 where not
        sampled. Also the entropy ``[B, T]`` when ``with_entropy``."""
        model = model if model is not None else self.model
        lps = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        ents = torch.zeros(batch.input_ids.shape, dtype=torch.float32) if with_entropy else None
        for rows, real in self._work(batch, model):
            lp, ent = self._forward(model, batch, rows, with_entropy)
            if real:
                lps[rows, :lp.shape[1]] = lp.float().cpu()
                if ents is not None:
                    ents[rows, :lp.shape[1]] = ent.cpu()
        return self._combine_rows(lps), (self._combine_rows(ents) if ents is not None else None)

    # -- the RL step ----------------------------------------------------------------------
    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One policy update from ``trajectories``; returns the step's metrics.

        Failed trajectories are skipped. Ingress refuses, one rollout at a time (the rest of
        the step trains): a malformed rollout (:func:`molt_core.train.ingress.refuse_malformed`:
        e.g. sampled tokens without a sampled span, misaligned fields, an id out of the
        vocabulary; ``ingress/refused_malformed``, ``ingress/refused_no_span``), a rollout
        whose action tokens differ from the engine's record, and -- with
        ``trainer.refuse_unverified`` (default) -- one whose action tokens carry no engine
        record (:func:`molt_core.identity.screen`). When ingress refuses every ok rollout, or
        the gate drops every sequence, no optimizer step is taken, ``version`` and ``step``
        stay, and ``train/skipped`` is 1.

        Args:
            trajectories: finished, scored rollouts (see :func:`build_batch`).

        Returns:
            ``dict[str, float]`` with the ingress metrics of :func:`molt_core.identity.screen`
            (``invariants/tokens_retokenized``, ``invariants/tokens_unverified``,
            ``ingress/refused_retokenized``, ``ingress/refused_unverified``,
            ``ledger/context_reencoded_tokens``), ``ingress/refused_malformed``,
            ``ingress/refused_no_span``, ``ingress/refused_rollouts`` (all refusals; only these,
            ``train/skipped`` = 1, ``train/rollouts`` = 0 and ``train/step`` when nothing is
            left to train on), ``invariants/logprob_absdiff_mean`` / ``_max`` (|behaviour - recomputed| over all
            sampled in-support tokens, before the update: policy drift plus mismatch),
            ``invariants/logprob_absdiff_max_onpolicy`` / ``_mean_onpolicy`` (every step,
            async included: each measured token against the weights of the version that
            sampled it -- the proximal logprobs for the current version, a recompute under a
            held older version otherwise; see :mod:`molt_core.version_history`; NaN when
            nothing could be measured; finite: an on-policy token outside its own version's
            support counts in ``invariants/onpolicy_out_of_support_tokens`` instead),
            ``invariants/onpolicy_tokens`` / ``_stale_tokens``,
            for an MoE policy with recorded routing the R3 metrics of
            :meth:`_routing_metrics` (``invariants/routing_flip_rate``,
            ``invariants/routing_replay_mismatch``, ``_noreplay`` logprob variants),
            ``invariants/staleness_max`` (over every sampled token, before the gate; see
            :func:`molt_core.algo.correction.apply_correction`), ``correction/*`` (incl.
            ``gated_frac`` and ``out_of_support_frac``), ``loss/*`` (``loss/total``,
            ``loss/policy``, ``loss/kl``, and the policy loss's own metrics), ``grad_norm``
            (before clipping), ``kl`` (estimator ``algo.kl_estimator`` against the reference,
            0 without one; over sampled tokens inside the reference's top-k / top-p support),
            ``kl/ref_out_of_support_frac`` (sampled tokens whose reference logprob is -inf --
            outside the reference's support -- / sampled tokens: left out of the KL term in the
            loss, the per-token reward and ``kl``), ``kl/behaviour_k3`` (current vs behaviour
            policy), ``kl_coef``,
            ``distill/reverse_kl`` (``on_policy_distill`` only: the reverse KL
            ``KL(pi_student || pi_teacher)`` in nats per token, estimated on the student's
            sampled tokens as the mean of ``log pi_student(y_t) - log pi_teacher(y_t)`` -- the
            k1 estimator, Schulman 2020 -- before the update),
            ``entropy`` (mean over sampled tokens, nats, of the processed distribution),
            ``lr``, ``tokens_per_s`` (non-pad tokens / step wall time), ``train/*`` counts
            (``train/fused_recompute`` 1 when the proximal logprobs came from the loss
            forward), ``time/recompute`` (reference pass + separate recompute pass, if any),
            ``time/onpolicy_check`` (recompute under older versions, plus the copy of this
            version's weights kept for later steps' check),
            ``time/train`` (loss forwards, backward, optimizer), ``time/step`` (seconds).

        Raises:
            IngressError: a step-level fault :func:`build_batch` still finds after the
                per-rollout refusals (in practice none: each check is made per rollout first).
        """
        from molt_core.algo.advantages import compute_advantages
        from molt_core.algo.correction import apply_correction
        from molt_core.algo.kl import kl_estimate
        from molt_core.identity import screen

        cfg = self.cfg
        t_start = time.perf_counter()
        distill = cfg.algo.advantage == "on_policy_distill"
        # one malformed rollout (e.g. sampled tokens without a span) is refused alone, not the step
        # (the whole batch first: in the common clean case the per-rollout pass is skipped)
        try:
            batch: Batch | None = build_batch(trajectories, self.pad_id, self.vocab_size, need_teacher=distill)
            malformed = {"ingress/refused_malformed": 0.0, "ingress/refused_no_span": 0.0}
        except IngressError:
            batch = None
            trajectories, malformed, _reasons = refuse_malformed(trajectories, self.pad_id, self.vocab_size,
                                                                 need_teacher=distill)
        n_in = len(trajectories)
        trajectories, ingress = screen(trajectories, refuse_unverified=cfg.trainer.refuse_unverified)
        if len(trajectories) != n_in:
            batch = None
        ingress.update(malformed)
        ingress["ingress/refused_rollouts"] += malformed["ingress/refused_malformed"]
        if ingress["ingress/refused_rollouts"] and not any(t.status == "ok" for t in trajectories):
            return {**ingress, "train/skipped": 1.0, "train/rollouts": 0.0, "train/step": float(self.step)}
        if batch is None:
            batch = build_batch(trajectories, self.pad_id, self.vocab_size, need_teacher=distill)
        mask = batch.mask
        n_sampled = int(mask.sum())
        beh = batch.behaviour_logprobs
        self._routing_used = {}
        noreplay = self._routing_noreplay(batch)  # R3 diagnostic, before any weight change

        def correct(prox: torch.Tensor, rows: slice = slice(None)):
            T = prox.shape[1]
            return apply_correction(cfg.correction, beh[rows, :T], batch.versions[rows, :T], prox, mask[rows, :T],
                                    self.version, cfg.async_.max_staleness, seq_index=batch.rollout_index[rows])

        # 1. recompute (no grad): reference logprobs; proximal logprobs unless fused
        fused = self.fused_recompute_ok(batch)
        t0 = time.perf_counter()
        ref_lp = self.recompute_logprobs(batch, model=self.ref_model)[0] if self.ref_model is not None else None
        # a sampled token outside the reference's top-k / top-p support (reference logprob -inf):
        # no finite KL exists for it; it is left out of the KL term (loss, reward and metric) and
        # counted in kl/ref_out_of_support_frac, with a finite stand-in so no inf/NaN reaches
        # the loss or its gradient
        kl_keep = mask
        if ref_lp is not None:
            ref_oos = mask & ~torch.isfinite(ref_lp)
            kl_keep = mask & ~ref_oos
            ref_lp = torch.where(ref_oos, beh, ref_lp)
        old_values = self.critic_values(batch) if self.critic is not None else None
        if fused:
            # the gate depends on versions only: with proximal = behaviour it yields keep / loss mask
            prox = ent = weights = prox_ok = None
            train_mask = correct(beh).loss_mask
        else:
            prox, ent = self.recompute_logprobs(batch, with_entropy=True)
            corr = correct(prox)
            train_mask, weights = corr.loss_mask, corr.weights
            prox_ok = _in_support(prox, beh, corr.out_of_support)
        t_recompute = time.perf_counter() - t0
        num_tokens = int(train_mask.sum())

        # 2. advantages (KL to the reference as a per-token reward when configured)
        metrics: dict[str, float] = dict(ingress)
        token_rewards = None
        if ref_lp is not None and cfg.algo.kl_as_reward:
            token_rewards = (-self.kl_coef * kl_estimate(prox_ok, ref_lp, cfg.algo.kl_estimator)) * kl_keep
        adv, returns = compute_advantages(
            cfg.algo, batch.rewards, batch.group_index, batch.rollout_index, mask, values=old_values,
            token_rewards=token_rewards, student_logprobs=prox_ok if distill else None,
            teacher_logprobs=batch.teacher_logprobs if distill else None)

        # 3. update; first keep these weights as this version (for the on-policy measure of
        # later steps) and measure this step's tokens sampled by older versions under theirs
        t_check = time.perf_counter()
        onpol = self._onpolicy_stale(batch)
        if num_tokens > 0:
            self.history.record(self.version, self.model)
        t_check = time.perf_counter() - t_check
        t1 = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])
        if num_tokens == 0:
            metrics.update({"train/skipped": 1.0, "loss/total": 0.0, "loss/policy": 0.0, "loss/kl": 0.0,
                            "grad_norm": 0.0})
            if prox is None:
                prox, ent = self.recompute_logprobs(batch, with_entropy=True)
        else:
            metrics["train/skipped"] = 0.0
            upd, fused_prox, fused_ent = self._update(batch, prox, weights, ref_lp, adv, train_mask, num_tokens,
                                                      correct if fused else None,
                                                      None if fused else corr.out_of_support, kl_keep)
            metrics.update(upd)
            if fused:
                prox, ent = fused_prox, fused_ent
            if self.critic is not None:
                metrics.update(self._update_critic(batch, old_values, returns, train_mask, num_tokens))
        t_train = time.perf_counter() - t1

        # 4. metrics of the step's batch (before the update)
        corr = correct(prox)  # the correction the update used (per row, so identical per micro-batch)
        if fused and not torch.equal(corr.loss_mask, train_mask):
            raise RuntimeError("internal: the fused recompute changed the gate's loss mask; report this bug")
        metrics.update({k: float(v) for k, v in corr.metrics.items()})  # incl. invariants/staleness_max
        from molt_core.version_history import onpolicy_metrics

        oos = corr.out_of_support
        metrics.update(onpolicy_metrics((beh - prox).abs()[mask & (batch.versions == self.version)], onpol))
        prox = _in_support(prox, beh, oos)  # the metrics below are over in-support tokens
        diff = (beh - prox).abs()[mask & ~oos]
        metrics["invariants/logprob_absdiff_mean"] = float(diff.mean()) if diff.numel() else 0.0
        metrics["invariants/logprob_absdiff_max"] = float(diff.max()) if diff.numel() else 0.0
        metrics.update(self._routing_metrics(batch, prox, noreplay))
        metrics["entropy"] = float(ent[mask].mean()) if n_sampled else 0.0
        metrics["kl/behaviour_k3"] = float(kl_estimate(prox, beh, "k3")[mask].mean()) if n_sampled else 0.0
        kl_ref = 0.0
        if ref_lp is not None and bool(kl_keep.any()):
            kl_ref = float(kl_estimate(prox, ref_lp, cfg.algo.kl_estimator)[kl_keep].mean())
        metrics["kl"] = kl_ref
        metrics["kl/ref_out_of_support_frac"] = float((mask & ~kl_keep).sum()) / n_sampled if n_sampled else 0.0
        metrics["kl_coef"] = self.kl_coef
        if distill:  # KL(student || teacher) on the student's own samples: k1, mean over sampled tokens
            metrics["distill/reverse_kl"] = float((prox - batch.teacher_logprobs)[mask].mean()) if n_sampled else 0.0
        keep = corr.keep.to(torch.bool)
        metrics["train/sequences"] = float(batch.size)
        metrics["train/rollouts"] = float(batch.rewards.numel())
        metrics["train/action_tokens"] = float(num_tokens)
        metrics["train/gated_sequences"] = float((~keep).sum())
        metrics["train/fused_recompute"] = float(fused)
        metrics["reward/batch_mean"] = float(batch.rewards.mean())
        metrics["lr"] = lr

        if num_tokens > 0:
            self.scheduler.step()
            if self.critic is not None:
                self.critic_scheduler.step()
            self.step += 1
            self.version += 1
            if self.kl_controller is not None and ref_lp is not None:
                self.kl_controller.update(kl_ref, n_steps=1)
                self.kl_coef = float(self.kl_controller.value)
        wall = time.perf_counter() - t_start
        metrics["time/recompute"] = t_recompute
        metrics["time/onpolicy_check"] = t_check
        metrics["time/train"] = t_train
        metrics["time/step"] = wall
        metrics["tokens_per_s"] = float(batch.lengths.sum()) / max(wall, 1e-9)
        metrics["train/step"] = float(self.step)
        return metrics

    def _onpolicy_stale(self, batch: Batch) -> torch.Tensor:
        """|behaviour - recomputed| ``[N]`` of the batch's tokens sampled by older versions,
        each under its own version's weights (see :mod:`molt_core.version_history`)."""
        from molt_core.version_history import stale_absdiff

        gen = torch.Generator().manual_seed(self.cfg.run.seed * 1_000_003 + self.version)  # a new sample each step
        return stale_absdiff(batch, self.version, self.history, lambda b, m: self.recompute_logprobs(b, model=m)[0],
                             self.model, self.cfg.async_.onpolicy_rows, generator=gen)

    def fused_recompute_ok(self, batch: Batch | None = None) -> bool:
        """Whether this step can take the proximal logprobs from the loss forward itself.

        With one PPO epoch the proximal policy *is* the policy being differentiated, so the
        separate no-grad recompute pass is skipped and ``lp.detach()`` of the loss forward
        (same weights, same micro-batches: bit-identical) serves as the proximal logprobs.
        Needs: ``ppo_epochs == 1``; no estimator that needs them before the loss
        (``on_policy_distill``, KL as reward); and a loss-token count that does not depend
        on them (not ``is_mode = "mask"``, which can reject tokens -- out-of-support ones at
        every level, ``off`` included). ``fuse_recompute = False``
        on the instance forces the separate pass. With ``batch`` given, also not for
        seq/geo weights when a rollout has several rows (its weight needs every row's proximal
        logprobs, which one micro-batch's forward may not hold).
        """
        cfg = self.cfg
        multi_row = batch is not None and bool((torch.bincount(batch.rollout_index) > 1).any())
        return (self.fuse_recompute and cfg.trainer.ppo_epochs == 1
                and not (multi_row and cfg.correction.is_level in ("seq", "geo"))
                and cfg.algo.advantage != "on_policy_distill"
                and not (cfg.algo.kl_as_reward and self.ref_model is not None)
                and cfg.correction.is_mode != "mask")

    def _update(self, batch, prox, weights, ref_lp, adv, train_mask, num_tokens, correct, out_of_support=None,
                kl_keep=None):
        """``ppo_epochs`` optimizer steps over the batch's micro-batches.

        With ``correct`` given (fused recompute), the proximal logprobs and IS weights of each
        micro-batch come from its own loss forward in epoch 0 via ``correct(prox_mb, rows)``;
        otherwise ``weights`` and ``out_of_support`` (``[B, T]``) come from the correction.
        ``kl_keep`` (``[B, T]`` bool, None: all) marks the tokens the KL term covers (not the
        ones outside the reference's support).

        Returns:
            ``(loss metrics averaged over epochs, prox [B, T] or None, entropy [B, T] or None)``
            -- the last two only when fused.
        """
        from molt_core.algo.kl import kl_loss
        from molt_core.algo.losses import policy_loss

        cfg = self.cfg
        clip = cfg.trainer.grad_clip
        dev = self.device
        fused = correct is not None
        B, Tfull = batch.input_ids.shape
        if fused:
            prox = torch.zeros((B, Tfull), dtype=torch.float32)
            ent_all = torch.zeros((B, Tfull), dtype=torch.float32)
        sums: dict[str, float] = {}
        for _epoch in range(cfg.trainer.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            tot = pol = klv = 0.0
            extra: dict[str, float] = {}
            for rows, real in self._work(batch):
                active = real and bool(train_mask[rows].any())
                if not active and not (fused and real) and not self.lockstep:
                    continue
                with torch.set_grad_enabled(active or self.lockstep):
                    lp, ent = self._forward(self.model, batch, rows, with_entropy=fused)
                T = lp.shape[1]
                if fused and real:
                    prox[rows, :T] = lp.detach().float().cpu()
                    ent_all[rows, :T] = ent.cpu()
                if not active:
                    if self.lockstep:  # every process runs the same backwards (FSDP2 collectives)
                        (0.0 * torch.nan_to_num(lp, neginf=0.0).sum()).backward()
                    continue
                if fused:
                    c = correct(prox[rows, :T], rows)
                    w, oos = c.weights, c.out_of_support
                else:
                    w, oos = weights[rows, :T], out_of_support[rows, :T]
                # an out-of-support token (logprob -inf) stays out of the gradient: weight 0,
                # finite stand-ins so no NaN reaches backward; it still counts in num_tokens
                # under trunc/clip (a weight-0 token), see apply_correction. A later PPO epoch
                # can push a token out of the current support too: same treatment.
                oos = oos.to(dev) | ~torch.isfinite(lp.detach())
                m = train_mask[rows, :T].to(dev) & ~oos
                lp = torch.where(oos, torch.zeros((), device=dev), lp)
                p_mb = torch.where(oos, torch.zeros((), device=dev), prox[rows, :T].to(dev))
                loss, lm = policy_loss(cfg.algo, lp, p_mb, adv[rows, :T].to(dev), m, w.to(dev), num_tokens)
                pol += float(loss.detach())
                _merge_loss_metrics(extra, lm, int(m.sum()) / num_tokens)
                if ref_lp is not None and not cfg.algo.kl_as_reward and self.kl_coef > 0:
                    km = m if kl_keep is None else m & kl_keep[rows, :T].to(dev)
                    kl_term = kl_loss(lp, ref_lp[rows, :T].to(dev), km, num_tokens, cfg.algo.kl_estimator)
                    klv += float(kl_term.detach())
                    loss = loss + self.kl_coef * kl_term
                tot += float(loss.detach())
                loss.backward()
            gn = self._clip_grads(self.params, clip)
            self.optimizer.step()
            ep = {(k if k.startswith("loss/") else f"loss/{k}"): v for k, v in extra.items()}
            ep.update({"loss/total": tot, "loss/policy": pol, "loss/kl": klv})
            ep = self._reduce_losses(ep)
            ep["grad_norm"] = gn
            for k, v in ep.items():
                sums[k] = sums.get(k, 0.0) + v / cfg.trainer.ppo_epochs
        return sums, (self._combine_rows(prox) if fused else None), (self._combine_rows(ent_all) if fused else None)

    # -- weights out ----------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict (name -> tensor) for ``engine.load_weights(state, version)``.

        The tensors are the live parameters (no copy): an engine must copy them (as
        ``load_state_dict`` does) before the next :meth:`train_step` changes them in place.
        With LoRA: the merged weights under the base model's names
        (:func:`molt_core.train.lora.merged_state_dict`).
        """
        if self.cfg.trainer.lora is not None:
            from molt_core.train.lora import merged_state_dict

            return merged_state_dict(self.model)
        return self.model.state_dict()

    def publish(self, engines: Iterable[Any]) -> int:
        """Call ``engine.load_weights(self.weights(), self.version)`` on each engine; returns
        the version published."""
        state = self.weights()
        for e in engines:
            e.load_weights(state, self.version)
        return self.version

    # -- checkpoints (molt_core.train.checkpoint) -------------------------------------------
    def save_checkpoint(self, run_dir: str | Path, data_cursor: dict[str, Any] | None = None) -> Path:
        """Write this trainer's checkpoint: :func:`molt_core.train.checkpoint.save_checkpoint`."""
        return save_checkpoint(self, run_dir, data_cursor)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore this trainer: :func:`molt_core.train.checkpoint.load_checkpoint`; returns the
        saved data cursor."""
        return load_checkpoint(self, path)


def _in_support(prox: torch.Tensor | None, beh: torch.Tensor, oos: torch.Tensor) -> torch.Tensor | None:
    """``prox`` ``[B, T]`` with the behaviour logprob in place of ``-inf`` on out-of-support
    tokens ``oos`` (``[B, T]`` bool), for consumers that need finite values (advantages, KL
    and logprob-difference metrics over in-support tokens); None passes through."""
    return None if prox is None else torch.where(oos, beh, prox)


def _merge_loss_metrics(acc: dict[str, float], mb: dict[str, float], share: float) -> None:
    """Fold one micro-batch's policy-loss metrics into ``acc``: ``*_min``/``*_max`` by
    min/max, the loss value and token count by sum, the rest (per-token means) weighted by
    the micro-batch's ``share`` of the step's action tokens."""
    for k, v in mb.items():
        v = float(v)
        if k.endswith("_min"):
            acc[k] = min(acc.get(k, v), v)
        elif k.endswith("_max"):
            acc[k] = max(acc.get(k, v), v)
        elif k in ("loss/pg", "loss/tokens"):
            acc[k] = acc.get(k, 0.0) + v
        else:
            acc[k] = acc.get(k, 0.0) + v * share
