"""The molt plugin API: pluggy hook specifications (entry-point group ``molt``).

A plugin is any module or object with functions decorated by :data:`hookimpl` whose names
are below. A hookimpl may accept fewer arguments than its spec (pluggy), so the API is
versioned by *adding* arguments and hooks, never changing them; :data:`HOOK_API_VERSION`
counts those additions.

Registration hooks receive a ``register(name, obj)`` callback rather than returning values,
so the host knows which plugin registered what and reports name collisions (pattern of
simonw/llm). Lifecycle hooks are broadcasts.
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

PROJECT = "molt"
HOOK_API_VERSION = 3
"""2: Reward API v2 -- async, group and trajectory rewards; ``weight`` / ``timeout_s`` per reward;
and ``molt_register_sandbox_backends``. 3: the minimal core's seams -- ``molt_register_estimators``,
``molt_register_losses``, ``molt_register_weight_sync_transports``, ``molt_register_routing_tools``,
``molt_register_modalities``, ``molt_register_adapters``, ``molt_register_trainer_backends``,
``molt_register_tool_parsers``, ``molt_register_wires``, ``molt_register_render_windows``, ``molt_register_builtin_models``."""

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[str, Any], None]


@hookspec
def molt_register_rewards(register: Register) -> None:
    """Register reward functions: ``register(name, fn_or_class)``.

    A reward is called as ``reward(response: str, task: dict, **options) -> float`` (or an
    object with that ``__call__``), where ``options`` is the recipe's ``[rewards.<name>]``
    table less the reserved keys ``weight`` and ``timeout_s``. API version 2 adds: ``async def``
    rewards (awaited), group rewards (``molt_group = True``: ``reward(responses, tasks,
    **options) -> list[float]``), and rewards given the whole rollout (a ``trajectory`` /
    ``trajectories`` parameter); see :mod:`molt_core.rewards`. Raising, running past
    ``timeout_s`` or returning a non-finite number marks the trajectory ``failed``.
    """


@hookspec
def molt_register_envs(register: Register) -> None:
    """Register agents: ``register(name, cls)`` where ``cls`` is an ``Env`` or ``ChatAgent``
    subclass (``molt_core.agents``), or a factory returning one."""


@hookspec
def molt_register_judges(register: Register) -> None:
    """Register LLM-as-judge scorers: ``register(name, cls)``."""


@hookspec
def molt_register_teachers(register: Register) -> None:
    """Register distillation teachers: ``register(name, cls)`` giving per-token teacher
    logprobs on the student's sampled tokens."""


@hookspec
def molt_register_replay_backends(register: Register) -> None:
    """Register MoE routing-replay (R3) backends: ``register(model_type, backend)``, a
    ``molt_plugins.moe.routing.ReplayBackend``: ``route(router, hidden_states [..., H],
    recorded [N, K] int64) -> (logits [N, E], weights [N, K], indices [N, K])`` and
    ``replay(model, routed_experts [B, T, L, K])``, a context manager (-1 rows: natural)."""


@hookspec
def molt_register_routing_tools(register: Register) -> None:
    """Register MoE routing tools (R3 record / replay / metrics): ``register(name, tool)``.

    The kernel asks one only for a model whose config declares experts
    (:func:`molt_core.models.declares_experts`); the first registered (by name) whose
    ``is_moe(model) -> bool`` holds serves it. A tool provides ``recorder(model)`` (engine:
    ``attach()``, ``clear()``, ``take() -> [N, L, K]`` int64 of the last forward's ``N``
    tokens, ``num_layers``, ``top_k``); ``collate(routed, T, where) -> [B, T, L, K]`` int64
    or None (ingress: per-row ``[T_b, L, K]`` lists or None, -1 padding; ValueError names the
    row); and the trainer's ``init_trainer(trainer, backend)`` (sets ``trainer.replay_backend``,
    may raise ValueError), ``forward(trainer, model, batch, rows, T)`` (a context manager
    around each policy forward), ``noreplay(trainer, batch) -> dict`` and ``metrics(trainer,
    batch, prox [B, T] float32, noreplay) -> dict[str, float]``."""


