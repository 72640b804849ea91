"""Scripted engines for ledger/server tests: they implement the RolloutEngine protocol and
return predetermined ids and logprobs, so tests can assert exact sequences."""

from __future__ import annotations

import asyncio
from typing import Any

from molt_core.engines.base import GenerationOutput
from molt_core.identity import digest_ids
from molt_core.types import SamplingParams


class ScriptedEngine:
    """Returns the next scripted reply per call.

    A reply is a list of ids (returned as is, finish ``stop`` if the last id is a stop id)
    or a str (the *model's* text, encoded once here as if sampled, then the stop id appended).
    Logprob of the j-th sampled token of call c: ``-(c + 1) / 10 - j / 1000``; version
    ``self.version``. ``prompts`` records every prompt. Like a real engine it attaches the
    digest of the ids it returns (``sampled_digest``, token identity).
    """

    def __init__(self, tokenizer: Any, replies: list[Any] | None = None, stop_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.version = 0
        self.replies = list(replies or [])
        self.stop_id = tokenizer.eos_token_id if stop_id is None else stop_id
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self.calls = 0

    def output(self, reply: Any, params: SamplingParams, prompt_len: int) -> GenerationOutput:
        if isinstance(reply, GenerationOutput):
            return reply
        if isinstance(reply, str):
            ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.stop_id]
        else:
            ids = list(reply)
        finish, reason = "length", None
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
        if finish == "length" and len(ids) > params.max_tokens:
            ids = ids[: params.max_tokens]
        c = self.calls
        return GenerationOutput(token_ids=ids, logprobs=[-(c + 1) / 10 - j / 1000 for j in range(len(ids))],
                                versions=[self.version] * len(ids), finish_reason=finish, stop_reason=reason,
                                prompt_len=prompt_len, sampled_digest=digest_ids(ids))

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        await asyncio.sleep(0)
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        reply = self.replies.pop(0) if self.replies else "ok"
        out = self.output(reply, params, len(prompt_ids))
        self.calls += 1
        return out

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.version = version


class EchoEngine(ScriptedEngine):
    """Deterministic per-prompt replies for load tests: the reply names the prompt length and
    a checksum of the prompt ids, so mixed-up sessions are detectable."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        await asyncio.sleep(0.001)
        text = f"len {len(prompt_ids)} sum {sum(prompt_ids) % 9973}"
        out = self.output(text, params, len(prompt_ids))
        self.calls += 1
        return out


class FailingEngine(ScriptedEngine):
    """Raises on every call (a request that fails must append nothing)."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        raise RuntimeError("engine exploded")
