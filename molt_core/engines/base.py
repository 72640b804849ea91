"""The contract every rollout engine meets.

An engine takes prompt token ids and :class:`~molt_core.types.SamplingParams` and returns
the ids it sampled, each one's behaviour logprob under the distribution actually sampled
from (:mod:`molt_core.sampling`), the policy version that sampled each token (a weight sync
during a generation changes it mid-sequence: partial rollout), the finish reason and, for
MoE models, the routed experts. Weights arrive through one ``load_weights(state, version)``.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from molt_core.types import SamplingParams

__all__ = ["GenerationOutput", "RolloutEngine"]


class GenerationOutput(BaseModel):
    """One generation's result.

    Fields (``N`` = number of sampled tokens):
      * ``token_ids`` ``[N]`` ints, exactly as sampled (a stop token, if hit, is included).
      * ``logprobs`` ``[N]`` floats, behaviour logprob of each sampled token (natural log).
      * ``versions`` ``[N]`` ints, policy version of the weights that sampled each token.
      * ``finish_reason``: ``stop`` (stop token or stop string) or ``length`` (max_tokens),
        ``abort`` (cancelled).
      * ``stop_reason``: the stop token id or stop string that ended it, or None.
      * ``routed_experts``: ``[P + N, num_moe_layers, top_k]`` for MoE engines (prompt
        positions included), else None.
      * ``prompt_len``: ``P``, the number of prompt ids the engine saw.

    Raises:
        pydantic.ValidationError: if per-token lengths differ.
    """

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: Literal["stop", "length", "abort"]
    stop_reason: int | str | None = None
    routed_experts: list[list[list[int]]] | None = None
    prompt_len: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _aligned(self) -> GenerationOutput:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"token_ids ({n}), logprobs ({len(self.logprobs)}) and versions "
                f"({len(self.versions)}) must have one entry per sampled token"
            )
        return self


@runtime_checkable
class RolloutEngine(Protocol):
    """What the ledger, server and runtime need from an engine.

    ``generate`` is a coroutine so many sessions share one engine; implementations batch
    concurrent requests (no one-request-at-a-time lock). ``load_weights`` swaps weights
    between decode steps and stamps later tokens with ``version``.
    """

    tokenizer: Any
    version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        """Sample a continuation of ``prompt_ids`` (list of int) under ``params``."""
        ...

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load ``state_dict`` (name -> tensor) as policy ``version``."""
        ...
