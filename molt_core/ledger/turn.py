"""The one turn, ``Ledger.prepare`` -> ``engine.generate`` -> ``Ledger.commit``, for every caller
(the Env loop, the loopback server, ``Ledger.generate``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from molt_core.ledger.records import AssistantTurn, Prepared
from molt_core.types import GenerationOutput, SamplingParams

__all__ = ["take_turn"]


async def take_turn(ledger: Any, engine: Any, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
                    tools: list[dict[str, Any]] | None = None, max_tokens: int | None = None,
                    max_model_len: int | None = None, max_total_tokens: int | None = None, fresh: bool = False,
                    allow_tool_calls: bool = True,
                    prepare_with: Callable[[Callable[[], Prepared]], Awaitable[Prepared]] | None = None,
                    before_engine: Callable[[SamplingParams], Awaitable[SamplingParams]] | None = None,
                    call: Callable[[Callable[[], Awaitable[GenerationOutput]]], Awaitable[GenerationOutput]] | None = None,
                    ) -> AssistantTurn | None:
    """Run one model turn of ``ledger``'s session on ``engine`` and record it.

    ``ledger.prepare`` plans it (a retry returns the cached turn); the engine samples the prompt under
    ``params`` (default ``SamplingParams()``) plus the ledger's stop ids, ``max_tokens`` (default
    ``params.max_tokens``) capped to ``max_model_len`` and ``max_total_tokens`` less the prompt.

    Args:
        prepare_with: runs the planning call (e.g. in a worker thread, mapping its errors); default inline.
        before_engine: maps the final sampling settings before the engine call (e.g. a per-turn seed).
        call: runs the zero-argument engine call it is given and returns the ``GenerationOutput`` to
            commit, or raises (nothing is committed). Default: await it.

    Returns:
        The committed :class:`~molt_core.ledger.AssistantTurn`; None, recording nothing, when the
        prompt leaves no room under ``max_total_tokens``.

    Raises:
        ValueError: malformed messages; ``PromptTooLong`` for a prompt of ``max_model_len`` tokens
            or more (as ``prepare_with`` maps them). An engine error propagates, recording nothing.
    """
    params = params or SamplingParams()
    plan = partial(ledger.prepare, messages, tools, params, max_prompt_tokens=max_model_len, fresh=fresh,
                   allow_tool_calls=allow_tool_calls)
    prepared = plan() if prepare_with is None else await prepare_with(plan)
    if prepared.mode == "retry":
        return ledger.commit(prepared, None)
    n = len(prepared.prompt_ids)
    budget = params.max_tokens if max_tokens is None else max_tokens
    if max_model_len is not None:  # > 0: prepare refused a prompt that fills the context
        budget = min(budget, max_model_len - n)
    if max_total_tokens is not None:
        if max_total_tokens - n <= 0:
            return None
        budget = min(budget, max_total_tokens - n)
    run = params.model_copy(update={"max_tokens": budget,
                                    "stop_token_ids": sorted(set(params.stop_token_ids) | set(ledger.stop_token_ids))})
    if before_engine is not None:
        run = await before_engine(run)

    def start() -> Awaitable[GenerationOutput]:  # a text-only engine need not accept ``images``
        return (engine.generate(prepared.prompt_ids, run, images=prepared.images) if prepared.images
                else engine.generate(prepared.prompt_ids, run))

    out = await start() if call is None else await call(start)
    return ledger.commit(prepared, out, run)