@hookspec
def molt_register_engines(register: Register) -> None:
    """Register rollout engines: ``register(name, factory)`` returning a ``RolloutEngine``;
    the factory is called with :func:`molt_core.runtime.workers.engine_kwargs` (``device`` among
    them when ``engine.num_gpus > 0``)."""


@hookspec
def molt_register_loggers(register: Register) -> None:
    """Register metric loggers: ``register(name, cls)``; ``cls(run_dir, config, **options)``
    has ``log(step: int, metrics: dict[str, float])`` and ``close()``. ``options`` is the
    recipe's ``[loggers.<name>]`` table (empty for the list form ``loggers = ["<name>"]``),
    validated first by ``cls.Options`` (a Pydantic model) when the class declares one. A logger
    may also have ``log_samples(step: int, rows: list[dict])``: decoded rollouts, each
    ``{"prompt": str, "completion": str, "reward": float | None, "status": str}``, for
    trackers that show tables."""


@hookspec
def molt_register_sandbox_backends(register: Register) -> None:
    """Register code-sandbox backends: ``register(name, backend)`` where ``backend`` (or a
    zero-argument class building it) implements ``molt_plugins.sandbox.SandboxBackend``:
    ``available()``, ``describe()`` and ``run(SandboxRequest) -> SandboxResult`` -- e.g. a
    client of a remote sandbox service. Selected by ``MOLT_SANDBOX_BACKEND=<name>``."""


@hookspec
def molt_register_weight_sync_transports(register: Register) -> None:
    """Register weight-sync transports: ``register(name, factory)``; ``factory()`` returns the
    transport used when ``engine.weight_sync`` resolves to ``name`` (``ray``, the object-store
    path, is built in). Group ranks: 0 is the trainer's rank 0, then each rollout worker's engine
    members in turn. The transport provides (each call blocks until every member is done):

    * ``free_address() -> (host, port)``: where rank 0 hosts the group;
    * ``sender(host, port, world_size, device, timeout_s) -> group``: rank 0 joins (``group.backend``: str);
    * ``send(group, state, version, dtype) -> int``: ``state`` name -> full tensor, floating-point
      ones cast to ``dtype`` (the engine's ``torch.dtype``); returns the bytes each receiver got;
    * ``receivers(engine) -> int``: members one engine adds;
    * ``join(engine, host, port, rank_offset, world_size, timeout_s) -> str``: the backend;
    * ``receive(engine, version) -> int``: loads ``version`` between decode steps; bytes received
      (raises ``ValueError`` when it refuses the sync, leaving the old weights in place).
    """


@hookspec
def molt_register_estimators(register: Register) -> None:
    """Register advantage estimators: ``register(name, fn)``, selected by ``algo.advantage``.

    ``fn`` takes tensors and numbers, by keyword, naming only those it uses (like a hookimpl):
    ``rewards`` ``[R]`` float32 (one per rollout), ``group_index`` ``[R]`` int64 (its prompt
    group), ``rollout_index`` ``[B]`` int64 (rollout of each row = segment), ``mask`` ``[B, T]``
    bool (sampled tokens); ``[B, T]`` float32 ``values`` (critic; naming it builds one),
    ``token_rewards`` (e.g. ``-kl_coef * kl``; naming it allows ``algo.kl_as_reward``),
    ``student_logprobs`` (the trainer's proximal logprobs) / ``teacher_logprobs`` (naming it
    needs a ``[teacher]``); the floats ``gamma``, ``lam``, ``eps`` (``algo.adv_eps``),
    ``std_tol``, ``coef`` (``algo.distill_coef``). A tensor named without a default is required. Naming
    ``group_index`` marks a group baseline (``rollout.n_samples_per_prompt >= 2``). Returns
    ``[R]`` (one advantage per rollout, broadcast to its sampled tokens), ``[B, T]``, or
    ``([B, T] advantages, [B, T] returns)``; float, 0 off ``mask``. The built-ins
    (:mod:`molt_core.algo.builtins`) register here too.
    """


