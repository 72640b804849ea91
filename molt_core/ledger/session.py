"""The :class:`Ledger` of one session (rollout): the token context the engine saw and produced,
planned by :meth:`Ledger.prepare` (pure), recorded by :meth:`Ledger.commit` (atomic), read out
as a :class:`~molt_core.types.Trajectory`."""

from __future__ import annotations

import base64
import threading
from typing import Any, Literal

from molt_core.ledger.commit import Recording
from molt_core.ledger.compare import _Reply
from molt_core.ledger.messages import NormalizeCache
from molt_core.ledger.prepare import Planning
from molt_core.ledger.records import REWRITE_CAUSES, AssistantTurn, _Open
from molt_core.ledger.render import Prover, WindowProof
from molt_core.ledger.template import TemplateFacts
from molt_core.ledger.toolcall import HermesParser, ToolParser
from molt_core.ledger.turn import take_turn
from molt_core.types import SamplingParams, Segment, Trajectory, new_id

__all__ = ["Ledger"]


class Ledger(TemplateFacts, Planning, Recording):
    """Token-exact accumulation of one session (one rollout); thread-safe.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        rollout_id: shared by every segment's trajectory (default: a fresh ``r-<hex>``).
        group_id: the group (prompt) this rollout belongs to.
        chat_template_kwargs: extra template variables, e.g. ``{"enable_thinking": False}``.
        think_tags / tool_call_tags: the model's reasoning and tool-call delimiters.
        tool_parser: a :class:`~molt_core.ledger.toolcall.ToolParser` (the caller resolves names:
            :func:`molt_core.plugins.tool_parser`); default: Hermes with ``tool_call_tags``.
        window_prover: a :data:`~molt_core.ledger.render.Prover`
            (:func:`molt_core.plugins.window_prover`); None always renders the whole conversation.
        vision: the modality plugin's image processor (``expand`` / ``extra_tokens``); None for a
            text-only model (image messages refused).
        image_policy: limits for image parts (:class:`~molt_core.config.ImagePolicy`; None: the defaults).
        modality: the registered modality whose ``decode_part`` reads image parts (default: ``vision``'s).

    Raises:
        ValueError: the tokenizer has no chat template, or ``tool_parser`` is a name, not a parser.
    """

    def __init__(self, tokenizer: Any, rollout_id: str | None = None, group_id: str = "",
                 chat_template_kwargs: dict[str, Any] | None = None,
                 think_tags: tuple[str, str] = ("<think>", "</think>"),
                 tool_call_tags: tuple[str, str] = ("<tool_call>", "</tool_call>"),
                 tool_parser: ToolParser | None = None, window_prover: Prover | None = None, vision: Any = None,
                 image_policy: Any = None, modality: Any = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; the ledger renders conversations with it")
        self.tokenizer = tokenizer
        self.rollout_id = rollout_id or new_id("r")
        self.group_id = group_id
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.think = think_tags
        if isinstance(tool_parser, str):
            raise ValueError(f"Ledger(tool_parser={tool_parser!r}): pass a parser, not a name; resolve the name "
                             "with molt_core.plugins.tool_parser(name, tokenizer) (the molt_register_tool_parsers registry)")
        self.tool_parser: ToolParser = HermesParser(tool_call_tags) if tool_parser is None else tool_parser
        self.counts = {"start": 0, "extend": 0, "rewrite": 0, "retry": 0}
        #: rewrites per cause (:data:`REWRITE_CAUSES`)
        self.rewrite_causes = dict.fromkeys(REWRITE_CAUSES, 0)
        # history index of each returned assistant message -> the reply the wire sent
        self._replies: dict[int, _Reply] = {}
        #: context tokens re-encoded from text on rewrites (see :meth:`prepare`)
        self.context_reencoded_tokens = 0
        #: committed generations that ended with finish reason ``length`` (cut by max_tokens)
        self.length_cut_turns = 0
        self._lock = threading.RLock()
        self._sealed: list[Segment] = []
        self._open = _Open()
        self._history: list[dict[str, Any]] = []
        self._tools: list[dict[str, Any]] | None = None
        self._last_prompt_text = ""
        self._last_turn: AssistantTurn | None = None
        self._epoch = 0
        self._last_req: tuple[Any, ...] | None = None
        self.vision = vision
        #: the rollout's images: SHA-256 -> encoded bytes, each distinct image once
        self._images: dict[str, bytes] = {}
        self._normalize = NormalizeCache(self._images, image_policy, getattr(modality or vision, "decode_part", None))
        #: extend checks decided by a window render / by the full render (see ``window_prover``)
        self.render_stats = {"window": 0, "full": 0}
        # per window scan: hits among the committed history's first _scan_n messages
        self._scan_hits: list[list[int]] = []
        self._scan_n = 0
        proof = self._template_facts(window_prover)
        #: the template's window proof (None: full renders)
        self.window_proof: WindowProof | None = proof
        self._scan_hits = [[] for _ in (proof.scans if proof else [])]

    async def generate(self, engine: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, max_model_len: int | None = None) -> AssistantTurn:
        """One turn for a framework-owned loop (:func:`~molt_core.ledger.turn.take_turn`); an engine
        error propagates and records nothing.

        Raises:
            ValueError: malformed messages; :class:`PromptTooLong` (``max_model_len`` tokens or more).
        """
        turn = await take_turn(self, engine, messages, params, tools=tools, max_model_len=max_model_len)
        assert turn is not None  # None only under max_total_tokens
        return turn

    def segments(self) -> list[Segment]:
        """The sealed segments and the open one (if it holds tokens), validated."""
        with self._lock:
            out = list(self._sealed)
            if self._open.token_ids:
                out.append(self._open.segment())
            return out

    @property
    def history(self) -> list[dict[str, Any]]:
        """The committed conversation (last request + the returned assistant message; images as
        ``{"type": "image", "sha256"}`` parts); sending it back extends it."""
        with self._lock:
            return [dict(m) for m in self._history]

    @property
    def num_tokens(self) -> int:
        """Tokens held in the open segment."""
        return len(self._open.token_ids)

    def trajectory(self, reward: float | None = None, score: float | None = None, info: dict[str, Any] | None = None,
                   status: Literal["ok", "failed"] = "ok", error: str | None = None, task: dict[str, Any] | None = None,
                   truncated: bool = False) -> Trajectory:
        """The session's :class:`Trajectory`: every segment, one ``rollout_id`` and ``reward``; ``info``
        under the ledger-owned keys (:meth:`owned_info`, which win); ``truncated`` also when any
        generation ended with ``length``; ``images`` (base64) each image the segments show, once."""
        with self._lock:
            inf = {**(info or {}), **self.owned_info()}
            segs = self.segments()
            shown = {im.sha256 for s in segs for im in s.images}
            images = {h: base64.b64encode(self._images[h]).decode("ascii") for h in sorted(shown)}
            return Trajectory(rollout_id=self.rollout_id, group_id=self.group_id, segments=segs, reward=reward,
                              score=score, info=inf, status=status, error=error, task=task or {},
                              truncated=bool(truncated or self.length_cut_turns), images=images)

    def owned_info(self) -> dict[str, Any]:
        """The ledger-owned ``info`` (:data:`LEDGER_INFO_KEYS`): ``requests`` per mode,
        ``context_reencoded_tokens``, ``length_cut_turns``, ``rewrite_causes`` (each cause listed)."""
        with self._lock:
            return {"requests": dict(self.counts), "context_reencoded_tokens": self.context_reencoded_tokens,
                    "length_cut_turns": self.length_cut_turns, "rewrite_causes": dict(self.rewrite_causes)}

