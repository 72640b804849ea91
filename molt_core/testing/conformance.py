"""Plugin conformance checks: ``molt plugins --check`` and :func:`molt_core.testing.check_plugins`.

Each check is about one registered object (or one plugin's hooks) and gives a
:class:`Check` that passed, failed or was skipped with its reason:

* ``hook_returns`` -- every registration hookimpl returns ``None`` (it reports through
  ``register``; a returned value would be silently ignored by the host);
* ``name`` -- a registered name is usable as a recipe key (``[rewards.<name>]``): letters,
  digits, ``_``, ``-``, ``.``, starting with a letter or digit. Two plugins registering one
  name fail earlier, in :func:`molt_core.plugins.load_plugins` (``PluginError``);
* ``shape`` -- the object is what its hookspec says (:mod:`molt_core.hookspecs`): a reward is
  callable; an env is an ``Env`` / ``ChatAgent`` subclass or a factory; a judge has ``score``;
  a teacher has ``annotate``; a replay backend has ``route``, ``replay`` and a
  ``router_class``; a routing tool has ``is_moe``, ``recorder``, ``collate``, ``init_trainer``,
  ``forward``, ``noreplay`` and ``metrics``; an engine is callable; a logger has ``log`` and
  ``close``; a sandbox backend has ``available``, ``describe`` and ``run``; a modality has
  ``decode_part``, ``is_model``, ``processor_for``, ``row_images``, ``forward_kwargs`` and
  ``wire_images``;
* ``options`` -- when the object has ``Options``, it is a Pydantic model whose JSON schema
  builds and which validates ``{}`` (every field has a default) -- or, for fields that cannot
  have a sensible default, the object's ``molt_example["options"]`` validates;
* ``deterministic`` (rewards) -- two calls on one fixed input, made as the runtime makes them
  (:func:`molt_core.testing.score_reward`), give the same score. The input is
  ``molt_example`` (``{"response": ..., "task": {...}, "options": {...}}``) when the reward
  declares one, else :data:`PROBE`; a reward that cannot score the probe input the same way
  twice (it raised both times with the same error) is *skipped* with that error;
* ``eval_finite`` (envs) -- the env, built with its default (or example) options, yields a
  finite ``eval`` split of JSON-able dicts (at most :data:`MAX_EVAL_TASKS`) and a first
  ``train`` task.

A plugin opts into richer probing by setting ``molt_example`` on the registered object.
"""

from __future__ import annotations

import inspect
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from molt_core.hookspecs import REGISTRATION_HOOKS

__all__ = ["Check", "check_host", "PROBE", "MAX_EVAL_TASKS", "NAME_RE"]

PROBE: dict[str, Any] = {"response": "The answer is 42.", "responses": ["The answer is 42.", "41"],
                         "task": {"question": "What is 6 * 7?", "prompt": "What is 6 * 7?", "answer": "42"}}
"""The default reward input of the ``deterministic`` check."""

MAX_EVAL_TASKS = 100_000
"""An eval split longer than this counts as endless."""

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
"""What a registered name must match (usable as a TOML key path component)."""

