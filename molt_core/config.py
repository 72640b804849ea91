"""Run configuration: :class:`RunConfig` loaded from a TOML recipe plus ``--set`` overrides.

Recipes are TOML files with one table per section below. Validation is strict: an unknown
key, or a value of the wrong type (a string where an int belongs, say), is an error, and
*every* bad field is reported at once with its dotted path and the expected type
(:class:`ConfigError`). ``--set section.key=value`` values are parsed as TOML values (ints,
floats, bools, lists, quoted strings); anything that is not a TOML value is taken as a bare
string (``--set model.path=runs/x``), and a field declared a string takes the raw text
whatever it looks like (``--set run.name=2024-01-01``, ``1e-3``, ``true``, ``nan``).
``--set '~section.key'`` removes an option the recipe sets, so it takes its default.
"""

from __future__ import annotations

import datetime
import difflib
import importlib.resources
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = ["ConfigError", "ImagePolicy", "RunConfig", "load_config", "apply_overrides", "parse_override", "RECIPES_DIR", "find_recipe",
           "recipes_dir", "list_recipes"]


def recipes_dir(package_dir: Path | None = None) -> Path:
    """The directory of the shipped recipes (``*.toml``, ``examples/*.toml``, ``agents/*.py``).

    The repo keeps them at its top, ``recipes/``; the wheel carries that folder inside the
    package as ``molt_core/recipes`` (``[tool.hatch.build.targets.wheel.force-include]`` in
    pyproject.toml). So: the packaged copy when present (a wheel install), else the checkout's
    ``<repo>/recipes`` (an editable install or ``PYTHONPATH``; a repo is recognised by its
    ``pyproject.toml``), else the packaged path, which does not exist (errors then name it).
    The working directory plays no part.

    Args:
        package_dir: the ``molt_core`` package directory; None is the imported package's
            (``importlib.resources.files("molt_core")``). Tests pass a fake one.
    """
    pkg = Path(str(importlib.resources.files("molt_core"))) if package_dir is None else Path(package_dir)
    packaged = pkg / "recipes"
    if packaged.is_dir():
        return packaged
    checkout = pkg.parent / "recipes"
    if checkout.is_dir() and (pkg.parent / "pyproject.toml").is_file():
        return checkout
    return packaged


RECIPES_DIR = recipes_dir()


def list_recipes(root: Path | None = None) -> list[tuple[str, Path]]:
    """``(name, path)`` of every shipped recipe: ``root/*.toml`` named by stem, then
    ``root/examples/*.toml`` named ``examples/<stem>`` (each name is what ``molt run`` takes).

    Args:
        root: the recipes directory; None is :data:`RECIPES_DIR`.
    """
    root = RECIPES_DIR if root is None else root
    top = [(p.stem, p) for p in sorted(root.glob("*.toml"))]
    return top + [(f"examples/{p.stem}", p) for p in sorted((root / "examples").glob("*.toml"))]


