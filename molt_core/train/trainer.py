"""The single trainable actor: logprob recompute, correction, loss, optimizer, weight export.

One :class:`Trainer` owns one Hugging Face ``AutoModelForCausalLM``; :meth:`Trainer.train_step` turns
finished :class:`~molt_core.types.Trajectory` objects into one policy update (docs/architecture.md) and
``version += 1``. The jobs live in the sibling modules (ingress, forward, update, critic, metrics, checkpoint).
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from molt_core.algo.correction import staleness_gate
from molt_core.algo.kl import AdaptiveKLController, kl_estimate
from molt_core.config import RunConfig
from molt_core.models import DTYPES, device_for, load_model, load_tokenizer, mask_vision_tokens, routing_tool
from molt_core.plugins import modality, use_run_plugins
from molt_core.train.algorithms import compute_advantages, correct_tokens, resolve_algorithms
from molt_core.train.checkpoint import load_checkpoint, save_checkpoint
from molt_core.train.critic import ValueModel, critic_values, update_critic
from molt_core.train.features import trainer_adapter
from molt_core.train.forward import forward_rows, model_vocab, recompute_logprobs, token_logprobs
from molt_core.train.grad_ckpt import enable_gradient_checkpointing
from molt_core.train.ingress import Batch, NonFiniteLogprobs, admit, build_batch, nonfinite_check
from molt_core.train.metrics import batch_metrics
from molt_core.train.onpolicy import OnPolicyChecks
from molt_core.train.update import in_support, lr_factor, policy_update
from molt_core.types import Trajectory
from molt_core.train.version_history import VersionHistory

log = logging.getLogger(__name__)

__all__ = ["Trainer", "ValueModel", "lr_factor", "token_logprobs"]


class Trainer(OnPolicyChecks):
    """The single trainable actor (policy, optional frozen reference, optimizer, schedule).

    Args:
        cfg: the run configuration.
        model: a causal LM whose ``forward(input_ids=...)`` returns ``.logits`` ``[B, T, V]``;
            loaded from ``cfg.model`` (``molt_core.models.load_model``) when None.
        tokenizer: saved with checkpoints; loaded from ``cfg.model`` when None and ``model`` is None.
        ref_model: frozen reference for the KL term; when None and ``algo.kl_coef > 0``, a frozen
            copy of the initial policy (:meth:`reset_reference` re-snapshots it).
        replay_backend: the MoE routing-replay backend to use instead of the model type's registered one.

    Attributes:
        version: the policy version of the current weights (0 = initial; +1 per update).
        step: optimizer steps taken (the LR schedule position).

    With ``algo.advantage = "gae"`` a critic (:class:`ValueModel`) is trained alongside with its own
    AdamW at ``trainer.critic_lr``; with LoRA it copies the plain decoder and trains all its weights.

    Raises:
        ValueError: ``trainer.betas`` not of length 2, GAE on a model without a decoder to copy,
            ``model.routing_replay`` with no replay backend for the MoE model's type.
        ConfigError: an estimator / loss option refused by :func:`resolve_algorithms`, or
            ``model.routing_replay`` for an MoE model and no routing tool loaded.
    """

    def __init__(self, cfg: RunConfig, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 ref_model: torch.nn.Module | None = None, replay_backend: Any = None) -> None:
        self.cfg = cfg
        use_run_plugins(cfg.plugins)  # forwards, ingress and SFT read the modality / routing registries
        #: the registered estimator and loss of ``algo.advantage`` / ``algo.loss`` (validated here)
        self.algo = resolve_algorithms(cfg)
        torch.manual_seed(cfg.run.seed)  # global torch RNG, so a run is reproducible from its seed
        if model is None:
            # fp32 master weights whatever model.dtype: bf16/fp16 is the compute dtype (autocast)
            model = load_model(cfg.model.path, dtype="float32", gguf_file=cfg.model.gguf_file, seed=cfg.run.seed)
            if tokenizer is None:
                tokenizer = load_tokenizer(cfg.model.path, gguf_file=cfg.model.gguf_file)
        mask_vision_tokens(model)  # a VL model never samples a vision special token; same logits as the engine
        self.device = device_for(cfg.trainer.num_gpus)
        #: forwards run in ``model.dtype`` under autocast over fp32 master weights (:meth:`autocast`)
        self.compute_dtype = DTYPES[cfg.model.dtype]
        self.model = model.to(self.device)
        critic = None
        #: the adapter plugin of ``[trainer.lora]`` (``molt_register_adapters``), else None
        self.adapter = trainer_adapter(cfg)
        if self.adapter is not None:
            if self.algo.needs_critic:  # the critic copies the plain decoder, before adapters are injected
                critic = ValueModel(self.model).eval()
            self.model = self.adapter.wrap(self.model, cfg.trainer.lora)
        self.model.eval()  # no dropout: on-policy ratios are exactly 1
        if cfg.trainer.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
            if critic is not None:
                enable_gradient_checkpointing(critic.backbone)
        self.tokenizer = tokenizer
        mod = modality()  # the registered image modality (None: a text-only run)
        #: a vision-language model's image processor (``cfg.model.path``'s), else None
        self.vision_processor = (mod.processor_for(model, cfg.model.path, tokenizer)
                                 if mod is not None and tokenizer is not None else None)
        self.kl_coef = float(cfg.algo.kl_coef)
        self.ref_model = ref_model
        if self.ref_model is None and self.kl_coef > 0:
            self.reset_reference()
        elif self.ref_model is not None:
            self.ref_model.to(self.device).eval().requires_grad_(False)
        self.kl_controller = None
        if cfg.algo.kl_target is not None and self.kl_coef > 0:
            self.kl_controller = AdaptiveKLController(self.kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
        tc = cfg.trainer
        if len(tc.betas) != 2:
            raise ValueError(f"trainer.betas must have 2 entries, got {tc.betas}")
        if critic is None and self.algo.needs_critic:
            critic = ValueModel(self.model)
        self.critic = critic.to(self.device) if critic is not None else None
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
        self.vocab_size = model_vocab(self.model)
        #: weights of the last ``max_staleness`` versions, for the on-policy consistency measure
        self.history = VersionHistory(cfg.async_.history_versions)
        self._check_proc: Any = None  # the on-policy check's process (CheckProcess), started on first use
        self._check_proc_failed = False
        #: the MoE routing tool (R3 record / replay / metrics) of the policy, None for a dense one
        self.routing = routing_tool(self.model, cfg.plugins, cfg.model.routing_replay)
        self.replay_backend: Any = None  # set by the routing tool when it replays
        self._routing_used: dict[int, torch.Tensor] = {}  # first row -> the selection its forward used
        if self.routing is not None:
            self.routing.init_trainer(self, replay_backend)
        #: take proximal logprobs from the loss forward when :meth:`fused_recompute_ok`
        self.fuse_recompute = True
        #: forwards run a shared prompt prefix once (not with checkpointing: a layer drops the KV cache)
        self.shared_prefix = cfg.trainer.shared_prefix and not cfg.trainer.gradient_checkpointing
        #: ``[saved, total]`` token positions of the loss forwards while an update runs, else None
        self.prefix_stats: list[int] | None = None

    # -- data-parallel seams, overridden by a trainer backend's subclass (molt_register_trainer_backends) --
    #: the trainer backend of a sharded rank (its checkpoint loaders); None: one process
    backend: Any = None
    #: every process runs the same forwards/backwards (FSDP2 collectives), zero ones included
    lockstep = False
    #: the on-policy check may run in its own process (CPU only); not a sharded trainer's collectives
    overlap_onpolicy_check = True

    def _shard(self) -> None:
        """Shard the models across processes, before the optimizers see the parameters."""

    def _work(self, batch: Batch, model: torch.nn.Module | None = None) -> list[tuple[slice, bool]]:
        """Micro-batches this process runs as ``(rows, real)`` (sharded: its share, then stand-ins)."""
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

    def reset_reference(self) -> None:
        """Make the frozen reference a copy of the current policy (no grad); with an adapter
        (LoRA), the adapter's reference (the policy with its adapter disabled)."""
        if self.adapter is not None:
            self.ref_model = self.adapter.reference(self.model)
            return
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)

    def autocast(self) -> Any:
        """The mixed-precision context of every forward: ``torch.autocast`` to ``model.dtype``
        (bfloat16 / float16) on the trainer's device, a no-op for float32. Parameters, gradients
        and AdamW moments stay float32 (docs/architecture.md); float16 has no loss scaling here."""
        enabled = self.compute_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.compute_dtype if enabled else None, enabled=enabled)

    def _forward(self, model: torch.nn.Module, batch: Batch, rows: slice, with_entropy: bool = False):
        """:func:`molt_core.train.forward.forward_rows` of ``rows`` under ``model``."""
        return forward_rows(self, model, batch, rows, with_entropy)

    def recompute_logprobs(self, batch: Batch, model: torch.nn.Module | None = None,
                           with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`molt_core.train.forward.recompute_logprobs` under ``model`` (default: the policy):
        ``[B, T]`` float32 (CPU) logprobs, no grad, and the entropy when ``with_entropy``."""
        return recompute_logprobs(self, batch, model if model is not None else self.model, with_entropy)

    def _routing(self, model: torch.nn.Module, batch: Batch, rows: slice, T: int):
        """The routing tool's context around a forward over ``rows`` (replay + record); none for a dense policy."""
        return self.routing.forward(self, model, batch, rows, T) if self.routing is not None else nullcontext()

    def _routing_metrics(self, batch: Batch, prox: torch.Tensor, noreplay: dict[str, Any]) -> dict[str, float]:
        """The routing tool's R3 metrics, ``{}`` for a dense policy (a sharded trainer merges ranks first)."""
        return self.routing.metrics(self, batch, prox, noreplay) if self.routing is not None else {}

    def critic_values(self, batch: Batch) -> torch.Tensor:
        """The critic's values ``[B, T]`` float32 (CPU) before the update: :func:`molt_core.train.critic.critic_values`."""
        return critic_values(self, batch)

    def _micro_batches(self, batch: Batch) -> list[slice]:
        mb = self.cfg.trainer.micro_batch_size
        return [slice(i, min(i + mb, batch.size)) for i in range(0, batch.size, mb)]

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One policy update from ``trajectories``; returns the step's metrics.

        Failed trajectories are skipped. Ingress refuses bad rollouts one at a time and the rest
        trains (:func:`molt_core.train.ingress.admit`); a non-finite logprob from any recompute before
        the optimizer step refuses its rollout too (the step is redone on the rest). With nothing
        left, or every sequence gated, no step is taken and ``train/skipped`` is 1.

        Args:
            trajectories: finished, scored rollouts (see :func:`build_batch`).

        Returns:
            ``dict[str, float]``: the step's metrics (:mod:`molt_core.train.metrics`).

        Raises:
            IngressError: a step-level fault :func:`build_batch` still finds after the per-rollout
                refusals (in practice none).
        """
        cfg = self.cfg
        t_start = time.perf_counter()
        distill = self.algo.needs_teacher
        trajectories, batch, ingress = admit(trajectories, self.pad_id, self.vocab_size, distill,
                                             cfg.trainer.refuse_unverified, vision=self.vision_processor)
        while True:
            if ingress["ingress/refused_rollouts"] and not any(t.status == "ok" for t in trajectories):
                return {**ingress, "train/skipped": 1.0, "train/rollouts": 0.0, "train/step": float(self.step)}
            if batch is None:
                batch = build_batch(trajectories, self.pad_id, self.vocab_size, need_teacher=distill,
                                    vision=self.vision_processor)
            try:
                return self._step(batch, ingress, t_start)
            except NonFiniteLogprobs as e:  # before any optimizer step: refuse them, redo on the rest
                ok = [t for t in trajectories if t.status == "ok"]
                bad = {ok[r].rollout_id for r in e.rollouts}
                log.warning("train step refused %d rollout(s): %s", len(bad), e)
                trajectories = [t for t in trajectories if t.status != "ok" or t.rollout_id not in bad]
                batch, self.prefix_stats = None, None  # (counted only while an update runs)
                for k, n in (("refused_nonfinite", len(bad)), ("refused_rollouts", len(bad))):
                    ingress[f"ingress/{k}"] += n
                ingress["invariants/nonfinite_logprobs"] += e.tokens

    def _step(self, batch: Batch, ingress: dict[str, float], t_start: float) -> dict[str, float]:
        """:meth:`train_step` on an admitted batch. Raises NonFiniteLogprobs, weights untouched, when a
        recompute (no-replay, reference, proximal, stale) or a loss forward gives NaN / +inf."""
        cfg = self.cfg
        distill, student = self.algo.needs_teacher, self.algo.needs_proximal
        mask, beh = batch.mask, batch.behaviour_logprobs
        self._routing_used = {}
        noreplay = self.routing.noreplay(self, batch) if self.routing is not None else {}  # R3, before any weight change
        if noreplay:
            nonfinite_check(noreplay["logprobs"], batch, "the no-replay (natural routing) recompute")

        # the staleness gate, once per step: versions only; every correction below reuses it
        gate = staleness_gate(batch.versions, mask, self.version, cfg.async_.max_staleness, batch.rollout_index)

        def correct(prox: torch.Tensor, rows: slice = slice(None)):
            T = prox.shape[1]
            return correct_tokens(cfg.correction, gate if rows == slice(None) else gate.rows(rows), beh[rows, :T],
                                  prox, mask[rows, :T])

        # 1. recompute (no grad): reference logprobs; proximal logprobs unless fused
        fused = self.fused_recompute_ok(batch)
        t0 = time.perf_counter()
        ref_lp = self.recompute_logprobs(batch, model=self.ref_model)[0] if self.ref_model is not None else None
        # a sampled token outside the reference's support (logprob -inf) has no finite KL: left out
        # of the KL term and counted, with a finite stand-in so no inf/NaN reaches the loss
        kl_keep = mask
        if ref_lp is not None:
            nonfinite_check(ref_lp, batch, "the reference recompute")
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
            nonfinite_check(prox, batch, "the proximal recompute")
            corr = correct(prox)
            train_mask, weights = corr.loss_mask, corr.weights
            prox_ok = in_support(prox, beh, corr.out_of_support)
        t_recompute = time.perf_counter() - t0
        num_tokens = int(train_mask.sum())

        # 2. advantages (KL to the reference as a per-token reward when configured)
        metrics: dict[str, float] = dict(ingress)
        token_rewards = None
        if ref_lp is not None and cfg.algo.kl_as_reward:
            token_rewards = (-self.kl_coef * kl_estimate(prox_ok, ref_lp, cfg.algo.kl_estimator)) * kl_keep
        adv, returns = compute_advantages(
            cfg.algo, batch.rewards, batch.group_index, batch.rollout_index, mask, values=old_values,
            token_rewards=token_rewards, student_logprobs=prox_ok if student else None,
            teacher_logprobs=batch.teacher_logprobs if distill else None, estimator=self.algo.estimator)

        # 3. update; measure the tokens of older versions under theirs; keep this version (settle)
        t_check = time.perf_counter()
        onpol_result = self._onpolicy_stale(batch)
        t_check = time.perf_counter() - t_check
        t1 = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])
        check_error: BaseException | None = None
        onpol, t_wait = torch.zeros(0, dtype=torch.float64), 0.0

        def settle(fused_prox: torch.Tensor | None) -> None:
            """Before the optimizer step: the fused / stale logprobs finite, then keep this version."""
            nonlocal check_error, onpol, t_wait
            t = time.perf_counter()
            try:
                onpol, rows = onpol_result()
            except Exception as e:  # the overlapped check failed: finish the step's bookkeeping, then raise
                check_error, rows = e, torch.zeros(0, dtype=torch.long)
            if fused_prox is not None:
                nonfinite_check(fused_prox, batch, "the proximal recompute (fused)")
            nonfinite_check(onpol, batch, "the recompute of stale tokens under their own version", rows=rows)
            if num_tokens > 0:  # (no check in flight reads the ring now)
                self.history.record(self.version, self.model)
                self._start_check_process()
            t_wait = time.perf_counter() - t

        if num_tokens == 0:
            metrics.update({"train/skipped": 1.0, "loss/total": 0.0, "loss/policy": 0.0, "loss/kl": 0.0,
                            "grad_norm": 0.0})
            if prox is None:
                prox, ent = self.recompute_logprobs(batch, with_entropy=True)
            settle(prox if fused else None)
        else:
            metrics["train/skipped"] = 0.0
            self.prefix_stats = [0, 0]  # counted by forward_rows over the loss forwards
            upd, fused_prox, fused_ent = policy_update(
                self, batch, prox, weights, ref_lp, adv, train_mask, num_tokens, correct if fused else None,
                None if fused else corr.out_of_support, kl_keep, before_step=settle)
            saved, total = self.prefix_stats
            self.prefix_stats = None
            metrics.update(upd)
            metrics["train/shared_prefix_frac"] = saved / total if total else 0.0
            if fused:
                prox, ent = fused_prox, fused_ent
            if self.critic is not None:
                metrics.update(update_critic(self, batch, old_values, returns, train_mask, num_tokens))
        t_train = time.perf_counter() - t1 - t_wait
        t_check += t_wait

        # 4. metrics of the step's batch (before the update)
        if fused:  # the correction the update used (per row, so identical per micro-batch); unfused: corr
            corr = correct(prox)
        if fused and not torch.equal(corr.loss_mask, train_mask):
            raise RuntimeError("internal: the fused recompute changed the gate's loss mask; report this bug")
        metrics.update(batch_metrics(self, batch, corr, prox, ent, ref_lp, kl_keep, onpol, num_tokens, noreplay))
        metrics["train/fused_recompute"] = float(fused)
        metrics["lr"] = lr

        if num_tokens > 0:
            self.scheduler.step()
            if self.critic is not None:
                self.critic_scheduler.step()
            self.step += 1
            self.version += 1
            if self.kl_controller is not None and ref_lp is not None:
                self.kl_controller.update(metrics["kl"], n_steps=1)
                self.kl_coef = float(self.kl_controller.value)
        wall = time.perf_counter() - t_start
        metrics["time/recompute"] = t_recompute
        metrics["time/onpolicy_check"] = t_check
        metrics["time/train"] = t_train
        metrics["time/step"] = wall
        metrics["tokens_per_s"] = float(batch.lengths.sum()) / max(wall, 1e-9)
        metrics["train/step"] = float(self.step)
        if check_error is not None:  # version / step / scheduler already match the updated weights
            raise RuntimeError(f"the on-policy check of step {self.step} failed after its update "
                               f"(the trainer is at version {self.version}): {check_error!r}") from check_error
        return metrics

    def fused_recompute_ok(self, batch: Batch | None = None) -> bool:
        """Whether this step can take the proximal logprobs from the loss forward itself: with one
        PPO epoch the proximal policy *is* the policy being differentiated, so ``lp.detach()`` of the
        loss forward (bit-identical) replaces the no-grad recompute. Needs ``ppo_epochs == 1``; no
        estimator needing them before the loss (``on_policy_distill``, KL as reward); not ``is_mode =
        "mask"`` (its token count depends on them); with ``batch``, not seq/geo weights when a rollout
        has several rows. ``fuse_recompute = False`` forces the separate pass."""
        cfg = self.cfg
        multi_row = batch is not None and bool((torch.bincount(batch.rollout_index) > 1).any())
        return (self.fuse_recompute and cfg.trainer.ppo_epochs == 1
                and not (multi_row and cfg.correction.is_level in ("seq", "geo"))
                and not self.algo.needs_proximal
                and not (cfg.algo.kl_as_reward and self.ref_model is not None)
                and cfg.correction.is_mode != "mask")

    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict (name -> tensor) for ``engine.load_weights(state, version)``.

        The tensors are the live parameters: an engine must copy them (as ``load_state_dict`` does)
        before the next :meth:`train_step`. With an adapter (LoRA): merged, under the base names.
        """
        if self.adapter is not None:
            return self.adapter.merged_state_dict(self.model)
        return self.model.state_dict()

    def publish(self, engines: Iterable[Any]) -> int:
        """``engine.load_weights(self.weights(), self.version)`` on each engine; returns the version."""
        state = self.weights()
        for e in engines:
            e.load_weights(state, self.version)
        return self.version

    def save_checkpoint(self, run_dir: str | Path, data_cursor: dict[str, Any] | None = None) -> Path:
        """Write this trainer's checkpoint: :func:`molt_core.train.checkpoint.save_checkpoint`."""
        return save_checkpoint(self, run_dir, data_cursor)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore this trainer (:func:`molt_core.train.checkpoint.load_checkpoint`); returns the data cursor."""
        return load_checkpoint(self, path)
