"""``reasoning_gym`` env: any reasoning-gym task, scored by the task's own ``score_answer``.

reasoning-gym (Apache-2.0, https://github.com/open-thought/reasoning-gym) ships 100+
procedural task generators; each item is ``{"question", "answer", "metadata"}`` built from
``random.Random(dataset_seed + index)``, and each dataset has a ``score_answer(answer, entry)``
verifier returning a float in [0, 1]. This env exposes one task by name with its config.

Splits. ``train`` draws indices ``0..size-1`` of the dataset seeded ``seed``; ``eval`` draws
``0..eval_size-1`` of the dataset seeded ``seed + EVAL_SEED_OFFSET``, so the two splits use
disjoint generator seeds. Procedural tasks with a small problem space can still repeat a
question by chance, so every train item whose prompt is also an eval prompt is skipped:
the splits are disjoint by construction (``tests/test_env_reasoning_gym.py`` checks it).

The ``gsm_symbolic`` task is refused: its upstream templates are CC BY-NC-ND.
"""

from __future__ import annotations

import json
import random
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field

from molt_core.agents import EpisodeState, Env
from molt_core.types import Result, RewardFailed
from molt_plugins.envs.dataset import strip_end_markers

__all__ = ["ReasoningGymEnv", "ReasoningGymOptions", "EVAL_SEED_OFFSET", "REFUSED_TASKS"]

#: Added to ``seed`` for the eval split's generator seed (train seeds are ``seed + index``
#: with ``index < size``; ``size`` is capped below this offset, so the ranges never meet).
EVAL_SEED_OFFSET = 1_000_000_007

#: Tasks this env refuses, with the reason.
REFUSED_TASKS = {
    "gsm_symbolic": "its upstream templates (Apple's GSM-Symbolic) are licensed CC BY-NC-ND, "
    "which molt-sdk does not ship; choose another arithmetic task, e.g. 'basic_arithmetic' or 'chain_sum'",
}


class ReasoningGymOptions(BaseModel):
    """Options of the ``reasoning_gym`` env (the recipe's ``[agent.options]``).

    * ``task`` -- reasoning-gym dataset name (``basic_arithmetic``, ``chain_sum``, ...).
    * ``config`` -- keyword arguments of that dataset's config dataclass (``seed`` and
      ``size`` are set by this env; don't put them here).
    * ``seed`` -- base generator seed; None uses the ``seed`` passed to ``tasks``.
    * ``size`` -- number of train problems (one epoch; the train iterator cycles,
      reshuffling each epoch), ``eval_size`` -- number of held-out problems.
    * ``prompt_template`` -- ``str.format`` template of the user message with the item's
      fields, e.g. ``"What is {metadata[expression]}?"``; None sends the task's question.
    * ``system_prompt`` -- optional system message.
    * ``strip_suffixes`` -- end markers removed from the reply (after whitespace stripping)
      before scoring, e.g. a chat template's ``<|im_end|>`` if the engine returns it.
    * ``answer_tag`` -- when set (e.g. ``"answer"``), score only the text inside the last
      ``<answer>...</answer>`` of the reply (reasoning-gym's ``extract_answer``); a reply
      without the tag scores 0.
    * ``binary`` -- reward 1.0 when ``score_answer`` gives 1.0, else 0.0 (reasoning-gym's
      default scorer gives partial credit ``len(gold)/len(reply)`` when the gold answer is a
      substring of the reply, e.g. 0.75 for ``"1101"`` against ``"110"``); ``score`` keeps
      the raw value either way.
    * ``reward_weight`` -- the env's reward is ``reward_weight * score`` (0 leaves the reward
      to ``[rewards.*]`` plugins while ``score`` still drives eval pass@k).
    """

    model_config = ConfigDict(extra="forbid")

    task: str
    config: dict[str, Any] = Field(default_factory=dict)
    seed: int | None = Field(None, ge=0)
    size: int = Field(10_000, ge=1, lt=EVAL_SEED_OFFSET)
    eval_size: int = Field(256, ge=1)
    prompt_template: str | None = None
    system_prompt: str | None = None
    strip_suffixes: list[str] = Field(default_factory=lambda: ["<|im_end|>", "<|endoftext|>"])
    answer_tag: str | None = None
    binary: bool = False
    reward_weight: float = 1.0