class ImagePolicy(BaseModel):
    """Limits and the remote-URL rule for image inputs (the recipe's ``[images]`` table; the
    loopback server's ``create_app(image_policy=...)``), read by the vision modality plugin
    (``molt_plugins.vision``); a recipe that sets it needs a modality plugin loaded.

    Fields: ``max_bytes`` -- encoded size limit in bytes (default 20 MiB, the Anthropic API's
    request-level image cap); ``max_pixels`` -- width x height limit (default 33,177,600 =
    7680 x 4320); ``allow_remote_urls`` -- fetch ``http(s)://`` image URLs (default False: only
    inline data); ``fetch_timeout_s`` -- total time for one fetch in seconds.
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
    """``[run]``: ``name``, ``seed``, ``steps`` (optimizer steps), ``out_dir`` (default
    ``runs/<name>-<time>``), ``threads`` (torch intra-op threads per process)."""

    name: str = "run"
    seed: int = 0
    steps: int = Field(100, ge=0)
    out_dir: str | None = None
    threads: int = Field(1, ge=1)


class ModelSection(_Section):
    """``[model]``: ``path`` -- an HF model directory, or ``builtin:<name>`` for a model the
    project builds from a config (``builtin:tiny-qwen3``); ``gguf_file`` for GGUF checkpoints;
    ``dtype`` -- the trainer's compute dtype: parameters, gradients and AdamW state stay
    float32 (master weights) and ``bfloat16``/``float16`` forwards run under autocast
    (:meth:`molt_core.train.Trainer.autocast`; bound of the forward-consistency invariant per
    dtype: :data:`molt_core.train.version_history.ONPOLICY_ABSDIFF_TOL`);
    ``routing_replay`` -- for an MoE policy, replay the rollout's recorded expert selection in
    the trainer's forwards (R3, arXiv 2510.11370; needs a replay backend for the model type)."""

    path: str = "builtin:tiny-qwen3"
    gguf_file: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    routing_replay: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class EngineSection(_Section):
    """``[engine]``: ``name`` of a registered engine (``transformers``, ``vllm``),
    ``num_engines`` rollout workers, ``max_batch_size`` concurrent sequences per engine,
    ``dtype`` of the engine's copy of the weights, ``num_cpus``/``num_gpus`` per worker,
    ``resources``: custom Ray resources each rollout worker requires (e.g. ``{rollout = 1}``
    to place workers on nodes started with ``ray start --resources '{"rollout": 1}'``);
    ``weight_sync`` -- how a publish reaches the engines: ``ray`` (the trainer packs the
    weights into one buffer that each rollout worker fetches from Ray's object store),
    ``collective`` (the trainer's rank 0 broadcasts into every vLLM worker through a process
    group, NCCL between distinct GPUs, gloo otherwise: :mod:`molt_plugins.engines.vllm.weight_sync`;
    vllm engine and a Ray run only) or ``auto`` (collective for the vllm engine with
    ``num_gpus > 0`` under Ray, else ray)."""

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
    """``[agent]``: ``name`` of a registered env/agent, or ``path`` to a ``.py`` file defining
    one; ``options`` validated by the agent's own options model."""

    name: str | None = None
    path: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)


class RolloutSection(_Section):
    """``[rollout]``: ``prompts_per_step`` groups per optimizer step, ``n_samples_per_prompt``
    rollouts per group, sampling (``temperature``, ``top_p``, ``top_k``), ``max_tokens`` per
    turn, ``max_turns`` and ``max_total_tokens`` per episode, ``timeout_s`` per rollout (the
    agent episode; each reward call has its own ``[rewards.NAME] timeout_s``),
    ``dynamic_filter`` drops groups whose rewards are all equal, ``reward_concurrency`` -- reward
    calls in flight at once per rollout worker (all rewards and groups together)."""

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


class AlgoSection(_Section):
    """``[algo]``: ``advantage`` estimator, policy ``loss``, clip band (PPO, arXiv 1707.06347;
    dual clip, arXiv 1912.09729), KL to a frozen reference (``kl_coef`` 0 disables; estimator
    k1/k2/k3, Schulman 2020 "Approximating KL divergence"; as a per-token reward or a loss
    term), ``gamma``/``lam`` for discounted estimators and GAE. ``adv_eps`` is the epsilon of
    std-normalised advantages (GRPO's ``std + eps``); ``std_tol`` is the std (computed in float64)
    below which a group or batch counts as having zero spread, so rounding residues are never
    divided by (issue 4, B14). ``kl_horizon`` is the adaptive KL controller's horizon (Ziegler et
    al. 2019, arXiv 1909.08593), used when ``kl_target`` is set. ``value_clip`` clips the GAE
    critic's new value to ``old +- value_clip`` in its loss (PPO value clipping; None disables)."""

    advantage: Literal[
        "reinforce", "reinforce_baseline", "rloo", "rloo_norm", "grpo", "dr_grpo", "gae", "on_policy_distill"
    ] = "grpo"
    loss: Literal["ppo", "gspo", "cispo"] = "ppo"
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
    """``[correction]``: importance correction of off-policy tokens (TIS, IcePop, MIS):
    ``is_level`` (off/token/seq/geo), ``is_mode`` (mask/clip/trunc), band ``[low, high]``."""

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
    """``[async]``: ``max_staleness`` -- how many policy versions rollout may run ahead of
    the trainer (0 = synchronous). The driver bounds how far ahead rollouts *start* (at most
    ``(1 + max_staleness) * prompts_per_step`` groups in flight); the trainer's gate bounds
    the *oldest token* of each rollout, so a (partial) rollout that finishes late, staler than
    the bound, is dropped and counted (``correction/gated_frac``). ``onpolicy_rows`` -- rows per older version
    recomputed under the weights that sampled them, for
    ``invariants/logprob_absdiff_max_onpolicy`` (-1, the default: every stale row; n > 0: a
    random sample of n rows per older version, new each step; 0: off, no weight copies kept);
    the trainer keeps ``max_staleness`` CPU copies of past weights and one shadow copy of the
    policy on its device for it (:mod:`molt_core.train.version_history`)."""

    max_staleness: int = Field(0, ge=0)
    onpolicy_rows: int = Field(-1, ge=-1)


