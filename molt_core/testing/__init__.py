"""Test helpers for plugin authors: engines, an episode runner, a reward harness, a server.

Everything here runs on CPU in milliseconds to seconds, offline, and is what molt-sdk's own
tests use. ``pip install molt-sdk`` also registers this module as a pytest plugin (entry point
``pytest11``), so a plugin's tests get these fixtures with no conftest:

* ``molt_tokenizer`` -- the builtin tiny Qwen3 tokenizer (session scope);
* ``molt_scripted_engine`` -- a factory: ``molt_scripted_engine(["reply", ...])`` ->
  :class:`ScriptedEngine` over ``molt_tokenizer``;
* ``molt_tiny_engine`` -- a real :class:`~molt_core.engines.transformers_engine.TransformersEngine`
  on the builtin ``tiny-qwen3`` model (random weights, seeded; session scope);
* ``molt_loopback`` -- a factory: ``molt_loopback(engine)`` -> a started loopback server
  (:func:`molt_core.server.start_server`), stopped at teardown;
* ``molt_run_episode`` / ``molt_score_reward`` -- :func:`run_episode` / :func:`score_reward`.

Helpers (plain functions, usable without pytest):

* :class:`ScriptedEngine` (and :class:`EchoEngine`, :class:`FailingEngine`) -- the
  ``RolloutEngine`` protocol with predetermined replies and logprobs;
* :func:`tiny_tokenizer`, :func:`tiny_engine` -- the builtin tiny model;
* :func:`run_episode` -- one Env or ChatAgent episode through the runtime's own rollout code
  (ledger, loopback server, reward scoring), under a scripted policy;
* :func:`score_reward` -- call a registered reward exactly as the runtime does (sync or async,
  per response or per group, with the whole rollout when it asks for it, ``weight`` and
  ``timeout_s`` honoured), returning its scores or raising :class:`RewardCallFailed`;
* :func:`check_plugins` -- the conformance checks of ``molt plugins --check``
  (:mod:`molt_core.testing.conformance`).

This module imports no plugin (``molt_plugins``) at import time; heavy imports (torch,
transformers, the runtime) happen inside the helpers that need them.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Callable, Iterator, Literal, Sequence

from molt_core.identity import digest_ids
from molt_core.testing.reward_probe import RewardCallFailed, score_reward
from molt_core.types import GenerationOutput, Group, SamplingParams

__all__ = ["ScriptedEngine", "EchoEngine", "FailingEngine", "tiny_tokenizer", "tiny_engine", "loopback_server",
           "run_episode", "RewardCallFailed", "score_reward", "check_plugins", "TINY_MODEL"]

TINY_MODEL = "builtin:tiny-qwen3"
"""The builtin ~1M-parameter Qwen3 (random weights, seeded) shipped with molt-sdk."""


# --------------------------------------------------------------------------- engines
class ScriptedEngine:
    """A ``RolloutEngine`` that returns the next scripted reply per call.

    A reply is a list of ids (returned as is, finish ``stop`` if an id is a stop id), a str
    (the *model's* text, encoded once here as if sampled, then the stop id appended) or a
    ready :class:`~molt_core.engines.base.GenerationOutput`. When the script runs out, the
    reply is ``"ok"``. Logprob of the j-th sampled token of call c (0-based):
    ``-(c + 1) / 10 - j / 1000``; version ``self.version`` (set by ``load_weights``). Stop
    strings cut after the token completing one; ``max_tokens`` cuts with finish ``length``
    (a stop id or string past the first ``max_tokens`` ids is never reached, as in a real engine).
    ``prompts`` / ``params`` / ``images`` record every call (``images``: the encoded image
    bytes passed with the prompt, ``[]`` for none). Like a real engine it attaches the digest
    of the ids it returns (``sampled_digest``, token identity).

    Args:
        tokenizer: the tokenizer of the run (e.g. :func:`tiny_tokenizer`).
        replies: the script, in call order.
        stop_id: the id appended to text replies (default ``tokenizer.eos_token_id``).
    """

    def __init__(self, tokenizer: Any, replies: Sequence[Any] | None = None, stop_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.version = 0
        self.replies = list(replies or [])
        self.stop_id = tokenizer.eos_token_id if stop_id is None else stop_id
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self.images: list[list[bytes]] = []
        self.calls = 0

    def output(self, reply: Any, params: SamplingParams, prompt_len: int) -> GenerationOutput:
        """The :class:`GenerationOutput` of ``reply`` under ``params`` for call ``self.calls``."""
        if isinstance(reply, GenerationOutput):
            return reply
        if isinstance(reply, str):
            ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.stop_id]
        else:
            ids = list(reply)
        ids = ids[: params.max_tokens]  # a real engine samples at most max_tokens: a stop after them is never reached
        finish: Literal["stop", "length"] = "length"
        reason: int | str | None = None
        stops = set(params.stop_token_ids) | {self.stop_id}
        for j, t in enumerate(ids):
            if t in stops:
                ids, finish, reason = ids[: j + 1], "stop", t
                break
        for j in range(len(ids)):  # stop strings: cut after the token that completes one
            text = self.tokenizer.decode(ids[: j + 1])
            hit = next((s for s in params.stop if s in text), None)
            if hit is not None:
                ids, finish, reason = ids[: j + 1], "stop", hit
                break
        c = self.calls
        return GenerationOutput(token_ids=ids, logprobs=[-(c + 1) / 10 - j / 1000 for j in range(len(ids))],
                                versions=[self.version] * len(ids), finish_reason=finish, stop_reason=reason,
                                prompt_len=prompt_len, sampled_digest=digest_ids(ids))

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       images: list[bytes] | None = None) -> GenerationOutput:
        """Record the call and return the next scripted reply (``"ok"`` once the script is spent)."""
        await asyncio.sleep(0)
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        self.images.append(list(images or []))
        reply = self.replies.pop(0) if self.replies else "ok"
        out = self.output(reply, params, len(prompt_ids))
        self.calls += 1
        return out

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Ignore the weights; later tokens carry ``version``."""
        self.version = version


class EchoEngine(ScriptedEngine):
    """Deterministic per-prompt replies for load tests: the reply is ``"len <P> sum <S>"``
    (prompt length, sum of prompt ids mod 9973), so mixed-up sessions are detectable."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       images: list[bytes] | None = None) -> GenerationOutput:
        """The echo reply of ``prompt_ids``."""
        await asyncio.sleep(0.001)
        text = f"len {len(prompt_ids)} sum {sum(prompt_ids) % 9973}"
        out = self.output(text, params, len(prompt_ids))
        self.calls += 1
        return out


class FailingEngine(ScriptedEngine):
    """Raises ``RuntimeError("engine exploded")`` on every call (a failing request must
    append nothing to a session)."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       images: list[bytes] | None = None) -> GenerationOutput:
        """Always raises ``RuntimeError``."""
        raise RuntimeError("engine exploded")


def tiny_tokenizer() -> Any:
    """The tokenizer of :data:`TINY_MODEL` (a Qwen3 chat template; loads offline)."""
    from molt_core.models import load_tokenizer

    return load_tokenizer(TINY_MODEL)


def tiny_engine(seed: int = 0, max_batch_size: int = 16, model_seed: int = 0) -> Any:
    """A real :class:`~molt_core.engines.transformers_engine.TransformersEngine` on
    :data:`TINY_MODEL` (CPU, float32): random weights from ``model_seed``, sampling RNG from
    ``seed``. Loads in about a second; its replies are gibberish but token-exact."""
    from molt_core.engines.transformers_engine import TransformersEngine

    return TransformersEngine(TINY_MODEL, max_batch_size=max_batch_size, seed=seed, model_seed=model_seed)


@contextlib.contextmanager
def loopback_server(engine: Any, tokenizer: Any | None = None, **kwargs: Any) -> Iterator[Any]:
    """Serve ``engine`` on 127.0.0.1 (a free port) for the duration of the ``with`` block.

    Yields the :class:`~molt_core.server.app.ServerHandle`: ``handle.create_session()`` gives
    ``openai_base_url`` / ``anthropic_base_url`` / ``api_key`` for a stock SDK, and
    ``handle.close_session(id)`` the session's token-exact ``Trajectory``. ``kwargs`` go to
    :func:`molt_core.server.start_server`.
    """
    from molt_core.server.app import start_server

    handle = start_server(engine, tokenizer if tokenizer is not None else engine.tokenizer, **kwargs)
    try:
        yield handle
    finally:
        handle.stop()


# --------------------------------------------------------------------------- episodes
def _worker(agent: Any, engine: Any, rewards: dict[str, dict[str, Any]], lookup: Callable[[str], Any] | None,
            rollout: dict[str, Any], chat_template_kwargs: dict[str, Any]) -> Any:
    """A :class:`molt_core.runtime.RolloutWorker` around an existing agent and engine (no
    plugin loading, no model loading): the runtime's own episode, ledger and reward code."""
    from molt_core.config import RunConfig
    from molt_core.ledger import Ledger
    from molt_core.rollout.scoring import RewardRunner
    from molt_core.runtime import RolloutWorker

    cfg = RunConfig.model_validate({"agent": {"name": "molt_testing"}, "rollout": rollout,
                                    "model": {"chat_template_kwargs": chat_template_kwargs}})
    if lookup is None and rewards:
        from molt_core.plugins import load_plugins

        host = load_plugins()
        lookup = lambda name: host.get("rewards", name)  # noqa: E731
    return RolloutWorker.from_parts(cfg, agent, engine, rewards, lookup or (lambda n: None))


def run_episode(agent: Any, task: dict[str, Any], replies: Sequence[Any] | None = None, *, engine: Any = None,
                n: int = 1, rewards: dict[str, dict[str, Any]] | None = None,
                reward_lookup: Callable[[str], Any] | None = None, max_turns: int = 4, max_tokens: int = 64,
                chat_template_kwargs: dict[str, Any] | None = None, **rollout: Any) -> Group:
    """Run ``n`` episodes of ``agent`` (an ``Env`` or ``ChatAgent`` instance) on ``task``
    under a scripted policy, exactly as a rollout worker of ``molt run`` does.

    The policy is a :class:`ScriptedEngine` over :func:`tiny_tokenizer` replaying ``replies``
    in call order (shared by the ``n`` episodes), unless ``engine`` is given (e.g.
    :func:`tiny_engine`). An Env's ``reset``/``step`` run turn by turn through the ledger;
    a ChatAgent talks to a loopback server started for the call. The finished group is
    scored by ``rewards`` (a recipe's ``rewards`` table: ``{name: {option: value, "weight":
    w}}``), looked up with ``reward_lookup(name)`` or, by default, among the installed
    plugins.

    Call it from synchronous code (it runs its own event loop with ``asyncio.run``).

    Args:
        max_turns / max_tokens / rollout: fields of the recipe's ``[rollout]`` table.

    Returns:
        The :class:`~molt_core.types.Group`; each trajectory has ``status`` ``ok`` (with
        ``reward``, ``score``, ``info["rewards"]``, ``segments``) or ``failed`` with the
        ``error`` the run would log (an agent that raises does not raise here).

    Raises:
        ValueError / KeyError: invalid rollout fields or an unknown reward name.
    """
    if engine is None:
        engine = ScriptedEngine(tiny_tokenizer(), replies)
    elif replies:
        raise ValueError("give replies (a scripted policy) or engine, not both")
    w = _worker(agent, engine, dict(rewards or {}), reward_lookup,
                {"max_turns": max_turns, "max_tokens": max_tokens, **rollout}, dict(chat_template_kwargs or {}))
    try:
        (group,) = asyncio.run(w.rollout([task], n))
    finally:
        if w.server is not None:
            w.server.stop()
    return group


# --------------------------------------------------------------------------- plugin checks
def check_plugins(local: Sequence[str] = (), entry_points: bool = True, names: Sequence[str] = ()) -> None:
    """Run the conformance checks of ``molt plugins --check`` (:mod:`molt_core.testing.conformance`)
    over the installed plugins plus ``local`` ``--plugin`` specs; pass in a test with::

        from molt_core.testing import check_plugins
        def test_conformance():
            check_plugins(names=["my_plugin"])

    Args:
        names: check only these plugins (entry-point names or ``--plugin`` specs); all when empty.

    Raises:
        AssertionError: listing every failed check (``plugin kind name: problem``).
        molt_core.plugins.PluginError: a plugin fails to load or two names clash.
    """
    from molt_core.testing.conformance import check_host
    from molt_core.plugins import load_plugins

    host = load_plugins(list(local), entry_points=entry_points)
    problems = [p for p in check_host(host) if not p.ok and (not names or p.plugin in names)]
    if problems:
        raise AssertionError("plugin conformance failed:\n" + "\n".join(f"  {p}" for p in problems))


# --------------------------------------------------------------------------- pytest fixtures
try:
    import pytest
except ImportError:  # pragma: no cover -- pytest is only needed for the fixtures
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(scope="session")
    def molt_tokenizer() -> Any:
        """The builtin tiny Qwen3 tokenizer (:func:`tiny_tokenizer`)."""
        return tiny_tokenizer()

    @pytest.fixture
    def molt_scripted_engine(molt_tokenizer: Any) -> Callable[..., ScriptedEngine]:
        """Factory ``(replies, stop_id=None) -> ScriptedEngine`` over ``molt_tokenizer``."""
        return lambda replies=(), stop_id=None: ScriptedEngine(molt_tokenizer, replies, stop_id=stop_id)

    @pytest.fixture(scope="session")
    def molt_tiny_engine() -> Any:
        """A real transformers engine on the builtin tiny model (:func:`tiny_engine`)."""
        eng = tiny_engine()
        yield eng
        close = getattr(eng, "close", None)
        if close is not None:
            close()

    @pytest.fixture
    def molt_loopback() -> Iterator[Callable[..., Any]]:
        """Factory ``(engine, **kwargs) -> ServerHandle`` (:func:`loopback_server`); every
        server it started is stopped at teardown."""
        stack = contextlib.ExitStack()
        with stack:
            yield lambda engine, **kw: stack.enter_context(loopback_server(engine, **kw))

    @pytest.fixture
    def molt_run_episode() -> Callable[..., Group]:
        """:func:`run_episode`."""
        return run_episode

    @pytest.fixture
    def molt_score_reward() -> Callable[..., Any]:
        """:func:`score_reward`."""
        return score_reward