@hookspec
def molt_register_losses(register: Register) -> None:
    """Register per-token policy losses: ``register(name, fn)``, selected by ``algo.loss``.

    ``fn`` takes, by keyword and naming only those it uses, ``logprobs`` ``[B, T]`` float
    (current policy, requires grad), ``proximal_logprobs`` and ``advantages`` ``[B, T]`` float
    (detached), ``mask`` ``[B, T]`` bool, and the floats ``clip_low``, ``clip_high``,
    ``dual_clip`` (None or > 1). Returns ``(loss [B, T], flags)`` with ``flags`` holding
    ``ratio`` ``[B, T]`` float and bool ``[B, T]`` ``clipped_low``, ``clipped_high`` (and
    optionally ``dual_clipped``). The trainer multiplies by the importance weights and takes
    the global token mean (:func:`molt_core.algo.losses.apply_policy_loss`).
    """


@hookspec
def molt_register_adapters(register: Register) -> None:
    """Register trainer adapters: ``register(name, adapter)``; ``[trainer.<name>]`` selects one
    (first party: ``lora``, :mod:`molt_plugins.lora`). The adapter provides, each taking the
    policy ``model`` (an ``nn.Module``):

    * ``wrap(model, options) -> nn.Module`` -- the policy the trainer trains (``options``: the
      ``[trainer.<name>]`` section); called once, before the optimizer sees the parameters;
    * ``reference(model) -> nn.Module`` -- the frozen KL reference (e.g. the adapter disabled);
    * ``merged_state_dict(model) -> dict[str, Tensor]`` -- plain weights under the base model's
      names, what engines load and ``model/`` of a checkpoint holds;
    * ``base_training(model)`` -- a context manager yielding ``(forward model, parameters)``
      the SFT warm start optimises;
    * ``save(model, d: Path)`` / ``load(model, d: Path)`` -- the adapter's checkpoint files in
      checkpoint directory ``d`` (``model/`` included); ``load`` raises ``FileNotFoundError``
      for a checkpoint it did not write.
    """


@hookspec
def molt_register_trainer_backends(register: Register) -> None:
    """Register data-parallel trainer backends: ``register(name, backend)``; ``fsdp2`` (first
    party, :mod:`molt_plugins.distributed`) runs ``trainer.world_size > 1``. The backend provides:

    * ``init_process_group(rank: int, world_size: int, init_method: str) -> str`` -- join the
      ranks' process group (``init_method``: a ``tcp://`` or ``file://`` rendezvous); returns
      the collective backend (``gloo`` / ``nccl``);
    * ``trainer(cfg: RunConfig) -> Trainer`` -- this rank's trainer (a ``Trainer`` subclass
      with ``rank``, ``world_size`` and ``backend``; its ``save_checkpoint`` writes the
      distributed checkpoint, every rank calling it);
    * ``load_checkpoint(trainer, d: Path)`` -- load the distributed checkpoint directory ``d``
      (``dcp/``) into any trainer, sharded at any world size or one plain ``Trainer``;
    * ``load_model(module, d: Path)`` / ``load_optimizer(module, optimizer, state: dict)`` -- a
      plain checkpoint's weight files / ``optimizer.state_dict()`` into a rank's sharded module.
    """


@hookspec
def molt_register_modalities(register: Register) -> None:
    """Register an input modality (images): ``register(name, modality)``; the kernel reaches
    images only through it (none registered: a text-only run, image parts and the ``[images]``
    section refused). The object provides (``molt_plugins.vision.modality.VisionModality``):
    ``error`` (the ValueError type of a refused image, with ``field``); ``decode_part(part,
    where, policy)`` -> ``.sha256`` (hex), ``.data`` (bytes) of an internal image part;
    ``is_model(model)``; ``processor_for(model, path, tokenizer)`` -> the model's processor or
    None, whose methods the ledger, ingress, trainer and SFT call (``expand(ids, shas, pool,
    offset)`` -> ``(ids, [ImageRef])``, ``extra_tokens(shas, pool)``, ``expand_placeholders(ids,
    images)``, ``check_segment(ids, refs, images)``, ``process(bytes)`` -> ``(pixels [n, D] float32,
    [t, h, w])``, ``padded_inputs(model, rows, width, device)`` -> ``position_ids [3, B, T]``,
    ``pixel_values``, ``image_grid_thw [N, 3]``); ``row_images(model, processor, ids, images,
    is_vision)`` and ``forward_kwargs(model, rows, spans, n, pos2d [B, n])`` for the embedded
    engine; ``rope_index(model)`` -> its ``get_rope_index`` (what a LoRA wrapper delegates to);
    ``wire_images(policy, processor)`` -> a request's collector (``openai_part``,
    ``anthropic_block``, ``responses_part``, ``remote``, ``check()``)."""