_SHAPE: dict[str, tuple[str, ...]] = {
    "judges": ("score",),
    "teachers": ("annotate",),
    "replay_backends": ("route", "replay"),
    "routing_tools": ("is_moe", "recorder", "collate", "init_trainer", "forward", "noreplay", "metrics"),
    "loggers": ("log", "close"),
    "sandbox_backends": ("available", "describe", "run"),
    "modalities": ("decode_part", "is_model", "processor_for", "row_images", "forward_kwargs", "wire_images"),
    "tool_parsers": ("parse",),
    "wires": ("mount",),
}


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``status`` is ``ok``, ``fail`` or ``skip``; ``detail`` says why."""

    plugin: str
    kind: str
    name: str
    check: str
    status: Literal["ok", "fail", "skip"]
    detail: str = ""

    @property
    def ok(self) -> bool:
        """True unless the check failed (a skipped check is not a failure)."""
        return self.status != "fail"

    def as_dict(self) -> dict[str, str]:
        """JSON-ready: ``{plugin, kind, name, check, status, detail}``."""
        return {"plugin": self.plugin, "kind": self.kind, "name": self.name, "check": self.check,
                "status": self.status, "detail": self.detail}

    def __str__(self) -> str:
        where = f"{self.kind}/{self.name}" if self.name else "hooks"
        return f"{self.status.upper():4} {self.plugin} {where}: {self.check}" + (f" -- {self.detail}" if self.detail else "")


def _example(obj: Any) -> dict[str, Any]:
    ex = getattr(obj, "molt_example", None)
    return dict(ex) if isinstance(ex, dict) else {}


def _check_options(obj: Any) -> tuple[str, str, dict[str, Any]]:
    """``(status, detail, options to build / call with)`` of the ``options`` check."""
    from pydantic import BaseModel, ValidationError

    model = getattr(obj, "Options", None)
    example = _example(obj).get("options")
    if model is None:
        return "skip", "no Options model (options are not validated or listed)", dict(example or {})
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return "fail", f"Options is {model!r}, not a pydantic BaseModel subclass", {}
    try:
        model.model_json_schema()
    except Exception as e:  # a field type without a JSON schema
        return "fail", f"Options has no JSON schema: {type(e).__name__}: {e}", {}
    try:
        model.model_validate({})
        return "ok", "", dict(example or {})
    except ValidationError as e:
        missing = sorted(".".join(map(str, x["loc"])) for x in e.errors())
    if example is None:
        return "fail", (f"Options field(s) {', '.join(missing)} have no default; give defaults, or set "
                        f"molt_example = {{'options': {{...}}}} on the registered object"), {}
    try:
        model.model_validate(example)
    except ValidationError as e:
        return "fail", f"molt_example['options'] does not validate: {e.errors()[0]['msg']} at {e.errors()[0]['loc']}", {}
    return "ok", f"required field(s) {', '.join(missing)} given by molt_example", dict(example)


def _check_reward(obj: Any, name: str, options: dict[str, Any]) -> tuple[str, str]:
    from molt_core.testing.reward_probe import RewardCallFailed, score_reward
    from molt_core.rewards import reward_spec

    ex = _example(obj)
    is_group = reward_spec(name, obj, options).group  # the runtime's own calling-convention decision
    resp = ex.get("responses" if is_group else "response", PROBE["responses" if is_group else "response"])
    task = ex.get("task", PROBE["task"])
    outs = []
    for _ in range(2):
        try:
            outs.append(("ok", score_reward(obj, resp, task, name=name, timeout_s=30, **options)))
        except RewardCallFailed as e:
            outs.append(("failed", e.error))
        except Exception as e:  # bad options etc.: reported as the reward's error
            outs.append(("failed", f"{type(e).__name__}: {e}"))
    (k1, v1), (k2, v2) = outs
    if k1 == k2 == "ok":
        return ("ok", f"{v1}") if v1 == v2 else ("fail", f"two calls on one input scored {v1} then {v2}")
    if k1 == k2 == "failed" and v1 == v2:
        return "skip", f"cannot score the probe input (set molt_example): {v1}"
    return "fail", f"two calls on one input gave {k1} {v1!r:.120} then {k2} {v2!r:.120}"


def _check_env(obj: Any, options: dict[str, Any]) -> tuple[str, str]:
    from molt_core.agents import ChatAgent, Env, make_agent

    try:
        agent = make_agent(obj, options)
    except Exception as e:
        return "fail", f"cannot build it with its default options: {type(e).__name__}: {e}"
    if not isinstance(agent, (Env, ChatAgent)):
        return "fail", f"built a {type(agent).__name__}, not an Env or ChatAgent"
    seed = int(_example(obj).get("seed", 0))
    try:
        ev = list(itertools.islice(agent.tasks("eval", seed), MAX_EVAL_TASKS + 1))
        first_train = next(iter(agent.tasks("train", seed)), None)
    except NotImplementedError as e:
        return "skip", str(e)
    except Exception as e:
        return "fail", f"tasks() raised {type(e).__name__}: {e}"
    if len(ev) > MAX_EVAL_TASKS:
        return "fail", f"the eval split yields more than {MAX_EVAL_TASKS} tasks (it must be finite)"
    for t in ev[:1000] + ([first_train] if first_train is not None else []):
        if not isinstance(t, dict):
            return "fail", f"a task is a {type(t).__name__}, not a dict"
        try:
            json.dumps(t)
        except (TypeError, ValueError) as e:
            return "fail", f"a task is not JSON-able: {e}"
    if first_train is None:
        return "fail", "the train split is empty"
    return "ok", f"{len(ev)} eval tasks"


def _shape(kind: str, obj: Any) -> tuple[str, str]:
    if kind == "envs":
        from molt_core.agents import ChatAgent, Env

        if isinstance(obj, type):
            ok = issubclass(obj, (Env, ChatAgent))
            return ("ok", "") if ok else ("fail", f"{obj.__name__} is not an Env or ChatAgent subclass")
        return ("ok", "factory") if callable(obj) else ("fail", f"{type(obj).__name__} is not callable")
    if kind in ("rewards", "engines"):
        return ("ok", "") if callable(obj) else ("fail", f"{type(obj).__name__} is not callable")
    if kind in ("estimators", "losses"):  # a signature the trainer can fill (hookspecs: calling convention)
        from molt_core.algo.advantages import estimator_params  # torch: not when pytest loads the kit
        from molt_core.algo.losses import loss_params

        try:
            (estimator_params if kind == "estimators" else loss_params)(obj)
        except (TypeError, ValueError) as e:
            return "fail", str(e)
        return "ok", ""
    need = _SHAPE.get(kind, ())
    lacking = [a for a in need if not callable(getattr(obj, a, None))]
    if kind == "replay_backends" and not lacking and not (isinstance(getattr(obj, "router_class", None), str)
                                                             and obj.router_class):
        return "fail", "router_class is not a non-empty str"
    return ("fail", f"lacks {', '.join(lacking)}") if lacking else ("ok", "")


def check_host(host: Any) -> list[Check]:
    """Run every check over the plugins of ``host`` (a loaded :class:`~molt_core.plugins.PluginHost`).

    Returns:
        The checks in plugin, kind, name order. Never raises for a plugin's fault: a
        crashing check is a failed :class:`Check` naming the exception.
    """
    out: list[Check] = []
    for kind, hook_name in REGISTRATION_HOOKS.items():  # hook_returns: call each impl with a recorder
        for impl in getattr(host.pm.hook, hook_name).get_hookimpls():
            if impl.plugin_name in host.kernel:  # molt's own built-ins: tested with molt
                continue
            seen: list[str] = []
            try:
                ret = impl.function(**{a: (lambda n, o, _s=seen: _s.append(n)) for a in impl.argnames})
            except Exception as e:
                out.append(Check(impl.plugin_name, kind, "", "hook_returns", "fail",
                                 f"{hook_name} raised {type(e).__name__}: {e}"))
                continue
            if inspect.isawaitable(ret):
                ret.close()  # type: ignore[union-attr]
            status, detail = ("ok", f"{hook_name}: {len(seen)} registered") if ret is None else \
                ("fail", f"{hook_name} returned {type(ret).__name__} (use the register callback; return None)")
            out.append(Check(impl.plugin_name, kind, "", "hook_returns", status, detail))
    for kind, regs in host.plugin_registries().items():
        for name, reg in sorted(regs.items()):
            obj, plugin = reg.obj, reg.plugin

            def add(check: str, status: str, detail: str = "") -> None:
                out.append(Check(plugin, kind, name, check, status, detail))  # type: ignore[arg-type]

            add("name", "ok" if NAME_RE.match(name) else "fail",
                "" if NAME_RE.match(name) else f"{name!r} must match {NAME_RE.pattern}")
            try:
                add("shape", *_shape(kind, obj))
                if kind in ("estimators", "losses"):  # numbers come from [algo], not per-plugin options
                    continue
                st, detail, options = _check_options(obj)
                add("options", st, detail)
                if kind == "rewards":
                    add("deterministic",
                        *(_check_reward(obj, name, options) if st != "fail" else ("skip", "options invalid")))
                elif kind == "envs":
                    add("eval_finite", *(_check_env(obj, options) if st != "fail" else ("skip", "options invalid")))
            except Exception as e:  # a check must not crash the report
                add("crashed", "fail", f"{type(e).__name__}: {e}")
    out.sort(key=lambda c: (c.plugin, c.kind, c.name))
    return out
