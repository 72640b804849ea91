"""Run configuration: :class:`RunConfig`, one documented schema, one table per section.

Recipes (TOML files), ``--set`` overrides and the error messages that name every bad field are
the CLI's (:mod:`molt_core.cli.recipe`); the kernel receives a validated :class:`RunConfig`.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from molt_core import _moved

__all__ = ["ConfigError", "ImagePolicy", "RunConfig", "text_hint"]


class ImagePolicy(BaseModel):
    """Limits and the remote-URL rule for image inputs (the recipe's ``[images]`` table; the
    loopback server's ``create_app(image_policy=...)``), read by the vision modality plugin
    (``molt_plugins.vision``); a recipe that sets it needs a modality plugin loaded.

    Attributes:
        max_bytes: Encoded size limit of one image in bytes (20 MiB: the Anthropic API's request-level image cap).
        max_pixels: Width x height limit of one image (7680 x 4320).
        allow_remote_urls: Fetch ``http(s)://`` image URLs (false: only inline data).
        fetch_timeout_s: Total time for one remote fetch in seconds.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    max_bytes: int = Field(20 * 1024 * 1024, ge=1)
    max_pixels: int = Field(7680 * 4320, ge=1)
    allow_remote_urls: bool = False
    fetch_timeout_s: float = Field(10.0, gt=0)


class ConfigError(ValueError):
    """Invalid recipe or override; ``errors`` lists ``(dotted_path, message)`` pairs."""

    def __init__(self, message: str, errors: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or []


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RunSection(_Section):
    """``[run]``: name, seed, length and output directory of a run.

    Attributes:
        name: Name of the run (the run directory's prefix).
        seed: Random seed of the run.
        steps: Optimizer steps.
        out_dir: Run directory (None: ``runs/<name>-<time>``).
        threads: Torch intra-op threads per process.
    """

    name: str = "run"
    seed: int = 0
    steps: int = Field(100, ge=0)
    out_dir: str | None = None
    threads: int = Field(1, ge=1)


class ModelSection(_Section):
    """``[model]``: the policy model and its compute dtype.

    Attributes:
        path: A Hugging Face model directory, or ``builtin:<name>`` for a model the project builds from a config
            (``builtin:tiny-qwen3``).
        gguf_file: A GGUF file name inside ``path``, for GGUF checkpoints.
        dtype: The trainer's compute dtype: parameters, gradients and AdamW state stay float32 (master weights) and
            ``bfloat16``/``float16`` forwards run under autocast (:meth:`molt_core.train.Trainer.autocast`; the
            forward-consistency bound per dtype: :data:`molt_core.train.version_history.ONPOLICY_ABSDIFF_TOL`).
        routing_replay: For an MoE policy, replay the rollout's recorded expert selection in the trainer's forwards
            (R3, arXiv 2510.11370; needs a replay backend for the model type).
        chat_template_kwargs: Chat-template variables of every rollout's sessions (e.g. ``{enable_thinking =
            false}``).
    """

    path: str = "builtin:tiny-qwen3"
    gguf_file: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    routing_replay: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class EngineSection(_Section):
    """``[engine]``: the rollout engines, their workers and how weights reach them.

    Attributes:
        name: A registered engine (``transformers``, ``vllm``).
        num_engines: Rollout workers, one engine each.
        max_batch_size: Concurrent sequences per engine.
        dtype: Dtype of the engine's copy of the weights.
        num_cpus: CPUs per rollout worker (a Ray resource).
        num_gpus: GPUs per rollout worker (a Ray resource).
        resources: Custom Ray resources each rollout worker requires (e.g. ``{rollout = 1}`` to place workers on
            nodes started with ``ray start --resources '{"rollout": 1}'``).
        options: Keyword options passed to the engine's factory (e.g. vLLM's ``return_routed_experts``).
        weight_sync: How a publish reaches the engines: ``ray`` (the trainer packs the weights into one buffer that
            each rollout worker fetches from Ray's object store), ``collective`` (the trainer's rank 0 broadcasts
            into every vLLM worker through a process group, NCCL between distinct GPUs, gloo otherwise:
            :mod:`molt_plugins.engines.vllm.weight_sync`; vllm engine and a Ray run only) or ``auto`` (collective
            for the vllm engine with ``num_gpus > 0`` under Ray, else ray).
    """

    name: str = "transformers"
    num_engines: int = Field(1, ge=1)
    max_batch_size: int = Field(64, ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict)
    weight_sync: Literal["auto", "ray", "collective"] = "auto"

    @model_validator(mode="after")
    def _collective_needs_vllm(self) -> "EngineSection":
        if self.weight_sync == "collective" and self.name != "vllm":
            raise ValueError(f"engine.weight_sync = \"collective\" broadcasts into vLLM workers; engine.name is "
                             f"{self.name!r}: set engine.name = \"vllm\" or engine.weight_sync = \"ray\"")
        return self


class AgentSection(_Section):
    """``[agent]``: the env or chat agent that runs each rollout.

    Attributes:
        name: A registered env or agent.
        path: A ``.py`` file defining the env or agent.
        options: Options of the agent, validated by the agent's own ``Options`` model.
    """

    name: str | None = None
    path: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)


class RolloutSection(_Section):
    """``[rollout]``: groups, samples, sampling and limits of the rollouts.

    Attributes:
        prompts_per_step: Groups (prompts) per optimizer step.
        n_samples_per_prompt: Rollouts per group.
        temperature: Sampling temperature.
        top_p: Nucleus sampling mass.
        top_k: Top-k sampling (-1: off).
        max_tokens: Sampled tokens per turn.
        max_turns: Turns per episode.
        max_total_tokens: Tokens per episode, prompt included.
        timeout_s: Time per rollout in seconds (the agent episode; each reward call has its own ``[rewards.NAME]
            timeout_s``).
        dynamic_filter: Drop groups whose rewards are all equal.
        reward_concurrency: Reward calls in flight at once per rollout worker (all rewards and groups together).
    """

    prompts_per_step: int = Field(8, ge=1)
    n_samples_per_prompt: int = Field(8, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    max_tokens: int = Field(64, ge=1)
    max_turns: int = Field(1, ge=1)
    max_total_tokens: int = Field(1024, ge=1)
    timeout_s: float = Field(60.0, gt=0)
    dynamic_filter: bool = False
    reward_concurrency: int = Field(16, ge=1)


def group_baseline_check(advantage: str, n_samples: int) -> None:
    """The rule of a group-baseline estimator (one naming ``group_index``): 2 samples per prompt.

    Raises:
        ConfigError: ``n_samples < 2``, naming both options.
    """
    if n_samples < 2:
        raise ConfigError(
            f"rollout.n_samples_per_prompt = {n_samples}: algo.advantage = {advantage!r} uses a group baseline "
            f"and needs at least 2 samples per prompt (or choose 'reinforce')")


class AlgoSection(_Section):
    """``[algo]``: advantage estimator, policy loss, clip band and KL to a frozen reference.

    Attributes:
        advantage: A registered advantage estimator (``molt_register_estimators``; checked when the trainer resolves
            it).
        loss: A registered per-token policy loss (``molt_register_losses``).
        clip_low: Lower clip of the ratio: ``1 - clip_low`` (PPO, arXiv 1707.06347).
        clip_high: Upper clip of the ratio: ``1 + clip_high``.
        dual_clip: Dual-clip bound on negative advantages (arXiv 1912.09729; None: off).
        kl_coef: Coefficient of the KL to the frozen reference (0 disables it).
        kl_estimator: KL estimator (Schulman 2020, "Approximating KL divergence").
        kl_as_reward: Apply the KL as a per-token reward instead of a loss term.
        kl_target: Target KL of the adaptive KL controller (Ziegler et al. 2019, arXiv 1909.08593; None: fixed
            ``kl_coef``).
        gamma: Discount of discounted estimators and GAE.
        lam: GAE lambda.
        distill_coef: Coefficient of on-policy distillation (``advantage = "on_policy_distill"``).
        adv_eps: Epsilon of std-normalised advantages (GRPO's ``std + eps``).
        std_tol: The std (computed in float64) below which a group or batch counts as having zero spread, so
            rounding residues are never divided by.
        kl_horizon: Horizon of the adaptive KL controller, used when ``kl_target`` is set.
        value_clip: Clip the GAE critic's new value to ``old +- value_clip`` in its loss (PPO value clipping; None
            disables).
    """

    advantage: str = "grpo"
    loss: str = "ppo"
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)
    dual_clip: float | None = None
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_as_reward: bool = False
    kl_target: float | None = None
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    distill_coef: float = 1.0
    adv_eps: float = Field(1e-6, ge=0)
    std_tol: float = Field(1e-6, ge=0)
    kl_horizon: int = Field(10000, ge=1)
    value_clip: float | None = Field(0.2, gt=0)


class CorrectionSection(_Section):
    """``[correction]``: importance correction of off-policy tokens (TIS, IcePop, MIS).

    Attributes:
        is_level: Level of the importance weight ``rho = pi_prox / pi_behaviour``: per token, the rollout's product,
            its geometric mean, or off (weight 1).
        is_mode: ``trunc``: ``min(rho, high)``; ``clip``: ``clamp(rho, low, high)``; ``mask``: 0 outside the band
            (the token or rollout rejected).
        low: Lower end of the weight band (must be <= 1).
        high: Upper end of the weight band (must be >= 1).
    """

    is_level: Literal["off", "token", "seq", "geo"] = "token"
    is_mode: Literal["mask", "clip", "trunc"] = "trunc"
    low: float = Field(0.0, ge=0)
    high: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _band_holds_one(self) -> "CorrectionSection":
        if not self.low <= 1.0 <= self.high:
            raise ValueError(f"the band [low, high] = [{self.low:g}, {self.high:g}] must contain 1 "
                             f"(an on-policy token's weight); set low <= 1 <= high")
        return self


class AsyncSection(_Section):
    """``[async]``: how far rollout may run ahead of the trainer.

    Attributes:
        max_staleness: How many policy versions rollout may run ahead of the trainer (0 = synchronous). The driver
            bounds how far ahead rollouts *start* (at most ``(1 + max_staleness) * prompts_per_step`` groups in
            flight); the trainer's gate bounds the *oldest token* of each rollout, so a (partial) rollout that
            finishes late, staler than the bound, is dropped and counted (``correction/gated_frac``).
        onpolicy_rows: Rows per older version recomputed under the weights that sampled them, for
            ``invariants/logprob_absdiff_max_onpolicy`` (-1: every stale row; n > 0: a random sample of n rows per
            older version, new each step; 0: off, no weight copies kept); the trainer keeps ``max_staleness`` CPU
            copies of past weights and one shadow copy of the policy on its device for it
            (:mod:`molt_core.train.version_history`).
    """

    max_staleness: int = Field(0, ge=0)
    onpolicy_rows: int = Field(-1, ge=-1)

    def groups_in_flight(self, prompts_per_step: int) -> int:
        """The driver's bound on groups in flight: ``(1 + max_staleness) * prompts_per_step``."""
        return (1 + self.max_staleness) * prompts_per_step

    @property
    def history_versions(self) -> int:
        """Past weight versions the trainer keeps for the on-policy measure: ``max_staleness``,
        0 when ``onpolicy_rows = 0``."""
        return self.max_staleness if self.onpolicy_rows != 0 else 0


class LoraSection(_Section):
    """``[trainer.lora]``: train a LoRA adapter (peft) instead of every weight. Needs the ``lora``
    extra and the ``lora`` adapter (:mod:`molt_plugins.lora`).

    Attributes:
        r: Rank of the adapter.
        alpha: Scale: the update is ``(alpha / r) B A``.
        dropout: Must stay 0: the trainer runs without dropout so an on-policy importance ratio is exactly 1.
        target_modules: Module-name suffixes such as ``q_proj``, or ``"all-linear"`` (None: peft's default for the
            model type).
    """

    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = 0.0
    target_modules: list[str] | str | None = None

    @field_validator("alpha", mode="before")
    @classmethod
    def _int_alpha(cls, v: Any) -> Any:
        """``alpha = 16`` (a TOML integer) is ``16.0``."""
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, v: float) -> float:
        """Only 0: the trainer runs in eval mode so recompute and loss forward are one function."""
        if v != 0.0:
            raise ValueError(f"trainer.lora.dropout = {v}: only 0 is supported (the trainer runs without dropout so "
                             f"an on-policy importance ratio is exactly 1); set trainer.lora.dropout = 0")
        return v


class TrainerSection(_Section):
    """``[trainer]``: the optimizer, its schedule, batching and the trainer's ranks.

    Attributes:
        lr: Peak AdamW learning rate.
        betas: AdamW betas.
        eps: AdamW epsilon.
        weight_decay: AdamW weight decay.
        grad_clip: Max global gradient norm (0 disables clipping).
        warmup_steps: Steps of linear learning-rate warmup.
        lr_schedule: Learning-rate schedule after warmup (decay over ``run.steps``).
        micro_batch_size: Sequences per forward.
        ppo_epochs: Passes over a step's batch.
        critic_lr: Learning rate of the GAE critic (None: ``lr``).
        refuse_unverified: Refuse at ingress a rollout whose action tokens carry no engine record of what was
            sampled (every first-party engine records; false trains on them, counted in
            ``invariants/tokens_unverified``; :mod:`molt_core.identity`).
        num_cpus: CPUs per trainer rank (its placement-group bundle).
        num_gpus: GPUs per trainer rank (its placement-group bundle).
        world_size: Trainer ranks (Ray actors) sharing one FSDP2-sharded model, each training on its share of a
            step's rows (:mod:`molt_plugins.distributed`).
        lora: A LoRA adapter instead of full fine-tuning (:class:`LoraSection`; None: off).
        gradient_checkpointing: Recompute each decoder layer's activations in the backward instead of keeping them
            (less memory, one more forward per layer; same loss and gradients).
        shared_prefix: Run the prompt prefix a micro-batch's rows share (a GRPO group's prompt) once per distinct
            prefix in each forward (:func:`molt_core.train.forward.shared_prefix`: same logprobs up to float
            rounding; not with gradient checkpointing, images, routing replay or ``world_size > 1``).
    """

    lr: float = Field(3e-4, gt=0)
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-8
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    micro_batch_size: int = Field(64, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    critic_lr: float | None = Field(None, gt=0)
    refuse_unverified: bool = True
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    world_size: int = Field(1, ge=1)
    lora: LoraSection | None = None
    gradient_checkpointing: bool = False
    shared_prefix: bool = True


class CheckpointSection(_Section):
    """``[checkpoint]``: how often checkpoints are written and how many are kept.

    Attributes:
        every: Write a checkpoint every this many steps (0: only at the end).
        keep: Checkpoints kept.
    """

    every: int = Field(50, ge=0)
    keep: int = Field(2, ge=1)


class EvalSection(_Section):
    """``[eval]``: held-out evaluation (pass@1 and pass@k).

    Attributes:
        every: Evaluate every this many steps (0: at the start and the end only).
        n_problems: Held-out problems per evaluation (0: no evaluation).
        k: Samples per problem (pass@k).
        temperature: Sampling temperature of the evaluation.
    """

    every: int = Field(0, ge=0)
    n_problems: int = Field(64, ge=0)
    k: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)


class SftSection(_Section):
    """``[sft]``: supervised warm start before RL. ``molt sft`` and the warm start inside ``molt run``
    run the same computation with ``run.threads`` torch threads.

    Attributes:
        steps: SFT steps (0 disables the warm start).
        data: Train on these rows instead of the agent's tasks: a JSONL of ``{"prompt", "completion"}`` or
            ``{"messages"}`` rows (or a Parquet file / dataset directory; :mod:`molt_core.train.sft`).
        lr: Peak AdamW learning rate.
        warmup_steps: Steps of linear warmup.
        lr_schedule: Decay over ``steps`` (as :func:`molt_core.train.lr_factor`).
        batch_size: Examples per step.
        label_noise: Fraction of deliberately wrong targets.
        n_examples: Examples drawn from the agent's train split (when ``data`` is unset).
        checkpoint_every: Inside ``molt run``, write a checkpoint every this many SFT steps (its AdamW state
            and step included; ``--resume`` continues the warm start from it, bit-exact), as
            ``[checkpoint] every`` does for RL steps (0: only the one after the warm start; one trainer rank only).
    """

    steps: int = Field(0, ge=0)
    data: str | None = None
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    batch_size: int = Field(32, ge=1)
    label_noise: float = Field(0.0, ge=0, le=1)
    n_examples: int = Field(2000, ge=1)
    checkpoint_every: int = Field(50, ge=0)


class TeacherSection(_Section):
    """``[teacher]``: on-policy distillation teacher. Each ok trajectory is annotated with
    ``info["teacher_logprobs"]`` before training (read by ``algo.advantage = "on_policy_distill"``).

    Attributes:
        name: A registered teacher (``hf_teacher``; None: no teacher).
        options: Options of the teacher, validated by the teacher's own options model.
    """

    name: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)