@hookspec
def molt_register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers of model families: ``register(name, parser_cls)``; the server
    (``create_app(tool_parser=NAME)``, ``molt serve --tool-parser NAME``) resolves a name once,
    building ``parser_cls.for_tokenizer(tokenizer)`` when the class defines it (how ``auto``
    picks one per model) else ``parser_cls()``, and hands the parser to every session's ledger
    (default with none named: Hermes over the ledger's ``tool_call_tags``, no lookup). First
    party, :mod:`molt_plugins.parsers`: ``hermes`` / ``qwen`` (Hermes, Qwen2.5, Qwen3),
    ``qwen3_coder``, ``llama3_json``, ``mistral``, ``auto``. The parser provides
    ``parse(text, start=0, tools=None) -> [ParsedCall(name, arguments: dict, span: (start,
    end))]`` (:class:`molt_core.ledger.toolcall.ToolParser`): every well-formed call in
    ``text[start:]`` of a turn's decoded body, in order, never raising on bad text; ``start`` is
    where the visible text begins (the ledger splits the reasoning first, with its
    ``think_tags``); ``tools`` the request's OpenAI-form schemas. The ledger removes each span
    from the visible content; a malformed block stays content."""


@hookspec
def molt_register_wires(register: Register) -> None:
    """Register a wire (an HTTP API dialect of the loopback server beside the kernel's OpenAI chat
    completions): ``register(name, wire)``; every registered wire is mounted on every server
    (none: its paths are a 404 naming the missing plugin). The object provides
    ``mount(server)``, called once per app with a ``molt_core.server.app.WireServer``: ``app``,
    ``tokenizer``, ``model_name``, ``route(path, method)`` (a decorator for ``async fn(sid,
    request)`` -> dict or Response), ``session_request(request, sid, Model)`` -> ``(session, req,
    body_bytes)`` (``session.ledger``; ``session.state``, a dict for the wire's per-session state),
    ``images()`` and ``checked(collector, body_bytes)``, ``params_of(temperature, top_p, top_k,
    seed, stop)``, ``run_turn(session, request, messages, tools, params, max_tokens,
    allow_tool_calls, body_bytes)`` -> ``AssistantTurn`` (the one turn, committed) and
    ``guarded(wire, handle)`` (errors in the wire's shape); ``paths`` (the session paths it
    serves, e.g. ``("/v1/messages",)``); optionally ``error_body(status, message, param, code)``
    -> dict (its error shape; default OpenAI's), ``owns(path)`` (a path whose framework errors take
    that shape) and ``server_error_type`` (the router's 5xx ``error.type``)."""


@hookspec
def molt_register_render_windows(register: Register) -> None:
    """Register a window prover for the ledger's extend check: ``register(name, prove)``, with
    ``prove(source, environment) -> (WindowProof | None, reason)``
    (:data:`molt_core.ledger.render.Prover`); the server and the Env loop hand the first by
    name to every ledger (none: every extend check renders the whole conversation). A proof
    must guarantee that a window render gives the full render's verdict and tail
    (:func:`molt_core.ledger.render.window_start` places the window). First party:
    :mod:`molt_plugins.render_window` (``jinja``)."""


@hookspec
def molt_register_builtin_models(register: Register) -> None:
    """Register a model that ``model.path = "builtin:NAME"`` builds: ``register(name, model)``
    with ``model.tokenizer()`` -> a Hugging Face tokenizer with a chat template;
    ``model.build(tokenizer)`` -> a float32 ``torch.nn.Module`` from a random init (called under
    the seeded RNG of ``load_model(seed=...)``; ``logits [B, T, V]`` from ``input_ids [B, T]``);
    ``model.vision`` -> bool (a vision-language model). The kernel's own: ``tiny-qwen3``,
    ``-moe``, ``-large``; first party: :mod:`molt_plugins.tiny_models` (``tiny-qwen3-bigvocab``,
    ``tiny-qwen2.5-vl``)."""


@hookspec(historic=True)
def molt_configure(config: Any) -> None:
    """Called once with the resolved ``RunConfig`` before any compute starts (historic:
    plugins registered later still receive it)."""


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
