"""A ChatAgent that shows the model an image through the stock OpenAI SDK.

The agent owns its loop exactly as it would against any OpenAI-compatible vision endpoint: it
draws the ``visual`` env's image (count the white squares), sends it as an ``image_url`` part
with a ``data:image/png;base64,...`` URL next to the question, and scores the reply. molt-sdk's
loopback server expands the image into the model's run of ``<|image_pad|>`` tokens and records
the turn token-exactly, with the image stored once in the trajectory (docs/vision.md).

Its options are the ``visual`` env's (``[agent.options]``: task, image_size, cell, ...), and
``first_messages`` gives the SFT warm start the same image and question the agent sends.
"""

from __future__ import annotations

from typing import Any, Iterator

import openai

from molt_core.agents import AgentContext, ChatAgent
from molt_plugins.vision.images import data_url
from molt_core.types import Result
from molt_plugins.envs.dataset import strip_end_markers
from molt_plugins.envs.visual import VisualEnv, VisualOptions, png_bytes


class VisualChat(ChatAgent):
    """One image question through ``openai.AsyncOpenAI``; reward 1.0 for the exact answer."""

    Options = VisualOptions
    options: VisualOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._env = VisualEnv(**options)  # the task source: same splits and images as the env

    def tasks(self, split: str, seed: int) -> Iterator[dict[str, Any]]:
        """The ``visual`` env's tasks (``{"task", "params", "question", "answer"}``)."""
        return self._env.tasks(split, seed)

    def first_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The messages the agent sends: the optional system prompt, then a user message with the
        PNG as an OpenAI ``image_url`` part and the question."""
        url = data_url(png_bytes(task), "image/png")
        system = [{"role": "system", "content": self.options.system_prompt}] if self.options.system_prompt else []
        return system + [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": task["question"]}]}]

    async def run(self, ctx: AgentContext) -> Result:
        """Ask once; score 1.0 if the reply (end markers stripped) equals the answer, reward
        ``reward_weight * score``."""
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0)
        try:
            r = await client.chat.completions.create(model=ctx.model, messages=self.first_messages(ctx.task),
                                                     max_tokens=ctx.sampling.max_tokens,
                                                     temperature=ctx.sampling.temperature)
        finally:
            await client.close()
        reply = strip_end_markers(r.choices[0].message.content or "", self.options.strip_suffixes)
        score = 1.0 if reply == ctx.task["answer"] else 0.0
        return Result(reward=self.options.reward_weight * score, score=score, terminated=True)