class LoraSection(_Section):
    """``[trainer.lora]``: train a LoRA adapter (peft) instead of every weight -- rank ``r``,
    scale ``alpha`` (the update is ``(alpha / r) B A``), ``dropout`` (must stay 0: the trainer
    runs without dropout so an on-policy importance ratio is exactly 1), ``target_modules``
    (module-name suffixes such as ``q_proj``; None: peft's default for the model type, or
    ``"all-linear"``). Needs the ``lora`` extra (:mod:`molt_core.train.lora`)."""

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
    """``[trainer]``: AdamW (``lr``, ``betas``, ``eps``, ``weight_decay``), ``grad_clip``
    (max global grad norm, 0 disables), ``warmup_steps``, ``lr_schedule``,
    ``micro_batch_size`` sequences per forward, ``ppo_epochs`` passes over a step's batch;
    ``critic_lr`` of the GAE critic (None: ``lr``); ``refuse_unverified`` -- refuse at ingress
    a rollout whose action tokens carry no engine record of what was sampled (default true:
    every first-party engine records; false trains on them, counted in
    ``invariants/tokens_unverified``; :mod:`molt_core.identity`); ``world_size`` -- trainer
    ranks (Ray actors, one placement-group bundle of ``num_cpus``/``num_gpus`` each) sharing
    one FSDP2-sharded model, each training on its share of a step's rows
    (:mod:`molt_core.train.distributed`); ``lora`` -- a LoRA adapter instead of full
    fine-tuning (:class:`LoraSection`; None: off); ``gradient_checkpointing`` -- recompute each
    decoder layer's activations in the backward instead of keeping them (less memory, one more
    forward per layer; same loss and gradients); ``shared_prefix`` -- run the prompt prefix a
    micro-batch's rows share (a GRPO group's prompt) once per distinct prefix in each forward
    (:func:`molt_core.train.forward.shared_prefix`: same logprobs up to float rounding; not with
    gradient checkpointing, images, routing replay or ``world_size > 1``)."""

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
    """``[checkpoint]``: write every ``every`` steps (0 = only at the end), keep ``keep``."""

    every: int = Field(50, ge=0)
    keep: int = Field(2, ge=1)


class EvalSection(_Section):
    """``[eval]``: every ``every`` steps (0 = start and end only) on ``n_problems`` held-out
    problems, ``k`` samples each at ``temperature`` (pass@1 and pass@k)."""

    every: int = Field(0, ge=0)
    n_problems: int = Field(64, ge=0)
    k: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)


class SftSection(_Section):
    """``[sft]``: warm start before RL (``steps`` 0 disables): ``lr`` (peak AdamW LR) with
    ``warmup_steps`` of linear warmup and ``lr_schedule`` (constant / linear / cosine decay over
    ``steps``, as :func:`molt_core.train.lr_factor`), ``batch_size``, ``label_noise``
    (fraction of deliberately wrong targets), ``n_examples``. ``molt sft`` and the warm start
    inside ``molt run`` run the same computation with ``run.threads`` torch threads. ``data``:
    train on these rows instead of the agent's tasks -- a JSONL of ``{"prompt", "completion"}``
    or ``{"messages"}`` rows (or a Parquet file / dataset directory; :mod:`molt_core.train.sft`)."""

    steps: int = Field(0, ge=0)
    data: str | None = None
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    batch_size: int = Field(32, ge=1)
    label_noise: float = Field(0.0, ge=0, le=1)
    n_examples: int = Field(2000, ge=1)


class TeacherSection(_Section):
    """``[teacher]``: on-policy distillation teacher. ``name`` of a registered teacher
    (``hf_teacher``; None = no teacher); ``options`` validated by the teacher's own options
    model. Each ok trajectory is annotated with ``info["teacher_logprobs"]`` before training
    (read by ``algo.advantage = "on_policy_distill"``)."""

    name: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)


