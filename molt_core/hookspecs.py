"""The molt plugin API: pluggy hook specifications (entry-point group ``molt``).

A plugin is a module or object with :data:`hookimpl` functions named below (taking any subset of
the spec's arguments). Registration hooks receive a ``register(name, obj)`` callback, so the host
knows who registered what (pattern of simonw/llm); lifecycle hooks are broadcasts.
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

PROJECT = "molt"
HOOK_API_VERSION = 3
"""Counts additions of hooks and arguments, never changes (docs/plugins/compatibility.md; CHANGELOG.md)."""

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[str, Any], None]


@hookspec
def molt_register_rewards(register: Register) -> None:
    """Register rewards: ``register(name, fn_or_class)``, called ``reward(response: str, task: dict,
    **options) -> float`` (``options``: ``[rewards.<name>]`` less the reserved keys); or ``async
    def``; or a group reward (``molt_group = True``: ``(responses, tasks, **options) -> list[float]``);
    or given the rollout (a ``trajectory`` / ``trajectories`` parameter); :mod:`molt_core.rewards`.
    Raising, running past ``timeout_s`` or a non-finite score marks the trajectory ``failed``."""


@hookspec
def molt_register_envs(register: Register) -> None:
    """Register agents: ``register(name, cls)``, an ``Env`` / ``ChatAgent`` subclass or a factory of one."""


@hookspec
def molt_register_judges(register: Register) -> None:
    """Register LLM-as-judge scorers: ``register(name, cls)``."""


@hookspec
def molt_register_teachers(register: Register) -> None:
    """Register distillation teachers: ``register(name, cls)``, per-token logprobs on sampled tokens."""


@hookspec
def molt_register_replay_backends(register: Register) -> None:
    """Register MoE routing-replay (R3) backends: ``register(model_type, backend)`` with
    ``route(router, hidden_states [..., H], recorded [N, K] int64) -> (logits [N, E], weights [N, K],
    indices [N, K])`` and ``replay(model, routed_experts [B, T, L, K])``, a context manager (-1 rows:
    natural routing)."""


@hookspec
def molt_register_routing_tools(register: Register) -> None:
    """Register MoE routing tools (R3 record / replay / metrics): ``register(name, tool)``; for a model
    declaring experts (:func:`molt_core.models.declares_experts`), the first by name whose
    ``is_moe(model) -> bool`` holds serves it. It provides the engine's ``recorder(model)``
    (``attach()``, ``clear()``, ``take() -> [N, L, K]`` int64 of the last forward's tokens,
    ``num_layers``, ``top_k``); ingress's ``collate(routed, T, where) -> [B, T, L, K]`` int64 or None
    (per-row ``[T_b, L, K]`` lists or None, -1 padding; ValueError names the row); the trainer's
    ``init_trainer(trainer, backend)`` (sets ``trainer.replay_backend``; may raise ValueError),
    ``forward(trainer, model, batch, rows, T)`` (a context manager around each policy forward),
    ``noreplay(trainer, batch) -> dict``, ``metrics(trainer, batch, prox [B, T] float32, noreplay)
    -> dict[str, float]``."""


@hookspec
def molt_register_engines(register: Register) -> None:
    """Register rollout engines: ``register(name, factory)``; ``factory(**engine_kwargs) -> RolloutEngine``
    (:func:`molt_core.runtime.workers.engine_kwargs`; ``device`` when ``engine.num_gpus > 0``)."""


@hookspec
def molt_register_loggers(register: Register) -> None:
    """Register metric loggers: ``register(name, cls)``; ``cls(run_dir, config, **options)`` (options:
    ``[loggers.<name>]``, validated by ``cls.Options`` if declared) has ``log(step: int, metrics:
    dict[str, float])``, ``close()`` and optionally ``log_samples(step: int, rows: list[dict])``,
    rows ``{"prompt": str, "completion": str, "reward": float | None, "status": str}``."""


@hookspec
def molt_register_sandbox_backends(register: Register) -> None:
    """Register code-sandbox backends: ``register(name, backend)`` (or a zero-argument class), a
    ``molt_plugins.sandbox.SandboxBackend``: ``available()``, ``describe()``, ``run(SandboxRequest)
    -> SandboxResult``. Selected by ``MOLT_SANDBOX_BACKEND=<name>``."""


@hookspec
def molt_register_weight_sync_transports(register: Register) -> None:
    """Register weight-sync transports: ``register(name, factory)``; ``factory()`` is the transport of
    ``engine.weight_sync = name`` (``ray`` is built in; the option's values today are ``auto`` / ``ray`` /
    ``collective``, so a plugin provides or replaces ``collective``; a new name needs a schema
    change). Rank 0 is the trainer's rank 0, then each
    worker's engine members. Each call blocks until every member is done:

    * ``free_address() -> (host, port)``: where rank 0 hosts the group;
    * ``sender(host, port, world_size, device, timeout_s) -> group``: rank 0 joins (``group.backend``: str);
    * ``send(group, state, version, dtype) -> int``: name -> full tensor (floats as the engine's ``dtype``);
      returns the bytes each receiver got;
    * ``receivers(engine) -> int``: members one engine adds;
    * ``join(engine, host, port, rank_offset, world_size, timeout_s) -> str``: the backend;
    * ``receive(engine, version) -> int``: bytes loaded between decode steps (ValueError refuses; old weights stay)."""


@hookspec
def molt_register_estimators(register: Register) -> None:
    """Register advantage estimators: ``register(name, fn)``, selected by ``algo.advantage``.

    ``fn`` takes by keyword only what it names: ``rewards`` ``[R]`` float32 (per rollout),
    ``group_index`` ``[R]`` int64 (naming it marks a group baseline: ``n_samples_per_prompt >= 2``),
    ``rollout_index`` ``[B]`` int64 (per row), ``mask`` ``[B, T]`` bool (sampled tokens); ``[B, T]``
    float32 ``values`` (builds a critic), ``token_rewards`` (e.g. ``-kl_coef * kl``; allows
    ``algo.kl_as_reward``), ``student_logprobs`` (proximal) / ``teacher_logprobs`` (needs a
    ``[teacher]``); floats ``gamma``, ``lam``, ``eps`` (``algo.adv_eps``), ``std_tol``, ``coef``
    (``algo.distill_coef``); a tensor without a default is required. Returns ``[R]`` (broadcast to
    each rollout's tokens), ``[B, T]`` or ``([B, T] advantages, [B, T] returns)``, float, 0 off
    ``mask``. The built-ins (:mod:`molt_core.algo.builtins`) register here too."""


@hookspec
def molt_register_losses(register: Register) -> None:
    """Register per-token policy losses: ``register(name, fn)``, selected by ``algo.loss``.

    ``fn`` takes by keyword only what it names: ``logprobs`` ``[B, T]`` float (requires grad),
    ``proximal_logprobs``, ``advantages`` ``[B, T]`` float (detached), ``mask`` ``[B, T]`` bool,
    floats ``clip_low``, ``clip_high``, ``dual_clip`` (None or > 1). Returns ``(loss [B, T], flags)``,
    ``flags``: ``ratio`` ``[B, T]`` float, bool ``[B, T]`` ``clipped_low``, ``clipped_high`` (optional
    ``dual_clipped``); the trainer applies the importance weights and the global token mean
    (:func:`molt_core.algo.losses.apply_policy_loss`)."""


@hookspec
def molt_register_adapters(register: Register) -> None:
    """Register trainer adapters: ``register(name, adapter)``. The schema has one adapter section,
    ``[trainer.lora]``, served by the adapter registered as ``lora`` (first party:
    :mod:`molt_plugins.lora`; a plugin may provide its own ``lora``). Each method takes the policy ``model`` (an ``nn.Module``):

    * ``wrap(model, options) -> nn.Module``: the trained policy (``options``: the section), before the optimizer;
    * ``reference(model) -> nn.Module``: the frozen KL reference (e.g. the adapter disabled);
    * ``merged_state_dict(model) -> dict[str, Tensor]``: plain weights under the base names (``model/``);
    * ``base_training(model)``: a context manager yielding the SFT's ``(forward model, parameters)``;
    * ``save(model, d: Path)`` / ``load(model, d: Path)``: its files in checkpoint directory ``d``;
      ``load`` raises ``FileNotFoundError`` for a checkpoint it did not write."""


@hookspec
def molt_register_trainer_backends(register: Register) -> None:
    """Register data-parallel trainer backends: ``register(name, backend)``; the backend registered as
    ``fsdp2`` (first party: :mod:`molt_plugins.distributed`) runs ``trainer.world_size > 1``. The backend provides:

    * ``init_process_group(rank: int, world_size: int, init_method: str) -> str``: join (a ``tcp://``
      or ``file://`` rendezvous); returns the collective backend (``gloo`` / ``nccl``);
    * ``trainer(cfg: RunConfig) -> Trainer``: this rank's ``Trainer`` (``rank``, ``world_size``, ``backend``;
      every rank calls its ``save_checkpoint``);
    * ``load_checkpoint(trainer, d: Path)``: distributed checkpoint ``d`` (``dcp/``) into any trainer;
    * ``load_model(module, d: Path)`` / ``load_optimizer(module, optimizer, state: dict)``: a plain
      checkpoint's weights / ``optimizer.state_dict()`` into a rank's sharded module."""


@hookspec
def molt_register_modalities(register: Register) -> None:
    """Register an input modality (images): ``register(name, modality)``, the kernel's only way to
    images (none: image parts and ``[images]`` refused). It provides (as ``molt_plugins.vision``'s
    ``VisionModality``): ``error`` (the ValueError type of a refused image, with ``field``);
    ``decode_part(part, where, policy)`` -> ``.sha256`` (hex), ``.data`` (bytes); ``is_model(model)``;
    ``processor_for(model, path, tokenizer)`` -> None or a processor with ``expand(ids, shas, pool,
    offset)`` -> ``(ids, [ImageRef])``, ``extra_tokens(shas, pool)``, ``expand_placeholders(ids,
    images)``, ``check_segment(ids, refs, images)``, ``process(bytes)`` -> ``(pixels [n, D] float32,
    [t, h, w])``, ``padded_inputs(model, rows, width, device)`` -> ``position_ids [3, B, T]``,
    ``pixel_values``, ``image_grid_thw [N, 3]``, and ``image_processor`` (a transformers image
    processor: checkpoints and SFT save it with ``save_pretrained(dir)``); ``row_images(model, processor, ids, images,
    is_vision)`` and ``forward_kwargs(model, rows, spans, n, pos2d [B, n])`` (embedded engine);
    ``rope_index(model)`` -> its ``get_rope_index``; ``wire_images(policy, processor)`` -> a
    request's collector (``openai_part``, ``anthropic_block``, ``responses_part``, ``remote``,
    ``check()``)."""


@hookspec
def molt_register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers: ``register(name, parser_cls)``; the server (``molt serve --tool-parser
    NAME``) builds ``parser_cls.for_tokenizer(tokenizer)`` if defined, else ``parser_cls()``, once, for
    every session's ledger (none named: Hermes). First party (:mod:`molt_plugins.parsers`): ``hermes``
    / ``qwen``, ``qwen3_coder``, ``llama3_json``, ``mistral``, ``auto`` (picks per model). The parser
    provides :class:`molt_core.ledger.toolcall.ToolParser`'s ``parse(text, start=0, tools=None) ->
    [ParsedCall(name, arguments: dict, span: (start, end))]``: every well-formed call in
    ``text[start:]`` (``start``: after the reasoning), in order, never raising; ``tools``: the
    request's OpenAI-form schemas. The ledger removes each span from the content."""


@hookspec
def molt_register_wires(register: Register) -> None:
    """Register a wire (an HTTP dialect of the loopback server beside OpenAI chat completions):
    ``register(name, wire)``, mounted on every server (none: its paths 404). It provides
    ``mount(server)``, called once per app with a ``molt_core.server.app.WireServer`` (``app``,
    ``tokenizer``, ``model_name``, ``route(path, method)``, a decorator for ``async fn(sid, request)``
    -> dict or Response, ``session_request(request, sid, Model)`` -> ``(session, req, body_bytes)``
    with ``session.ledger`` and ``session.state`` (a dict), ``images()``, ``checked(collector,
    body_bytes)``, ``params_of(temperature, top_p, top_k, seed, stop)``, ``run_turn(session,
    request, messages, tools, params, max_tokens, allow_tool_calls, body_bytes)`` -> the committed
    ``AssistantTurn``, ``guarded(wire, handle)``: errors in the wire's shape); ``paths`` (e.g.
    ``("/v1/messages",)``); optionally ``error_body(status, message, param, code)`` -> dict (default
    OpenAI's), ``owns(path)`` (paths whose framework errors take that shape) and
    ``server_error_type`` (the router's 5xx ``error.type``)."""


@hookspec
def molt_register_render_windows(register: Register) -> None:
    """Register a window prover for the ledger's extend check: ``register(name, prove)``,
    ``prove(source, environment) -> (WindowProof | None, reason)`` (:data:`molt_core.ledger.render.Prover`);
    the first by name serves every ledger (none: full renders). A proof guarantees the full render's
    verdict and tail on the window :func:`~molt_core.ledger.render.window_start` places."""


@hookspec
def molt_register_builtin_models(register: Register) -> None:
    """Register a model ``model.path = "builtin:NAME"`` builds: ``register(name, model)`` with
    ``tokenizer()`` -> a Hugging Face tokenizer with a chat template; ``build(tokenizer)`` -> a
    float32 ``torch.nn.Module`` from a random init (under ``load_model(seed=...)``'s seeded RNG;
    ``logits [B, T, V]`` from ``input_ids [B, T]``); ``vision`` -> bool (a vision-language model).
    The kernel's own: ``tiny-qwen3``, ``-moe``, ``-large``; first party: :mod:`molt_plugins.tiny_models`
    (``tiny-qwen3-bigvocab``, ``tiny-qwen2.5-vl``)."""


@hookspec(historic=True)
def molt_configure(config: Any) -> None:
    """Called once with the resolved ``RunConfig`` before any compute (historic: late plugins get it)."""


@hookspec
def molt_on_trajectory(trajectory: Any) -> None:
    """Called with each finished ``Trajectory`` (after rewards), before it is queued."""


@hookspec
def molt_on_step_end(step: int, metrics: dict) -> None:
    """Called after each optimizer step with the step's metrics (``dict[str, float]``)."""


REGISTRATION_HOOKS: dict[str, str] = {
    "rewards": "molt_register_rewards",
    "envs": "molt_register_envs",
    "judges": "molt_register_judges",
    "teachers": "molt_register_teachers",
    "replay_backends": "molt_register_replay_backends",
    "routing_tools": "molt_register_routing_tools",
    "engines": "molt_register_engines",
    "loggers": "molt_register_loggers",
    "sandbox_backends": "molt_register_sandbox_backends",
    "weight_sync_transports": "molt_register_weight_sync_transports",
    "estimators": "molt_register_estimators",
    "losses": "molt_register_losses",
    "adapters": "molt_register_adapters",
    "trainer_backends": "molt_register_trainer_backends",
    "modalities": "molt_register_modalities",
    "tool_parsers": "molt_register_tool_parsers",
    "wires": "molt_register_wires",
    "render_windows": "molt_register_render_windows",
    "builtin_models": "molt_register_builtin_models",
}
