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

    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    max_bytes: int = Field(20 * 1024 * 1024, ge=1)
    """Encoded size limit of one image in bytes (20 MiB: the Anthropic API's request-level image cap)."""
    max_pixels: int = Field(7680 * 4320, ge=1)
    """Width x height limit of one image (7680 x 4320)."""
    allow_remote_urls: bool = False
    """Fetch ``http(s)://`` image URLs (false: only inline data)."""
    fetch_timeout_s: float = Field(10.0, gt=0)
    """Total time for one remote fetch in seconds."""


class ConfigError(ValueError):
    """Invalid recipe or override; ``errors`` lists ``(dotted_path, message)`` pairs."""

    def __init__(self, message: str, errors: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or []


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RunSection(_Section):
    """``[run]``: name, seed, length and output directory of a run."""

    name: str = "run"
    """Name of the run (the run directory's prefix)."""
    seed: int = 0
    """Random seed of the run."""
    steps: int = Field(100, ge=0)
    """Optimizer steps."""
    out_dir: str | None = None
    """Run directory (None: ``runs/<name>-<time>``)."""
    threads: int = Field(1, ge=1)
    """Torch intra-op threads per process."""


class ModelSection(_Section):
    """``[model]``: the policy model and its compute dtype."""

    path: str = "builtin:tiny-qwen3"
    """A Hugging Face model directory, or ``builtin:<name>`` for a model the project builds from a
    config (``builtin:tiny-qwen3``)."""
    gguf_file: str | None = None
    """A GGUF file name inside ``path``, for GGUF checkpoints."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The trainer's compute dtype: parameters, gradients and AdamW state stay float32 (master weights)
    and ``bfloat16``/``float16`` forwards run under autocast (:meth:`molt_core.train.Trainer.autocast`;
    the forward-consistency bound per dtype: :data:`molt_core.train.version_history.ONPOLICY_ABSDIFF_TOL`)."""
    routing_replay: bool = True
    """For an MoE policy, replay the rollout's recorded expert selection in the trainer's forwards
    (R3, arXiv 2510.11370; needs a replay backend for the model type)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Chat-template variables of every rollout's sessions (e.g. ``{enable_thinking = false}``)."""


class EngineSection(_Section):
    """``[engine]``: the rollout engines, their workers and how weights reach them."""

    name: str = "transformers"
    """A registered engine (``transformers``, ``vllm``)."""
    num_engines: int = Field(1, ge=1)
    """Rollout workers, one engine each."""
    max_batch_size: int = Field(64, ge=1)
    """Concurrent sequences per engine."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the engine's copy of the weights."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs per rollout worker (a Ray resource)."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per rollout worker (a Ray resource)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each rollout worker requires (e.g. ``{rollout = 1}`` to place workers on
    nodes started with ``ray start --resources '{"rollout": 1}'``)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword options passed to the engine's factory (e.g. vLLM's ``return_routed_experts``)."""
    weight_sync: Literal["auto", "ray", "collective"] = "auto"
    """How a publish reaches the engines: ``ray`` (the trainer packs the weights into one buffer that
    each rollout worker fetches from Ray's object store), ``collective`` (the trainer's rank 0 broadcasts
    into every vLLM worker through a process group, NCCL between distinct GPUs, gloo otherwise:
    :mod:`molt_plugins.engines.vllm.weight_sync`; vllm engine and a Ray run only) or ``auto``
    (collective for the vllm engine with ``num_gpus > 0`` under Ray, else ray)."""

    @model_validator(mode="after")
    def _collective_needs_vllm(self) -> "EngineSection":
        if self.weight_sync == "collective" and self.name != "vllm":
            raise ValueError(f"engine.weight_sync = \"collective\" broadcasts into vLLM workers; engine.name is "
                             f"{self.name!r}: set engine.name = \"vllm\" or engine.weight_sync = \"ray\"")
        return self


class AgentSection(_Section):
    """``[agent]``: the env or chat agent that runs each rollout."""

    name: str | None = None
    """A registered env or agent."""
    path: str | None = None
    """A ``.py`` file defining the env or agent."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Options of the agent, validated by the agent's own ``Options`` model."""


class RolloutSection(_Section):
    """``[rollout]``: groups, samples, sampling and limits of the rollouts."""

    prompts_per_step: int = Field(8, ge=1)
    """Groups (prompts) per optimizer step."""
    n_samples_per_prompt: int = Field(8, ge=1)
    """Rollouts per group."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling (-1: off)."""
    max_tokens: int = Field(64, ge=1)
    """Sampled tokens per turn."""
    max_turns: int = Field(1, ge=1)
    """Turns per episode."""
    max_total_tokens: int = Field(1024, ge=1)
    """Tokens per episode, prompt included."""
    timeout_s: float = Field(60.0, gt=0)
    """Time per rollout in seconds (the agent episode; each reward call has its own
    ``[rewards.NAME] timeout_s``)."""
    dynamic_filter: bool = False
    """Drop groups whose rewards are all equal."""
    reward_concurrency: int = Field(16, ge=1)
    """Reward calls in flight at once per rollout worker (all rewards and groups together)."""


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
    """``[algo]``: advantage estimator, policy loss, clip band and KL to a frozen reference."""

    advantage: str = "grpo"
    """A registered advantage estimator (``molt_register_estimators``; checked when the trainer resolves it)."""
    loss: str = "ppo"
    """A registered per-token policy loss (``molt_register_losses``)."""
    clip_low: float = Field(0.2, ge=0)
    """Lower clip of the ratio: ``1 - clip_low`` (PPO, arXiv 1707.06347)."""
    clip_high: float = Field(0.2, ge=0)
    """Upper clip of the ratio: ``1 + clip_high``."""
    dual_clip: float | None = None
    """Dual-clip bound on negative advantages (arXiv 1912.09729; None: off)."""
    kl_coef: float = Field(0.0, ge=0)
    """Coefficient of the KL to the frozen reference (0 disables it)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman 2020, "Approximating KL divergence")."""
    kl_as_reward: bool = False
    """Apply the KL as a per-token reward instead of a loss term."""
    kl_target: float | None = None
    """Target KL of the adaptive KL controller (Ziegler et al. 2019, arXiv 1909.08593; None: fixed ``kl_coef``)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of discounted estimators and GAE."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda."""
    distill_coef: float = 1.0
    """Coefficient of on-policy distillation (``advantage = "on_policy_distill"``)."""
    adv_eps: float = Field(1e-6, ge=0)
    """Epsilon of std-normalised advantages (GRPO's ``std + eps``)."""
    std_tol: float = Field(1e-6, ge=0)
    """The std (computed in float64) below which a group or batch counts as having zero spread, so
    rounding residues are never divided by."""
    kl_horizon: int = Field(10000, ge=1)
    """Horizon of the adaptive KL controller, used when ``kl_target`` is set."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clip the GAE critic's new value to ``old +- value_clip`` in its loss (PPO value clipping; None disables)."""


class CorrectionSection(_Section):
    """``[correction]``: importance correction of off-policy tokens (TIS, IcePop, MIS)."""

    is_level: Literal["off", "token", "seq", "geo"] = "token"
    """Level of the importance weight ``rho = pi_prox / pi_behaviour``: per token, the rollout's product,
    its geometric mean, or off (weight 1)."""
    is_mode: Literal["mask", "clip", "trunc"] = "trunc"
    """``trunc``: ``min(rho, high)``; ``clip``: ``clamp(rho, low, high)``; ``mask``: 0 outside the band
    (the token or rollout rejected)."""
    low: float = Field(0.0, ge=0)
    """Lower end of the weight band (must be <= 1)."""
    high: float = Field(2.0, gt=0)
    """Upper end of the weight band (must be >= 1)."""

    @model_validator(mode="after")
    def _band_holds_one(self) -> "CorrectionSection":
        if not self.low <= 1.0 <= self.high:
            raise ValueError(f"the band [low, high] = [{self.low:g}, {self.high:g}] must contain 1 "
                             f"(an on-policy token's weight); set low <= 1 <= high")
        return self


class AsyncSection(_Section):
    """``[async]``: how far rollout may run ahead of the trainer."""

    max_staleness: int = Field(0, ge=0)
    """How many policy versions rollout may run ahead of the trainer (0 = synchronous). The driver bounds
    how far ahead rollouts *start* (at most ``(1 + max_staleness) * prompts_per_step`` groups in flight);
    the trainer's gate bounds the *oldest token* of each rollout, so a (partial) rollout that finishes
    late, staler than the bound, is dropped and counted (``correction/gated_frac``)."""
    onpolicy_rows: int = Field(-1, ge=-1)
    """Rows per older version recomputed under the weights that sampled them, for
    ``invariants/logprob_absdiff_max_onpolicy`` (-1: every stale row; n > 0: a random sample of n rows
    per older version, new each step; 0: off, no weight copies kept); the trainer keeps
    ``max_staleness`` CPU copies of past weights and one shadow copy of the policy on its device for it
    (:mod:`molt_core.train.version_history`)."""

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
    extra and the ``lora`` adapter (:mod:`molt_plugins.lora`)."""

    r: int = Field(8, ge=1)
    """Rank of the adapter."""
    alpha: float = Field(16.0, gt=0)
    """Scale: the update is ``(alpha / r) B A``."""
    dropout: float = 0.0
    """Must stay 0: the trainer runs without dropout so an on-policy importance ratio is exactly 1."""
    target_modules: list[str] | str | None = None
    """Module-name suffixes such as ``q_proj``, or ``"all-linear"`` (None: peft's default for the model type)."""

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
    """``[trainer]``: the optimizer, its schedule, batching and the trainer's ranks."""

    lr: float = Field(3e-4, gt=0)
    """Peak AdamW learning rate."""
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.98])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, ge=0)
    """Max global gradient norm (0 disables clipping)."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear learning-rate warmup."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warmup (decay over ``run.steps``)."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over a step's batch."""
    critic_lr: float | None = Field(None, gt=0)
    """Learning rate of the GAE critic (None: ``lr``)."""
    refuse_unverified: bool = True
    """Refuse at ingress a rollout whose action tokens carry no engine record of what was sampled
    (every first-party engine records; false trains on them, counted in ``invariants/tokens_unverified``;
    :mod:`molt_core.identity`)."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs per trainer rank (its placement-group bundle)."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per trainer rank (its placement-group bundle)."""
    world_size: int = Field(1, ge=1)
    """Trainer ranks (Ray actors) sharing one FSDP2-sharded model, each training on its share of a
    step's rows (:mod:`molt_plugins.distributed`)."""
    lora: LoraSection | None = None
    """A LoRA adapter instead of full fine-tuning (:class:`LoraSection`; None: off)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (less memory,
    one more forward per layer; same loss and gradients)."""
    shared_prefix: bool = True
    """Run the prompt prefix a micro-batch's rows share (a GRPO group's prompt) once per distinct prefix
    in each forward (:func:`molt_core.train.forward.shared_prefix`: same logprobs up to float rounding;
    not with gradient checkpointing, images, routing replay or ``world_size > 1``)."""