class RunConfig(_Section):
    """The whole resolved configuration of a run (one field per recipe table).

    ``plugins`` lists ``--plugin`` specs to load; ``rewards`` maps a registered reward name to
    its table: the reward's options plus the reserved keys ``weight`` (default 1.0) and
    ``timeout_s`` (default 60), which the runtime reads and does not pass on
    (:mod:`molt_core.rewards`); ``loggers`` maps a registered logger name to its options
    (``[loggers.wandb]`` / ``mode = "online"``), validated by that logger's ``Options`` model
    before any compute (:func:`molt_core.runtime.rundir.check_loggers`); the list form
    ``loggers = ["wandb"]`` stays valid and means the same loggers with default options.
    The JSONL metrics file is always written.
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
    #: ``[images]``: image input limits and ``allow_remote_urls`` (:class:`ImagePolicy`)
    images: ImagePolicy = Field(default_factory=ImagePolicy)
    plugins: list[str] = Field(default_factory=list)
    rewards: dict[str, dict[str, Any]] = Field(default_factory=dict)
    loggers: dict[str, dict[str, Any]] = Field(default_factory=dict)

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    @field_validator("loggers", mode="before")
    @classmethod
    def _logger_names_as_tables(cls, v: Any) -> Any:
        """``loggers = ["wandb", ...]`` is ``{"wandb": {}, ...}``: each logger with default options.

        Raises:
            ValueError: a list item that is not a string, or a name listed twice.
        """
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
        group = {"grpo", "dr_grpo", "rloo", "rloo_norm", "reinforce_baseline"}
        if self.algo.advantage in group and self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                f"rollout.n_samples_per_prompt = {self.rollout.n_samples_per_prompt}: algo.advantage = "
                f"{self.algo.advantage!r} uses a group baseline and needs at least 2 samples per prompt "
                f"(or choose 'reinforce')"
            )
        return self

    @model_validator(mode="after")
    def _lora_supported(self) -> "RunConfig":
        """``[trainer.lora]`` is refused with ``trainer.world_size > 1`` (the sharded trainer
        does not wrap adapters yet)."""
        if self.trainer.lora is None:
            return self
        if self.trainer.world_size > 1:
            raise ValueError(f"trainer.lora with trainer.world_size = {self.trainer.world_size} is not supported yet "
                             f"(the sharded trainer does not wrap adapters); set trainer.world_size = 1 (an adapter's "
                             f"optimizer state is small: one rank holds it) or remove [trainer.lora]")
        return self

    def to_toml(self) -> str:
        """Serialise to TOML (the form written into the run directory); ``None`` fields are
        omitted, so the file loads back to an equal config."""
        data = self.model_dump(by_alias=True, exclude_none=True)
        return tomli_w.dumps(data)

    def write(self, path: str | Path) -> Path:
        """Write :meth:`to_toml` to ``path``; returns the path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_toml())
        return p


