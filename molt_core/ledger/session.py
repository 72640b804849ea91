"""The session ledger: the single place where trajectories are assembled, token-exactly.

Token identity (invariant 1, docs/README.md): the trainer trains on the ids the engine sampled,
never on a re-tokenized transcript. Per session (one rollout) the :class:`Ledger` holds the
token context the engine actually saw and produced. Each request of the session is decided
by :meth:`Ledger.prepare` (pure) and recorded by :meth:`Ledger.commit` (atomic) -- the one turn runs both around the engine (:mod:`molt_core.ledger.turn`).
"""

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
        tokenizer: a Hugging Face tokenizer with a chat template (``apply_chat_template``,
            ``encode``, ``decode``).
        rollout_id: shared by every segment's trajectory (default: a fresh ``r-<hex>``).
        group_id: the group (prompt) this rollout belongs to.
        chat_template_kwargs: extra template variables, e.g. ``{"enable_thinking": False}``.
        think_tags / tool_call_tags: the model's reasoning and tool-call delimiters.
        tool_parser: the model family's tool-call parser (:class:`~molt_core.ledger.toolcall.ToolParser`),
            resolved from its name by the caller (:func:`molt_core.plugins.tool_parser`: the
            ``molt_register_tool_parsers`` registry); default: Hermes with ``tool_call_tags``.
        window_prover: a window prover (:data:`~molt_core.ledger.render.Prover`; the caller's
            :func:`molt_core.plugins.window_prover`): an extension of a template it proves is
            checked on a window of the conversation (same verdict and tail as the full render,
            cost independent of the turn count); None always renders the whole conversation.
        vision: the model's image processor from the modality plugin (``molt_register_modalities``:
            its ``expand`` / ``extra_tokens``); None for a text-only model (a message with an
            image is then refused).
        image_policy: limits for image parts (:class:`~molt_core.config.ImagePolicy`; default
            limits, no remote URLs).
        modality: the registered modality (its ``decode_part`` reads image parts); default
            ``vision``'s own ``decode_part``; None with no ``vision``: image parts are refused.

    Raises:
        ValueError: the tokenizer has no chat template, or ``tool_parser`` is a name (the ledger
            takes a parser; its callers look names up).
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
        # history index of each assistant message the ledger returned -> the reply the wire sent
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
        #: the rollout's images: SHA-256 -> encoded bytes, each distinct image once (an image of a
        #: request that later failed stays too; the trajectory stores only those its segments show)
        self._images: dict[str, bytes] = {}
        # normalize_messages, reusing the previous request's normalized prefix
        self._normalize = NormalizeCache(self._images, image_policy, getattr(modality or vision, "decode_part", None))
        #: extend checks decided by a window render / by the full render (see ``window_prover``)
        self.render_stats = {"window": 0, "full": 0}
        # per window scan: indices of the committed history's messages that satisfy it, and
        # how many history messages were scanned (reset when a start/rewrite replaces history)
        self._scan_hits: list[list[int]] = []
        self._scan_n = 0
        proof = self._template_facts(window_prover)
        #: the template's window proof (None: every extend check renders the whole conversation)
        self.window_proof: WindowProof | None = proof
        self._scan_hits = [[] for _ in (proof.scans if proof else [])]

    async def generate(self, engine: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, max_model_len: int | None = None) -> AssistantTurn:
        """One turn for a framework-owned loop: :meth:`prepare`, ``engine.generate``, :meth:`commit`
        (:func:`~molt_core.ledger.turn.take_turn`).

        Adds :attr:`stop_token_ids` to ``params.stop_token_ids`` and caps ``max_tokens`` to
        ``max_model_len - prompt length``. An engine error propagates and records nothing.

        Raises:
            ValueError: malformed messages; :class:`PromptTooLong` for a prompt of
                ``max_model_len`` tokens or more.
        """
        turn = await take_turn(self, engine, messages, params, tools=tools, max_model_len=max_model_len)
        assert turn is not None  # None only under max_total_tokens
        return turn

    # ---------------------------------------------------------------- read out

    def segments(self) -> list[Segment]:
        """The sealed segments and the open one (if it holds tokens), validated."""
        with self._lock:
            out = list(self._sealed)
            if self._open.token_ids:
                out.append(self._open.segment())
            return out

    @property
    def history(self) -> list[dict[str, Any]]:
        """The committed conversation (last request's messages + the assistant message returned).

        Messages with images hold them as ``{"type": "image", "sha256": hex}`` parts (the bytes
        stay in the rollout's store); sending this history back (as the Env loop does) extends it."""
        with self._lock:
            return [dict(m) for m in self._history]

    @property
    def num_tokens(self) -> int:
        """Tokens held in the open segment."""
        return len(self._open.token_ids)

    def trajectory(self, reward: float | None = None, score: float | None = None, info: dict[str, Any] | None = None,
                   status: Literal["ok", "failed"] = "ok", error: str | None = None, task: dict[str, Any] | None = None,
                   truncated: bool = False) -> Trajectory:
        """The session's :class:`Trajectory`: every segment, one ``rollout_id`` and ``reward``.

        ``info`` is the caller's (the agent's) merged under the ledger-owned keys
        (:data:`LEDGER_INFO_KEYS`, which win): ``requests`` (count per mode),
        ``context_reencoded_tokens`` (see :meth:`prepare`), ``length_cut_turns`` and
        ``rewrite_causes`` (rewrites per :data:`REWRITE_CAUSES` entry, each listed).
        ``truncated`` is True when the caller says so or when any committed generation of
        the session ended with finish reason ``length`` (cut by ``max_tokens``). ``images``
        holds (base64) each distinct image the segments show, once.
        """
        with self._lock:
            inf = {**(info or {}), **self.owned_info()}
            segs = self.segments()
            shown = {im.sha256 for s in segs for im in s.images}
            images = {h: base64.b64encode(self._images[h]).decode("ascii") for h in sorted(shown)}
            return Trajectory(rollout_id=self.rollout_id, group_id=self.group_id, segments=segs, reward=reward,
                              score=score, info=inf, status=status, error=error, task=task or {},
                              truncated=bool(truncated or self.length_cut_turns), images=images)

    def owned_info(self) -> dict[str, Any]:
        """The ledger-owned ``info`` entries (:data:`LEDGER_INFO_KEYS`) of the session so far."""
        with self._lock:
            return {"requests": dict(self.counts), "context_reencoded_tokens": self.context_reencoded_tokens,
                    "length_cut_turns": self.length_cut_turns, "rewrite_causes": dict(self.rewrite_causes)}