class CheckpointSection(_Section):
    """``[checkpoint]``: how often checkpoints are written and how many are kept."""

    every: int = Field(50, ge=0)
    """Write a checkpoint every this many steps (0: only at the end)."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept."""


class EvalSection(_Section):
    """``[eval]``: held-out evaluation (pass@1 and pass@k)."""

    every: int = Field(0, ge=0)
    """Evaluate every this many steps (0: at the start and the end only)."""
    n_problems: int = Field(64, ge=0)
    """Held-out problems per evaluation (0: no evaluation)."""
    k: int = Field(1, ge=1)
    """Samples per problem (pass@k)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of the evaluation."""


class SftSection(_Section):
    """``[sft]``: supervised warm start before RL. ``molt sft`` and the warm start inside ``molt run``
    run the same computation with ``run.threads`` torch threads."""

    steps: int = Field(0, ge=0)
    """SFT steps (0 disables the warm start)."""
    data: str | None = None
    """Train on these rows instead of the agent's tasks: a JSONL of ``{"prompt", "completion"}`` or
    ``{"messages"}`` rows (or a Parquet file / dataset directory; :mod:`molt_core.train.sft`)."""
    lr: float = Field(1e-3, gt=0)
    """Peak AdamW learning rate."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay over ``steps`` (as :func:`molt_core.train.lr_factor`)."""
    batch_size: int = Field(32, ge=1)
    """Examples per step."""
    label_noise: float = Field(0.0, ge=0, le=1)
    """Fraction of deliberately wrong targets."""
    n_examples: int = Field(2000, ge=1)
    """Examples drawn from the agent's train split (when ``data`` is unset)."""


class TeacherSection(_Section):
    """``[teacher]``: on-policy distillation teacher. Each ok trajectory is annotated with
    ``info["teacher_logprobs"]`` before training (read by ``algo.advantage = "on_policy_distill"``)."""

    name: str | None = None
    """A registered teacher (``hf_teacher``; None: no teacher)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Options of the teacher, validated by the teacher's own options model."""


class RunConfig(_Section):
    """The whole resolved configuration of a run (one field per recipe table)."""

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
    """``--plugin`` specs to load (dotted module paths or ``.py`` files)."""
    rewards: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """A registered reward name to its table: the reward's options plus the reserved keys ``weight``
    (default 1.0) and ``timeout_s`` (default 60), which the runtime reads and does not pass on
    (:mod:`molt_core.rewards`)."""
    loggers: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """A registered logger name to its options (``[loggers.wandb]`` / ``mode = "online"``), validated
    by that logger's ``Options`` model before any compute (:func:`molt_core.runtime.rundir.check_loggers`);
    the list form ``loggers = ["wandb"]`` means the same loggers with default options. The JSONL metrics
    file is always written."""

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