def _type_name(model: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    """The annotation of the field at ``loc`` (a pydantic error location), as text."""
    cur: Any = model
    ann: Any = None
    for part in loc:
        if isinstance(cur, type) and issubclass(cur, BaseModel):
            fields = cur.model_fields
            key = part
            if key not in fields:
                key = next((k for k, f in fields.items() if f.alias == part), None)
                if key is None:
                    return None
            ann = fields[key].annotation
            cur = ann
        else:
            return None
    if ann is None:
        return None
    return getattr(ann, "__name__", None) if isinstance(ann, type) else str(ann).replace("typing.", "")


def _suggest(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    cur: Any = model
    for part in loc[:-1]:
        if isinstance(cur, type) and issubclass(cur, BaseModel):
            f = cur.model_fields.get(part) or next((f for f in cur.model_fields.values() if f.alias == part), None)
            cur = f.annotation if f else None
        else:
            return ""
    if not (isinstance(cur, type) and issubclass(cur, BaseModel)):
        return ""
    names = [f.alias or k for k, f in cur.model_fields.items()]
    key = str(loc[-1])
    close = difflib.get_close_matches(key, names, n=1)
    exact = _field_paths(key, fuzzy=False)  # a field of that very name in another section wins
    if close and not exact:
        return f" (did you mean {close[0]!r}?)"
    elsewhere = exact or _field_paths(key)
    if elsewhere:
        return f" (did you mean {' or '.join(repr(p) for p in elsewhere)}?)"
    return f" (known keys: {', '.join(names)})"


def _field_paths(key: str, fuzzy: bool = True) -> list[str]:
    """Dotted paths ``section.field`` of every :class:`RunConfig` section field named ``key``
    (``steps`` -> ``run.steps``, ``sft.steps``), else (when ``fuzzy``) of the fields whose name
    is closest to it (``stesp`` -> the same); ``[]`` when none is."""
    paths: dict[str, list[str]] = {}
    for sec, f in RunConfig.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            for k, sf in f.annotation.model_fields.items():
                paths.setdefault(sf.alias or k, []).append(f"{f.alias or sec}.{sf.alias or k}")
    close = [key] if key in paths else difflib.get_close_matches(key, list(paths), n=1) if fuzzy else []
    return paths[close[0]] if close else []


def validate_config(data: dict[str, Any], source: str = "recipe") -> RunConfig:
    """Validate a recipe dict into a :class:`RunConfig`.

    Raises:
        ConfigError: listing every bad field as ``path: problem (expected TYPE)``.
    """
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        errors: list[tuple[str, str]] = []
        for err in e.errors():
            loc = tuple(err["loc"])
            path = ".".join(str(p) for p in loc)
            if err["type"] == "extra_forbidden":
                msg = f"unknown key{_suggest(RunConfig, loc)}"
            elif err["type"] == "value_error":  # a cross-field rule: its message says it all
                msg = str(err["msg"]).removeprefix("Value error, ")
                path = path or "(whole recipe)"
            else:
                expected = _type_name(RunConfig, loc)
                got = err.get("input")
                msg = f"{err['msg']}"
                if expected:
                    msg += f" (expected {expected}, got {type(got).__name__} {got!r})"
            errors.append((path, msg))
        lines = "\n".join(f"  {p}: {m}" for p, m in errors)
        raise ConfigError(f"{source} has {len(errors)} invalid field(s):\n{lines}", errors) from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse ``section.key=value`` into (``["section", "key"]``, typed value).

    The value is parsed as a TOML value (``8`` -> int, ``3e-4`` -> float, ``true`` -> bool,
    ``[1, 2]`` -> list, ``"x"`` -> str); otherwise it is the bare string. (``~section.key``,
    which removes an option, is handled by :func:`apply_overrides`.)

    Raises:
        ConfigError: no ``=``, an empty key, or an empty value (``key=""`` is the empty string).
    """
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set {item!r}: empty key")
    raw = raw.strip()
    if not raw:
        raise ConfigError(f"--set {item!r}: empty value; for an empty string write {key}='\"\"', to put the "
                          f"option back to its default write '~{key}'")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    if isinstance(value, (datetime.date, datetime.time)):  # no option is a TOML date: 2024-01-01 is a name
        value = raw
    return key.split("."), value


def text_hint(where: str, err: Mapping[str, Any]) -> str:
    """For a pydantic error at option ``where`` (``loggers.wandb.project``) that wanted a
    string and got a number or bool -- what ``--set where=123`` gives a plugin option, whose
    type the override parser cannot know -- `` (quote it for text: --set 'where="123"')``;
    else ``""``."""
    val = err.get("input")
    if err.get("type") != "string_type" or not isinstance(val, (bool, int, float)):
        return ""
    text = json.dumps(val) if isinstance(val, bool) else str(val)
    return f" (got {text}; quote it for text: --set '{where}=\"{text}\"')"


def _declared(path: list[str]) -> Any:
    """The annotation of the :class:`RunConfig` field at ``path`` (section aliases such as
    ``async`` included), or None when the path is not a declared field."""
    cls: Any = RunConfig
    ann: Any = None
    for p in path:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None
        f = next((f for n, f in cls.model_fields.items() if p in (n, f.alias)), None)
        if f is None:
            return None
        ann = cls = f.annotation
    return ann


def _wants_str(ann: Any) -> bool:
    """True when a field of annotation ``ann`` holds a string: ``str``, ``str | None``, or a
    ``Literal`` of strings."""
    import types
    import typing

    if ann is str:
        return True
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Literal:
        return all(isinstance(a, str) for a in args)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return len(rest) == 1 and _wants_str(rest[0])
    return False


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``section.key=value`` override applied.

    A value is coerced to the declared type of its field: a string field takes the raw text
    (so ``run.name=2024-01-01``, ``1e-3``, ``true`` or ``nan`` stay the strings typed); other
    fields take the TOML value (:func:`parse_override`). ``~section.key`` (Hydra's syntax, as in
    verl) removes the key, so the option takes its default.

    Raises:
        ConfigError: an override is malformed, descends into a non-table value, or removes a
            key that is not set.
    """
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        if item.strip().startswith("~"):  # Hydra's deletion syntax (verl's CLI): back to the default
            _unset(out, item)
            continue
        path, value = parse_override(item)
        names = out.get("loggers")
        if path[0] == "loggers" and len(path) > 1 and isinstance(names, list) and all(isinstance(n, str) for n in names):
            out["loggers"] = {n: {} for n in names}  # --set loggers.wandb.mode=... on the list form
        if not isinstance(value, str) and _wants_str(_declared(path)):
            value = item.split("=", 1)[1].strip()
        cur = out
        for p in path[:-1]:
            nxt = cur.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: {p!r} is not a table")
            cur = nxt
        cur[path[-1]] = value
    return out


def _unset(data: dict[str, Any], item: str) -> None:
    """Apply ``--set '~section.key'``: remove that key from ``data`` (in place), so the option
    takes its default (e.g. ``~trainer.lora`` turns a recipe's LoRA off, ``~model.gguf_file``
    clears a path).

    Raises:
        ConfigError: a value after the key, or the key is not in the recipe.
    """
    key = item.strip()[1:].strip()
    if "=" in key or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected '~section.key' (no value) to remove an option")
    path = key.split(".")
    cur: Any = data
    for p in path[:-1]:
        cur = cur.get(p) if isinstance(cur, dict) else None
    if not isinstance(cur, dict) or path[-1] not in cur:
        if _declared(path) is None and not _plugin_options(path):  # a typo, not an option left at its default
            raise ConfigError(f"--set {item!r}: {key!r} is not an option{_closest_option(path)}")
        raise ConfigError(f"--set {item!r}: {key!r} is not set in the recipe (or an earlier --set), so there is "
                          f"nothing to remove; it already has its default")
    del cur[path[-1]]


def _plugin_options(path: list[str]) -> bool:
    """Whether ``path`` lies inside a free-form table (a plugin's ``options``, ``loggers``),
    whose keys no schema here declares."""
    return any(p in ("options", "loggers") for p in path[:-1]) or path[0] == "loggers"


def _closest_option(path: list[str]) -> str:
    """`` (did you mean 'a.b'?)`` for the declared option closest to ``path``'s last part among
    its parent's fields; ``""`` when none is close or the parent is not a declared table."""
    cls: Any = RunConfig if len(path) == 1 else _declared(path[:-1])
    if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
        return ""
    names = [f.alias or n for n, f in cls.model_fields.items()]
    close = difflib.get_close_matches(path[-1], names, n=1)
    return f" (did you mean {'.'.join(path[:-1] + close[:1])!r}?)" if close else ""


def find_recipe(recipe: str | Path) -> Path:
    """Resolve ``recipe``: a path to a TOML file, or the name of a shipped recipe
    (``quickstart``, ``examples/regex``; see :func:`list_recipes`), found in :data:`RECIPES_DIR`.

    Raises:
        ConfigError: neither exists; lists the shipped recipes and where they were looked for.
    """
    p = Path(recipe)
    if p.is_file():
        return p
    for cand in (RECIPES_DIR / f"{recipe}.toml", RECIPES_DIR / str(recipe)):
        if cand.is_file():
            return cand
    shipped = ", ".join(name for name, _ in list_recipes()) or f"none found in {RECIPES_DIR}"
    raise ConfigError(f"recipe {str(recipe)!r} not found: not a file, and not a shipped recipe"
                      f"{_closest_recipe(str(recipe))} ({shipped})")


def _closest_recipe(name: str) -> str:
    """`` (did you mean 'X'?)`` naming the shipped recipe closest to ``name``: a top-level one
    (``quickstrt`` -> ``quickstart``) or an example (``wandb`` -> ``examples/wandb``); ``""`` when
    none is close."""
    names: dict[str, str] = {}
    for p in sorted(RECIPES_DIR.glob("examples/*.toml")):
        names[p.stem] = names[f"examples/{p.stem}"] = f"examples/{p.stem}"
    names.update({p.stem: p.stem for p in RECIPES_DIR.glob("*.toml")})  # a top-level recipe wins a tie
    close = difflib.get_close_matches(name.removesuffix(".toml"), list(names), n=1)
    return f" (did you mean {names[close[0]]!r}?)" if close else ""


def load_config(recipe: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a TOML recipe (path or shipped name), apply overrides, validate.

    Raises:
        ConfigError: file missing, TOML syntax error, or invalid fields (all listed).
    """
    path = find_recipe(recipe)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: TOML syntax error: {e}") from None
    data = apply_overrides(data, overrides)
    cfg = validate_config(data, source=f"{path} with --set overrides" if overrides else str(path))
    if cfg.agent.path and not Path(cfg.agent.path).is_absolute() and not Path(cfg.agent.path).exists():
        beside = path.parent / cfg.agent.path  # a recipe names its agent file relative to itself
        if beside.exists():
            cfg = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"path": str(beside)})})
    return cfg