def _jsonable(x: Any) -> Any:
    """``x`` converted to plain JSON types (tuples/sets -> lists, other objects -> str)."""
    return json.loads(json.dumps(x, default=lambda o: sorted(o, key=repr) if isinstance(o, (set, frozenset)) else str(o)))


class ReasoningGymEnv(Env):
    """Single-turn env over one reasoning-gym task.

    ``tasks(split, seed)`` yields ``{"question", "answer", "metadata", "rg"}`` dicts (plain
    JSON; ``question`` is the rendered prompt, ``rg`` locates the source item as
    ``{"task", "seed", "index", "question"}``). ``step`` scores the reply with the dataset's
    ``score_answer`` on the *original* item (regenerated from ``rg``, so metadata that is not
    JSON survives); ``reward == score`` in [0, 1], ``terminated`` is True.

    Raises (at construction):
        ValueError: the task is refused (``gsm_symbolic``), unknown (lists close names),
            or its config is invalid (the dataset's own message).
    """

    Options = ReasoningGymOptions
    molt_example = {"options": {"task": "basic_arithmetic", "size": 16, "eval_size": 4}}
    """Options for ``molt plugins --check`` (``task`` has no default)."""
    molt_requires: tuple[str, ...] = ("reasoning_gym",)
    """``molt plugins`` (and a failed import) name the extra that installs reasoning-gym."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o: ReasoningGymOptions = self.options
        if o.task in REFUSED_TASKS:
            raise ValueError(f"agent.options.task = {o.task!r} is refused: {REFUSED_TASKS[o.task]}")
        bad = sorted({"seed", "size"} & set(o.config if isinstance(o.config, dict) else ()))
        if bad:
            raise ValueError(
                f"agent.options.config sets {', '.join(bad)}; set agent.options.seed / agent.options.size instead"
            )
        self._check_task()
        self.system_prompt = o.system_prompt or None
        self._datasets: dict[tuple[int, int], Any] = {}
        self._dataset(0, 1)  # validate the config now, not at the first rollout

    def _check_task(self) -> None:
        """Import reasoning-gym and check that ``options.task`` is one of its datasets.

        Raises:
            ValueError: an unknown task (the message lists close names).
        """
        o = self.options
        import reasoning_gym  # noqa: F401  (registers every dataset)
        from reasoning_gym.factory import DATASETS

        if o.task not in DATASETS:
            import difflib

            close = difflib.get_close_matches(o.task, list(DATASETS), n=3)
            hint = f"did you mean {', '.join(map(repr, close))}?" if close else f"known: {', '.join(sorted(DATASETS))}"
            raise ValueError(f"agent.options.task = {o.task!r} is not a reasoning-gym task; {hint}")

    # -- datasets ------------------------------------------------------------------------
    def _create(self, seed: int, size: int) -> Any:
        """The task's dataset for generator seed ``seed`` and ``size`` items: indexable (item
        ``i`` is a ``{"question", "answer", "metadata"}`` dict) with ``score_answer(reply, item)``."""
        from reasoning_gym import create_dataset

        return create_dataset(self.options.task, **self.options.config, seed=seed, size=size)

    def _dataset(self, seed: int, size: int) -> Any:
        key = (seed, size)
        if key not in self._datasets:
            try:
                self._datasets[key] = self._create(seed, size)
            except (TypeError, AssertionError, ValueError) as e:
                raise ValueError(
                    f"agent.options.config is invalid for reasoning-gym task {self.options.task!r}: "
                    f"{type(e).__name__}: {e}"
                ) from None
        return self._datasets[key]

    def _render(self, item: dict[str, Any]) -> str:
        t = self.options.prompt_template
        if t is None:
            return str(item["question"])
        try:
            return t.format(**item)
        except (KeyError, IndexError, AttributeError) as e:
            raise ValueError(
                f"agent.options.prompt_template {t!r} refers to a missing field ({e!r}); "
                f"available: {sorted(item)} and metadata keys {sorted(item.get('metadata', {}))}"
            ) from None

    def _task(self, seed: int, size: int, index: int) -> dict[str, Any]:
        item = self._dataset(seed, size)[index]
        return {
            "question": self._render(item),
            "answer": str(item["answer"]) if item.get("answer") is not None else None,
            "metadata": _jsonable(item.get("metadata", {})),
            "rg": {"task": self.options.task, "seed": seed, "size": size, "index": index, "question": item["question"]},
        }

    def _base_seed(self, seed: int) -> int:
        return self.options.seed if self.options.seed is not None else seed

    def eval_tasks(self, seed: int) -> list[dict[str, Any]]:
        """The held-out split: ``eval_size`` tasks from generator seed ``seed + EVAL_SEED_OFFSET``."""
        s = self._base_seed(seed) + EVAL_SEED_OFFSET
        return [self._task(s, self.options.eval_size, i) for i in range(self.options.eval_size)]

    def tasks(self, split: str, seed: int) -> Iterator[dict[str, Any]]:
        """Yield task dicts of ``split``.

        ``"train"``: endless; each epoch is a fresh permutation (``random.Random(seed+epoch)``)
        of indices ``0..size-1``, skipping any item whose prompt is an eval prompt.
        ``"eval"``: the ``eval_size`` held-out tasks, in order, once.

        Raises:
            ValueError: unknown split, or every train item collides with the eval split.
        """
        if split == "eval":
            yield from self.eval_tasks(seed)
            return
        if split != "train":
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        base = self._base_seed(seed)
        held_out = {t["question"] for t in self.eval_tasks(seed)}
        size = self.options.size
        epoch = 0
        while True:
            order = list(range(size))
            random.Random(base + epoch).shuffle(order)
            yielded = 0
            for i in order:
                t = self._task(base, size, i)
                if t["question"] in held_out:
                    continue
                yielded += 1
                yield t
            if yielded == 0:
                raise ValueError(
                    f"every one of the {size} train problems of {self.options.task!r} is also an eval problem; "
                    f"lower agent.options.eval_size or widen the task config"
                )
            epoch += 1

    # -- episode -------------------------------------------------------------------------
    def reset(self, task: dict[str, Any]) -> str:
        """The user message: the task's rendered ``question``."""
        return str(task["question"])

    def _entry(self, task: dict[str, Any]) -> dict[str, Any]:
        """The original reasoning-gym item for ``task`` (regenerated when ``rg`` locates it
        and matches), else the task's own fields."""
        rg = task.get("rg")
        if isinstance(rg, dict) and rg.get("task") == self.options.task:
            try:
                item = self._dataset(int(rg["seed"]), int(rg["size"]))[int(rg["index"])]
            except (KeyError, TypeError, ValueError, IndexError):
                item = None
            if item is not None and item.get("question") == rg.get("question") and str(item.get("answer")) == str(task.get("answer")):
                return item
        return {"question": (rg or {}).get("question", task.get("question")), "answer": task.get("answer"), "metadata": task.get("metadata", {})}

    def clean_reply(self, action_text: str) -> str | None:
        """The reply as scored: whitespace-stripped, end markers removed, and (with
        ``answer_tag``) the content of the last tag, or None when the tag is absent."""
        s = strip_end_markers(action_text, self.options.strip_suffixes)
        if self.options.answer_tag:
            from reasoning_gym.utils import extract_answer

            return extract_answer(s, tag_name=self.options.answer_tag)
        return s

    def score(self, action_text: str, task: dict[str, Any]) -> float:
        """``score_answer(clean_reply(action_text), entry)`` of the task's dataset, in [0, 1].

        Raises:
            RewardFailed: reason ``crash`` when the dataset's scorer raises.
        """
        entry = self._entry(task)
        ds = self._dataset(*(
            (int(task["rg"]["seed"]), int(task["rg"]["size"])) if isinstance(task.get("rg"), dict) else (0, 1)
        ))
        try:
            return float(ds.score_answer(self.clean_reply(action_text), entry))
        except Exception as e:  # the task's own verifier crashed: not a 0.0, a failure
            raise RewardFailed("crash", f"{self.options.task}.score_answer raised {type(e).__name__}: {e}") from e

    def step(self, action_text: str, state: EpisodeState) -> Result:
        """Score the single reply; the episode ends (``terminated=True``). ``reward`` is
        ``reward_weight`` times the score (or its 0/1 form with ``binary``)."""
        s = self.score(action_text, state.task)
        r = self.options.reward_weight * ((1.0 if s == 1.0 else 0.0) if self.options.binary else s)
        return Result(reward=r, score=s, terminated=True, info={"task": self.options.task})
