"""A ChatAgent: the agent owns its loop through the stock OpenAI SDK (multi-turn).

It asks the question, then asks the model to repeat its answer, exactly as it would talk to
any OpenAI-compatible server; molt-sdk's loopback server records both turns token-exactly.
"""

from __future__ import annotations

import random

import openai

from molt_core.agents import AgentContext, ChatAgent
from molt_core.types import Result


class AdditionChat(ChatAgent):
    """Two-turn addition through ``openai.AsyncOpenAI``; reward 0.5 per correct reply."""

    def tasks(self, split, seed):
        rng = random.Random(seed + (0 if split == "train" else 1_000_003))
        for _ in range(10**9 if split == "train" else 64):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            yield {"question": f"What is {a} + {b}?", "answer": str(a + b)}

    async def run(self, ctx: AgentContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0)
        messages = [{"role": "user", "content": ctx.task["question"]}]
        reward = 0.0
        right = False
        for follow_up in ("Say it again.", None):
            r = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                     max_tokens=ctx.sampling.max_tokens,
                                                     temperature=ctx.sampling.temperature)
            reply = r.choices[0].message.content or ""
            right = reply.strip() == ctx.task["answer"]
            reward += 0.5 * right
            messages.append({"role": "assistant", "content": reply})
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        await client.close()
        return Result(reward=reward, terminated=True, score=1.0 if right else 0.0)