class RunConfig(_Section):
    """The whole resolved configuration of a run (one field per recipe table).

    Attributes:
        plugins: ``--plugin`` specs to load (dotted module paths or ``.py`` files).
        rewards: A registered reward name to its table: the reward's options plus the reserved keys ``weight``
            (default 1.0), ``timeout_s`` (default 60) and ``isolation`` (``thread`` / ``process``), which the
            runtime reads and does not pass on (:mod:`molt_core.rewards`).
        loggers: A registered logger name to its options (``[loggers.wandb]`` / ``mode = "online"``), validated by
            that logger's ``Options`` model before any compute (:func:`molt_core.runtime.rundir.check_loggers`); the
            list form ``loggers = ["wandb"]`` means the same loggers with default options. The JSONL metrics file is
            always written.
    """

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    agent: AgentSection = Field(default_factory=AgentSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    algo: AlgoSection = Field(default_factory=AlgoSection)
    correction: CorrectionSection = Field(default_factory=CorrectionSection)
    async_: AsyncSection = Field(default_factory=AsyncSection, alias="async")
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    sft: SftSection = Field(default_factory=SftSection)
    teacher: TeacherSection = Field(default_factory=TeacherSection)
    images: ImagePolicy = Field(default_factory=ImagePolicy)
    plugins: list[str] = Field(default_factory=list)
    rewards: dict[str, dict[str, Any]] = Field(default_factory=dict)
    loggers: dict[str, dict[str, Any]] = Field(default_factory=dict)

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    @field_validator("loggers", mode="before")
    @classmethod
    def _logger_names_as_tables(cls, v: Any) -> Any:
        """``loggers = ["wandb", ...]`` is ``{"wandb": {}, ...}`` (default options); refuses non-strings, repeats."""
        if not isinstance(v, list):
            return v
        bad = [x for x in v if not isinstance(x, str)]
        if bad:
            raise ValueError(f"expected logger names (strings) or [loggers.NAME] option tables, got {bad[0]!r}")
        if len(set(v)) != len(v):
            raise ValueError(f"a logger is named twice in {v!r}")
        return {name: {} for name in v}

    @model_validator(mode="after")
    def _group_estimators_need_groups(self) -> "RunConfig":
        """A built-in group-baseline estimator needs 2 samples per prompt (a plugin's: checked by the trainer)."""
        if self.rollout.n_samples_per_prompt < 2:
            from molt_core.algo.builtins import ESTIMATORS  # torch: only on this path, not at CLI start-up

            fn = ESTIMATORS.get(self.algo.advantage)
            if fn is not None and "group_index" in inspect.signature(fn).parameters:
                group_baseline_check(self.algo.advantage, self.rollout.n_samples_per_prompt)
        return self

    @model_validator(mode="after")
    def _lora_supported(self) -> "RunConfig":
        """``[trainer.lora]`` is refused with ``trainer.world_size > 1`` (the sharded trainer wraps no adapter)."""
        if self.trainer.lora is None:
            return self
        if self.trainer.world_size > 1:
            raise ValueError(f"trainer.lora with trainer.world_size = {self.trainer.world_size} is not supported yet "
                             f"(the sharded trainer does not wrap adapters); set trainer.world_size = 1 (an adapter's "
                             f"optimizer state is small: one rank holds it) or remove [trainer.lora]")
        return self

    def to_toml(self) -> str:
        """TOML of the config (``None`` fields omitted; loads back to an equal config)."""
        data = self.model_dump(by_alias=True, exclude_none=True)
        return tomli_w.dumps(data)

    def write(self, path: str | Path) -> Path:
        """Write :meth:`to_toml` to ``path``; returns the path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_toml())
        return p


def text_hint(where: str, err: Mapping[str, Any]) -> str:
    """`` (got 123; quote it for text: --set 'where="123"')`` for a pydantic error at option ``where``
    that wanted a string and got a number or bool (``--set`` cannot know a plugin option's type), else ``""``."""
    val = err.get("input")
    if err.get("type") != "string_type" or not isinstance(val, (bool, int, float)):
        return ""
    text = json.dumps(val) if isinstance(val, bool) else str(val)
    return f" (got {text}; quote it for text: --set '{where}=\"{text}\"')"


def __getattr__(name: str) -> object:
    """Recipe loading moved to :mod:`molt_core.cli.recipe` (deprecated here)."""
    return _moved.moved_attr(__name__, name)
